#!/usr/bin/env bash
# The engine-v2 table: Rivulet against vLLM's CPU build (and llama.cpp's server where built) on this machine,
# one system at a time (never two servers under load), the same OpenAI-HTTP client for all:
#   row 1  8 x 128/128 at concurrency 1       output tok/s, TPOT
#   row 2  32 x 128/128 at concurrency 16     output tok/s
#   row 3  128 x 128/128 at concurrency 64    output tok/s, TPOT
#   row 4  16 x 1024/16 at concurrency 8      mean TTFT
#   row 5  start to healthy                   seconds from launch to GET /health == 200
#   row 6  memory after the rows              PSS and RSS (MiB) summed over the server's process tree
# Each point is measured with `rivulet bench serve` and, when vLLM is installed, with vLLM's own `vllm bench
# serve` too. Writes $OUT/<system>_<row>[_vllmclient].json, $OUT/summary.json, $OUT/table.md and $OUT/table.png.
#
#   bash benchmarks/peers/setup_vllm.sh                 # once: vLLM in ~/.cache/rivulet-peers/vllm
#   bash benchmarks/cpu_vs_peers.sh                     # SYSTEMS="rivulet rivulet-int4 vllm llamacpp" by default
#   SYSTEMS="rivulet vllm" ROWS="1 3" bash benchmarks/cpu_vs_peers.sh
#   ROWS= bash benchmarks/cpu_vs_peers.sh               # start to healthy only
#   VLLM_CLIENT=0 bash benchmarks/cpu_vs_peers.sh       # each point with `rivulet bench serve` only
#   TEMPERATURE=1.0 ROWS="2 3" bash benchmarks/cpu_vs_peers.sh   # sampled rows (the sampler in the step)
#   TEMPERATURE=0.7 TOP_P=0.9 ROWS=3 bash benchmarks/cpu_vs_peers.sh   # and nucleus-filtered
#   WARM=1 bash benchmarks/cpu_vs_peers.sh              # Rivulet's rows after its KV cache is faulted in
# Rivulet is healthy before its KV cache's pages exist (they are faulted in at idle priority, ~40-55 s in this VM,
# while vLLM writes all of its cache before it is healthy): by default the rows start at once and the first
# ones pay for the pages they reach first; WARM=1 waits for the engine's "faulted in" log line (up to 180 s).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results/cpu_vs_peers}
PEERS_DIR=${PEERS_DIR:-$HOME/.cache/rivulet-peers}
VLLM=${VLLM:-$PEERS_DIR/vllm}
LLAMA_SERVER=${LLAMA_SERVER:-$PEERS_DIR/llama.cpp/build/bin/llama-server}
SYSTEMS=${SYSTEMS:-"rivulet rivulet-int4 vllm llamacpp"}
ROWS=${ROWS-"1 2 3 4"}  # ROWS= (empty): starts only
PORT=${PORT:-8020}
POINT_S=${POINT_S:-300}
TEMPERATURE=${TEMPERATURE:-0}  # the rows' sampling temperature (0: greedy, as vLLM's client sends by default)
TOP_P=${TOP_P:-}  # the rows' top_p (empty: not sent)
SAMPLING=(--temperature "$TEMPERATURE" ${TOP_P:+--top-p "$TOP_P"})
VLLM_DTYPE=${VLLM_DTYPE:-bfloat16}  # e.g. float32 on AVX2-only CPUs, where its bf16 path is weak
VLLM_CLIENT=${VLLM_CLIENT:-1}  # 0: only `rivulet bench serve` (half the time, on slow machines)
WARM=${WARM:-0}
HF_DIR=${HF_DIR:-$PEERS_DIR/smollm2-135m-instruct-hf}
mkdir -p "$OUT"
log() { echo "== $(date +%H:%M:%S) $*" >&2; }
GGUF=$(.venv/bin/python -c 'from rivulet.models.loader.source import resolve_model; print(resolve_model("default").gguf_path)')
# the HF copy of the default model: what vLLM serves, and the tokenizer vLLM's client reads for every system
if [[ ! -d $HF_DIR && ( " $SYSTEMS " == *" vllm "* || ( $VLLM_CLIENT == 1 && -x $VLLM/bin/vllm ) ) ]]; then
    .venv/bin/python benchmarks/peers/make_hf_model.py "$HF_DIR" > /dev/null
fi
row_args() {  # num_prompts input output concurrency
    case $1 in
        1) echo "8 128 128 1" ;; 2) echo "32 128 128 16" ;; 3) echo "128 128 128 64" ;; 4) echo "16 1024 16 8" ;;
    esac
}

start_server() {  # system -> sets PID, writes $OUT/<system>_start.json
    local sys=$1 t0
    t0=$(date +%s.%N)
    case $sys in
        rivulet) .venv/bin/rivulet serve --dtype bfloat16 --port "$PORT" --max-num-seqs 64 --max-model-len 2048 \
                     --disable-uvicorn-access-log > "$OUT/${sys}_serve.log" 2>&1 & ;;
        rivulet-int4) .venv/bin/rivulet serve --dtype bfloat16 --quantization int4 --port "$PORT" --max-num-seqs 64 \
                     --max-model-len 2048 --disable-uvicorn-access-log > "$OUT/${sys}_serve.log" 2>&1 & ;;
        vllm)
            local tc iomp
            tc=$(ldconfig -p | awk '/libtcmalloc_minimal.so.4 / && !f {print $NF; f = 1}')  # no early exit: SIGPIPE under pipefail
            iomp=$(find "$VLLM/lib" -name 'libiomp5.so' -print -quit)
            VLLM_CPU_OMP_THREADS_BIND=0-$(( $(nproc) - 1 )) VLLM_CPU_NUM_OF_RESERVED_CPU=0 VLLM_USE_AOT_COMPILE=0 \
            VLLM_CPU_KVCACHE_SPACE=2 LD_PRELOAD="$tc:$iomp" \
                "$VLLM/bin/vllm" serve "$HF_DIR" --served-model-name default --dtype "$VLLM_DTYPE" --port "$PORT" \
                --max-num-seqs 64 --max-model-len 2048 --no-enable-log-requests > "$OUT/${sys}_serve.log" 2>&1 & ;;
        # --no-repack: ggml's AMX path for Q4_1 (its only repacked layout for that type) dies with SIGILL
        # (tilezero) in the VMs this runs on, where oneDNN's AMX works; the AVX512-VNNI kernels remain
        # one KV pool shared by the 64 slots (-kvu), about the tokens the others hold, so a 1024-token prompt fits
        llamacpp) "$LLAMA_SERVER" -m "$GGUF" -t "$(nproc)" -c 98304 -np 64 -kvu --no-repack --port "$PORT" \
                     > "$OUT/${sys}_serve.log" 2>&1 & ;;
    esac
    PID=$!
    for _ in $(seq 1 1200); do
        if curl -sf "http://127.0.0.1:$PORT/health" > /dev/null 2>&1; then
            python3 -c "import json,sys,time; json.dump({'system': sys.argv[1], 'start_s': time.time() - float(sys.argv[2])}, open(sys.argv[3], 'w'))" \
                "$sys" "$t0" "$OUT/${sys}_start.json"
            return 0
        fi
        kill -0 "$PID" 2> /dev/null || { echo "$sys exited; see $OUT/${sys}_serve.log" >&2; return 1; }
        sleep 0.25
    done
    echo "$sys not healthy in 300 s" >&2; return 1
}

stop_server() { kill "$PID" 2> /dev/null || true; wait "$PID" 2> /dev/null || true; sleep 2; }

record_memory() {  # system -> $OUT/<system>_mem.json: PSS (shared pages split) and RSS of $PID and its descendants
    python3 - "$PID" "$1" "$OUT/${1}_mem.json" <<'PY'
import json, os, sys
root, system, path = int(sys.argv[1]), sys.argv[2], sys.argv[3]
children = {}
for p in filter(str.isdigit, os.listdir("/proc")):
    try:
        ppid = int(open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError):
        continue
    children.setdefault(ppid, []).append(int(p))
tree, todo = [], [root]
while todo:
    p = todo.pop()
    tree.append(p)
    todo += children.get(p, [])
pss = rss = 0
for p in tree:
    try:
        for line in open(f"/proc/{p}/smaps_rollup"):
            if line.startswith("Pss:"):
                pss += int(line.split()[1])
            elif line.startswith("Rss:"):
                rss += int(line.split()[1])
    except OSError:
        pass
json.dump({"system": system, "processes": len(tree), "pss_mib": pss / 1024, "rss_mib": rss / 1024}, open(path, "w"))
PY
}

for sys in $SYSTEMS; do
    if [[ $sys == vllm && ! -x $VLLM/bin/vllm ]]; then log "skip vllm: run benchmarks/peers/setup_vllm.sh"; continue; fi
    if [[ $sys == llamacpp && ! -x $LLAMA_SERVER ]]; then log "skip llamacpp: no $LLAMA_SERVER"; continue; fi
    log "start $sys"
    start_server "$sys"
    # one short warm-up request (compiles, allocator, caches)
    .venv/bin/rivulet bench serve --base-url "http://127.0.0.1:$PORT" --tokenizer default --input-len 32 --output-len 8 \
        --num-prompts 2 --max-concurrency 2 --ignore-eos --disable-tqdm > /dev/null
    if [[ $WARM == 1 && $sys == rivulet* ]]; then
        for _ in $(seq 1 720); do grep -q "faulted in" "$OUT/${sys}_serve.log" && break; sleep 0.25; done
        log "$sys: $(grep -o 'KV cache memory faulted in.*' "$OUT/${sys}_serve.log" || echo 'KV cache not faulted in after 180 s')"
    fi
    for row in $ROWS; do
        read -r n in out c <<< "$(row_args "$row")"
        log "$sys row $row: $n x $in/$out at $c"
        .venv/bin/rivulet bench serve --base-url "http://127.0.0.1:$PORT" --tokenizer default --label "$sys" \
            --dataset random --input-len "$in" --output-len "$out" --num-prompts "$n" --max-concurrency "$c" \
            "${SAMPLING[@]}" --ignore-eos --disable-tqdm --max-duration-s "$POINT_S" --result-json "$OUT/${sys}_row${row}.json" \
            > "$OUT/${sys}_row${row}.log" 2>&1 || log "rivulet bench serve failed for $sys row $row (see the log)"
        if [[ $VLLM_CLIENT == 1 && -x $VLLM/bin/vllm ]]; then
            "$VLLM/bin/vllm" bench serve --backend openai --base-url "http://127.0.0.1:$PORT" --model default \
                --tokenizer "$HF_DIR" --dataset-name random --random-input-len "$in" --random-output-len "$out" \
                --num-prompts "$n" --max-concurrency "$c" "${SAMPLING[@]}" --ignore-eos --disable-tqdm --save-result \
                --result-dir "$OUT" --result-filename "${sys}_row${row}_vllmclient.json" > "$OUT/${sys}_row${row}_vllmclient.log" 2>&1 \
                || log "vllm bench serve failed for $sys row $row (see the log)"
        fi
    done
    record_memory "$sys"
    stop_server
done
.venv/bin/python benchmarks/cpu_vs_peers_table.py "$OUT"
