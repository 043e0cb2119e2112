"""`draftwise distill`: a better draft for a target, learnt from the requests the server answered.

The draft learns to write what the target wrote on the service's own traffic (served.py): cross-entropy on the
target's output tokens, which are its greedy choices, through a low-rank adapter (peft's LoRA) on the draft's
attention and MLP projections. Why an adapter and not the whole draft: it trains a few million weights instead of
half a billion (a CPU hour goes further), it cannot drift far from the draft that was already good, and a version
is a few megabytes beside the base draft's file, which every backend goes on reading as published (the quant backend
its 4-bit blocks, llama.cpp its GGUF file) with the adapter applied beside it.

Judged on the latest requests (time_split): the share of the target's output tokens that the draft's greedy choice
matches, each read after the target's own text before it (the acceptance of a one-token draft), before and after.

The result is a version folder, $DRAFTWISE_HOME/drafts/<base draft>/v<N>/ (versions.py), written whole. The work
folder keeps a checkpoint every CHECKPOINT_EVERY steps; the same command resumes it.
"""
from __future__ import annotations

import hashlib
import json
import random
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from draftwise.config import DEFAULT_DRAFT_TOKENS
from draftwise.files import write_whole
from draftwise.hardware import native_bf16
from draftwise.train.schedule import lr_scale
from draftwise.train.served import Served, Span, served_requests, time_split, window

CHECKPOINT_EVERY = 16  # steps
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Recipe:
    rank: int = 16
    alpha: float = 32.0  # the adapter's output is scaled by alpha / rank
    lr: float = 3e-4
    epochs: int = 2
    seq_len: int = 512  # tokens of a request trained on at once: its output, and the prompt before it that fits
    held_out: float = 0.2  # the latest share of the requests
    warmup_steps: int = 8
    seed: int = 0
    modules: tuple[str, ...] = PROJECTIONS


@dataclass
class Agreement:
    """The share of the target's output tokens the draft's greedy choice matches, teacher-forced; and the share of its
    guesses that greedy rounds of a fixed number of draft tokens keep (kept_share: what the server reports as
    acceptance at that k)."""

    matched: int = 0
    tokens: int = 0
    kept: int = 0
    proposed: int = 0

    @property
    def share(self) -> float:
        return self.matched / self.tokens if self.tokens else 0.0

    @property
    def kept_share(self) -> float:
        return self.kept / self.proposed if self.proposed else 0.0

    def add(self, matches: list[bool], chain: int) -> None:
        """One answer's teacher-forced matches, in order."""
        self.matched, self.tokens = self.matched + sum(matches), self.tokens + len(matches)
        kept, proposed = chain_rounds(matches, chain)
        self.kept, self.proposed = self.kept + kept, self.proposed + proposed


def chain_rounds(matches: list[bool], k: int) -> tuple[int, int]:
    """(kept, proposed) of greedy speculation with chains of k over one answer, from its teacher-forced matches. Exact,
    not an estimate: a kept guess is the target's own token, so the draft's next guess is read after the target's text,
    as teacher forcing reads it; each round keeps the matches in a row from where it starts (at most k) and the target
    adds one token of its own (its correction, or the token after a chain kept whole). As the engine, a round never
    drafts for the answer's last token (which the target's own token would be)."""
    kept = proposed = position = 0
    while position < len(matches):
        offered = min(k, len(matches) - position - 1)
        run = 0
        while run < offered and matches[position + run]:
            run += 1
        kept, proposed, position = kept + run, proposed + offered, position + run + 1
    return kept, proposed


@dataclass
class Outcome:
    """What distill() made and measured, the provenance of a version."""

    recipe: dict
    trained_on: dict  # Span of the earlier requests
    held_out: dict  # Span of the latest requests
    agreement_before: float
    agreement_after: float
    held_out_tokens: int
    steps: int
    train_s: float
    logs: list[str] = field(default_factory=list)
    kept_before: float = 0.0  # Agreement.kept_share, rounds of DEFAULT_DRAFT_TOKENS
    kept_after: float = 0.0


def run_key(train: list[Served], base: str, recipe: Recipe) -> str:
    """What a checkpoint belongs to: the same base, recipe and training requests, or it is not resumed."""
    ids = [s.request_id for s in train]
    return hashlib.sha256(json.dumps([base, asdict(recipe), ids]).encode()).hexdigest()[:16]


def distill(draft_model, base: str, logs: list[str], recipe: Recipe, work: Path, progress: bool = True,
            log=lambda line: None) -> tuple[torch.nn.Module, Outcome]:
    """(the draft with its trained adapter (a peft model), what was measured). work: the folder for checkpoints."""
    # (peft asks transformers a question transformers 5 renamed: its warning says nothing to a user of distill)
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)

    train, held_out = time_split(served_requests(logs), recipe.held_out)
    log(f"{len(train)} requests to learn from ({Span.of(train).tokens} output tokens), the latest "
        f"{len(held_out)} held out")
    before = agreement(draft_model, held_out, recipe.seq_len, progress, "held-out, before")
    model = with_adapter(draft_model, recipe)
    trainer = _Trainer(model, recipe, total_steps=recipe.epochs * len(train), key=run_key(train, base, recipe))
    checkpoint = work / "checkpoint.pt"
    done = trainer.resume(checkpoint)
    if done:
        log(f"resuming at step {done} of {trainer.total_steps}")
    started = time.perf_counter()
    order = _order(len(train), recipe)
    with tqdm(total=trainer.total_steps, initial=done, desc="distill", unit="request", disable=not progress,
              dynamic_ncols=True) as bar:
        for step in range(done, trainer.total_steps):
            loss = trainer.step(train[order[step]])
            bar.set_postfix(loss=f"{loss:.3f}")
            bar.update(1)
            if (step + 1) % CHECKPOINT_EVERY == 0 and step + 1 < trainer.total_steps:
                trainer.checkpoint(checkpoint, step + 1)
    train_s = time.perf_counter() - started + trainer.earlier_s
    after = agreement(model, held_out, recipe.seq_len, progress, "held-out, after")
    outcome = Outcome(asdict(recipe), asdict(Span.of(train)), asdict(Span.of(held_out)), before.share, after.share,
                      after.tokens, trainer.total_steps, round(train_s, 1), [str(Path(p).resolve()) for p in logs],
                      before.kept_share, after.kept_share)
    return model, outcome


def with_adapter(draft_model, recipe: Recipe) -> torch.nn.Module:
    """draft_model (modified in place) with the recipe's fresh low-rank adapter, seeded: a peft model."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(recipe.seed)
    config = LoraConfig(r=recipe.rank, lora_alpha=recipe.alpha, lora_dropout=0.0, target_modules=list(recipe.modules),
                        task_type="CAUSAL_LM")
    return get_peft_model(draft_model, config)


def _order(count: int, recipe: Recipe) -> list[int]:
    """Which request each step trains on: every request once an epoch, shuffled by the recipe's seed."""
    rng, order = random.Random(recipe.seed), []
    for _ in range(recipe.epochs):
        epoch = list(range(count))
        rng.shuffle(epoch)
        order += epoch
    return order


@torch.inference_mode()
def agreement(model, items: list[Served], seq_len: int, progress: bool = False, desc: str = "agreement",
              chain: int = DEFAULT_DRAFT_TOKENS) -> Agreement:
    model.eval()
    result = Agreement()
    for item in tqdm(items, desc=desc, unit="request", disable=not progress, dynamic_ncols=True, leave=False):
        ids, start = window(item, seq_len)
        start = max(start, 1)  # the first token has nothing before it to be predicted from
        logits = _answer_logits(model, ids, start)  # [A, V]
        wanted = torch.tensor(ids[start:], device=logits.device)  # [A]
        result.add((logits.argmax(-1) == wanted).tolist(), chain)
    return result


def _answer_logits(model, ids: list[int], start: int) -> torch.Tensor:
    """[A, V]: the draft's logits for each output token from start (>= 1) on, read at the token before it
    (A = len(ids) - start)."""
    device = next(model.parameters()).device
    logits = model(input_ids=torch.tensor([ids], device=device)).logits[0]  # [L, V]
    return logits[start - 1 : len(ids) - 1].float()


class _Trainer:
    def __init__(self, model, recipe: Recipe, total_steps: int, key: str):
        self.model, self.recipe, self.total_steps, self.key = model, recipe, total_steps, key
        self.earlier_s = 0.0  # training seconds of the run this one resumed
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.device = self.params[0].device
        self.autocast = native_bf16(self.device.type)  # bfloat16 matmuls only where computed natively
        self.optimizer = torch.optim.AdamW(self.params, lr=recipe.lr, weight_decay=0.0)
        self.schedule = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: lr_scale(step, recipe.warmup_steps, total_steps))
        self._started = time.perf_counter()

    def step(self, item: Served) -> float:
        self.model.train()
        ids, start = window(item, self.recipe.seq_len)
        start = max(start, 1)  # the first token has nothing before it to be predicted from
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            logits = _answer_logits(self.model, ids, start)  # [A, V]
        loss = F.cross_entropy(logits, torch.tensor(ids[start:], device=logits.device))
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.optimizer.step()
        self.schedule.step()
        return float(loss.detach())

    def resume(self, path: Path) -> int:
        if not path.is_file():
            return 0
        state = torch.load(path, weights_only=True, map_location="cpu")
        if state.get("key") != self.key:
            return 0  # another run's: start over rather than mix two recipes or two logs
        trained = [p for p in self.model.parameters() if p.requires_grad]
        for param, saved in zip(trained, state["adapter"]):
            param.data.copy_(saved)
        self.optimizer.load_state_dict(state["optimizer"])
        self.schedule.load_state_dict(state["schedule"])
        self.earlier_s = float(state["train_s"])
        return int(state["step"])

    def checkpoint(self, path: Path, step: int) -> None:
        state = {"key": self.key, "step": step, "adapter": [p.detach().cpu() for p in self.params],
                 "optimizer": self.optimizer.state_dict(), "schedule": self.schedule.state_dict(),
                 "train_s": self.earlier_s + time.perf_counter() - self._started}
        path.parent.mkdir(parents=True, exist_ok=True)
        write_whole(path, lambda p: torch.save(state, p))

