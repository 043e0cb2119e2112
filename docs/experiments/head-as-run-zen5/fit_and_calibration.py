# Usage: python fit_and_calibration.py: the default head (float32, whole sequences, as training validates it) on 40
# of its training sequences against its held-back split (is it short of data or of capacity?), and, on the held-back
# split, how often its top token is the target's by how sure it was (are its chances honest, as the tree sizing
# takes them?).
import random
import torch
from default_split import HEAD as H, default_split
from draftwise.head import train as T
from draftwise.head.model import load_head, readout_layer
from draftwise.loading import load_models
target, tok, _ = load_models("qwen2.5-coder-1.5b-instruct", None, "auto", "cpu", progress=False)
cfg = T.TrainConfig()
train, val = default_split(tok)
random.Random(0).shuffle(train)
head, ids = load_head(H)
vocab = target.get_output_embeddings().weight.shape[0]
scorer = T._Trainer(head, readout_layer(target, ids).float(), target.get_input_embeddings(), ids, vocab, cfg, 1)
print("held back:", scorer.evaluate(val).line())
print("40 training sequences:", scorer.evaluate(train[:40]).line())
edges = [i / 10 for i in range(11)]
counts, hits, claimed = [0] * 10, [0] * 10, [0.0] * 10
with torch.no_grad():
    for s in val:
        _, (logits1, _) = scorer._losses(s, noise=0.0)
        sure, top = torch.softmax(logits1.float(), -1).max(-1)  # [L - 1]: row t guesses next[t + 1]
        label = scorer.to_readout[s["next"][1:]]
        scored = torch.arange(1, len(s["ids"])) + 1 >= s["answer_start"]
        for p, ok in zip(sure[scored].tolist(), (top == label)[scored].tolist()):
            b = min(9, int(p * 10))
            counts[b] += 1; hits[b] += ok; claimed[b] += p
total = sum(counts)
print("held back, depth 1, by the head's probability of its top token:")
for b in range(10):
    if counts[b]:
        print(f"  {edges[b]:.1f}-{edges[b + 1]:.1f}: {counts[b]:5d} positions ({100 * counts[b] / total:4.1f}%), "
              f"claimed {claimed[b] / counts[b]:.3f}, the target's token {hits[b] / counts[b]:.3f}")
print(f"  all: claimed {sum(claimed) / total:.3f}, the target's token {sum(hits) / total:.3f}")
