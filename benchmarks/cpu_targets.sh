#!/usr/bin/env bash
# Every CPU target of the benchmark issue on this machine, Rivulet and llama.cpp side by side, one system at a
# time (never both running during a measurement):
#   1. single-stream decode tok/s          rivulet bench latency       vs llamacpp_peer.py single (Llama.generate)
#   2. prompt processing, 512 tokens tok/s rivulet bench latency       vs llamacpp_peer.py single (Llama.eval)
#   3. 64 streams x 128 in / 128 out       rivulet bench throughput    vs llamacpp_peer.py batched (llama_batch API)
#   4. HTTP, 64 concurrent streams 128/128 rivulet serve               vs python -m llama_cpp.server, both measured
#      + a sweep over concurrency 1,4,16,64 and one PNG of both        by rivulet bench serve (same client)
# llama.cpp runs the shipped Q4_1 GGUF; Rivulet runs with $RIVULET_ARGS (engine flags: dtype, quantization...).
#
#   bash benchmarks/cpu_targets.sh
#   RIVULET_ARGS="--dtype float32" OUT=benchmarks/results/cpu_f32 bash benchmarks/cpu_targets.sh
#
# Needs .venv (make setup-test) and llama-cpp-python in $LLAMACPP_PY's environment (see benchmarks/README.md).
# Sizes, ports and which targets run: the variables below (e.g. ONLY=4, STREAMS=8 for a quick smoke run).
set -euo pipefail
cd "$(dirname "$0")/.."

RIVULET_ARGS=${RIVULET_ARGS:-"--dtype bfloat16"}
LLAMACPP_PY=${LLAMACPP_PY:-/work/llamacpp-venv/bin/python}
OUT=${OUT:-benchmarks/results/cpu_targets}
THREADS=${THREADS:-$(nproc)}
RIV_PORT=${RIV_PORT:-8010}
LCPP_PORT=${LCPP_PORT:-8011}
SWEEP=${SWEEP:-1,4,16,64}
POINT_S=${POINT_S:-240}       # time bound of each HTTP point (requests still running then are cancelled)
ONLY=${ONLY:-1,2,3,4}         # which targets to run, e.g. ONLY=4
STREAMS=${STREAMS:-64}        # the sizes of the issue's targets (smaller for a quick smoke run)
IN_LEN=${IN_LEN:-128}
OUT_LEN=${OUT_LEN:-128}
PREFILL=${PREFILL:-512}
ITERS=${ITERS:-3}
# Idle OpenMP threads sleep instead of spinning (both systems use OpenMP): on a shared 2-core machine a spinning
# thread that loses its core stalls every barrier (Rivulet single-stream decode measured 5x slower with ACTIVE).
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
RIV=(.venv/bin/python -m rivulet.entrypoints.cli)
GGUF=$(.venv/bin/python -c 'from rivulet.models.loader.source import resolve_model; print(resolve_model("default").gguf_path)')
mkdir -p "$OUT"
PEER=(benchmarks/llamacpp_peer.py)
# llama.cpp built with -DGGML_NATIVE=ON uses AMX when the CPU reports it; where AMX dies with SIGILL (this
# sandbox) the peer runs with --no-amx (AVX-512 paths, weight repacking kept). LLAMACPP_NO_AMX=0/1 forces it.
GGUF_PATH=$GGUF
if [[ -z "${LLAMACPP_NO_AMX:-}" ]]; then
    if "$LLAMACPP_PY" "${PEER[@]}" probe-amx "$GGUF_PATH"; then LLAMACPP_NO_AMX=0; else LLAMACPP_NO_AMX=1; fi
fi
NOAMX=()
[[ "$LLAMACPP_NO_AMX" == 1 ]] && NOAMX=(--no-amx)
log() { echo "== $(date +%H:%M:%S) $*" >&2; }
want() { [[ ",$ONLY," == *",$1,"* ]]; }
# shellcheck disable=SC2206
RARGS=($RIVULET_ARGS)

wait_health() {  # url pid
    for _ in $(seq 1 600); do
        curl -sf "$1" > /dev/null 2>&1 && return 0
        kill -0 "$2" 2> /dev/null || { echo "server exited" >&2; return 1; }
        sleep 0.5
    done
    echo "server not healthy in 300 s" >&2; return 1
}
stop() { kill -TERM "$1" 2> /dev/null || true; wait "$1" 2> /dev/null || true; }

if want 1 || want 2; then
    log "1+2 rivulet: single-stream decode (8-token prompt, $OUT_LEN tokens) and prefill of $PREFILL tokens"
    "${RIV[@]}" bench latency "${RARGS[@]}" --input-len 8 --output-len "$OUT_LEN" --num-iters "$ITERS" \
        --result-json "$OUT/rivulet_decode.json" > /dev/null
    "${RIV[@]}" bench latency "${RARGS[@]}" --input-len "$PREFILL" --output-len 2 --num-iters "$ITERS" \
        --result-json "$OUT/rivulet_prefill.json" > /dev/null
    log "1+2 llama.cpp: Llama.generate $OUT_LEN tokens, Llama.eval $PREFILL tokens"
    "$LLAMACPP_PY" "${PEER[@]}" single "${NOAMX[@]}" --model "$GGUF" --threads "$THREADS" --output-len "$OUT_LEN" \
        --prefill-len "$PREFILL" --iters "$ITERS" --result-json "$OUT/llamacpp_single.json" > /dev/null
fi

if want 3; then
    log "3 rivulet: $STREAMS x $IN_LEN/$OUT_LEN offline"
    "${RIV[@]}" bench throughput "${RARGS[@]}" --num-prompts "$STREAMS" --input-len "$IN_LEN" --output-len "$OUT_LEN" \
        --result-json "$OUT/rivulet_batched.json" > /dev/null
    log "3 llama.cpp: $STREAMS sequences x $IN_LEN/$OUT_LEN through llama_batch"
    "$LLAMACPP_PY" "${PEER[@]}" batched "${NOAMX[@]}" --model "$GGUF" --threads "$THREADS" --parallel "$STREAMS" \
        --input-len "$IN_LEN" --output-len "$OUT_LEN" --iters 1 --result-json "$OUT/llamacpp_batched.json" > /dev/null
fi

if want 4; then
    BENCH=(bench serve --dataset random --input-len "$IN_LEN" --output-len "$OUT_LEN" --ignore-eos --disable-tqdm
           --max-duration-s "$POINT_S" --slo ttft=2000,tpot=200)
    log "4 rivulet serve $RIVULET_ARGS"
    "${RIV[@]}" serve "${RARGS[@]}" --port "$RIV_PORT" --max-num-seqs "$STREAMS" \
        --max-model-len 1024 --disable-uvicorn-access-log > "$OUT/rivulet_serve.log" 2>&1 &
    RPID=$!
    trap 'stop $RPID' EXIT
    wait_health "http://127.0.0.1:$RIV_PORT/health" "$RPID"
    "${RIV[@]}" "${BENCH[@]}" --base-url "http://127.0.0.1:$RIV_PORT" --label rivulet --num-prompts "$STREAMS" \
        --max-concurrency "$STREAMS" --result-json "$OUT/http_rivulet.json" > "$OUT/http_rivulet.txt"
    "${RIV[@]}" "${BENCH[@]}" --base-url "http://127.0.0.1:$RIV_PORT" --label rivulet --sweep "$SWEEP" \
        --prompts-per-concurrency 1 --result-json "$OUT/sweep_rivulet.json" > "$OUT/sweep_rivulet.txt"
    stop "$RPID"
    trap - EXIT

    # llama-cpp-python's server runs one request at a time (a global lock; no parallel slots); by default a
    # new request interrupts the one streaming, so --interrupt_requests False makes requests queue instead.
    # It has no ignore_eos: min_tokens (a logits processor) keeps every request at --output-len tokens.
    log "4 llama.cpp server (llama-cpp-python, no-amx=$LLAMACPP_NO_AMX)"
    "$LLAMACPP_PY" "${PEER[@]}" serve "${NOAMX[@]}" --model "$GGUF" --n_ctx 8192 --port "$LCPP_PORT" --host 127.0.0.1 \
        --n_threads "$THREADS" --n_threads_batch "$THREADS" --interrupt_requests False --verbose False \
        > "$OUT/llamacpp_serve.log" 2>&1 &
    LPID=$!
    trap 'stop $LPID' EXIT
    wait_health "http://127.0.0.1:$LCPP_PORT/v1/models" "$LPID"
    LBENCH=(--base-url "http://127.0.0.1:$LCPP_PORT" --tokenizer default --label llama.cpp
            --extra-body "{\"min_tokens\": $OUT_LEN}")
    "${RIV[@]}" "${BENCH[@]}" "${LBENCH[@]}" --num-prompts "$STREAMS" --max-concurrency "$STREAMS" \
        --result-json "$OUT/http_llamacpp.json" > "$OUT/http_llamacpp.txt"
    "${RIV[@]}" "${BENCH[@]}" "${LBENCH[@]}" --sweep "$SWEEP" --prompts-per-concurrency 1 \
        --result-json "$OUT/sweep_llamacpp.json" > "$OUT/sweep_llamacpp.txt"
    stop "$LPID"
    trap - EXIT
    "${RIV[@]}" bench plot "$OUT/sweep_rivulet.json" "$OUT/sweep_llamacpp.json" --label rivulet \
        --label llama.cpp -o "$OUT/sweep.png"
fi

log "summary"
.venv/bin/python - "$OUT" <<'PY'
import json, os, sys
out = sys.argv[1]
def load(name):
    p = os.path.join(out, name)
    return json.load(open(p)) if os.path.exists(p) else None
rows = []
d, p, l = load("rivulet_decode.json"), load("rivulet_prefill.json"), load("llamacpp_single.json")
if d and l:
    rows.append(("1. single-stream decode tok/s", d["decode_tok_s"], l["decode_tok_s_median"]))
if p and l:
    rows.append((f"2. prefill {p['input_len']} tokens tok/s", p["prefill_tok_s"], l["prefill_tok_s_median"]))
b, lb = load("rivulet_batched.json"), load("llamacpp_batched.json")
if b and lb:
    rows.append((f"3. {lb['parallel']} x {lb['input_len']}/{lb['output_len']} offline output tok/s",
                 b["runs"][0]["output_tok_s"], lb["output_tok_s"]))
h, lh = load("http_rivulet.json"), load("http_llamacpp.json")
if h and lh:
    hp, lp = h["points"][0], lh["points"][0]
    n = hp["max_concurrency"]
    rows.append((f"4. HTTP {n} streams output tok/s", hp["output_throughput"], lp["output_throughput"]))
    rows.append((f"4. HTTP {n} streams median TTFT ms", hp["median_ttft_ms"], lp["median_ttft_ms"]))
    rows.append((f"4. HTTP {n} streams median TPOT ms", hp["median_tpot_ms"], lp["median_tpot_ms"]))
    rows.append((f"4. HTTP {n} streams completed", hp["completed"], lp["completed"]))
print(f"{'target':<44}{'rivulet':>12}{'llama.cpp':>12}")
for name, r, c in rows:
    print(f"{name:<44}{r:>12.1f}{c:>12.1f}")
json.dump([{"target": n, "rivulet": r, "llama.cpp": c} for n, r, c in rows],
          open(os.path.join(out, "summary.json"), "w"), indent=2)
PY
