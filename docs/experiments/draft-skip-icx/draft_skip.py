"""The 0.5B draft with some of its decoder layers passed over, on the quant backend: c (a draft forward over a
one-token target forward) and the share of the target's greedy tokens the draft's top token names (teacher-forced,
on the unseen prompts' greedy answers), for 0 to 8 layers skipped (ShortGPT's least influential first, measured on
draftwise's calibration text)."""
import json, statistics, time
import torch
from torch import nn
from draftwise import Engine
from draftwise.proposers.calibration_text import CALIBRATION_TEXT
from draftwise.proposers.skip_calibration import skip_order

PROMPTS = "docs/experiments/bench-unseen-spr/prompts-unseen.jsonl"
NEW = 96
eng = Engine.from_pretrained("qwen2.5-coder-1.5b-instruct", draft="qwen2.5-coder-0.5b-instruct", method="draft",
                             backend="quant")
tok = eng.tokenizer
target, draft = eng.target.default, eng.proposer.backend
dmodel = draft.model if hasattr(draft, "model") else draft.backend.model
readout_ids = getattr(eng.proposer, "token_ids", None)
print("draft", type(draft).__name__, "readout ids", None if readout_ids is None else len(readout_ids), flush=True)

prompts = [json.loads(line) for line in open(PROMPTS)]
texts = []
for p in prompts:
    ids = tok.apply_chat_template([{"role": "user", "content": p["turns"][0]}], tokenize=True,
                                  add_generation_prompt=True, return_dict=False)
    out = eng.generate(ids, method="none", max_new_tokens=NEW, ignore_eos=True)
    texts.append((p["category"], ids, out.token_ids))
print("answers done", flush=True)

layers = dmodel.model.layers
full = list(layers)
count = dmodel.config.num_hidden_layers
with torch.inference_mode():
    cal = torch.tensor([tok(CALIBRATION_TEXT)["input_ids"][:192]])
    hs = dmodel(input_ids=cal, output_hidden_states=True, use_cache=False).hidden_states
order = skip_order(hs)
print("skip order", order, flush=True)

def with_layers(keep):
    dmodel.model.layers = nn.ModuleList([full[i] for i in keep])
    dmodel.config.num_hidden_layers = len(keep)

def to_target(top):
    return top if readout_ids is None else readout_ids[top]

def agreement():
    hits = total = 0
    per = {}
    for cat, ids, answer in texts:
        seq = ids + answer
        draft.trim(0)
        logits = draft.forward(seq[:-1])  # [len-1, vocab']: after each token
        tops = logits.argmax(-1)
        tops = to_target(tops) if readout_ids is not None else tops
        # positions whose next token is an answer token
        pred = tops[len(ids) - 1:]
        truth = torch.tensor(answer)
        h = int((pred == truth).sum())
        hits += h; total += len(answer)
        a, b = per.get(cat, (0, 0)); per[cat] = (a + h, b + len(answer))
        draft.trim(0)
    return hits / total, {c: round(a / b, 3) for c, (a, b) in per.items()}

def forward_ms(backend, n=40):
    backend.trim(0); backend.append(list(range(1000, 1200)))
    for i in range(3): backend.forward([1500 + i]); backend.trim(200)
    times = []
    for i in range(n):
        t = time.perf_counter(); backend.forward([1500 + i % 50]); times.append(time.perf_counter() - t)
        backend.trim(200)
    backend.trim(0)
    return 1e3 * statistics.median(times)

rows = []
for rep in range(2):
    for skip_n in (0, 2, 4, 6, 8):
        skipped = set(order[:skip_n])
        keep = [i for i in range(count) if i not in skipped]
        with_layers(keep)
        try:
            acc, per = agreement() if rep == 0 else (None, None)
            d_ms = forward_ms(draft)
        finally:
            with_layers(list(range(count)))
        t_ms = forward_ms(target, 20)
        rows.append(dict(rep=rep, skip=skip_n, layers=sorted(skipped), agreement=acc, per=per, draft_ms=round(d_ms, 2),
                         target_ms=round(t_ms, 2), c=round(d_ms / t_ms, 3)))
        print(json.dumps(rows[-1]), flush=True)
