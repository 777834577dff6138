#!/usr/bin/env bash
# Multi-LoRA throughput, served: 4 random rank-16 adapters of the default model (all attention and MLP
# projections, benchmarks/lora_adapters.py), 64 x 128/128 random prompts at concurrency 16, ignore_eos, bf16:
#   base      `rivulet serve` without --enable-lora
#   lora-base the same server with --enable-lora --max-loras 4, every request to the base model
#   lora-mix  the same, requests cycling over the 4 adapters (4 adapters in every batch)
# Writes $OUT/<name>.json and prints the throughput of each against base. ROUNDS=N repeats the three
# (writing $OUT/r<i>/...), so that the ratio's spread on a noisy machine shows.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results/lora}
ADAPTERS=${ADAPTERS:-$HOME/.cache/rivulet/lora-bench}  # ~75 MB of float32 adapters: not in the repository
PORT=${PORT:-8031}
mkdir -p "$OUT"
.venv/bin/python benchmarks/lora_adapters.py "$ADAPTERS" --count 4 --rank 16 > /dev/null
log() { echo "== $(date +%H:%M:%S) $*" >&2; }
serve() {  # name, extra flags...
    local name=$1; shift
    .venv/bin/rivulet serve --dtype bfloat16 --port "$PORT" --max-num-seqs 16 --disable-uvicorn-access-log "$@" \
        > "$D/${name}_serve.log" 2>&1 &
    PID=$!
    for _ in $(seq 1 600); do
        curl -sf "http://127.0.0.1:$PORT/health" > /dev/null 2>&1 && break
        kill -0 "$PID" 2> /dev/null || { echo "$name exited; see $D/${name}_serve.log" >&2; exit 1; }
        sleep 0.25
    done
}
stop() { kill "$PID" 2> /dev/null || true; wait "$PID" 2> /dev/null || true; sleep 2; }
bench() {  # name, extra client flags...
    local name=$1; shift
    log "$D $name"
    .venv/bin/rivulet bench serve --base-url "http://127.0.0.1:$PORT" --model default --tokenizer default \
        --label "$name" --input-len 128 --output-len 128 --num-prompts 64 --max-concurrency 16 --ignore-eos \
        --num-warmups 2 --disable-tqdm --result-json "$D/$name.json" "$@" > "$D/$name.txt"
}
MODULES=$(for n in 0 1 2 3; do echo -n "lora$n=$ADAPTERS/lora$n "; done)
for i in $(seq 1 "${ROUNDS:-1}"); do
    D="$OUT/r$i"
    mkdir -p "$D"
    serve base
    bench base
    stop
    # shellcheck disable=SC2086
    serve lora --enable-lora --max-loras 4 --max-lora-rank 16 --lora-modules $MODULES
    bench lora-base
    bench lora-mix --lora-modules lora0 lora1 lora2 lora3
    stop
done
.venv/bin/python - "$OUT" <<'PY'
import glob, json, statistics, sys
ratios = {"lora-base": [], "lora-mix": []}
for d in sorted(glob.glob(f"{sys.argv[1]}/r*")):
    tput = {n: json.load(open(f"{d}/{n}.json"))["points"][0]["output_throughput"] for n in ("base", "lora-base", "lora-mix")}
    print(d, "  ".join(f"{n} {t:.1f} tok/s ({t / tput['base']:.2f}x)" for n, t in tput.items()))
    for n in ratios:
        ratios[n].append(tput[n] / tput["base"])
print("median:", "  ".join(f"{n} {statistics.median(r):.2f}x base" for n, r in ratios.items()))
PY
