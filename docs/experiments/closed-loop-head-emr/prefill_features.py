"""The earlier traffic's features as a server captures them (serve/feature_capture.py's files), from a
teacher-forced prefill of each logged request on the quant backend (row-invariant: the same bits as served;
checked against the files a serving run captured)."""
import json, os, sys, time
import torch
from safetensors.torch import load_file, save_file
from draftwise import Engine
from draftwise.config import GenerationConfig
from draftwise.serve.feature_capture import captured_files
from draftwise.train.served import served_requests

log, before, out, served_dir = sys.argv[1], float(sys.argv[2]), sys.argv[3], sys.argv[4]
os.makedirs(out, exist_ok=True)
items = [s for s in served_requests([log]) if s.ts < before]
served = {}
for path in captured_files(served_dir):
    t = load_file(str(path))
    served[tuple(t["ids.0"].tolist())] = t["features.0"]
eng = Engine.from_pretrained("qwen2.5-coder-1.5b-instruct", method="none", backend="quant", progress=False)
parts = []
eng.feature_sink = lambda seq, start, features: parts.append((start, features.clone()))
checked = equal = 0
started = time.time()
for n, item in enumerate(items):
    parts.clear()
    seq = eng.open_sequence(item.ids, GenerationConfig(max_new_tokens=1, ignore_eos=True))
    while not seq.prefill_done:
        eng.prefill(seq)
    eng.close_sequence(seq)
    features = torch.cat([f for _, f in sorted(parts, key=lambda p: p[0])])
    length = min(len(features), len(item.ids) - 1)
    record = {"ids.0": torch.tensor(item.ids[:length], dtype=torch.int32), "features.0": features[:length].contiguous(),
              "next.0": torch.tensor(item.ids[1:length + 1], dtype=torch.int32),
              "answer_start.0": torch.tensor([item.answer_start], dtype=torch.int32)}
    key = tuple(item.ids[:length])
    if key in served:
        checked += 1
        equal += torch.equal(served[key], record["features.0"])
    save_file(record, os.path.join(out, f"capture-{int(item.ts * 1000):013d}-{item.request_id[:32]}.safetensors"),
              metadata={"request_id": item.request_id, "ended": f"{item.ts:.3f}", "greedy": "true"})
    if n % 20 == 0:
        print(n, len(items), f"checked {checked} equal {equal} {time.time() - started:.0f}s", flush=True)
print(json.dumps({"requests": len(items), "checked_against_served": checked, "bit_equal": equal,
                  "seconds": round(time.time() - started)}))
