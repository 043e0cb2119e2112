# Probe, not a training recipe: does summarization-shaped data (a long passage in the request, a summary that draws on
# it in the answer, as users ask) lift the head on summaries? The mix head (head-mix-zen4) is fine-tuned a little
# two ways, at one learning rate and schedule: on N summary answers mixed with its own training features ("summ"), and
# on as many of its own features alone ("replay", the control: more steps, no new kind of text). Score them with
# head-everyday-zen5/bench_top1.py. The passages are excerpts of the installed packages' prose files (.md, .rst,
# .txt) on the training side of train-head's split; never a benchmark's text.
# Run from the repository: python docs/bench/head-mix-zen4/summaries_probe.py MIX_DIR OUT_DIR N
import copy, random, sys, time
from pathlib import Path
import torch
from draftwise.backends.kernels import on_timed_kernels
from draftwise.head.answers import target_answers
from draftwise.head.corpus import corpus_texts, package_roots
from draftwise.head.features import load_shards, target_features
from draftwise.head.model import load_head, readout_layer, save_head
from draftwise.head.train import TrainConfig, _held_back, _Trainer
from draftwise.loading import load_models

MIX, OUT, N = Path(sys.argv[1]).expanduser(), Path(sys.argv[2]).expanduser(), int(sys.argv[3])
PASSAGE_CHARS, ANSWER_TOKENS, LR = 2400, 160, 2e-4
OUT.mkdir(parents=True, exist_ok=True)
target, tok, _ = load_models("qwen2.5-coder-1.5b-instruct", None, "auto", "cpu", progress=False)
started = time.time()
cache = OUT / "summaries.pt"
if cache.exists():
    summaries = torch.load(cache)
else:
    fast = on_timed_kernels(target)
    rng, requests = random.Random(1), []
    for label, text in corpus_texts(package_roots()):
        if len(requests) >= N:
            break
        if label.endswith((".md", ".rst", ".txt")) and not _held_back(label) and len(text) >= PASSAGE_CHARS:
            start = rng.randrange(len(text) - PASSAGE_CHARS + 1)
            passage = text[start : start + PASSAGE_CHARS].strip()
            requests.append((label, [{"role": "user", "content": f"Summarize the following text.\n\n{passage}"}]))
    pieces = target_answers(fast, tok, requests, ANSWER_TOKENS, progress=False)
    print(f"{len(pieces)} summaries written in {time.time() - started:.0f} s", flush=True)
    summaries = []
    for piece in pieces:
        features, following = target_features(fast, piece.ids)
        summaries.append({"ids": torch.tensor(piece.ids), "features": features, "next": following.long(),
                          "answer_start": piece.answer_start})
    torch.save(summaries, cache)
    del fast
    print(f"features done at {time.time() - started:.0f} s; mean length {sum(len(s['ids']) for s in summaries) / len(summaries):.0f} "
          f"tokens, answers {sum(len(s['ids']) - s['answer_start'] for s in summaries) / len(summaries):.0f}", flush=True)
own = load_shards(sorted((MIX / "features").glob("*.safetensors")))
random.Random(2).shuffle(own)
head, ids = load_head(MIX)
readout = readout_layer(target, ids).float()
embed, vocab = target.get_input_embeddings(), target.get_output_embeddings().weight.shape[0]
replay_count = 2 * len(summaries)
arms = {"summ": summaries + own[:replay_count], "replay": own[: len(summaries) + replay_count]}
for name, data in arms.items():
    data = list(data)
    random.Random(3).shuffle(data)
    tuned = copy.deepcopy(head).requires_grad_(True)
    trainer = _Trainer(tuned, readout, embed, ids, vocab, TrainConfig(lr=LR, warmup_steps=10), total_steps=len(data))
    t = time.time()
    losses = [trainer.step(sequence) for sequence in data]
    save_head(tuned, ids, OUT / name)
    print(f"{name}: {len(data)} steps in {time.time() - t:.0f} s, mean loss first/last quarter "
          f"{sum(losses[: len(losses) // 4]) / (len(losses) // 4):.3f} / {sum(losses[-(len(losses) // 4):]) / (len(losses) // 4):.3f}",
          flush=True)
