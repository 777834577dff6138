#!/usr/bin/env bash
# One-shot GPU check of Rivulet (kernels vs references, ceilings, decode, throughput vs transformers).
#
#   bash benchmarks/gpu/run.sh [gpu_check.py flags]     e.g. --budget-s 300 --long-requests 0
#
# Runs from the repository with PYTHONPATH=. (nothing is installed); needs python3 with torch
# (CUDA), triton and transformers. Writes $OUT/summary.md, $OUT/gpu_check.json, $OUT/parts/*.json
# and $OUT/logs/*.log ($OUT defaults to ./out) and prints the summary. Stays under 8 minutes:
# the driver's own budget is 440 s and `timeout` stops it at 470 s whatever happens.
set -uo pipefail
cd "$(dirname "$0")/../.."
PY="${PYTHON:-python3}"
OUT="${OUT:-./out}"
export OUT

if ! command -v "$PY" >/dev/null 2>&1; then
    echo "error: $PY not found (set PYTHON=...)" >&2
    exit 2
fi
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "error: no CUDA device is visible to $PY (torch missing, CPU-only build, or no GPU)." >&2
    echo "       This check needs a GPU; on CPU run: $PY benchmarks/gpu/gpu_check.py --dry-run" >&2
    exit 2
fi
mkdir -p "$OUT"
command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
export TOKENIZERS_PARALLELISM=false
timeout -k 5 470 "$PY" benchmarks/gpu/gpu_check.py --out "$OUT" "$@"
rc=$?
if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    echo "error: gpu_check.py was stopped at 470 s; partial results in $OUT" >&2
    [ -f "$OUT/summary.md" ] && cat "$OUT/summary.md"
fi
exit "$rc"
