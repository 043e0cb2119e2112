"""A feature-level draft head (EAGLE, Li et al. 2024): one decoder layer over the target's own last hidden states.

At text position t the target has read token x_t and produced its feature f_t (its last hidden state, after the
final norm: what its output layer reads). The head takes f_t and the embedding of the next token x_{t+1},
fused by one linear layer, runs one causal decoder layer over those inputs (attending to the earlier positions'
inputs through its own small KV cache) and predicts f_{t+1}; the target's own output layer, restricted to the
common tokens (as the compact draft is), reads out the distribution of x_{t+2}. Past the text the head feeds
its own predicted features back in, one depth of a token tree per forward.

Only the fuse layer and the decoder layer are trained and saved (a few tens of MB); the embeddings and the
output layer are the target's, frozen, taken at load. The model and its files live here, on the inference side:
loading reads a head (load_head), training (draftwise/train/) builds and writes one (save_head).
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from draftwise.errors import DraftwiseError
from draftwise.files import write_whole

WEIGHTS_FILE = "head.safetensors"
CONFIG_FILE = "head_config.json"


@dataclass(frozen=True)
class HeadConfig:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float
    rms_eps: float
    readout_size: int  # target token ids the readout covers (the common ones plus the special ones)
    # Decoder layers whose outputs the head reads beside the last hidden state (EAGLE-3's fused features); () for
    # the last alone. Kept as a list in the JSON.
    feature_layers: tuple[int, ...] = ()
    # Whether each input also carries the embedding of x_t, the token the feature f_t was computed at (see
    # FeatureHead); False for heads trained before it.
    reads_current: bool = False
    target: str = ""  # the target's name or path it was trained for
    training: dict | None = None  # how it was trained (corpus, steps, accuracy): the record, not a setting

    @classmethod
    def for_target(cls, target_config, readout_size: int, intermediate_size: int | None = None,
                   target: str = "", feature_layers: tuple[int, ...] = (),
                   reads_current: bool = False) -> "HeadConfig":
        """The target's own attention shape, so its features and rotary positions carry over unchanged."""
        config = target_config.get_text_config()
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        rope = getattr(config, "rope_parameters", None) or {}
        theta = rope.get("rope_theta") or getattr(config, "rope_theta", None) or 10000.0
        return cls(hidden_size=config.hidden_size, num_heads=heads,
                   num_kv_heads=getattr(config, "num_key_value_heads", None) or heads, head_dim=head_dim,
                   intermediate_size=intermediate_size or config.intermediate_size, rope_theta=float(theta),
                   rms_eps=float(getattr(config, "rms_norm_eps", 1e-6)), readout_size=readout_size, target=target,
                   feature_layers=tuple(feature_layers), reads_current=reads_current)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(variance + self.eps)).to(x.dtype) * self.weight


def with_room(buffer: torch.Tensor | None, held: int, needed: int, like: torch.Tensor, dim: int) -> torch.Tensor:
    """buffer, or where it has no room for `needed` entries along dim, a new one with room for twice that (256 at
    least) holding its first `held`; like: what is to be stored, whose dtype, device and other sizes it takes."""
    if buffer is not None and needed <= buffer.shape[dim]:
        return buffer
    shape = list(like.shape)
    shape[dim] = max(256, 2 * needed)
    grown = like.new_zeros(shape)
    if buffer is not None:
        grown.narrow(dim, 0, held).copy_(buffer.narrow(dim, 0, held))
    return grown


class HeadCache:
    """One sequence's head keys and values, [1, kv_heads, capacity, head_dim], grown by doubling."""

    def __init__(self):
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.length = 0

    def __len__(self) -> int:
        return self.length

    def view(self, last: int | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The held keys and values, or only the `last` entries."""
        if not self.length:
            return None
        first = 0 if last is None else max(0, self.length - last)
        return self.keys[:, :, first : self.length], self.values[:, :, first : self.length]

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """keys/values: [1, kv_heads, n, head_dim], stored after what is held."""
        have, n = self.length, keys.shape[2]
        self.keys = with_room(self.keys, have, have + n, keys, dim=2)
        self.values = with_room(self.values, have, have + n, values, dim=2)
        self.keys[:, :, have : have + n] = keys
        self.values[:, :, have : have + n] = values
        self.length = have + n

    def trim(self, length: int) -> None:
        self.length = min(self.length, length)


class FeatureHead(nn.Module):
    """With config.reads_current, the input at position t is (f_t, x_{t+1}, x_t): x_t's embedding lets one
    attention layer copy. The token that followed an earlier x_{t+1} is often the target's next token (prompt
    lookup's guess, right at a good third of positions in summaries and code, more after a longer match), and a
    head without x_t guesses it far less often: its keys hold x_{t+1} and f_t, which mostly say what comes next,
    not which token a position holds. With x_t in each key, a query's x_{t+1} finds the
    positions that held the same token, whose values hold the token that followed it."""

    def __init__(self, config: HeadConfig):
        super().__init__()
        self.config = config
        h, kv = config.hidden_size, config.num_kv_heads * config.head_dim
        self.fuse = nn.Linear((3 if config.reads_current else 2) * h, h, bias=False)
        if config.feature_layers:  # the true features of several layers, each normed, brought down to H
            parts = len(config.feature_layers) + 1
            self.layer_norms = nn.ModuleList(RMSNorm(h, config.rms_eps) for _ in range(parts))
            self.reduce = nn.Linear(parts * h, h, bias=False)
        self.input_norm = RMSNorm(h, config.rms_eps)
        self.q_proj = nn.Linear(h, config.num_heads * config.head_dim, bias=True)
        self.k_proj = nn.Linear(h, kv, bias=True)
        self.v_proj = nn.Linear(h, kv, bias=True)
        self.o_proj = nn.Linear(config.num_heads * config.head_dim, h, bias=False)
        self.mlp_norm = RMSNorm(h, config.rms_eps)
        self.gate_proj = nn.Linear(h, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, h, bias=False)
        inv_freq = 1.0 / config.rope_theta ** (torch.arange(0, config.head_dim, 2).float() / config.head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # [head_dim / 2]

    def joining_layers(self) -> tuple[str, ...]:
        """Its linears whose input joins tensors of different scales: the fuse, and a fused head's reduce."""
        return ("fuse", "reduce") if self.config.feature_layers else ("fuse",)

    def forward(self, features: torch.Tensor, embeddings: torch.Tensor, positions: torch.Tensor,
                past: tuple[torch.Tensor, torch.Tensor] | None = None, mask: torch.Tensor | None = None,
                return_kv: bool = False, current: torch.Tensor | None = None):
        """features, embeddings: [B, N, H] (f_t and the embedding of x_{t+1}); positions: [N] text positions t;
        current: [B, N, H], the embedding of x_t, required if config.reads_current (ignored otherwise). A
        fused head's true features are [B, N, (layers + 1) H], brought down to H first; its own predicted ones
        (a tree's deeper inputs) are [B, N, H].

        past: keys and values of earlier inputs, [B, kv_heads, P, D] each. mask: [N, P + N] bool, what each new
        input attends to; None is causal (every earlier input and itself). Returns the predicted features
        [B, N, H], and with return_kv also the new inputs' keys and values (to cache)."""
        if features.shape[-1] != self.config.hidden_size:  # true features of several layers
            parts = features.split(self.config.hidden_size, dim=-1)
            features = self.reduce(torch.cat([norm(part) for norm, part in zip(self.layer_norms, parts)], dim=-1))
        if self.config.reads_current and current is None:
            raise ValueError("this head reads the current token (config.reads_current): give current, the "
                             "embedding of x_t at each position")
        fused = [embeddings, features, current] if self.config.reads_current else [embeddings, features]
        x = self.fuse(torch.cat(fused, dim=-1))  # [B, N, H]
        attended, kv = self._attend(self.input_norm(x), positions, past, mask)
        x = x + attended
        h = self.mlp_norm(x)
        out = x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))  # [B, N, H]
        return (out, kv) if return_kv else out

    def _attend(self, x: torch.Tensor, positions: torch.Tensor, past, mask):
        c = self.config
        b, n, _ = x.shape
        q = self.q_proj(x).view(b, n, c.num_heads, c.head_dim).transpose(1, 2)  # [B, heads, N, D]
        k = self.k_proj(x).view(b, n, c.num_kv_heads, c.head_dim).transpose(1, 2)  # [B, kv_heads, N, D]
        v = self.v_proj(x).view(b, n, c.num_kv_heads, c.head_dim).transpose(1, 2)
        cos, sin = self._rotary(positions, q.dtype)  # [N, D]
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        keys, values = (k, v) if past is None else (torch.cat([past[0], k], 2), torch.cat([past[1], v], 2))
        if mask is None:
            before = keys.shape[2] - n
            mask = torch.ones(n, before + n, dtype=torch.bool, device=x.device).tril(before)  # [N, P + N]
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask,
                                             enable_gqa=c.num_heads != c.num_kv_heads)  # [B, heads, N, D]
        return self.o_proj(out.transpose(1, 2).reshape(b, n, c.num_heads * c.head_dim)), (k, v)

    def _rotary(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions.float()[:, None] * self.inv_freq[None, :]  # [N, D / 2]
        angles = torch.cat([angles, angles], dim=-1)  # [N, D]
        return angles.cos().to(dtype), angles.sin().to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding, the half-split layout of Llama and Qwen."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


# -- readout ------------------------------------------------------------------------------------------------
def readout_ids(target_vocab: int, keep: int, special_ids=(), frequent=()) -> torch.Tensor:
    """The target ids the head reads out: `keep` of them, first those of `frequent` (ids, most frequent first: the
    tokens the target emits on the training split), then the lowest others (byte-level BPE numbers the tokens
    frequent in its own training text first, as the compact draft relies on), plus the special ones. [readout]
    long, ascending.

    Why frequency first: the lowest ids of a multilingual vocabulary are not all what a coding model writes, and
    the readout is most of a head forward's cost. For the Qwen pair, of the target's next tokens on the held-back
    files and answers, 16,384 ids chosen this way cover 89.1%, the lowest 16,384 85.7%, the lowest 32,768 91.5%:
    nearly the wider readout's cover at half its cost."""
    keep = min(keep, target_vocab)
    kept = dict.fromkeys(i for i in frequent if 0 <= i < target_vocab)  # (ordered, without repeats)
    kept = set(list(kept)[:keep])
    lowest = (i for i in range(target_vocab) if i not in kept)
    while len(kept) < keep:
        kept.add(next(lowest))
    kept |= {i for i in special_ids if 0 <= i < target_vocab}
    return torch.tensor(sorted(kept), dtype=torch.long)


def readout_layer(target_model, ids: torch.Tensor) -> nn.Linear:
    """The target's output layer over `ids` only: [readout, H], frozen."""
    weight = output_weight(target_model, ids)
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=weight.dtype, device=weight.device)
    layer.weight = nn.Parameter(weight, requires_grad=False)
    return layer.requires_grad_(False)


def output_weight(target_model, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The output layer's [vocab, H] weight in float, or its [len(rows), H] rows. A layer repacked for a faster
    kernel (backends/kernels.py) has no plain weight, and a model that ties it to the input embeddings still holds
    it there; one on a GGUF file's blocks (the quant backend) gives what its blocks stand for, only the rows asked
    (the whole vocabulary in float is a gigabyte for the 1.5B)."""
    layer = target_model.get_output_embeddings()
    weight = getattr(layer, "weight", None)
    if weight is None and getattr(target_model.config.get_text_config(), "tie_word_embeddings", False):
        weight = target_model.get_input_embeddings().weight
    if weight is None and hasattr(layer, "dequantized"):
        return layer.dequantized(rows)
    if weight is None:
        raise DraftwiseError("the target's output layer has no plain weight (it was repacked for a kernel); "
                             "give the head the model as loaded")
    return weight if rows is None else weight.detach()[rows.to(weight.device)]


# -- files --------------------------------------------------------------------------------------------------
def save_head(head: FeatureHead, ids: torch.Tensor, folder: Path) -> None:
    """head.safetensors (the trained weights and the readout ids) and head_config.json, written whole or not at all."""
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().contiguous().cpu() for name, t in head.state_dict().items()}
    tensors["readout_ids"] = ids.cpu()
    write_whole(folder / WEIGHTS_FILE, lambda p: save_file(tensors, str(p)))
    save_config(head, folder)


def save_config(head: FeatureHead, folder: Path) -> None:
    """head_config.json alone (the weights unchanged), written whole or not at all."""
    write_whole(folder / CONFIG_FILE, lambda p: p.write_text(json.dumps(asdict(head.config), indent=2)))


def require_head(folder: str | Path) -> Path:
    """The folder, if it holds a trained head (checked in an instant, before a target loads for minutes)."""
    folder = Path(folder)
    if not (folder / WEIGHTS_FILE).is_file() or not (folder / CONFIG_FILE).is_file():
        raise DraftwiseError(f"method 'head' needs a trained head; none in {folder} ({WEIGHTS_FILE} and "
                             f"{CONFIG_FILE}). Make one with: draftwise train-head --target MODEL --out {folder}")
    return folder


def load_head(folder: str | Path, dtype: torch.dtype = torch.float32,
              device: str | torch.device = "cpu") -> tuple[FeatureHead, torch.Tensor]:
    """(the head, its readout ids) from a folder save_head wrote."""
    folder = require_head(folder)
    fields = json.loads((folder / CONFIG_FILE).read_text())
    config = HeadConfig(**{**fields, "feature_layers": tuple(fields.get("feature_layers", ()))})
    tensors = load_file(str(folder / WEIGHTS_FILE))
    ids = tensors.pop("readout_ids")
    head = FeatureHead(config)
    head.load_state_dict(tensors)
    return head.to(device=device, dtype=dtype).eval().requires_grad_(False), ids


def check_fits(config: HeadConfig, target_model, folder) -> None:
    """A head trained for another model's features cannot draft for this one: say which size differs."""
    target = target_model.config.get_text_config()
    if config.hidden_size != target.hidden_size:
        raise DraftwiseError(f"the head in {folder} was trained for hidden size {config.hidden_size} "
                             f"({config.target or 'another model'}); this target's is {target.hidden_size}")
    if any(not 0 <= layer < target.num_hidden_layers for layer in config.feature_layers):
        raise DraftwiseError(f"the head in {folder} reads decoder layers {list(config.feature_layers)}; this target "
                             f"has {target.num_hidden_layers} decoder layers")


def parameter_count(head: FeatureHead) -> int:
    return sum(math.prod(p.shape) for p in head.parameters())
