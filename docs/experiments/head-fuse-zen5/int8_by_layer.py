# Usage: python int8_by_layer.py (the default head under $DRAFTWISE_HOME/heads; its features must be collected)
"""The head's held-back top-1 with one group of its linears (fuse, attention, MLP, readout, or all) on int8-dynamic and
the rest on their own float weights (dense)."""
import json
from pathlib import Path
import torch
from torch import nn
from draftwise.loading import load_models
from draftwise.head.model import load_head, readout_layer
from draftwise.head.train import _Trainer, TrainConfig, _held_back
from draftwise.head.corpus import Piece, training_sequences
from draftwise.head.features import collect, load_shards
folder = Path("/root/.cache/draftwise/heads/qwen2.5-coder-1.5b-instruct")
m, tok, _ = load_models("qwen2.5-coder-1.5b-instruct", None, "auto", "cpu", progress=False)
vocab = m.get_output_embeddings().weight.shape[0]
pieces = [Piece(**p) for p in json.loads((folder / "answers.json").read_text())["pieces"]]
pieces += training_sequences(tok, 512, 60000)
data = load_shards(collect(None, [p.ids for p in pieces], folder / "features", False))
for s, p in zip(data, pieces): s["answer_start"] = p.answer_start
val = [s for s, p in zip(data, pieces) if _held_back(p.source)]
from draftwise.backends.kernels import Int8DynamicLinear
def fwd(self, x):  # quantized 4 rows a call, as the engine's head calls of 1 to 4 rows are (wide ones would run float)
    rows = x.reshape(-1, self.in_features)
    y = torch.cat([self._quantized(p) for p in rows.split(4)])
    return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
Int8DynamicLinear.forward = fwd
class Cast(nn.Module):
    def __init__(self, h):
        super().__init__(); self.h, self.config = h, h.config
    def forward(self, f, e, pos, past=None, mask=None, return_kv=False, current=None):
        current = None if current is None else current.to(torch.bfloat16)
        return self.h(f.to(torch.bfloat16), e.to(torch.bfloat16), pos, past=past, mask=mask, return_kv=return_kv,
                      current=current)
class CastRo(nn.Module):
    def __init__(self, r):
        super().__init__(); self.r = r
    def forward(self, x): return self.r(x.to(torch.bfloat16)).float()
_, ids = load_head(folder, dtype=torch.bfloat16)
groups = {"none": [], "fuse": ["fuse"], "attn": ["q_proj", "k_proj", "v_proj", "o_proj"], "mlp": ["gate_proj", "up_proj", "down_proj"], "readout": ["readout"], "all": ["fuse", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "readout"]}
for gname, names in groups.items():
    head, _ = load_head(folder, dtype=torch.bfloat16)
    for n in names:
        if n != "readout":
            setattr(head, n, Int8DynamicLinear(getattr(head, n)))
    r = readout_layer(m, ids)
    ro = Int8DynamicLinear(r) if "readout" in names else r
    t = _Trainer(Cast(head), CastRo(ro), m.get_input_embeddings(), ids, vocab, TrainConfig(), total_steps=1)
    t.autocast = False
    print("int8-dynamic on", gname, t.evaluate(val).line(), flush=True)
