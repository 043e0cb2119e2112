"""qgemm.c built for this machine and called from PyTorch: QuantLinear, an nn.Linear on a GGUF file's own blocks.

The library has a path per instruction set (ISAS: avx512, avxvnni, avx2, scalar; docs/kernel-isa.md), each built
from the same source with its own flags and -DDW_ISA, all giving the same bits. The fastest the CPU's flags allow
is used, or the one DRAFTWISE_KERNEL_ISA names (for tests and measurement). Each is compiled once per source, flags
and CPU into $DRAFTWISE_HOME/kernels (the file name carries the ISA and a hash of all three), and loaded after
torch, so that it shares torch's OpenMP runtime (one thread team, not two fighting for the cores).
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
from torch import nn

from draftwise.backends.gguf_weights import Packed, unpack
from draftwise.errors import DraftwiseError
from draftwise.files import write_whole

SOURCE = Path(__file__).with_name("qgemm.c")
# -ffp-contract=off: the compiler fuses nothing on its own, so each path's float steps are the ones its source writes.
FLAGS = ("-O3", "-fopenmp", "-ffp-contract=off", "-shared", "-fPIC")
ISA_VARIABLE = "DRAFTWISE_KERNEL_ISA"
PREFETCH_VARIABLE = "DRAFTWISE_KERNEL_PREFETCH"
PREFETCH_L2_FLAG = "-DDW_PREFETCH_L2=1"  # qgemm.c prefetches into the L2 (DW_PREFETCH_L2)
ISAS = ("avx512", "avxvnni", "avx2", "scalar")  # the kernel's paths, fastest first; qgemm.c's DW_ISA numbers them
ISA_CODES = {"scalar": 0, "avx2": 1, "avxvnni": 2, "avx512": 3}
# what each path needs in /proc/cpuinfo's flags
ISA_NEEDS = {"avx512": ("avx512f", "avx512bw", "avx512vl", "avx512_vnni"), "avxvnni": ("avx2", "fma", "avx_vnni"),
             "avx2": ("avx2", "fma"), "scalar": ()}
# The vector paths take exactly their instruction sets (the AVX2 path must run on a CPU without AVX-512, whatever
# this one has); avx512 and scalar take the machine's own (-march=native: the scalar path's plain C may be
# auto-vectorized, which never reorders a float sum without -ffast-math).
ISA_FLAGS = {"avx512": ("-march=native",), "avxvnni": ("-mavx2", "-mfma", "-mavxvnni", "-mtune=native"),
             "avx2": ("-mavx2", "-mfma", "-mtune=native"), "scalar": ("-march=native",)}


def kernel_dir() -> Path:
    from draftwise.models.store import store_home

    return store_home() / "kernels"


def _cpuinfo_line(key: str) -> str:
    """The first line of /proc/cpuinfo that starts with key ("" where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    return next((line for line in text.splitlines() if line.startswith(key)), "")


def _cpu_flags() -> str:
    return _cpuinfo_line("flags") or platform.processor()


L2_PREFETCH_AMD_FAMILY = 26  # Zen 5 and later, where the L2 measured faster; Zen 4 (25) is not measured yet


def prefetch_level() -> str:
    """Where the kernel prefetches its weights to (qgemm.c's DW_PREFETCH_L2): DRAFTWISE_KERNEL_PREFETCH where set
    (l1 or l2, for measurement), else the L2 on Intel's CPUs and AMD's from Zen 5, where that measured faster, and the
    L1 elsewhere."""
    forced = os.environ.get(PREFETCH_VARIABLE, "").strip().lower()
    if forced in ("", "auto"):
        return "l2" if _prefetches_to_l2() else "l1"
    if forced not in ("l1", "l2"):
        raise DraftwiseError(f"{PREFETCH_VARIABLE} must be l1, l2 or auto, got {forced!r}")
    return forced


def _prefetches_to_l2() -> bool:
    vendor = _cpuinfo_line("vendor_id")
    if "GenuineIntel" in vendor:
        return True
    family = _cpuinfo_line("cpu family").rpartition(":")[2].strip()
    return "AuthenticAMD" in vendor and family.isdigit() and int(family) >= L2_PREFETCH_AMD_FAMILY


def _prefetch_flags() -> tuple[str, ...]:
    return (PREFETCH_L2_FLAG,) if prefetch_level() == "l2" else ()


def isas_here() -> tuple[str, ...]:
    """The kernel's paths this CPU can run, fastest first (scalar always)."""
    flags = set(_cpu_flags().split())
    return tuple(isa for isa in ISAS if set(ISA_NEEDS[isa]) <= flags)


def chosen_isa() -> str:
    """The path the kernel runs: DRAFTWISE_KERNEL_ISA where set (an ISA this CPU has), else the fastest here."""
    here = isas_here()
    forced = os.environ.get(ISA_VARIABLE, "").strip().lower()
    if forced in ("", "auto"):
        return here[0]
    if forced not in ISAS:
        raise DraftwiseError(f"{ISA_VARIABLE} must be one of {', '.join(ISAS)} (or auto), got {forced!r}")
    if forced not in here:
        missing = sorted(set(ISA_NEEDS[forced]) - set(_cpu_flags().split()))
        raise DraftwiseError(f"{ISA_VARIABLE}={forced}: this CPU lacks {', '.join(missing)}; it runs "
                             f"{', '.join(here)}")
    return forced


def fast_here() -> bool:
    """Whether this machine would run a vector path of the kernel (AVX2 + FMA at least, and a C compiler), without
    compiling it."""
    return chosen_isa() != "scalar" and find_compiler() is not None


def find_compiler() -> str | None:
    return shutil.which("cc") or shutil.which("gcc")


def compiler() -> str:
    """The C compiler that builds the kernel, or an error that says what to install."""
    found = find_compiler()
    if found is None:
        raise DraftwiseError("the quant backend compiles its kernel (draftwise/backends/qgemm.c) on first use and "
                             "needs a C compiler: install gcc (apt install gcc), or use --backend hf")
    return found


def build_flags(isa: str) -> list[str]:
    """The compiler's flags for one path of the kernel."""
    return [*FLAGS, *ISA_FLAGS[isa], *_prefetch_flags(), f"-DDW_ISA={ISA_CODES[isa]}"]


@lru_cache(maxsize=1)
def library() -> ctypes.CDLL:
    """The kernel library for this machine (the path chosen_isa names), compiled on first use (a few seconds).
    Where the fastest path fails to compile unasked (a compiler too old for -mavxvnni), the next one is used."""
    isa = chosen_isa()
    forced = os.environ.get(ISA_VARIABLE, "").strip().lower() not in ("", "auto")
    candidates = (isa,) if forced else isas_here()[isas_here().index(isa):]
    failure = None
    for candidate in candidates:
        try:
            return library_for(candidate)
        except DraftwiseError as error:
            failure = failure or error
    raise failure


def kernel_isa() -> str:
    """The path the kernel library in use runs (compiling it if needed): what speed_paths["kernel_isa"] says."""
    return library().isa


def kernel_prefetch() -> str:
    """Where the kernel library in use prefetches to (l1 or l2): what speed_paths["kernel_prefetch"] says."""
    return library().prefetch


@lru_cache(maxsize=None)
def library_for(isa: str) -> ctypes.CDLL:
    """One path's library, whatever the environment says (tests load several side by side: each CDLL keeps its own
    symbols)."""
    if isa not in ISAS:
        raise DraftwiseError(f"the kernel's paths are {', '.join(ISAS)}, not {isa!r}")
    source, flags = SOURCE.read_bytes(), build_flags(isa)
    key = hashlib.sha256(source + " ".join(flags).encode() + _cpu_flags().encode()).hexdigest()[:16]
    path = kernel_dir() / f"qgemm-{isa}-{key}.so"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        cc = compiler()

        def build(partial: Path) -> None:
            done = subprocess.run([cc, *flags, "-o", str(partial), str(SOURCE), "-lm"], capture_output=True,
                                  text=True)
            if done.returncode:
                raise DraftwiseError(f"compiling the quant kernel's {isa} path failed ({cc}):\n"
                                     f"{done.stderr[-2000:]}")

        write_whole(path, build)
    return open_library(path, isa, prefetch="l2" if PREFETCH_L2_FLAG in flags else "l1")


def open_library(path: Path, isa: str, prefetch: str | None = None) -> ctypes.CDLL:
    """A built library of the kernel, checked to run path isa, its functions declared. prefetch: the level it was
    built to prefetch to (default: what build_flags gives now)."""
    lib = ctypes.CDLL(str(path))
    lib.dw_isa.restype = ctypes.c_int
    if lib.dw_isa() != ISA_CODES[isa]:
        raise DraftwiseError(f"the quant kernel built for {isa} runs path {lib.dw_isa()} ({path})")
    lib.isa, lib.prefetch = isa, prefetch or prefetch_level()
    pointer, number = ctypes.c_void_p, ctypes.c_int
    lib.dw_linear.argtypes = [pointer, *[number] * 6, *[pointer] * 6]
    lib.dw_linear.restype = number
    lib.dw_vectorized.restype = number
    lib.dw_stream_sum.argtypes = [pointer, ctypes.c_long, number]
    lib.dw_stream_sum.restype = ctypes.c_longlong
    stride = ctypes.c_long
    lib.dw_attention.argtypes = [pointer, *[stride] * 3, pointer, *[stride] * 3, pointer, *[stride] * 3, pointer,
                                 *[number] * 6, ctypes.c_float, pointer]
    lib.dw_attention.restype = number
    weight = ctypes.POINTER(WeightStruct)
    lib.dw_rmsnorm.argtypes = [pointer, number, number, pointer, ctypes.c_float, pointer]
    lib.dw_rmsnorm.restype = None
    lib.dw_mlp.argtypes = [pointer, number, weight, weight, weight, pointer]
    lib.dw_mlp.restype = number
    lib.dw_qkv.argtypes = [pointer, number, weight, weight, weight, *[pointer] * 5, number, *[pointer] * 3]
    lib.dw_qkv.restype = number
    lib.dw_decoder_layer.argtypes = [ctypes.POINTER(LayerStruct), pointer, number, number, pointer, pointer, pointer,
                                     pointer, *[stride] * 3, *[pointer] * 3, number, pointer]
    lib.dw_decoder_layer.restype = number
    lib.dw_decoder_stack.argtypes = [pointer, number, pointer, number, number, pointer, pointer, pointer, pointer,
                                     *[stride] * 3, *[pointer] * 3, number, pointer, pointer]
    lib.dw_decoder_stack.restype = number
    return lib


class WeightStruct(ctypes.Structure):
    """qgemm.c's dw_weight: one QuantLinear's shape and buffers."""

    _fields_ = [("n", ctypes.c_int), ("k", ctypes.c_int), ("g", ctypes.c_int), ("s", ctypes.c_int),
                ("bits", ctypes.c_int), ("q", ctypes.c_void_p), ("sc", ctypes.c_void_p), ("mn", ctypes.c_void_p),
                ("d", ctypes.c_void_p), ("dmin", ctypes.c_void_p)]


class LayerStruct(ctypes.Structure):
    """qgemm.c's dw_layer: one decoder layer's weights (its WeightStructs must outlive it)."""

    _fields_ = [*[(name, ctypes.POINTER(WeightStruct)) for name in ("q", "k", "v", "o", "gate", "up", "down")],
                *[(name, ctypes.c_void_p) for name in ("bq", "bk", "bv", "norm1", "norm2")],
                ("eps1", ctypes.c_float), ("eps2", ctypes.c_float), ("scale", ctypes.c_float),
                ("heads", ctypes.c_int), ("kv_heads", ctypes.c_int), ("d", ctypes.c_int)]


def vectorized() -> bool:
    """Whether the kernel runs a vector path here (avx512, avxvnni or avx2; else the scalar one: same results, far
    slower)."""
    return bool(library().dw_vectorized())


class QuantLinear(nn.Module):
    """A linear layer computed from quantized weights (gguf_weights.Packed) by qgemm.c: float32 in and out.

    Each row is quantized to int8 on the way in, so values differ slightly from the dequantized float layer;
    what holds is that a row's result never depends on the other rows of the call (batch invariance)."""

    def __init__(self, packed: Packed, bias: torch.Tensor | None = None):
        super().__init__()
        self.in_features, self.out_features = packed.k, packed.n
        self.group, self.supers, self.bits = packed.group, packed.supers, packed.bits
        self.padded_out = packed.n + (-packed.n % 16)
        for name in ("q", "sc", "d", "dmin"):
            self.register_buffer(name, torch.from_numpy(np.ascontiguousarray(getattr(packed, name))))
        # Q6_K's minimum is its scale: one buffer under both names, so a pass reads those bytes once
        shared = packed.mn is packed.sc
        self.register_buffer("mn", self.sc if shared else torch.from_numpy(np.ascontiguousarray(packed.mn)))
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())
        library()  # compiled now, not in the first forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(torch.float32).contiguous()  # [tokens, in]
        y = torch.empty(len(rows), self.padded_out, dtype=torch.float32)  # [tokens, out (padded to 16)]
        if len(rows):
            status = library().dw_linear(rows.data_ptr(), len(rows), self.padded_out, self.in_features, self.group,
                                         self.supers, self.bits, self.q.data_ptr(), self.sc.data_ptr(),
                                         self.mn.data_ptr(), self.d.data_ptr(), self.dmin.data_ptr(), y.data_ptr())
            if status:
                raise DraftwiseError(f"the quant kernel refused a [{len(rows)}, {self.in_features}] call ({status})")
        if self.padded_out != self.out_features:
            y = y[:, : self.out_features]
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def dequantized(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """[out, in] float32, or [len(rows), in] for those output channels: the weight its blocks stand for (a feature
        head reads out through the output layer's float rows; the kernel never forms them)."""
        blocks = unpack(self.packed())
        return torch.from_numpy((blocks if rows is None else blocks.rows(rows.cpu().numpy())).dequantize())

    def packed(self) -> Packed:
        """The blocks as they were packed in (views of this module's buffers)."""
        buffers = (getattr(self, name).numpy() for name in ("q", "sc", "mn", "d", "dmin"))
        return Packed(*buffers, self.out_features, self.in_features, self.group, self.supers, self.bits)

    def struct(self) -> WeightStruct:
        """The weight as qgemm.c's fused calls take it (valid while this module's buffers live)."""
        return WeightStruct(self.padded_out, self.in_features, self.group, self.supers, self.bits,
                            *(getattr(self, name).data_ptr() for name in ("q", "sc", "mn", "d", "dmin")))

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, group={self.group}, "
                f"{self.bits}-bit values")


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, visible: torch.Tensor,
              scale: float) -> torch.Tensor:
    """[B, n, H, d] float32: each query attends to the keys visible marks, on its own (qgemm.c's dw_attention).
    query [B, H, n, d]; key, value [B, Hkv, L, d] (float32, last dimension contiguous); visible [B, n, L] (bool or
    uint8)."""
    batch, heads, n, dim = query.shape
    kv_heads, keys = key.shape[1], key.shape[2]
    tensors = [t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value)]
    mask = visible if visible.dtype == torch.uint8 and visible.is_contiguous() else visible.to(torch.uint8).contiguous()
    out = torch.empty(batch, n, heads, dim, dtype=torch.float32)
    strides = [s for t in tensors for s in (t.data_ptr(), *t.stride()[:3])]
    status = library().dw_attention(*strides, mask.data_ptr(), batch, heads, kv_heads, n, keys, dim, scale,
                                    out.data_ptr())
    if status:
        raise DraftwiseError(f"the attention kernel refused {heads} query heads over {kv_heads} key heads ({status})")
    return out
