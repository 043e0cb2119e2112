#!/usr/bin/env bash
# One server (draftwise serve --method $1 --prompt-cache-mb 0, the default backend), one loadgen run against it:
# $1 server method, $2 methods, $3 out folder, $4 repeats, $5 levels (default 1,2,4,8); BACKEND=hf (or quant) to choose;
# TRACE=FILE: the server traces every engine step into FILE (traced_serve.py); SLICES=N: loadgen --slices N;
# REQUESTS=N: loadgen --requests N (the prompts cycled).
set -u
cd "$(dirname "$0")/../../.."
PORT=8765
SERVE=(.venv/bin/draftwise)
[ -n "${TRACE:-}" ] && SERVE=(.venv/bin/python docs/experiments/throttle-zen4/traced_serve.py "$TRACE")
"${SERVE[@]}" serve --port $PORT --method "$1" --prompt-cache-mb 0 ${BACKEND:+--backend $BACKEND} > "$3.serve.log" 2>&1 &
SERVER=$!
for i in $(seq 1 300); do curl -sf http://127.0.0.1:$PORT/health > /dev/null && break; sleep 1; done
.venv/bin/draftwise loadgen --url http://127.0.0.1:$PORT --methods "$2" --speculation on,always,off \
    --concurrency "${5:-1,2,4,8}" --repeats "$4" --slices "${SLICES:-1}" ${REQUESTS:+--requests $REQUESTS} --max-tokens 96 \
    --prompts docs/experiments/invariance-zen4/prompts-unseen.jsonl --per-category 8 --out "$3" > "$3.table.md" 2> "$3.progress.log"
kill -TERM $SERVER; wait $SERVER
