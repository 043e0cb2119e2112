#!/usr/bin/env bash
# One replica's capacity, through Ray Serve and without it: `draftwise loadgen` against the single-process server,
# then against `--replicas 1` (all cores) on the same models, and the CPU seconds Ray's HTTP proxy and our ingress
# spent relaying (read from /proc), for the capacity model of docs/replicas.md.
#   docs/experiments/tools/replica_capacity.sh OUT [CONCURRENCY] [REQUESTS]
set -euo pipefail
out=${1:?usage: replica_capacity.sh OUT [CONCURRENCY] [REQUESTS]}
levels=${2:-1,4}
requests=${3:-8}
mkdir -p "$out"
dw=.venv/bin/draftwise

wait_up() {  # the server answers /health (models loaded), or give up after 10 minutes
    for _ in $(seq 600); do curl -sf "http://127.0.0.1:$1/health" >/dev/null && return 0; sleep 1; done
    echo "the server on port $1 never came up" >&2; return 1
}

cpu_of() {  # utime + stime, in seconds, of the processes whose command line matches $1
    local total=0
    for pid in $(pgrep -f "$1" || true); do
        read -r -a stat < "/proc/$pid/stat"
        total=$((total + stat[13] + stat[14]))
    done
    echo "scale=2; $total / $(getconf CLK_TCK)" | bc
}

run() {  # NAME PORT SERVE-ARGS...
    local name=$1 port=$2; shift 2
    setsid $dw serve --port "$port" --prompt-cache-mb 0 "$@" > "$out/$name.serve.log" 2>&1 &
    local pid=$!
    wait_up "$port"
    local proxy0 ingress0
    proxy0=$(cpu_of "ProxyActor"); ingress0=$(cpu_of "ServeReplica:draftwise:Ingress")
    $dw loadgen --url "http://127.0.0.1:$port" --concurrency "$levels" --speculation on --requests "$requests" \
        --out "$out/$name" > "$out/$name.table.md"
    echo "$name proxy_cpu_s $(echo "$(cpu_of ProxyActor) - $proxy0" | bc)" \
         "ingress_cpu_s $(echo "$(cpu_of ServeReplica:draftwise:Ingress) - $ingress0" | bc)" >> "$out/relay_cpu.txt"
    kill -TERM -- -"$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
    sleep 5
}

lscpu | grep -E "Model name|^CPU\(s\)" > "$out/machine.txt"
run single 8301
run replicas1 8302 --replicas 1
cat "$out/relay_cpu.txt"
