"""What the machine at hand computes natively, and the dtype that follows from it.

bfloat16 halves the bytes a memory-bound decode step reads, but only pays where the hardware computes it:
a CPU with AVX-512 BF16 or AMX, or a CUDA device. Elsewhere (AVX2, or AVX-512 without BF16) torch emulates
it and a step is no faster than float32, while its rounding can flip greedy near-ties. So `auto` picks
bfloat16 only where it is native, and float32 otherwise.
"""
from __future__ import annotations

import platform
import re

import torch

from draftwise.config import DTYPES
from draftwise.errors import DraftwiseError


def native_bf16(device: str = "cpu") -> bool:
    """Whether device computes bfloat16 matmuls in hardware (not by emulation)."""
    kind = torch.device(device).type
    if kind == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if kind == "cpu":
        return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    return False


def check_device(name: str) -> str:
    """name, if the models can run there: cpu, or a CUDA GPU this machine has. Checked before any model loads."""
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise DraftwiseError(f"device must be cpu, cuda or cuda:N, got {name!r}")
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if not count:
            raise DraftwiseError(f"device {name!r}: no CUDA GPU is usable here (torch {torch.__version__}); "
                                 "use cpu, or a machine with an NVIDIA GPU and a CUDA build of torch")
        if device.index is not None and device.index >= count:
            raise DraftwiseError(f"device {name!r}: this machine has {count} CUDA GPU(s), cuda:0 to cuda:{count - 1}")
    return name


def resolve_dtype(name: str, device: str = "cpu") -> str:
    """'auto' -> 'bfloat16' where native on device, else 'float32'; an explicit dtype is kept as given."""
    check_device(device)
    if name not in DTYPES:
        raise DraftwiseError(f"dtype must be one of {', '.join(DTYPES)}, got {name!r}")
    if name != "auto":
        return name
    return "bfloat16" if native_bf16(device) else "float32"


def describe_machine(device: str = "cpu") -> dict:
    """What a measurement ran on, for caches keyed by machine and for reports."""
    if torch.device(device).type == "cuda":
        return {"device": "cuda", "name": torch.cuda.get_device_name(), "native_bf16": native_bf16(device)}
    return {
        "device": "cpu",
        "name": _cpu_model_name(),
        "capability": torch.backends.cpu.get_cpu_capability(),
        "native_bf16": native_bf16(device),
        "threads": torch.get_num_threads(),
    }


def machine_key(device: str = "cpu") -> str:
    """A file-name-safe name for what a timing depends on: the processor, its instruction set, threads, torch."""
    facts = describe_machine(device)
    bf16 = "bf16" if facts.get("native_bf16") else ""  # (a VM may hide AMX or AVX-512 BF16 from one CPU model)
    parts = [facts["name"], facts.get("capability", ""), bf16, f"{facts.get('threads', 0)}t", f"torch{torch.__version__}"]
    return re.sub(r"[^A-Za-z0-9.+-]+", "_", "-".join(p for p in parts if p)).strip("_")


def _cpu_model_name() -> str:
    """The processor's name with its family and model: clouds name different generations alike ("AMD EPYC" is a
    Zen 3, 4 or 5), and what a timing or a calibration measured on one says little of another."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "cpu family", "model") and key not in fields:
                    fields[key] = value.strip()
                if not line.strip():  # the first processor's block is enough
                    break
    except OSError:
        pass
    name = fields.get("model name") or platform.processor() or platform.machine()
    if "cpu family" in fields and "model" in fields:
        name += f" (family {fields['cpu family']}, model {fields['model']})"
    return name
