"""Linear kernels chosen by measurement on the machine at hand, never assumed.

Decoding on a CPU is bound by memory bandwidth: a pass over 1 to 8 new tokens should cost about what
reading the weights once costs. torch's default linear does not always get there: on some CPUs a float32
`F.linear` over 2 to 8 rows takes several times its 1-row time, while oneDNN with prepacked weights stays nearly
flat; on another CPU, or in bfloat16, or for another shape, the answer
differs (oneDNN's bfloat16 packing even refuses CPUs without AVX-512). So each candidate kernel is timed on
each distinct weight shape, at the widths the model will run, and the one with the smallest worst-case
slowdown against the best kernel at each width replaces `nn.Linear` (never one slower than dense for a
single token: plain steps must not pay for verification). The choices are cached per machine,
dtype and shape under $DRAFTWISE_HOME/calibration, so the second load pays nothing.

Kernels:
- `dense`: `nn.Linear` as loaded (torch's default, MKL on x86);
- `onednn`: oneDNN with the weight reordered once into its blocked layout (same values, same math);
- `split`: dense for a single row, oneDNN for more: where oneDNN beats dense over 2 to 8 rows but loses over
  one, neither alone is right for both a plain step and a verification pass;
- `padded`: oneDNN, a call of fewer than PAD_ROWS rows run as PAD_ROWS (zero rows below its own). oneDNN runs
  fewer rows through paths of their own, which on some CPUs (in bfloat16 especially) take longer over one row than
  over four, weights streamed from memory as in a real pass; padded, a plain step pays the four-row path's time,
  so the padding costs less than it saves where that holds (the timing decides). Same values as onednn's four-row
  path, so a row's result no longer depends on how many rows share its call below PAD_ROWS;
- `invariant`: padded's oneDNN calls, and wider ones cut into tiles of at most TILE_ROWS rows, so that a row's result
  is the same bits in any call: a plain step, a verification pass, a tree, a prefill chunk, a row of a batch.
  oneDNN takes other paths (other orders of the sums over the inner dimension) for a single row and for wide calls,
  and in bfloat16 their last bits change tokens. That the widths from PAD_ROWS to TILE_ROWS agree is not assumed:
  proven_tile checks it for each shape on this machine at first load (cached) and, where they do not, every call
  is exactly PAD_ROWS rows. Batch-invariant models (batch_invariant, the default on a CPU) run it everywhere;
- `invariant-int8`: int8's weights and values in invariant's calls, for a batch-invariant draft (value-changing);
- `int8`: weight-only int8, one scale per output row. It changes the values, so only a draft may use it:
  the target still verifies every token, so only acceptance can move;
- `int8-dynamic`: int8 weights (one scale per output row) and int8 activations quantized on each call, in torch's
  packed quantized GEMM (fbgemm on x86), for calls of a few rows (wider ones run the float weight). On CPUs
  without VNNI, in float32, it can run a draft's MLP projections several times faster than dense where `int8`'s
  weight-only kernel is slower than dense; elsewhere the timings decide. Draft-only, like `int8`.
"""
from __future__ import annotations

import copy
import json
import time
import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from draftwise.backends.attention import groups_queries, use_grouped_attention, use_row_invariant_attention
from draftwise.errors import DraftwiseError
from draftwise.files import write_whole

EXACT_KERNELS = ("dense", "onednn", "split", "padded")  # timed for the target: the model's own values
INVARIANT = "invariant"  # the model's own values too, a row's the same in any call: a batch-invariant model's kernel
INVARIANT_INT8 = "invariant-int8"  # int8's values in invariant's calls: a batch-invariant draft's
INVARIANT_KERNELS = (INVARIANT, INVARIANT_INT8)
TARGET_KERNELS = (*EXACT_KERNELS, INVARIANT)  # what the target may use
EXACT_RUNS = ("dense", "onednn")  # what runs under invariant; invariant-int8 runs "int8"
DRAFT_KERNELS = ("dense", "onednn", "split", "padded", "int8", "int8-dynamic")  # timed for a draft
# draft-only: every other kernel computes the model's own values
VALUE_CHANGING = ("int8", "int8-dynamic", INVARIANT_INT8)
TARGET_WIDTHS = (1, 2, 4, 8)  # a plain step, and verification passes of k + 1 tokens
DRAFT_WIDTHS = (1, 2)  # a draft step, and the catch-up after a fully accepted round
ONEDNN_PACK_ROWS = 8  # the row count oneDNN's layout is tuned for
PAD_ROWS = 4  # the padded kernel's narrowest call (where padding pays, 2 and 3 rows cost more than 4, as 1 does)
DYNAMIC_MAX_ROWS = 8  # int8-dynamic's widest call: a draft step or a tree's depth, never a prefill
TILE_ROWS = 64  # the widest call of the invariant kernel: a prefill chunk re-reads the weight once per 64 rows
MIN_GAIN = 0.05  # another kernel must beat dense by this much: timings jitter, and dense is the known path
REPEATS = 7
RULE_VERSION = 4  # part of every cache key: a changed rule or timing method measures again


class OneDNNLinear(nn.Module):
    """nn.Linear with its weight reordered once into oneDNN's blocked layout."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()  # [out, in]
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(weight, ONEDNN_PACK_ROWS))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).contiguous()  # [tokens, in]
        return self._packed_rows(rows).reshape(*x.shape[:-1], self.out_features)

    def _packed_rows(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.bias, "none", [], "")  # [tokens, out]


class PaddedLinear(OneDNNLinear):
    """oneDNN's packed weight, a call of fewer than PAD_ROWS rows run as PAD_ROWS: where oneDNN's narrow paths
    stream the weight more slowly than its wider one, a plain step pays a 4-row pass's time, not more."""

    def _packed_rows(self, rows: torch.Tensor) -> torch.Tensor:
        missing = PAD_ROWS - len(rows)
        if missing <= 0:
            return super()._packed_rows(rows)
        padded = F.pad(rows, (0, 0, 0, missing))  # [PAD_ROWS, in]: the call's rows, then zeros
        return super()._packed_rows(padded)[: len(rows)]  # [tokens, out]


class InvariantLinear(nn.Module):
    """nn.Linear computed so that a row's result does not depend on the call: every call is at least PAD_ROWS rows
    (padded with zeros) and at most `tile` (wider ones are cut into tiles of that many).

    run: the kernel under it, "onednn" (a packed weight) or "dense" (torch's own linear: faster for small shapes,
    and the one left where oneDNN cannot pack this dtype here), or for a draft "int8" (Int8Linear's weights).
    tile: TILE_ROWS where that kernel gives every width from PAD_ROWS to TILE_ROWS the same bits on this machine,
    else PAD_ROWS (every call then has the one shape). Both are chosen by invariant_plan, measured once per shape
    and machine."""

    def __init__(self, linear: nn.Linear | None = None, cache: bool = True, *, runs: tuple[str, ...] = EXACT_RUNS,
                 weight: torch.Tensor | None = None, bias: torch.Tensor | None = None, run: str | None = None,
                 tile: int | None = None):
        """From linear (its run, among runs, and its tile planned here), or from weight [out, in] and bias [out]
        with run and tile given."""
        super().__init__()
        if linear is not None:
            weight, bias = linear.weight.detach(), None if linear.bias is None else linear.bias.detach()
            run, tile = invariant_plan(weight, bias, _shape_key(linear), cache, runs)
        self.out_features, self.in_features = weight.shape
        self.run, self.tile, self.dtype = run, tile, weight.dtype
        self.register_buffer("bias", bias)  # the model's own tensors, not copies (but a packed or int8 weight)
        self.register_buffer("packed", _pack(weight) if run == "onednn" else None)
        self.register_buffer("scale", None)
        if run == "int8":
            check_int8_width(self.in_features)
            weight, self.scale = int8_weight(weight)
        self.register_buffer("weight", None if run == "onednn" else weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)  # [tokens, in]
        n = len(rows)
        if PAD_ROWS <= n <= self.tile:
            out = self.call(rows.contiguous())
        elif 0 < n < PAD_ROWS:
            out = self.call(F.pad(rows, (0, 0, 0, PAD_ROWS - n)))[:n]  # zeros below: a PAD_ROWS-row call
        else:
            return self._tiled(rows).reshape(*x.shape[:-1], self.out_features)
        return out.reshape(*x.shape[:-1], self.out_features)

    def _tiled(self, rows: torch.Tensor) -> torch.Tensor:
        if not len(rows):
            return rows.new_empty(0, self.out_features)
        return torch.cat([self(part) for part in rows.split(self.tile)])  # [tokens, out]

    def call(self, rows: torch.Tensor) -> torch.Tensor:
        """[n, out]: one call of the kernel over exactly these rows [n, in] (contiguous)."""
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.bias, "none", [], "")
        if self.scale is None:
            return F.linear(rows, self.weight, self.bias)
        y = torch.ops.aten._weight_int8pack_mm(rows, self.weight, self.scale)  # [n, out]
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, run={self.run}, tile={self.tile}"


class NoInvariantKernel(DraftwiseError):
    """No kernel here gives a linear's rows the same bits in every call."""


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight, ONEDNN_PACK_ROWS)


def invariant_plan(weight: torch.Tensor, bias: torch.Tensor | None, key: str, cache: bool = True,
                   runs: tuple[str, ...] = EXACT_RUNS) -> tuple[str, int]:
    """(run, tile) for InvariantLinear on this shape: of the runs whose rows keep their bits at least in calls of
    PAD_ROWS rows, the faster over a plain step and a 16-row pass, each in its own widest proven call.
    NoInvariantKernel where there is none. Cached per machine."""
    store = CalibrationCache(cache)
    entry_key = f"v{RULE_VERSION}|invariant|{','.join(runs)}|{key}"
    entry = store.get(entry_key)
    if entry is not None and entry.get("run") in runs and entry.get("tile") in (PAD_ROWS, TILE_ROWS):
        return entry["run"], entry["tile"]
    proven, ms = {}, {}
    for run in runs:
        try:
            module = InvariantLinear(weight=weight, bias=bias, run=run, tile=PAD_ROWS)
        except (RuntimeError, NotImplementedError):  # oneDNN refusing bfloat16 without AVX-512, a torch without int8
            continue
        if _rows_agree(module, (PAD_ROWS,)):
            module.tile = TILE_ROWS if _rows_agree(module, range(PAD_ROWS + 1, TILE_ROWS + 1)) else PAD_ROWS
            proven[run], ms[run] = module.tile, _time(module)
    if not proven:
        raise NoInvariantKernel(f"a {key} linear's rows change with their place in a {PAD_ROWS}-row call on this "
                                "machine: no batch-invariant kernel here; load with batch_invariant=False "
                                "(--no-batch-invariant)")
    run = min(ms, key=ms.get)
    store.put(entry_key, {"run": run, "tile": proven[run], "ms": ms})
    store.save()
    return run, proven[run]


@torch.inference_mode()
def _rows_agree(linear: InvariantLinear, widths) -> bool:
    """Whether rows computed in calls of each width (from other places in the call) are the bits they are in calls
    of PAD_ROWS rows."""
    dtype = linear.dtype
    x = torch.randn(TILE_ROWS, linear.in_features, generator=torch.Generator().manual_seed(0)).to(dtype)
    reference = torch.cat([linear.call(part) for part in x.split(PAD_ROWS)])  # [TILE_ROWS, out]
    for width in widths:
        start = (3 * width + 1) % (TILE_ROWS - width + 1)  # rows at other places than in the reference
        if not torch.equal(linear.call(x[start:start + width]), reference[start:start + width]):
            return False
    return True


@torch.inference_mode()
def _time(linear: InvariantLinear, widths=(1, 16)) -> float:
    """ms: the fastest of REPEATS runs of each width, summed."""
    dtype = linear.dtype
    total = 0.0
    for width in widths:
        x = torch.randn(width, linear.in_features).to(dtype)
        linear(x)
        samples = []
        for _ in range(REPEATS):
            started = time.perf_counter()
            linear(x)
            samples.append(1000 * (time.perf_counter() - started))
        total += min(samples)
    return total


class SplitLinear(OneDNNLinear):
    """Dense for one row (a plain step), oneDNN's packed weight for several (a verification pass)."""

    def __init__(self, linear: nn.Linear):
        super().__init__(linear)
        self.register_buffer("weight", linear.weight.detach())  # [out, in]: the model's own tensor, not a copy

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() == self.in_features:  # one row
            return F.linear(x, self.weight, self.bias)
        return super().forward(x)


class Int8Linear(nn.Module):
    """nn.Linear with int8 weights, one scale per output row (activations stay in the model's dtype)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        check_int8_width(self.in_features)
        weight, scale = int8_weight(linear.weight.detach())
        self.register_buffer("weight", weight)
        self.register_buffer("scale", scale)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).contiguous()  # [tokens, in]
        y = torch.ops.aten._weight_int8pack_mm(rows, self.weight, self.scale)  # [tokens, out]
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


class Int8DynamicLinear(nn.Module):
    """nn.Linear as torch's dynamically quantized linear for a few rows (a draft step): int8 weights, one scale
    per output row, packed once; each call quantizes its activations with one scale (7 bits: AVX2's int8
    multiply-add saturates at 8) and returns the model's dtype.

    Wider calls (a prefill, a catch-up) run the model's own float weight: one activation scale over many rows
    is set by the few with huge activations (a prompt's first tokens), and rounds the others' far more coarsely
    than a scale per row would: errors the draft's cache would then keep.
    keep_float=False keeps no reference to the float weight (a copy that only ever drafts, beside a target
    that repacked its own): wide calls then run a few rows at a time."""

    def __init__(self, linear: nn.Linear, keep_float: bool = True):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        keep = (lambda t: t) if keep_float else (lambda t: None)  # the model's own tensors, not copies, or nothing
        self.register_buffer("weight", keep(linear.weight.detach()))  # [out, in]
        self.register_buffer("bias", None if linear.bias is None else keep(linear.bias.detach()))
        weight = linear.weight.detach().float()  # [out, in]
        scale = _int8_row_scales(weight)  # [out]
        bias = None if linear.bias is None else linear.bias.detach().float()
        with warnings.catch_warnings():  # torch marks its quantized tensors for removal; a failing build is skipped
            warnings.simplefilter("ignore")
            qweight = torch.quantize_per_channel(weight, scale.double(), torch.zeros_like(scale, dtype=torch.long),
                                                 0, torch.qint8)
        self.packed = torch.ops.quantized.linear_prepack(qweight, bias)  # not a tensor: stays on the CPU

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)  # [tokens, in]
        if len(rows) <= DYNAMIC_MAX_ROWS:
            y = self._quantized(rows)
        elif self.weight is not None:
            return F.linear(x, self.weight, self.bias)
        else:
            y = torch.cat([self._quantized(part) for part in rows.split(DYNAMIC_MAX_ROWS)])
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def _quantized(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic(rows.float(), self.packed, True)  # [rows, out] (True: 7 bits)


INT8_WIDTH = 16  # torch's weight-only int8 kernel reads the input 16 channels at a time (and crashes on a rest)


def check_int8_width(in_features: int) -> None:
    """A RuntimeError (the kernel cannot be built, as the timing expects) for a width the int8 kernel cannot run."""
    if in_features % INT8_WIDTH:
        raise RuntimeError(f"the int8 kernel needs input widths a multiple of {INT8_WIDTH}, not {in_features}")


def int8_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 [out, in], scales [out] in weight's dtype) of a float weight [out, in]: one scale per output row."""
    scale = _int8_row_scales(weight.float())  # [out]
    return (weight.float() / scale[:, None]).round().clamp(-128, 127).to(torch.int8), scale.to(weight.dtype)


def _int8_row_scales(weight: torch.Tensor) -> torch.Tensor:
    """[out]: one scale per output row of a float weight [out, in], mapping its largest magnitude to 127."""
    return weight.abs().amax(dim=1).clamp(min=1e-12) / 127


_BUILDERS = {"dense": lambda linear: linear, "onednn": OneDNNLinear, "split": SplitLinear, "padded": PaddedLinear,
             INVARIANT: InvariantLinear, INVARIANT_INT8: lambda linear: InvariantLinear(linear, runs=("int8",)),
             "int8": Int8Linear, "int8-dynamic": Int8DynamicLinear}
# The same table read backwards: what kernel a module of the loaded model runs.
_KERNEL_NAMES = {nn.Linear: "dense", **{built: name for name, built in _BUILDERS.items() if isinstance(built, type)}}


@dataclass(frozen=True)
class KernelPlan:
    """The kernel chosen for each weight shape, and the timings that chose it."""

    choices: dict[str, str]  # shape key -> kernel name
    timings: dict[str, dict[str, list[float]]]  # shape key -> kernel -> ms at each width (only what was timed)
    widths: tuple[int, ...]


def kernel_counts(model: nn.Module) -> dict[str, int]:
    """How many linears of model run on each kernel, e.g. {"onednn": 169, "dense": 28}."""
    return dict(Counter(name for name in map(_kernel_name, model.modules()) if name))


def plan_kernels(model: nn.Module, kernels=EXACT_KERNELS, widths=TARGET_WIDTHS, cache: bool = True) -> KernelPlan:
    """Time every candidate kernel on each distinct linear shape of model and choose per shape.

    Only CPU models have candidates; elsewhere every linear stays dense."""
    linears = _linears_by_shape(model)
    device = next(model.parameters()).device
    if device.type != "cpu" or kernels == ("dense",):
        return KernelPlan({key: "dense" for key in linears}, {}, tuple(widths))
    if kernels == (INVARIANT,):  # nothing to choose: batch invariance asks for it everywhere
        return KernelPlan({key: INVARIANT for key in linears}, {}, tuple(widths))
    store = CalibrationCache(cache)
    choices, timings = {}, {}
    for key, linear in linears.items():
        entry_key = f"v{RULE_VERSION}|{key}|{','.join(kernels)}|{','.join(map(str, widths))}"
        entry = store.kernel_choice(entry_key, kernels) or _measure(linear, kernels, widths)
        store.put(entry_key, entry)
        choices[key], timings[key] = entry["kernel"], entry["ms"]
    store.save()
    return KernelPlan(choices, timings, tuple(widths))


def with_kernels(model: nn.Module, plan: KernelPlan) -> nn.Module:
    """model as the engine runs it: each linear on its planned kernel, and grouped-query attention without
    copies of the cache (attention.py). The model passed in is left untouched (the bench runs transformers' own
    generate on it); the copy shares every tensor that keeps its kernel."""
    if all(kernel == "dense" for kernel in plan.choices.values()) and not groups_queries(model):
        return model
    shared = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    fast = copy.deepcopy(model, memo=shared)
    for parent in list(fast.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                kernel = plan.choices.get(_shape_key(child), "dense")
                if kernel != "dense":
                    setattr(parent, name, _BUILDERS[kernel](child))
    if set(plan.choices.values()) & set(INVARIANT_KERNELS):  # a batch-invariant model: its attention must be too
        use_row_invariant_attention(fast)
    else:
        use_grouped_attention(fast)
    return fast.eval()


def planned_kernel(linear: nn.Linear, plan: KernelPlan) -> str:
    """The kernel plan chose for linear's shape."""
    return plan.choices.get(_shape_key(linear), "dense")


def draft_copy(linear: nn.Linear, kernel: str) -> nn.Module:
    """linear on kernel, for a draft beside a target whose own linears were repacked (the skip draft's copies):
    an int8-dynamic copy keeps no reference to the float weight, which the target no longer holds."""
    if kernel == "int8-dynamic":
        return Int8DynamicLinear(linear, keep_float=False)
    return _BUILDERS[kernel](linear)


def on_timed_kernels(model: nn.Module, kernels=EXACT_KERNELS, widths=TARGET_WIDTHS) -> nn.Module:
    """model (a copy, see with_kernels) with each linear on the kernel timed fastest here for these widths."""
    return with_kernels(model, plan_kernels(model, tuple(kernels), widths))


def _measure(linear: nn.Linear, kernels, widths) -> dict:
    """{"kernel": the choice, "ms": {kernel: [fastest ms at each width]}}; a kernel that fails is left out.

    The fastest of several runs, not the median: another process on the machine only ever adds time."""
    candidates = {}
    # split is timed as what it runs: dense's one row, oneDNN's wider passes (below).
    timed = dict.fromkeys(part for name in kernels for part in (("dense", "onednn") if name == "split" else (name,)))
    for name in timed:
        try:
            module = _BUILDERS[name](linear)
            module(torch.zeros(1, linear.in_features, dtype=linear.weight.dtype))
            candidates[name] = module
        # e.g. oneDNN bfloat16 on a CPU without AVX-512, or a torch without quantized kernels
        except (RuntimeError, NotImplementedError, AttributeError):
            continue
    ms = {name: [] for name in candidates}
    with torch.inference_mode():
        for n in widths:
            x = torch.randn(n, linear.in_features, dtype=linear.weight.dtype)  # [n, in]
            for name, module in candidates.items():
                module(x)  # warm the caches and the kernel's own dispatch
            samples = {name: [] for name in candidates}
            for _ in range(REPEATS):  # interleaved, so a slow moment of the machine hits every kernel
                for name, module in candidates.items():
                    started = time.perf_counter()
                    module(x)
                    samples[name].append(1000 * (time.perf_counter() - started))
            for name in candidates:
                ms[name].append(min(samples[name]))
    if "split" in kernels and {"dense", "onednn"} <= set(ms):
        ms["split"] = ms["dense"][:1] + ms["onednn"][1:]
    ms = {name: row for name, row in ms.items() if name in kernels}
    if not ms:  # every kernel asked for failed to build here (oneDNN refusing bfloat16 without AVX-512)
        raise DraftwiseError(f"none of the kernels {', '.join(kernels)} could be built for a {_shape_key(linear)} "
                             "linear on this machine; add dense to the kernels")
    return {"kernel": _choose(ms), "ms": ms}


def _choose(ms: dict[str, list[float]]) -> str:
    """The kernel whose worst slowdown against the fastest at any width is smallest, among those no slower than
    dense at the first width (a plain step must never pay for faster verification); dense unless clearly beaten."""
    widths = range(len(next(iter(ms.values()))))
    best = [min(row[i] for row in ms.values()) for i in widths]
    worst = {name: max(row[i] / best[i] for i in widths) for name, row in ms.items()}
    if "dense" not in ms:
        return min(worst, key=worst.get)
    eligible = {name: w for name, w in worst.items() if ms[name][0] <= ms["dense"][0] * (1 + MIN_GAIN)}
    choice = min(eligible, key=eligible.get)
    return choice if eligible[choice] < worst["dense"] * (1 - MIN_GAIN) else "dense"


def _linears_by_shape(model: nn.Module) -> dict[str, nn.Linear]:
    shapes = {}
    for module in model.modules():
        if type(module) is nn.Linear:
            shapes.setdefault(_shape_key(module), module)
    return shapes


def _shape_key(linear: nn.Linear) -> str:
    dtype = str(linear.weight.dtype).removeprefix("torch.")
    return f"{dtype}:{linear.out_features}x{linear.in_features}{'+bias' if linear.bias is not None else ''}"


def _kernel_name(module: nn.Module) -> str | None:
    from draftwise.backends.qgemm import QuantLinear  # (deferred: kernels.py loads with every engine)

    if isinstance(module, QuantLinear):  # the quant backend's: named by the bits its values take, e.g. "q4"
        return f"q{module.bits}"
    if isinstance(module, InvariantLinear):
        return INVARIANT_INT8 if module.run == "int8" else INVARIANT
    return _KERNEL_NAMES.get(type(module))


def calibration_dir() -> Path:
    """Where measured choices are kept: beside the models, so a second load on this machine pays nothing."""
    from draftwise.models.store import store_home

    return store_home() / "calibration"


class CalibrationCache:
    """One JSON file per machine (CPU model, instruction set, threads, torch version), written atomically."""

    def __init__(self, enabled: bool):
        from draftwise.hardware import machine_key

        self.path = calibration_dir() / f"{machine_key()}.json" if enabled else None
        self.entries = self._load()
        self.dirty = False

    def _load(self) -> dict:
        if self.path is None or not self.path.is_file():
            return {}
        try:
            entries = json.loads(self.path.read_text())
        except (OSError, ValueError):  # a damaged cache is measured again, never trusted
            return {}
        return entries if isinstance(entries, dict) else {}

    def get(self, key: str) -> dict | None:
        entry = self.entries.get(key)
        return entry if isinstance(entry, dict) else None

    def kernel_choice(self, key: str, kernels: tuple[str, ...]) -> dict | None:
        """The kernel entry measured for key, if it chose among `kernels`: a hand-edited or damaged one (an int8
        choice for the target's exact kernels) is measured again, never trusted."""
        entry = self.get(key)
        if entry is not None and entry.get("kernel") in kernels and isinstance(entry.get("ms"), dict):
            return entry
        return None

    def put(self, key: str, entry: dict) -> None:
        if self.entries.get(key) != entry:
            self.entries[key], self.dirty = entry, True

    def save(self) -> None:
        if self.path is None or not self.dirty:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            text = json.dumps(self.entries, indent=1, sort_keys=True)
            write_whole(self.path, lambda partial: partial.write_text(text))  # (a partial of its own per writer)
        except OSError:  # a read-only home costs a re-measurement next load, nothing else
            pass

