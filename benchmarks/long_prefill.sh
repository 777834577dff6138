#!/usr/bin/env bash
# `rivulet serve` with its default long-prefill threshold (CPU: 512) against the same server with it off
# (--long-prefill-token-threshold 0), alternating, REPS times: the peer table's rows 4, 2 and 3
# (16 x 1024/16 at 8, 32 x 128/128 at 16, 128 x 128/128 at 64), `rivulet bench serve` as the client.
#   OUT=benchmarks/results/long_prefill REPS=2 bash benchmarks/long_prefill.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results/long_prefill}
REPS=${REPS:-2}
PORT=${PORT:-18301}
mkdir -p "$OUT"
for rep in $(seq "$REPS"); do
    for mode in default off; do
        extra=()
        [[ $mode == off ]] && extra=(--long-prefill-token-threshold 0)
        .venv/bin/rivulet serve --dtype bfloat16 --port "$PORT" --max-num-seqs 64 --max-model-len 2048 \
            --disable-uvicorn-access-log "${extra[@]}" > "$OUT/serve_${mode}.log" 2>&1 &
        server=$!
        for _ in $(seq 240); do curl -sf "localhost:$PORT/health" > /dev/null && break; sleep 0.5; done
        .venv/bin/rivulet bench serve --base-url "http://127.0.0.1:$PORT" --tokenizer default --input-len 32 \
            --output-len 8 --num-prompts 2 --max-concurrency 2 --ignore-eos --disable-tqdm > /dev/null
        for row in "16 1024 16 8" "32 128 128 16" "128 128 128 64"; do
            read -r n in out c <<< "$row"
            .venv/bin/rivulet bench serve --base-url "http://127.0.0.1:$PORT" --tokenizer default --dataset random \
                --input-len "$in" --output-len "$out" --num-prompts "$n" --max-concurrency "$c" --ignore-eos \
                --disable-tqdm --result-json "$OUT/b${mode}_${n}_r${rep}.json" > "$OUT/b${mode}_${n}_r${rep}.log" 2>&1
        done
        kill "$server"; wait "$server" 2>/dev/null
    done
done
python3 - "$OUT" <<'PY'
import glob, json, sys
for f in sorted(glob.glob(sys.argv[1] + "/b*_r*.json")):
    p = json.load(open(f))["points"][0]
    print(f.rsplit("/", 1)[1], "mean TTFT ms", round(p["mean_ttft_ms"]), "output tok/s", round(p["output_throughput"], 1))
PY
