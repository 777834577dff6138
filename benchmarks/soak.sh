#!/usr/bin/env bash
# Soak: `rivulet serve` under a mixed load for DURATION seconds (default 30 min), the RSS of every process in its
# tree sampled every 10 s, the slope after warm-up (the first third) reported per process with its standard error.
# Loopback only. Writes $OUT/soak.json, $OUT/soak.png and $OUT/serve.log.
#
#   bash benchmarks/soak.sh                                           # default model, default flags
#   DURATION=600 SERVE_ARGS="--quantization int4" bash benchmarks/soak.sh
#   SERVE_ARGS="--tensor-parallel-size 3" OUT=benchmarks/results/soak_tp3 bash benchmarks/soak.sh
set -euo pipefail
cd "$(dirname "$0")/.."
DURATION=${DURATION:-1800}
CLIENTS=${CLIENTS:-16}
PORT=${PORT:-8031}
SERVE_ARGS=${SERVE_ARGS:-}
OUT=${OUT:-benchmarks/results/soak}
mkdir -p "$OUT"
# shellcheck disable=SC2086
.venv/bin/rivulet serve --port "$PORT" --disable-uvicorn-access-log $SERVE_ARGS > "$OUT/serve.log" 2>&1 &
PID=$!
trap 'kill $PID 2>/dev/null || true; wait $PID 2>/dev/null || true' EXIT
for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && break
    kill -0 $PID 2>/dev/null || { echo "server exited; see $OUT/serve.log" >&2; exit 1; }
    sleep 0.5
done
.venv/bin/python benchmarks/soak.py --pid "$PID" --url "http://127.0.0.1:$PORT" --duration "$DURATION" \
    --clients "$CLIENTS" --out "$OUT"
