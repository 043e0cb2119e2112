"""6 chat requests at temperature 0 to `draftwise serve`, alone then all at once, then one streamed: same texts?"""
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
import httpx, openai
extra = sys.argv[1:]
port = 8791
cmd = [sys.executable, "-m", "draftwise", "serve", "--target", "smollm2-135m-instruct", "--method", "lookup", "--port", str(port), "--backend", "hf", *extra]
proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
url = f"http://127.0.0.1:{port}"
try:
    for _ in range(300):
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200: break
        except httpx.HTTPError: pass
        time.sleep(1)
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=300)
    prompts = ["Write a Python function that reverses a linked list.", "Explain what a hash map is, briefly.",
               "Give three tips for writing clear emails.", "Translate to French: The weather is nice today.",
               "What is the capital of Australia, and why is it not Sydney?", "Summarize the water cycle in two sentences."]
    ask = lambda p: client.chat.completions.create(model="smollm2-135m-instruct", messages=[{"role": "user", "content": p}], max_tokens=64, temperature=0).choices[0].message.content
    alone = [ask(p) for p in prompts]
    with ThreadPoolExecutor(6) as pool: together = list(pool.map(ask, prompts))
    stream = client.chat.completions.create(model="smollm2-135m-instruct", messages=[{"role": "user", "content": prompts[0]}], max_tokens=64, temperature=0, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    print("command:", " ".join(cmd[2:]))
    print(f"batched == alone: {sum(a == b for a, b in zip(alone, together))} of {len(prompts)}; streamed == alone: {streamed == alone[0]}")
finally:
    proc.terminate(); proc.wait(30)
