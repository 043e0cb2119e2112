"""qgemm.c built for this machine and called from PyTorch: QuantLinear, an nn.Linear on a GGUF file's own blocks.

The library is compiled once per source and CPU (-march=native: AVX512-VNNI where the CPU has it, a scalar
path with the same results where not) into $DRAFTWISE_HOME/kernels, and loaded after torch, so that it shares
torch's OpenMP runtime (one thread team, not two fighting for the cores).
"""
from __future__ import annotations

import ctypes
import hashlib
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
FLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-shared", "-fPIC")


def kernel_dir() -> Path:
    from draftwise.models.store import store_home

    return store_home() / "kernels"


def _cpu_flags() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    return next((line for line in text.splitlines() if line.startswith("flags")), "")


def fast_here() -> bool:
    """Whether this machine would run the kernel's vector path (AVX512-VNNI and a C compiler), without compiling it."""
    flags = _cpu_flags().split()
    return "avx512_vnni" in flags and "avx512bw" in flags and find_compiler() is not None


def find_compiler() -> str | None:
    return shutil.which("cc") or shutil.which("gcc")


def compiler() -> str:
    """The C compiler that builds the kernel, or an error that says what to install."""
    found = find_compiler()
    if found is None:
        raise DraftwiseError("the quant backend compiles its kernel (draftwise/backends/qgemm.c) on first use and "
                             "needs a C compiler: install gcc (apt install gcc), or use --backend hf")
    return found


@lru_cache(maxsize=1)
def library() -> ctypes.CDLL:
    """The kernel library for this machine, compiled on first use (a few seconds)."""
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join(FLAGS).encode() + _cpu_flags().encode()).hexdigest()[:16]
    path = kernel_dir() / f"qgemm-{key}.so"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        cc = compiler()

        def build(partial: Path) -> None:
            done = subprocess.run([cc, *FLAGS, "-o", str(partial), str(SOURCE), "-lm"], capture_output=True,
                                  text=True)
            if done.returncode:
                raise DraftwiseError(f"compiling the quant kernel failed ({cc}):\n{done.stderr[-2000:]}")

        write_whole(path, build)
    lib = ctypes.CDLL(str(path))
    pointer, number = ctypes.c_void_p, ctypes.c_int
    lib.dw_linear.argtypes = [pointer, *[number] * 6, *[pointer] * 6]
    lib.dw_linear.restype = number
    lib.dw_vectorized.restype = number
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
    """Whether the kernel runs its AVX512-VNNI path here (else the scalar one: same results, far slower)."""
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
        buffers = (getattr(self, name).numpy() for name in ("q", "sc", "mn", "d", "dmin"))
        blocks = unpack(Packed(*buffers, self.out_features, self.in_features, self.group, self.supers, self.bits))
        return torch.from_numpy((blocks if rows is None else blocks.rows(rows.cpu().numpy())).dequantize())

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
