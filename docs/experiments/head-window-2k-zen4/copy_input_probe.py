# Probe, not a feature: would a head handed the copy candidate learn to use it? The mix-rc head gets a fourth input,
# the embedding of the token that followed the most recent earlier copy of x_{t+1} (zeros where there is none), its
# fuse widened with zero weights so that it starts as the same head. Two arms are tuned alike for one pass over
# mix-rc's own training features (no bench text): "copy" with the candidate, "control" with zeros in its place. Both
# are then scored on the bench answers (evaluation only; head-everyday-zen5/bench_top1.py's cache) with training's own
# validation (float32, full attention), by category.
# Run from the repository: python docs/bench/head-window-2k-zen4/copy_input_probe.py MIX_RC_DIR
import collections
import copy
import random
import sys
import time
from pathlib import Path

import torch

from draftwise.head.features import load_shards
from draftwise.head.model import load_head, readout_layer
from draftwise.head.train import TrainConfig, _Trainer
from draftwise.loading import load_models

# (copy_candidates and CopyInput now live beside the from-scratch run that followed this probe)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "head-copy-input-zen4"))
from copy_input_scratch import CopyInput  # noqa: E402

MIX = Path(sys.argv[1]).expanduser()
LR = 2e-4
torch.manual_seed(0)
target, _, _ = load_models("qwen2.5-coder-1.5b-instruct", None, "auto", "cpu", progress=False)
embed, vocab = target.get_input_embeddings(), target.get_output_embeddings().weight.shape[0]
head, ids = load_head(MIX)
readout = readout_layer(target, ids).float()
own = load_shards(sorted((MIX / "features").glob("*.safetensors")))
random.Random(2).shuffle(own)
bench = torch.load("/tmp/diag/bench_answers_8_96.pt")

for name, use in (("copy", True), ("control", False)):
    tuned = copy.deepcopy(head).requires_grad_(True)
    wrapper = CopyInput(tuned, embed, use)
    trainer = _Trainer(tuned, readout, embed, ids, vocab, TrainConfig(lr=LR, warmup_steps=10), total_steps=len(own))
    started, losses = time.time(), []
    for sequence in own:
        wrapper.set_sequence(sequence)
        losses.append(trainer.step(sequence))
    quarter = len(losses) // 4
    print(f"{name}: {len(own)} steps in {time.time() - started:.0f} s, mean loss first/last quarter "
          f"{sum(losses[:quarter]) / quarter:.3f} / {sum(losses[-quarter:]) / quarter:.3f}", flush=True)
    hits, counted = collections.Counter(), collections.Counter()
    for answer in bench:
        wrapper.set_sequence(answer)
        accuracy = trainer.evaluate([answer])
        for category in (answer["category"], "all"):
            hits[category] += accuracy.top1 * accuracy.tokens
            counted[category] += accuracy.tokens
    print(f"{name} on the bench answers: " + ", ".join(f"{c} {100 * hits[c] / counted[c]:.1f}%" for c in counted),
          flush=True)
