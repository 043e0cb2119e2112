# Usage: python as_run.py: the default head's held-back split scored as the engine runs it (draftwise/head/as_run.py),
# with its fuse on the model's own values (the default since 14163fa) and on the kernel timed fastest (as before).
import time
import draftwise.loading as loading
from default_split import HEAD as H, default_split
from draftwise.head import train as T
from draftwise.head.as_run import gap_line, top1_as_run
from draftwise.head.model import load_head, readout_layer
from draftwise.loading import load_models
target, tok, _ = load_models("qwen2.5-coder-1.5b-instruct", None, "auto", "cpu", progress=False)
cfg = T.TrainConfig()
_, val = default_split(tok)
# Training's validation on the same split (the installed packages give it now: the record's is of the day it trained).
head, ids = load_head(H)
vocab = target.get_output_embeddings().weight.shape[0]
scorer = T._Trainer(head, readout_layer(target, ids).float(), target.get_input_embeddings(), ids, vocab, cfg, 1)
trained = scorer.evaluate(val).top1
print(f"held back: {len(val)} sequences; training's validation (float32, whole sequences) top-1 {100 * trained:.1f}%")
for name, exact in (("fuse exact (default)", loading.EXACT_INPUT_LAYERS), ("fuse on its timed kernel", ())):
    loading.EXACT_INPUT_LAYERS = exact
    started = time.perf_counter()
    as_run = top1_as_run(target, H, val, progress=False)
    print(f"{name}: {gap_line(as_run, trained)} [{time.perf_counter() - started:.0f} s]", flush=True)
