"""Teacher-forced agreement and guesses kept (rounds of 4) of the 0.5B draft when its readout keeps only some ids:
the lowest 32,768 (the compact draft's, proposers/compact.py), 65,536, all 151,936, or 32,768 chosen by the earlier
traffic (every token the target wrote in the proposal log, most frequent first, then the lowest ids).

    .venv/bin/python readout_agreement.py LOG.db RESULTS.json PROMPTS.jsonl [RESULTS.json PROMPTS.jsonl ...]

RESULTS.json: a `draftwise bench --methods none` run's results (the target's greedy answers) on PROMPTS.jsonl.
A record's script, not part of the library."""
import collections
import json
import sys

import torch

from draftwise.loading import load_model, load_tokenizer
from draftwise.models import resolve
from draftwise.request_text import encode_chat
from draftwise.train.distill import Agreement, _answer_logits
from draftwise.train.served import Served, served_requests, window

VOCAB, COMPACT = 151936, 32768
target = resolve("qwen2.5-coder-1.5b-instruct", progress=False)
tok = load_tokenizer(str(target.path), target.gguf_file)
draft = resolve("qwen2.5-coder-0.5b-instruct", progress=False)
model = load_model(str(draft.path), draft.gguf_file, "float32", "cpu", False).eval()


def readout(ids) -> torch.Tensor:
    """[VOCAB] True where a readout over ids (and the special tokens) has a row."""
    kept = torch.zeros(VOCAB, dtype=torch.bool)
    kept[torch.as_tensor(ids)] = True
    kept[sorted(set(tok.all_special_ids))] = True
    return kept


counts = collections.Counter(i for r in served_requests([sys.argv[1]]) for i in r.ids[r.answer_start:])
seen = [i for i, _ in counts.most_common()]
print(len(seen), "distinct output tokens in the log;", sum(i >= COMPACT for i in seen), "of them >=", COMPACT)
unseen = [i for i in range(VOCAB) if i not in set(seen)]
readouts = {"32768": readout(range(COMPACT)), "traffic": readout((seen + unseen)[:COMPACT]),
            "65536": readout(range(65536)), "151936": readout(range(VOCAB))}
for results, prompts in zip(sys.argv[2::2], sys.argv[3::2]):
    turns = {json.loads(line)["question_id"]: json.loads(line)["turns"][0] for line in open(prompts)}
    found = {name: Agreement() for name in readouts}
    high = total = 0
    for run in json.load(open(results))["runs"]:
        if run["method"] != "none" or run["repeat"] != 0:
            continue
        prompt = encode_chat(tok, [{"role": "user", "content": turns[run["question_id"]]}])
        answer = json.loads(run["token_ids"]) if isinstance(run["token_ids"], str) else run["token_ids"]
        ids, start = window(Served("x", 0, prompt + answer, len(prompt)), 512)
        with torch.inference_mode():
            logits = _answer_logits(model, ids, start)  # [A, VOCAB]
        wanted = torch.tensor(ids[start:])  # [A]
        high, total = high + int((wanted >= COMPACT).sum()), total + len(wanted)
        for name, kept in readouts.items():
            guesses = logits.masked_fill(~kept, float("-inf")).argmax(-1)
            found[name].add((guesses == wanted).tolist(), 4)
    print(prompts, f"{total} tokens, {high / total:.1%} with ids >= {COMPACT}")
    for name, agreement in found.items():
        print(f"  keep {name}: agreement {agreement.share:.1%}, kept in rounds of 4 {agreement.kept_share:.1%}")
