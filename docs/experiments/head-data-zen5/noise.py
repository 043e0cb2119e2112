# Usage: python noise.py NAME NOISE: the default run's training again on its own answers and features (today's split),
# with the input features' noise at NOISE (a share of their RMS; the default is 0.05), into heads/NAME.
import shutil, sys, time
from dataclasses import replace
from pathlib import Path
from draftwise.head.train import TrainConfig, train_head
from draftwise.loading import load_models
name, noise = sys.argv[1], float(sys.argv[2])
H = Path.home() / ".cache/draftwise/heads"
out = H / name
out.mkdir(exist_ok=True)
for f in ("answers.json", "target.json"):
    if (H / "qwen2.5-coder-1.5b-instruct" / f).is_file():
        shutil.copy(H / "qwen2.5-coder-1.5b-instruct" / f, out / f)
if not (out / "features").exists():
    (out / "features").symlink_to(H / "qwen2.5-coder-1.5b-instruct" / "features")
target, tok, _ = load_models("qwen2.5-coder-1.5b-instruct", None, "auto", "cpu", progress=False)
started = time.perf_counter()
r = train_head(target, tok, out, replace(TrainConfig(), noise=noise), progress=False, target_name="qwen2.5-coder-1.5b-instruct")
print(name, noise, "train_s", r["train_s"], "val", [round(100 * e["top1"], 1) for e in r["val_after"]],
      "d2", [round(100 * e["top1_depth2"], 1) for e in r["val_after"]], "as_run", r["val_as_run"]["top1"], flush=True)
