"""Teacher-forced agreement and guesses kept (rounds of 4) of the 0.5B draft when its readout keeps only some ids:
the lowest 32,768 (the compact draft's, proposers/compact.py), 65,536, all 151,936, or 32,768 chosen by the earlier
traffic (every token the target wrote in the proposal log, most frequent first, then the lowest ids).

    .venv/bin/python readout_agreement.py LOG.db RESULTS.json PROMPTS.jsonl [RESULTS.json PROMPTS.jsonl ...]

RESULTS.json: a `draftwise bench --methods none` run's results (the target's greedy answers) on PROMPTS.jsonl.
A record's script, not part of the library."""
import json, sys, collections, torch
from draftwise.loading import load_model, load_tokenizer
from draftwise.models import resolve
from draftwise.request_text import encode_chat
from draftwise.train.distill import Agreement, _answer_logits
from draftwise.train.served import window, Served
t = resolve("qwen2.5-coder-1.5b-instruct", progress=False); tok = load_tokenizer(str(t.path), t.gguf_file)
d = resolve("qwen2.5-coder-0.5b-instruct", progress=False)
model = load_model(str(d.path), d.gguf_file, "float32", "cpu", False).eval()
special = sorted(set(tok.all_special_ids))
keeps = [32768, "traffic", 65536, 151936]
from draftwise.train.served import served_requests
counts = collections.Counter(i for r in served_requests([sys.argv[1]]) for i in r.ids[r.answer_start:])
seen = [i for i, _ in counts.most_common()]
fill = [i for i in range(151936) if i not in set(seen)]
traffic_kept = torch.tensor(sorted((seen + fill)[:32768]))
print(len(seen), "distinct output tokens in the log;", sum(i >= 32768 for i in seen), "of them >= 32768")
for results, prompts in zip(sys.argv[2::2], sys.argv[3::2]):
    turns = {json.loads(l)["question_id"]: json.loads(l)["turns"][0] for l in open(prompts)}
    res = {k: Agreement() for k in keeps}; high = total = 0
    for run in json.load(open(results))["runs"]:
        if run["method"] != "none" or run["repeat"] != 0: continue
        p = encode_chat(tok, [{"role": "user", "content": turns[run["question_id"]]}])
        out = json.loads(run["token_ids"]) if isinstance(run["token_ids"], str) else run["token_ids"]
        ids, start = window(Served("x", 0, p + out, len(p)), 512)
        with torch.inference_mode():
            logits = _answer_logits(model, ids, start)
        wanted = torch.tensor(ids[start:])
        high += int((wanted >= 32768).sum()); total += len(wanted)
        for k in keeps:
            masked = logits.clone()
            if k == "traffic" or k < masked.shape[1]:
                keep = torch.zeros(masked.shape[1], dtype=torch.bool)
                if k == "traffic": keep[traffic_kept] = True
                else: keep[:k] = True
                keep[special] = True
                masked[:, ~keep] = float("-inf")
            res[k].add((masked.argmax(-1) == wanted).tolist(), 4)
    print(prompts, f"{total} tokens, {high/total:.1%} with ids >= 32768")
    for k in keeps:
        print(f"  keep {k}: agreement {res[k].share:.1%}, kept in rounds of 4 {res[k].kept_share:.1%}")
