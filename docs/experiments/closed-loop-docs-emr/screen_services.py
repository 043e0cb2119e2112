"""Two more shapes of service to screen (16 requests each, from the earlier traffic's packages): a code reviewer
answering in a fixed form, and an extractor answering with JSON only. Writes OUT/review.jsonl and OUT/extract.jsonl.

    .venv/bin/python screen_services.py OUT

A record's script, not part of the library."""
import sys
import json, itertools
from draftwise.train.traffic import SERVICES, request_text, _round_robin
REVIEW = ("You are the code reviewer of a platform team. Review the function below. Answer in exactly this form and "
          "nothing else:\n### Verdict\nAPPROVE or REQUEST CHANGES\n### Findings\n1. [low|medium|high] one sentence per "
          "finding\n### Patch\n```diff\na unified diff that fixes the findings\n```\n\n```python\n{source}\n```")
EXTRACT = ("Read this part of the {package} documentation and answer with a JSON object only, with the keys "
           "\"topic\" (a few words), \"audience\" (who it is for), \"steps\" (a list of short imperative sentences a "
           "user should follow) and \"caveats\" (a list of short sentences).\n\n{text}")
def write(name, service, template, n=16):
    s = SERVICES[service]; roots = s.roots()[: -max(1, round(0.25 * len(s.roots())))]  # the train packages
    items = list(itertools.islice(_round_robin(roots, s.items), n))
    with open(f"{sys.argv[1]}/{name}.jsonl", "w") as f:
        for i, it in enumerate(items):
            f.write(json.dumps({"question_id": f"{name}-{i}", "category": name, "turns": [request_text(template, it)]}) + "\n")
write("review", "code", REVIEW)
write("extract", "docs", EXTRACT)
