#!/usr/bin/env bash
# Speculative decoding against plain decoding, served, one server at a time:
#   row 1  copy tasks at concurrency 1          `--dataset copy` (edit/repeat code), chat, greedy, up to 256 tokens
#   row 2  128 x 128/128 random at concurrency 64   ignore_eos: the cost where drafts rarely match
# for `rivulet serve` bf16 and `--quantization int4`, each without and with n-gram drafts (row 2 also with
# disable_by_batch_size), and bf16 with a draft model (DRAFT: by default the default model itself, int4:
# the only draft with the default model's tokenizer on this machine). Writes $OUT/<config>_<row>.json and
# $OUT/table.md. CONFIGS picks configurations (default: all).
#   bash benchmarks/spec_decode.sh
#   SPEC='{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}' bash benchmarks/spec_decode.sh
#   CONFIGS="bf16 bf16-draft" bash benchmarks/spec_decode.sh
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results/spec_decode}
PORT=${PORT:-8021}
POINT_S=${POINT_S:-300}
SPEC=${SPEC:-'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}'}
DRAFT=${DRAFT:-'{"model": "default", "quantization": "int4", "num_speculative_tokens": 3}'}
CONFIGS=${CONFIGS:-"bf16 bf16-ngram int4 int4-ngram bf16-draft bf16-ngram-auto"}
SPEC_AUTO=$(python3 -c 'import json,sys; d=json.loads(sys.argv[1]); d["disable_by_batch_size"]=8; print(json.dumps(d))' "$SPEC")
mkdir -p "$OUT"
log() { echo "== $(date +%H:%M:%S) $*" >&2; }

serve() {  # name, extra flags...
    local name=$1; shift
    .venv/bin/rivulet serve --dtype bfloat16 --port "$PORT" --max-num-seqs 64 --max-model-len 2048 \
        --disable-uvicorn-access-log "$@" > "$OUT/${name}_serve.log" 2>&1 &
    PID=$!
    for _ in $(seq 1 600); do
        curl -sf "http://127.0.0.1:$PORT/health" > /dev/null 2>&1 && break
        kill -0 "$PID" 2> /dev/null || { echo "$name exited; see $OUT/${name}_serve.log" >&2; exit 1; }
        sleep 0.25
    done
    .venv/bin/rivulet bench serve --base-url "http://127.0.0.1:$PORT" --tokenizer default --input-len 32 \
        --output-len 8 --num-prompts 2 --max-concurrency 2 --ignore-eos --disable-tqdm > /dev/null
}
stop() { kill "$PID" 2> /dev/null || true; wait "$PID" 2> /dev/null || true; sleep 2; }
bench() {  # name row, extra client flags...
    local name=$1 row=$2; shift 2
    log "$name row $row"
    .venv/bin/rivulet bench serve --base-url "http://127.0.0.1:$PORT" --tokenizer default --label "$name" \
        --max-duration-s "$POINT_S" --disable-tqdm --result-json "$OUT/${name}_${row}.json" "$@" > "$OUT/${name}_${row}.txt"
}
row1() { bench "$1" 1 --dataset copy --endpoint chat --input-len 300 --output-len 256 --num-prompts 8 --max-concurrency 1; }
row2() { bench "$1" 2 --input-len 128 --output-len 128 --num-prompts 128 --max-concurrency 64 --ignore-eos; }

run() {  # name, rows, serve flags...
    local name=$1 rows=$2; shift 2
    [[ " $CONFIGS " == *" $name "* ]] || return 0
    serve "$name" "$@"
    for r in $rows; do "row$r" "$name"; done
    stop
}
run bf16 "1 2"
run bf16-ngram "1 2" --speculative-config "$SPEC"
run int4 1 --quantization int4
run int4-ngram 1 --quantization int4 --speculative-config "$SPEC"
run bf16-draft 1 --speculative-config "$DRAFT"
run bf16-ngram-auto 2 --speculative-config "$SPEC_AUTO"

python3 - "$OUT" "$SPEC" "$DRAFT" <<'PY'
import json, sys
from pathlib import Path
out, spec, draft = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
def load(name):
    p = out / f"{name}.json"
    if not p.exists():
        return None
    d = json.loads(p.read_text())
    return d["points"][0] if "points" in d else d
rows = ["| workload | config | output tok/s | mean TPOT ms | acceptance rate | tokens per verify step | ratio |", "|---|---|---|---|---|---|---|"]
for row, label, configs in [(1, "copy tasks at 1", [("bf16", "bf16"), ("bf16-ngram", "bf16"), ("int4", "int4"), ("int4-ngram", "int4"),
                                                       ("bf16-draft", "bf16")]),
                            (2, "128 x 128/128 at 64", [("bf16", "bf16"), ("bf16-ngram", "bf16"), ("bf16-ngram-auto", "bf16")])]:
    for name, base in configs:
        p, b = load(f"{name}_{row}"), load(f"{base}_{row}")
        if p is None:
            continue
        s = p.get("spec_decode")
        acc = f"{100 * s['acceptance_rate']:.0f}%" if s else "-"
        length = f"{s['mean_acceptance_length']:.2f}" if s else "-"
        ratio = f"{p['output_throughput'] / b['output_throughput']:.2f}x" if b and name != base else ""
        rows.append(f"| {label} | {name} | {p['output_throughput']:.1f} | {p['mean_tpot_ms']:.1f} | {acc} | {length} | {ratio} |")
text = f"n-gram: `{spec}` (auto: + disable_by_batch_size 8); draft: `{draft}`\n\n" + "\n".join(rows) + "\n"
(out / "table.md").write_text(text)
print(text)
PY
