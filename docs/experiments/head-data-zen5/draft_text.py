# Usage: python draft_text.py OUT [ANSWERS]: does text written by the 0.5B draft, read by the target, teach the head as
# its own answers do, for less CPU? The default run's pieces (the target's 256 answers and the package text), plus the
# 0.5B draft's greedy answers to the next ANSWERS requests of the same kind (default 256; never about a held-back file,
# whose answers are the target's own and are what validation scores), trained 5 epochs as the default; the target's
# features and distribution are the labels everywhere, as in every run.
import json
import sys
import time
from pathlib import Path
from draftwise.backends.kernels import on_timed_kernels
from draftwise.head import train as T
from draftwise.head.answers import answer_prompts, target_answers
from draftwise.head.corpus import Piece, training_sequences
from draftwise.loading import load_models
H = Path.home() / ".cache/draftwise/heads/qwen2.5-coder-1.5b-instruct"
out, extra = Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 256
target, tok, draft = load_models("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct", "auto", "cpu",
                                 progress=False)
cfg = T.TrainConfig()
pieces = [Piece(**p) for p in json.loads((H / "answers.json").read_text())["pieces"]]
pieces += training_sequences(tok, cfg.seq_len, cfg.max_tokens)
(out / "features").mkdir(parents=True, exist_ok=True)
for shard in (H / "features").glob("shard-*.safetensors"):  # the default run's features, reused where they match
    if not (out / "features" / shard.name).exists():
        (out / "features" / shard.name).symlink_to(shard)
path = out / "draft_answers.json"
if path.is_file():
    written = [Piece(**p) for p in json.loads(path.read_text())]
else:
    requests = answer_prompts(cfg.answers + extra, cfg.seed)[cfg.answers :]  # the default's are the first 256
    started = time.perf_counter()
    written = target_answers(on_timed_kernels(draft), tok, requests, cfg.answer_tokens, progress=False)
    seconds = time.perf_counter() - started
    tokens = sum(len(p.ids) - p.answer_start for p in written)
    print(f"the draft wrote {len(written)} answers, {tokens} tokens, in {seconds:.0f} s ({tokens / seconds:.0f} tok/s)")
    path.write_text(json.dumps([p.__dict__ for p in written]))
kept = [p for p in written if not T._held_back(p.source)]
print(f"{len(kept)} of them about training files; {sum(len(p.ids) for p in kept)} tokens with their requests", flush=True)
record = T.train_head(target, tok, out, cfg, progress=False, pieces=pieces + kept,
                      target_name="qwen2.5-coder-1.5b-instruct")
print("sequences", record["sequences"], "train_tokens", record["train_tokens"], "collect_s", record["collect_s"],
      "train_s", record["train_s"])
print("val top-1", [round(100 * e["top1"], 1) for e in record["val_after"]], "top-3",
      round(100 * record["val_after"][-1]["top3"], 1), "depth-2", [round(100 * e["top1_depth2"], 1) for e in record["val_after"]],
      "as run", round(100 * record["val_as_run"]["top1"], 1))
