"""Offline throughput: N requests x P prompt tokens x O output tokens on one model, Rivulet's
`LLM.generate` against transformers' batched `generate` on the same weights, in one run.

A thin wrapper over `rivulet bench throughput` (rivulet/bench/offline.py), kept for the command in RESULTS.md:

    .venv/bin/python benchmarks/offline_throughput.py --num-prompts 64 --input-len 128 --output-len 128 \
        --dtypes bfloat16,float32 --result-json benchmarks/results/offline_throughput.json

runs, for each dtype, the same as

    .venv/bin/rivulet bench throughput --backend rivulet,transformers --dtype bfloat16 \
        --num-prompts 64 --input-len 128 --output-len 128 --result-json benchmarks/results/offline_throughput.json
"""

from __future__ import annotations

import argparse
import json
import sys

from rivulet.bench.offline import run_throughput


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--systems", default="rivulet,transformers")
    ap.add_argument("--result-json", default=None)
    a = ap.parse_args()
    result = run_throughput(a.model, a.systems.split(","), a.dtypes.split(","), a.num_prompts, a.input_len,
                            a.output_len, log=lambda r: print(json.dumps(r), flush=True))
    if a.result_json:
        with open(a.result_json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
