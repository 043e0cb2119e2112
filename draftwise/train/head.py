"""Train a feature head: collect the target's features over the corpus, then fit the head to them, on the
target's device (the CPU here; a GPU where the target was loaded on one).

Each training sequence teaches two depths at once (EAGLE-3's "training-time test", shortened to two steps):
- depth 1: inputs (f_t, x_{t+1}) with the target's true features, as the head sees them for the first draft
  token of a round; it predicts f_{t+1};
- depth 2: inputs (its own prediction of f_{t+1}, x_{t+2}), attending to the true inputs before it, as the head
  sees them one token past the text; it predicts f_{t+2}.
The loss at each depth is the cross-entropy of the readout against the target's own distribution there (over
the readout tokens) plus a small feature regression (EAGLE's smooth L1), and the input features get a little
noise so that the head tolerates its own imperfect predictions.

The sequences of one source file in VAL_EVERY (and the answers about those files) are held back, never
trained on; their top-1 and top-3 accuracy against the target's own greedy token, over the answers' positions
only (not the requests or the chat template), is reported at the start (chance: the untrained head) and after
each epoch. A checkpoint (head, optimizer, step) is written every `checkpoint_every` steps and at each epoch's end,
so an interrupted run resumes where it stopped.
"""
from __future__ import annotations

import hashlib
import json
import math
import random
import re
import time
import zlib
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from draftwise.backends.kernels import on_timed_kernels
from draftwise.files import write_whole
from draftwise.hardware import native_bf16
from draftwise.proposers.head_model import (FeatureHead, HeadConfig, output_weight, readout_ids, readout_layer,
                                            save_config, save_head)
from draftwise.train.answers import answer_prompts, requests_key, target_answers
from draftwise.train.as_run import gap_line, top1_as_run
from draftwise.train.corpus import Piece, training_sequences
from draftwise.train.everyday import everyday_key, everyday_prompts
from draftwise.train.features import collect, load_shards
from draftwise.train.schedule import lr_scale

VAL_EVERY = 20  # one source file in 20 is held back for validation
CAPTURED_HELD_OUT = 0.2  # of a server's captured requests, the latest share held out (train_head(captured=...))
CHECKPOINT_FILE = "checkpoint.pt"
TARGET_FILE = "target.json"  # the target (class, dtype, device, weights) whose run the folder holds
REGRESSION_WEIGHT = 0.1
WINDOW_SHARE = 0.98  # of the training sequences, those the head's attention window covers whole


@dataclass(frozen=True)
class TrainConfig:
    max_tokens: int = 60_000  # corpus size, in target tokens
    seq_len: int = 512
    epochs: int = 5
    lr: float = 5e-4
    warmup_steps: int = 20
    noise: float = 0.05  # input-feature noise, as a share of the features' RMS
    intermediate_size: int = 4096  # the head's MLP width (the target's own is wider: cost, not accuracy, sets it)
    readout: int = 16384  # target tokens the readout covers (plus the special ones): frequent_tokens first
    checkpoint_every: int = 100
    seed: int = 0
    # Requests the target answers itself (answers.py, about the corpus; everyday.py), 16 to a batch. An everyday answer
    # costs half a package one (shorter) and carries further to what users ask (everyday.py), so fewer of those.
    answers: int = 160
    everyday: int = 256
    answer_tokens: int = 256  # the longest answer
    feature_layers: tuple[int, ...] = ()  # decoder layers read beside the last hidden state (EAGLE-3's fusion)
    # Each input also carries x_t's embedding (proposers/head_model.FeatureHead): the feature says where the target
    # was, the embedding which token it chose there, and the head guesses better with both.
    reads_current: bool = True


@dataclass(frozen=True)
class Accuracy:
    top1: float  # depth 1: the head's top token is the target's greedy token
    top3: float
    top1_depth2: float  # depth 2, from its own predicted feature
    tokens: int

    def line(self) -> str:
        return (f"top-1 {100 * self.top1:.1f}%, top-3 {100 * self.top3:.1f}%, depth-2 top-1 "
                f"{100 * self.top1_depth2:.1f}% over {self.tokens} tokens")


def train_head(target_model, tokenizer, out: Path, cfg: TrainConfig = TrainConfig(), progress: bool = True,
               pieces: list[Piece] | None = None, target_name: str = "", log=print,
               captured: list[Path] | None = None) -> dict:
    """Train a head for target_model and save it under out; returns the training record (also in its config).

    pieces: the sequences to train on (default: the target's own answers and the corpus of corpus.py).
    captured: instead, a server's captured requests (serve/feature_capture.py, earliest first), whose features the
    target computed while serving: no target pass here; the latest CAPTURED_HELD_OUT of them are held out."""
    started = time.perf_counter()
    layers = target_model.config.get_text_config().num_hidden_layers
    if any(not 0 <= layer < layers for layer in cfg.feature_layers):
        raise ValueError(f"--feature-layers {','.join(map(str, cfg.feature_layers))}: the target's decoder layers "
                         f"are 0 to {layers - 1}")
    out.mkdir(parents=True, exist_ok=True)
    _claim(out, target_fingerprint(target_model))
    from_corpus = pieces is None and captured is None
    folder = "features" + "".join(f"-{layer}" for layer in cfg.feature_layers)
    if captured is not None:
        if cfg.feature_layers:
            raise ValueError("a captured request holds the last hidden state alone: no --feature-layers")
        torch.manual_seed(cfg.seed)  # (_collected seeds after its kernel plan)
        # (earliest first, as the files are named; a head learns from a sequence's third position on)
        shards, data = captured, [s for s in load_shards(captured) if len(s["ids"]) >= 3]
        held = _held_out_latest(len(data))
    else:
        shards, data, held = _collected(target_model, tokenizer, cfg, out, progress, pieces, folder)
    val = [s for s, h in zip(data, held) if h]
    train = [s for s, h in zip(data, held) if not h]
    if not train or not val:
        how = (f"the latest {CAPTURED_HELD_OUT:.0%} held out" if captured is not None else
               f"1 source in {VAL_EVERY} held back")
        raise ValueError(f"{len(data)} sequences cannot be split into training and validation ({how}); give more")
    collected_s = time.perf_counter() - started
    # (a fused head's shards are named as the plain head's: its folder tells a checkpoint of the other apart)
    names = "".join(path.name for path in shards) + (folder if cfg.feature_layers else "")
    data_key = hashlib.sha256(names.encode()).hexdigest()[:16]

    vocab = target_model.get_output_embeddings().out_features  # (a quantized layer's float weight is made, not kept)
    ids = readout_ids(vocab, cfg.readout, tokenizer.all_special_ids, frequent_tokens(train))
    readout = readout_layer(target_model, ids).float()
    embed = target_model.get_input_embeddings()
    head_cfg = HeadConfig.for_target(target_model.config, len(ids), cfg.intermediate_size, target_name,
                                     cfg.feature_layers, cfg.reads_current)
    head = FeatureHead(head_cfg).to(embed.weight.device)
    trainer = _Trainer(head, readout, embed, ids, vocab, cfg, total_steps=cfg.epochs * len(train), data_key=data_key)
    resumed = step = trainer.resume(out / CHECKPOINT_FILE)
    if resumed == cfg.epochs * len(train) and (out / "training.json").is_file():
        log(f"the head in {out} is already trained with these settings and data; its record is kept")
        return json.loads((out / "training.json").read_text())
    before = trainer.evaluate(val)
    log(f"validation {'at the checkpoint' if step else 'before training'}: {before.line()}")
    order = random.Random(cfg.seed)
    history = []
    with tqdm(total=cfg.epochs * len(train), initial=step, desc="train head", unit="seq", disable=not progress,
              dynamic_ncols=True) as bar:
        for epoch in range(cfg.epochs):
            shuffled = train[:]
            order.shuffle(shuffled)  # the same order on a resumed run: the generator is replayed from the start
            if (epoch + 1) * len(train) <= resumed:
                continue  # finished before the checkpoint: its accuracy was that run's to report
            for i, sequence in enumerate(shuffled):
                if epoch * len(train) + i < step:
                    continue
                loss = trainer.step(sequence)
                step += 1
                bar.update(1)
                bar.set_postfix(loss=f"{loss:.3f}")
                if step % cfg.checkpoint_every == 0:
                    trainer.checkpoint(out / CHECKPOINT_FILE, step)
            trainer.checkpoint(out / CHECKPOINT_FILE, step)
            after = trainer.evaluate(val)
            history.append(asdict(after))
            log(f"validation after epoch {epoch + 1}: {after.line()}")
    if not history:  # every epoch ended before the checkpoint, whose record was lost: the head as it was saved
        history.append(asdict(before))
    trained_lengths = [len(s["ids"]) for s in train]
    record = {
        "corpus": f"{cfg.answers} of the target's own answers to requests built from, and {cfg.max_tokens} tokens "
                  "of, the third-party package sources and docs installed beside draftwise (draftwise/train/)"
                  + (f", and its answers to {cfg.everyday} everyday requests" if cfg.everyday else "")
                  if from_corpus else f"{len(captured)} requests a server captured, the latest "
                  f"{CAPTURED_HELD_OUT:.0%} held out" if captured is not None else "given sequences",
        "sequences": len(data), "train_tokens": sum(len(s["ids"]) for s in train),
        "val_tokens": sum(len(s["ids"]) for s in val), "config": asdict(cfg),
        "longest_sequence": max(trained_lengths),
        "window": attention_window_of(trained_lengths),  # the head attends no further back
        "collect_s": round(collected_s, 1), "train_s": round(time.perf_counter() - started - collected_s, 1),
        "readout": f"{len(ids)} ids: the target's {cfg.readout} most frequent next tokens on the training split "
                   "(then the lowest ids), and the special ones",
        "readout_cover": readout_cover(val, ids),
        "val_before" if not resumed else "val_at_checkpoint": asdict(before), "val_after": history,
        "resumed_at_step": resumed,
        "scored": "validation scores the target's next token at every position of the held-back sequences' "
                  "answers (the files' text, the target's own answers), never the requests or chat template",
    }
    head.config = replace(head_cfg, training=record)
    save_head(head, ids, out)
    # Scored again through the engine's own path (as_run.py), from the head just saved, as --method head loads it.
    record["val_as_run"] = top1_as_run(target_model, out, val, progress)
    log(gap_line(record["val_as_run"], history[-1]["top1"]))
    save_config(head, out)  # (head.config.training is the record itself)
    (out / "training.json").write_text(json.dumps(record, indent=2))
    return record


def _collected(target_model, tokenizer, cfg: TrainConfig, out: Path, progress: bool, pieces: list[Piece] | None,
               folder: str) -> tuple[list[Path], list[dict], list[bool]]:
    """The target's features over `pieces` (default: its own answers and the corpus), collected into out/folder:
    (shards, sequences, whether each is held back)."""
    # The answers and the features come from the target on the kernels timed for this machine, as the engine runs
    # it (backends/kernels.py; same values, and faster than torch's dense linear where the timing picked another).
    running = on_timed_kernels(target_model)
    torch.manual_seed(cfg.seed)  # after the plan, whose timings draw random inputs only when not cached
    if pieces is None:
        pieces = own_answers(running, tokenizer, cfg, out, progress)
        pieces += training_sequences(tokenizer, cfg.seq_len, cfg.max_tokens)
    # (a fused head's features are wider: kept apart from the last hidden state's alone)
    shards = collect(running, [piece.ids for piece in pieces], out / folder, progress, cfg.feature_layers)
    del running  # its packed weights: as large as the target's own
    data = load_shards(shards)
    for sequence, piece in zip(data, pieces):
        sequence["answer_start"] = piece.answer_start
    # Held back by source file: a file's pieces, and the answers about it, are all on one side of the split.
    return shards, data, [_held_back(piece.source) for piece in pieces]


def _held_out_latest(count: int) -> list[bool]:
    """Of `count` captured requests, earliest first: the latest CAPTURED_HELD_OUT (at least one) held out, by time,
    never at random among requests of the same hour."""
    held = max(1, round(count * CAPTURED_HELD_OUT)) if count > 1 else 0
    return [i >= count - held for i in range(count)]


def target_fingerprint(model) -> dict:
    """What makes a run's answers, features and checkpoint this target's own: its class, dtype, device and weights
    (their sums, as a checksum; read in float64, without a copy where the model holds them in float)."""
    sums = [float(weight.detach().sum(dtype=torch.float64)) for weight in (model.get_input_embeddings().weight,
                                                                           output_weight(model))]
    return {"model": type(model).__name__, "dtype": str(model.dtype).removeprefix("torch."),
            "device": model.device.type, "weight_sums": [round(value, 6) for value in sums]}


def _claim(out: Path, fingerprint: dict) -> None:
    """One folder, one target: a run of another model or dtype would reuse this one's answers and features (named
    by the text alone) and resume its checkpoint, silently training on the other's features."""
    path = out / TARGET_FILE
    if path.is_file():
        saved = json.loads(path.read_text())
        if saved != fingerprint:
            raise ValueError(f"{out} holds a run of another target or dtype ({saved}; this one: {fingerprint}); "
                             "give another --out, or delete that folder to start over")
        return
    write_whole(path, lambda p: p.write_text(json.dumps(fingerprint)))


def own_answers(target_model, tokenizer, cfg: TrainConfig, out: Path, progress: bool) -> list[Piece]:
    """The target's own answers: cfg.answers about the package corpus (answers.py), then cfg.everyday to everyday
    requests (everyday.py). Each set is kept in out (answers.json, everyday.json): generating them is the slow part."""
    about_packages = _kept_answers(out / "answers.json", "answers", cfg.answers, requests_key(), answer_prompts,
                                   target_model, tokenizer, cfg, progress)
    everyday = _kept_answers(out / "everyday.json", "everyday", cfg.everyday, everyday_key(), everyday_prompts,
                             target_model, tokenizer, cfg, progress)
    return about_packages + everyday


def _kept_answers(path: Path, kind: str, count: int, requests_digest: str, make_requests, target_model, tokenizer,
                  cfg: TrainConfig, progress: bool) -> list[Piece]:
    """The answers saved at path for these requests, else the target's answers to make_requests(count, seed) (saved
    there). kind names the count in the saved key ("answers": the key older runs saved)."""
    if not count:
        return []
    key = {kind: count, "requests": requests_digest, "answer_tokens": cfg.answer_tokens, "seed": cfg.seed}
    if path.is_file():
        saved = json.loads(path.read_text())
        if saved.get("key") == key and "pieces" in saved:
            return [Piece(**piece) for piece in saved["pieces"]]
    pieces = target_answers(target_model, tokenizer, make_requests(count, cfg.seed), cfg.answer_tokens,
                            progress=progress)
    write_whole(path, lambda p: p.write_text(json.dumps({"key": key, "pieces": [asdict(piece) for piece in pieces]})))
    return pieces


def attention_window_of(lengths: list[int]) -> int:
    """The longest distance the head saw often enough in training to read: the length WINDOW_SHARE of the training
    sequences fit in. Why not the longest: a few excerpts tokenize into far more tokens than most (the Qwen run of
    256 answers: 392 sequences, 360 trained on; 2 of those 360 ran to 929 and 1,419 tokens, the rest to at most
    612). Distances that only they teach are taught once or twice, and unseen distances are what the window keeps
    the head from (proposers/feature_head.py)."""
    ordered = sorted(lengths)
    return ordered[math.ceil(WINDOW_SHARE * len(ordered)) - 1]  # (at least the first, at most the last)


def frequent_tokens(sequences: list[dict]) -> list[int]:
    """The target's greedy next tokens over the sequences, most frequent first (ties: the lower id first)."""
    counts = torch.bincount(torch.cat([s["next"] for s in sequences]))
    seen = counts.nonzero()[:, 0]  # [distinct]
    order = sorted(zip((-counts[seen]).tolist(), seen.tolist()))
    return [token for _, token in order]


def readout_cover(sequences: list[dict], ids: torch.Tensor) -> float:
    """The share of the target's next tokens over the sequences that the readout can name at all."""
    labels = torch.cat([s["next"] for s in sequences])
    return round(float(torch.isin(labels, ids).float().mean()), 4) if len(labels) else 0.0


def _held_back(source: str) -> bool:
    """One source in VAL_EVERY, by a hash of its name: the same files on every run. A vendored copy
    (pip/_vendor/rich/x.py) is named as its own package's file (rich/x.py), so the two, nearly one text, fall on the
    same side of the split."""
    own = re.split(r"/_?vendor(?:ed)?/", source)[-1]
    return zlib.crc32(own.encode()) % VAL_EVERY == 0


class _Trainer:
    def __init__(self, head: FeatureHead, readout, embed, ids: torch.Tensor, vocab: int, cfg: TrainConfig,
                 total_steps: int, data_key: str = ""):
        self.data_key = data_key  # which features it trains on: a checkpoint of other data is not resumed
        self.head, self.readout, self.embed, self.cfg = head, readout, embed, cfg
        self.device = embed.weight.device  # the target's, where the head trains; the features wait on the CPU
        # target id -> readout index (-1: not covered)
        self.to_readout = torch.full((vocab,), -1, dtype=torch.long, device=self.device)
        self.to_readout[ids.to(self.device)] = torch.arange(len(ids), device=self.device)
        self.optimizer = torch.optim.AdamW(head.parameters(), lr=cfg.lr, weight_decay=0.0, betas=(0.9, 0.95))
        self.schedule = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: lr_scale(s, cfg.warmup_steps, total_steps))
        self.autocast = native_bf16(self.device.type)  # bfloat16 matmuls only where computed natively

    def resume(self, path: Path) -> int:
        if not path.is_file():
            return 0
        state = torch.load(path, weights_only=True, map_location="cpu")  # load_state_dict moves it to the head
        # (a checkpoint from before a field: a plain head's)
        saved = {"feature_layers": (), "reads_current": False, **state["config"]}
        if saved != asdict(self.cfg) or state.get("data") != self.data_key:
            return 0  # another run's checkpoint: start over rather than mix two settings or two corpora
        self.head.load_state_dict(state["head"])
        torch.set_rng_state(state["rng"])  # the input noise goes on as if never interrupted
        self.optimizer.load_state_dict(state["optimizer"])
        self.schedule.load_state_dict(state["schedule"])
        return int(state["step"])

    def checkpoint(self, path: Path, step: int) -> None:
        state = {"head": self.head.state_dict(), "optimizer": self.optimizer.state_dict(),
                 "schedule": self.schedule.state_dict(), "step": step, "config": asdict(self.cfg),
                 "data": self.data_key, "rng": torch.get_rng_state()}
        write_whole(path, lambda p: torch.save(state, p))

    def step(self, sequence: dict) -> float:
        self.head.train()
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            loss = sum(self._losses(sequence, noise=self.cfg.noise)[0])
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.head.parameters(), 1.0)
        self.optimizer.step()
        self.schedule.step()
        return float(loss.detach())

    @torch.no_grad()
    def evaluate(self, sequences: list[dict]) -> Accuracy:
        self.head.eval()
        hits = torch.zeros(3, device=self.device)
        counted = torch.zeros(2, device=self.device)
        for sequence in sequences:
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
                _, (logits1, logits2) = self._losses(sequence, noise=0.0)
            want = sequence["next"].to(self.device)  # [L]: the target's greedy token after each position
            # Position p's label is the token at p + 1: scored from the answer's first token on.
            scored = torch.arange(len(want), device=self.device) + 1 >= sequence.get("answer_start", 0)  # [L]
            top = logits1.float().topk(3, dim=-1).indices  # [L - 1, 3]: row t predicts want[t + 1]
            label1, keep1 = self.to_readout[want[1:]], scored[1:]  # [L - 1]
            hits[0] += ((top[:, 0] == label1) & keep1).sum()
            hits[1] += ((top == label1[:, None]).any(-1) & keep1).sum()
            counted[0] += keep1.sum()
            keep2 = scored[2:]
            hits[2] += ((logits2.float().argmax(-1) == self.to_readout[want[2:]]) & keep2).sum()
            counted[1] += keep2.sum()
        counted = counted.clamp(min=1)
        return Accuracy(float(hits[0] / counted[0]), float(hits[1] / counted[0]), float(hits[2] / counted[1]),
                        int(counted[0]))

    def _losses(self, sequence: dict, noise: float):
        """([depth-1 loss, depth-2 loss], (depth-1 logits [L - 1, R], depth-2 logits [L - 2, R]))."""
        ids, inputs = sequence["ids"].to(self.device), sequence["features"].to(self.device).float()  # [L], [L, F]
        features = inputs[:, -self.head.config.hidden_size :]  # [L, H]: the last hidden state (F = H unless fused)
        length = len(ids)
        with torch.no_grad():
            embeddings = self.embed(ids).float()  # [L, H]
            wanted = torch.softmax(self.readout(features[1:]).float(), dim=-1)  # [L - 1, R] the target's p
        inputs = inputs[:-1]
        if noise:  # each layer's features by their own scale (a low layer's residual stream runs far larger)
            parts = inputs.view(len(inputs), -1, features.shape[-1])  # [L - 1, layers + 1, H]
            rms = parts.pow(2).mean(dim=(0, 2), keepdim=True).sqrt()  # [1, layers + 1, 1]
            # Drawn on the CPU, whose generator the checkpoint saves, so a resumed run draws the same noise.
            noisy = parts + (torch.rand(parts.shape).to(self.device) * 2 - 1) * noise * rms
            inputs = noisy.view(len(inputs), -1)
        positions = torch.arange(length - 1, device=self.device)
        # Depth 1: true features at every position.
        predicted1, past = self.head(inputs[None], embeddings[1:][None], positions, return_kv=True,
                                     current=embeddings[:-1][None])  # [1, L-1, H]
        # Depth 2: position t + 1 reads the head's own f_{t+1}, and sees the true inputs at positions <= t.
        n = length - 2
        mask = torch.cat([torch.ones(n, length - 1, dtype=torch.bool, device=self.device).tril(),
                          torch.eye(n, dtype=torch.bool, device=self.device)], 1)
        predicted2 = self.head(predicted1[:, :-1], embeddings[2:][None], positions[1:], past=past, mask=mask,
                               current=embeddings[1:-1][None])
        losses, logits = [], []
        for predicted, target_p, target_f in ((predicted1[0], wanted, features[1:]),
                                              (predicted2[0], wanted[1:], features[2:])):
            out = self.readout(predicted.float())  # [n, R]
            cross_entropy = -(target_p * torch.log_softmax(out, dim=-1)).sum(-1).mean()
            losses.append(cross_entropy + REGRESSION_WEIGHT * F.smooth_l1_loss(predicted.float(), target_f))
            logits.append(out)
        return losses, tuple(logits)

