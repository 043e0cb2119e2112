# Experiment: the default head's data (its 256 package answers and the 60,000-token corpus, reusing the reg-n05 folder's
# answers and feature shards: the default's training again, head-data-zen5/noise.py) plus N everyday answers
# (draftwise/head/everyday.py), trained with the default settings. Run from the repository:
# python docs/bench/head-everyday-zen5/everyday_run.py OUT N
import sys, json, time, shutil, os
from pathlib import Path
from dataclasses import asdict
from draftwise.loading import load_models
from draftwise.backends.kernels import on_timed_kernels
from draftwise.head import train as T
from draftwise.head.answers import target_answers
from draftwise.head.corpus import Piece, training_sequences
from draftwise.head.everyday import everyday_prompts
out = Path(os.path.expanduser(sys.argv[1])); N = int(sys.argv[2])
base = Path(os.path.expanduser("~/.cache/draftwise/heads/reg-n05"))
target, tok, _ = load_models("qwen2.5-coder-1.5b-instruct", None, "auto", "cpu", progress=False)
cfg = T.TrainConfig()
out.mkdir(parents=True, exist_ok=True)
if not (out / "features").exists():
    shutil.copytree(base / "features", out / "features")  # content-named shards: the default data's are reused
everyday = out / "everyday.json"
if everyday.is_file():
    extra = [Piece(**p) for p in json.loads(everyday.read_text())]
else:
    t = time.time()
    extra = target_answers(on_timed_kernels(target), tok, everyday_prompts(N), cfg.answer_tokens, progress=False)
    everyday.write_text(json.dumps([asdict(p) for p in extra]))
    print(f"{N} everyday answers: {sum(len(p.ids) - p.answer_start for p in extra)} answer tokens, "
          f"{sum(map(len, (p.ids for p in extra)))} in all, in {time.time() - t:.0f} s", flush=True)
base_answers = [Piece(**p) for p in json.loads((base / "answers.json").read_text())["pieces"]]
pieces = base_answers + extra + training_sequences(tok, cfg.seq_len, cfg.max_tokens)
t = time.time()
record = T.train_head(target, tok, out, cfg, progress=False, pieces=pieces, target_name="qwen2.5-coder-1.5b-instruct")
print(f"trained in {time.time() - t:.0f} s: train tokens {record['train_tokens']}, collect {record['collect_s']} s, "
      f"train {record['train_s']} s; val {record['val_after'][-1]}; as run {record['val_as_run']}", flush=True)
