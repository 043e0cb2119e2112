#!/usr/bin/env bash
# draftwise's server (hybrid, quant backend via --backend auto, prompt cache on: the defaults) and llama.cpp's
# llama-server -np 4 on the same GGUF file, one after the other, ROUNDS times, each driven by the same loadgen:
# the 8 unseen prompts, 96 tokens, 8 requests a level, concurrency 1 and 4. Out: $1/{draftwise,llama}-R.md.
#   docs/experiments/quant-emr/servers.sh OUT [ROUNDS]
set -u
cd "$(dirname "$0")/../../.."
OUT=$1; ROUNDS=${2:-2}; mkdir -p "$OUT"
GGUF=$(ls ~/.cache/draftwise/models/qwen2.5-coder-1.5b-instruct/*.gguf)
SERVER=${DRAFTWISE_HOME:-$HOME/.cache/draftwise}/llama.cpp/0.3.36/bin/llama-server
LOADGEN=(--concurrency 1,4 --requests 8 --max-tokens 96 --per-category 8
         --prompts docs/experiments/invariance-zen4/prompts-unseen.jsonl)
wait_up() { for i in $(seq 1 300); do curl -sf "http://127.0.0.1:$1/health" > /dev/null && return; sleep 1; done; }
for round in $(seq 1 "$ROUNDS"); do
    .venv/bin/draftwise serve --port 8130 --method hybrid > "$OUT/draftwise-$round.serve.log" 2>&1 &
    pid=$!; wait_up 8130
    .venv/bin/draftwise loadgen --url http://127.0.0.1:8130 --speculation on,off "${LOADGEN[@]}" \
        --out "$OUT/draftwise-$round" > "$OUT/draftwise-$round.md" 2> /dev/null
    kill -TERM $pid; wait $pid
    "$SERVER" -m "$GGUF" -np 4 -c 8192 -t 2 --port 8131 > "$OUT/llama-$round.serve.log" 2>&1 &
    pid=$!; wait_up 8131
    .venv/bin/draftwise loadgen --url http://127.0.0.1:8131 --speculation off "${LOADGEN[@]}" \
        --out "$OUT/llama-$round" > "$OUT/llama-$round.md" 2> /dev/null
    kill -TERM $pid; wait $pid
done
