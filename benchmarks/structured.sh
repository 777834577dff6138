#!/usr/bin/env bash
# Structured output's cost: TPOT of 32 x 128/128 random prompts at concurrency 16 (ignore_eos), free text
# against every request constrained by a JSON schema (an array of 20 small objects: longer than 128
# tokens, so every answer runs to max_tokens like the free ones). One `rivulet serve`, both points in
# turn, prefix caching off (the two points send the same prompts). Writes $OUT/free.json, $OUT/json_schema.json and $OUT/table.md.
#   bash benchmarks/structured.sh
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results/structured}
PORT=${PORT:-8023}
mkdir -p "$OUT"
SCHEMA='{"type": "object", "properties": {"items": {"type": "array", "minItems": 20, "maxItems": 20, "items": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16}, "qty": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["name", "qty"], "additionalProperties": false}}}, "required": ["items"], "additionalProperties": false}'
.venv/bin/rivulet serve --dtype bfloat16 --port "$PORT" --max-num-seqs 64 --max-model-len 2048 \
    --no-enable-prefix-caching --disable-uvicorn-access-log > "$OUT/serve.log" 2>&1 &
PID=$!
trap 'kill $PID 2> /dev/null || true' EXIT
for _ in $(seq 1 600); do
    curl -sf "http://127.0.0.1:$PORT/health" > /dev/null 2>&1 && break
    kill -0 "$PID" 2> /dev/null || { echo "server exited; see $OUT/serve.log" >&2; exit 1; }
    sleep 0.25
done
bench() {  # name, extra client flags...
    local name=$1; shift
    echo "== $(date +%H:%M:%S) $name" >&2
    .venv/bin/rivulet bench serve --base-url "http://127.0.0.1:$PORT" --tokenizer default --label "$name" \
        --input-len 128 --output-len 128 --num-prompts 32 --max-concurrency 16 --ignore-eos --disable-tqdm \
        --result-json "$OUT/$name.json" "$@" > "$OUT/$name.txt"
}
bench free
bench json_schema --extra-body "{\"structured_outputs\": {\"json\": $SCHEMA}}"
python3 - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
def load(name):
    d = json.loads((out / f"{name}.json").read_text())
    return d["points"][0] if "points" in d else d
free, js = load("free"), load("json_schema")
rows = ["| workload | free text | JSON schema | ratio |", "|---|---|---|---|"]
for key, label in [("mean_tpot_ms", "mean TPOT ms"), ("output_throughput", "output tok/s"), ("mean_ttft_ms", "mean TTFT ms"),
                   ("total_output_tokens", "output tokens")]:
    rows.append(f"| 32 x 128/128 at 16: {label} | {free[key]:.1f} | {js[key]:.1f} | {js[key] / free[key]:.2f}x |")
text = "\n".join(rows) + "\n"
(out / "table.md").write_text(text)
print(text)
PY
