"""Does `serve --replicas 1 --max-replicas 2` add a replica under load? Starts the server as a user would, keeps
`--streams` requests in flight for `--seconds`, and prints the running replicas every 2 s (from Ray Serve's status,
read through the server's own cluster) with the requests answered so far.

    python docs/experiments/tools/replica_autoscale.py --seconds 90
"""
from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import ray
from ray import serve


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--seconds", type=float, default=90)
    p.add_argument("--target-ongoing-requests", default="2")
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "draftwise", "serve", "--target", args.target, "--draft", "none", "--method",
               "lookup", "--replicas", "1", "--max-replicas", "2", "--threads-per-replica", "1",
               "--target-ongoing-requests", args.target_ongoing_requests, "--port", str(port)]
    print("$", " ".join(command[1:]), flush=True)
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        ray.init(address="auto", namespace="draftwise", log_to_driver=False)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
        done, stop = [0], threading.Event()

        def load():
            while not stop.is_set():
                client.chat.completions.create(model=args.target, max_tokens=64, temperature=0,
                                               messages=[{"role": "user", "content": "Tell me about the sea."}])
                done[0] += 1

        threads = [threading.Thread(target=load, daemon=True) for _ in range(args.streams)]
        for t in threads:
            t.start()
        began = time.monotonic()
        while time.monotonic() - began < args.seconds:
            states = serve.status().applications["draftwise"].deployments["DraftwiseReplica"].replica_states
            print(f"t={time.monotonic() - began:5.0f}s replicas {dict(states)} answered {done[0]}", flush=True)
            time.sleep(2)
        stop.set()
        for t in threads:
            t.join(timeout=300)
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(90)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
    return 0


if __name__ == "__main__":
    sys.exit(main())
