#!/usr/bin/env bash
# Soak: a server under a mixed load for DURATION seconds (default 30 min), the RSS of every process in its tree
# sampled every 10 s, the slope after warm-up (the first third) reported per process with its standard error.
# Loopback only. Writes $OUT/soak.json, $OUT/soak.png and $OUT/serve.log.
#
#   bash benchmarks/soak.sh                                           # rivulet serve, default model and flags
#   DURATION=900 SERVE_ARGS="--quantization int4" OUT=benchmarks/results/soak/int4 bash benchmarks/soak.sh
#   SERVE_ARGS="--tensor-parallel-size 3" OUT=benchmarks/results/soak/tp3 bash benchmarks/soak.sh
#   SYSTEM=vllm OUT=benchmarks/results/soak/vllm bash benchmarks/soak.sh   # the peer (benchmarks/peers/setup_vllm.sh)
#   SYSTEM=router OUT=benchmarks/results/soak/router bash benchmarks/soak.sh  # rivulet router over 2 rivulet serve
set -euo pipefail
cd "$(dirname "$0")/.."
SYSTEM=${SYSTEM:-rivulet}
DURATION=${DURATION:-1800}
CLIENTS=${CLIENTS:-16}
PORT=${PORT:-8031}
SERVE_ARGS=${SERVE_ARGS:-}
OUT=${OUT:-benchmarks/results/soak/$SYSTEM}
PEERS_DIR=${PEERS_DIR:-$HOME/.cache/rivulet-peers}
mkdir -p "$OUT"
case $SYSTEM in
    # shellcheck disable=SC2086
    rivulet) .venv/bin/rivulet serve --port "$PORT" --disable-uvicorn-access-log $SERVE_ARGS > "$OUT/serve.log" 2>&1 & ;;
    vllm)  # as benchmarks/cpu_vs_peers.sh starts it: the HF copy of the default model, a 2 GiB KV cache
        HF_DIR=${HF_DIR:-$PEERS_DIR/smollm2-135m-instruct-hf}
        [[ -d $HF_DIR ]] || .venv/bin/python benchmarks/peers/make_hf_model.py "$HF_DIR" > /dev/null
        tc=$(ldconfig -p | awk '/libtcmalloc_minimal.so.4 / && !f {print $NF; f = 1}')
        iomp=$(find "$PEERS_DIR/vllm/lib" -name 'libiomp5.so' -print -quit)
        # shellcheck disable=SC2086
        VLLM_CPU_OMP_THREADS_BIND=0-$(( $(nproc) - 1 )) VLLM_CPU_NUM_OF_RESERVED_CPU=0 VLLM_USE_AOT_COMPILE=0 \
        VLLM_CPU_KVCACHE_SPACE=2 LD_PRELOAD="$tc:$iomp" \
            "$PEERS_DIR/vllm/bin/vllm" serve "$HF_DIR" --served-model-name default --dtype bfloat16 --port "$PORT" \
            --no-enable-log-requests $SERVE_ARGS > "$OUT/serve.log" 2>&1 & ;;
    router)  # one process group: 2 replicas (ports PORT+1, PORT+2) and the router in front of them on PORT
        # shellcheck disable=SC2086
        setsid bash -c ".venv/bin/rivulet serve --port $((PORT + 1)) --disable-uvicorn-access-log $SERVE_ARGS &
            .venv/bin/rivulet serve --port $((PORT + 2)) --disable-uvicorn-access-log $SERVE_ARGS &
            .venv/bin/rivulet router --port $PORT --worker-urls http://127.0.0.1:$((PORT + 1)) \
                http://127.0.0.1:$((PORT + 2)) --log-level warning & wait" > "$OUT/serve.log" 2>&1 & ;;
    *) echo "SYSTEM must be rivulet, vllm or router" >&2; exit 2 ;;
esac
PID=$!
if [[ $SYSTEM == router ]]; then
    trap 'kill -- -$PID 2>/dev/null || true; wait $PID 2>/dev/null || true' EXIT
    PORTS="$((PORT + 1)) $((PORT + 2)) $PORT"  # the replicas first: the router answers /health at once
else
    trap 'kill $PID 2>/dev/null || true; wait $PID 2>/dev/null || true' EXIT
    PORTS=$PORT
fi
for p in $PORTS; do
    for _ in $(seq 1200); do
        curl -sf "http://127.0.0.1:$p/health" > /dev/null && break
        kill -0 $PID 2>/dev/null || { echo "server exited; see $OUT/serve.log" >&2; exit 1; }
        sleep 0.5
    done
done
.venv/bin/python benchmarks/soak.py --pid "$PID" --url "http://127.0.0.1:$PORT" --duration "$DURATION" \
    --clients "$CLIENTS" --out "$OUT"
