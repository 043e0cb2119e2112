# Probe, not a feature: does a head trained from the start with the copy candidate as an input learn to use it?
# The candidate at text position t is the token that followed the most recent earlier copy of x_{t+1} (prompt lookup's
# one-token guess for x_{t+2}, from anywhere in the text, not only the head's window), its embedding a fourth input
# to the fuse (zeros where there is none). Trained exactly as data_scaling.py trains its heads, on all of mix-rc's
# training sequences (the default recipe, features reused), and scored the same way; the control is mix-rc itself,
# the same recipe and data without the input (data_scaling.txt's "fraction 1" line), and, with --control, the same
# run as this one, the same seed and widened fuse, given zeros in the candidate's place.
# Run from the repository: python docs/bench/head-copy-input-zen4/copy_input_scratch.py MIX_RC_DIR BENCH_CACHE [--control]
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "head-scaling-zen4"))
from data_scaling import load_run, new_trainer, scores, train_epochs  # noqa: E402


def copy_candidates(tokens: list[int]) -> torch.Tensor:
    """[L - 1] ids: at position t, the token after the most recent earlier copy of tokens[t + 1], or -1."""
    last_seen, out = {}, []
    for t in range(len(tokens) - 1):
        last_seen[tokens[t]] = t  # a copy at j <= t has its follower tokens[j + 1] inside the text given
        j = last_seen.get(tokens[t + 1])
        out.append(tokens[j + 1] if j is not None else -1)
    return torch.tensor(out)


class CopyInput:
    """Widens a head's fuse by one input (zero weights to start) and feeds it the copy candidate's embedding beside
    x_t's: the wrapped forward reads the candidates of the sequence last given to set_sequence, by position."""

    def __init__(self, head: nn.Module, embed: nn.Module, use: bool = True):
        self.embed, self.use, self.table = embed, use, None
        h = head.config.hidden_size
        wide = nn.Linear(head.fuse.in_features + h, h, bias=False)
        with torch.no_grad():
            wide.weight.copy_(torch.cat([head.fuse.weight, torch.zeros(h, h)], dim=1))
        head.fuse = wide
        self.forward = head.forward
        head.forward = self.wrapped

    def set_sequence(self, sequence: dict) -> None:
        candidates = copy_candidates(sequence["ids"].tolist())  # [L - 1]
        with torch.no_grad():
            table = self.embed(candidates.clamp(min=0)).float() * (candidates >= 0)[:, None]  # [L - 1, H]
        self.table = table if self.use else torch.zeros_like(table)

    def wrapped(self, features, embeddings, positions, past=None, mask=None, return_kv=False, current=None):
        extra = self.table[positions][None].to(current.dtype)  # [1, N, H]
        return self.forward(features, embeddings, positions, past=past, mask=mask, return_kv=return_kv,
                            current=torch.cat([current, extra], dim=-1))


if __name__ == "__main__":
    mix, bench_cache, use = Path(sys.argv[1]).expanduser(), Path(sys.argv[2]), "--control" not in sys.argv[3:]
    target, tokenizer, cfg, record, train, val = load_run(mix)
    bench = torch.load(bench_cache)
    wrappers = []
    trainer = new_trainer(target, tokenizer, cfg, train, cfg.epochs * len(train),
                          widen=lambda head: wrappers.append(CopyInput(head, target.get_input_embeddings(), use)))
    started = time.time()
    train_epochs(trainer, cfg, train, prepare=wrappers[0].set_sequence)
    arm = "copy input" if use else "control (zeros)"
    print(f"{arm}, all {len(train)} training sequences: trained in {time.time() - started:.0f} s; "
          f"{scores(trainer, bench, val, prepare=wrappers[0].set_sequence)}", flush=True)
