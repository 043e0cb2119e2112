"""Per-token mask cost of three grammar engines on Qwen's tokenizer, one JSON schema, the same text."""
import json, sys, time, statistics
sys.path.append("/tmp/xg")  # pip install --no-deps --target /tmp/xg xgrammar==0.2.9 apache-tvm-ffi outlines-core==0.2.14
import torch
from transformers import AutoTokenizer
from draftwise.models import model_path
tok = AutoTokenizer.from_pretrained(model_path("qwen2.5-coder-0.5b-instruct"))
row = json.loads(open("/work/main/docs/experiments/structured-zen4/prompts.jsonl").readline())
schema = row["schema"]
text = json.dumps({"name": "Tomasz Wierzbicki", "age": 41, "city": "Krakow", "occupation": "pipe organ repairer", "hobbies": ["beekeeping", "chess"]})
ids = tok(text)["input_ids"]
V = 151936
out = {}
# llguidance
import llguidance, llguidance.hf, llguidance.torch
lt = llguidance.hf.from_tokenizer(tok, n_vocab=V, eos_token=[151645])
g = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "})
m = llguidance.LLMatcher(lt, g)
mask = llguidance.torch.allocate_token_bitmask(1, V)
ts = []
for t in ids:
    s = time.perf_counter(); llguidance.torch.fill_next_token_bitmask(m, mask, 0); ts.append(time.perf_counter() - s)
    assert m.consume_token(t), t
out["llguidance"] = ts
# xgrammar
import xgrammar as xgr
info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=V)
s = time.perf_counter()
comp = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(", ", ": "))
print("xgrammar compile s", round(time.perf_counter() - s, 3))
xm = xgr.GrammarMatcher(comp)
bm = xgr.allocate_token_bitmask(1, V)
ts = []
for t in ids:
    s = time.perf_counter(); xm.fill_next_token_bitmask(bm, 0); ts.append(time.perf_counter() - s)
    assert xm.accept_token(t), t
out["xgrammar"] = ts
# outlines-core
try:
    from outlines_core import Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema
    regex = build_regex_from_schema(json.dumps(schema))
    s = time.perf_counter()
    pieces = {}
    for piece, i in tok.get_vocab().items():
        if i != 151645:
            pieces.setdefault(piece, []).append(i)
    vocab = Vocabulary(151645, pieces)
    index = Index(regex, vocab)
    print("outlines-core index s", round(time.perf_counter() - s, 1))
    state = index.get_initial_state(); ts = []
    for t in ids:
        s = time.perf_counter(); allowed = index.get_allowed_tokens(state); ts.append(time.perf_counter() - s)
        state = index.get_next_state(state, t)
    out["outlines-core"] = ts
except Exception as err:
    print("outlines-core:", type(err).__name__, str(err)[:200])
for name, ts in out.items():
    print(f"{name}: median {1e6*statistics.median(ts):.0f} us, p90 {1e6*sorted(ts)[int(.9*len(ts))]:.0f} us, max {1e6*max(ts):.0f} us over {len(ts)} tokens")
