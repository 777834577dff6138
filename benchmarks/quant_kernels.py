"""The weight-only int8/int4 kernels at small step sizes, in process, 2 threads:

- `linears`: the default model's 120 linears (QKV, o, gate_up, down of 30 layers; random weights of the
  same shapes) in int4 and int8 at M rows, against the bf16 matmul on packed weights that bigger steps use;
- `lm_head`: its LM head [49152, 576] in int8 (what `--quantization int4` keeps it in) at M rows;
- `steps`: the default model's whole step of M tokens after 128 tokens of context (`--quantization int4`,
  bf16, logits of every row, as a verify step of M - 1 drafts has), median of 60;
- `decode` (`--decode S,...`): batched decode steps of S sequences (128 tokens of context each) with
  `--quantization int4` (or bf16 weights, `--decode-weights bf16`) in bf16, the decode program against layer
  by layer, alternated step by step (above the compact copies' rows the program reads the packed bf16
  originals, the layers the same weights).

    python benchmarks/quant_kernels.py --json benchmarks/results/quant_panels/after.json
    python benchmarks/quant_kernels.py --steps-only --rows 1,5 --reps 300 --json ...   # A/B of two builds
    python benchmarks/quant_kernels.py --decode-only --decode 16,32,48,64 --json ...
    python benchmarks/quant_kernels.py --decode-only --decode 1,16,64 --decode-weights bf16 --json ...
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from pathlib import Path

import torch

from rivulet.config import CacheConfig, ModelConfig
from rivulet.kernels.ops import get_op
from rivulet.layers.quantization import WeightOnly
from rivulet.models.loader import resolve_model
from rivulet.worker.batch import SeqChunk
from rivulet.worker.model_runner import ModelRunner

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (N, K) of one layer's linears


def median_ms(fn, reps: int) -> float:
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def linears(rows: list[int]) -> dict:
    weights = [torch.randn(n, k, dtype=torch.bfloat16) * 0.05 for n, k in SHAPES * 30]
    quant = {m: [WeightOnly(m, w, max_rows=1 << 20) for w in weights] for m in ("int4", "int8")}
    pack, packed_linear = get_op("pack_linear_weight"), get_op("packed_linear")
    packed = [pack(w) for w in weights]
    head_w = torch.randn(49152, 576, dtype=torch.bfloat16) * 0.05
    head = WeightOnly("int8", head_w, max_rows=1 << 20)
    out = {}
    for m in rows:
        xs = {k: torch.randn(m, k, dtype=torch.bfloat16) for k in (576, 1536)}
        row = {f"{q}_ms": median_ms(lambda: [f(xs[w.shape[1]], w, None) for f, w in zip(quant[q], weights)], 9)
               for q in quant}
        row["bf16_packed_ms"] = median_ms(lambda: [packed_linear(xs[w.shape[1]], p, None) if p is not None else None
                                                   for p, w in zip(packed, weights)], 9)
        row["lm_head_int8_ms"] = median_ms(lambda: head(xs[576], head_w, None), 15)
        out[m] = {k: round(v, 3) for k, v in row.items()}
        print(f"M={m}: " + ", ".join(f"{k} {v:.2f}" for k, v in row.items()), flush=True)
    return out


def steps(rows: list[int], context: int = 128, reps: int = 60) -> dict:
    runner = ModelRunner(ModelConfig(model="default", dtype="bfloat16", quantization="int4"),
                         CacheConfig(block_size=16), resolve_model("default"))
    runner.allocate_kv_cache(64)
    table = list(range(16))
    runner.forward([SeqChunk(list(range(1, context + 1)), 0, table)])
    out = {}
    for m in rows:
        ms = median_ms(lambda: runner.forward([SeqChunk(list(range(5, 5 + m)), context, table)], all_logits=True), reps)
        out[m] = round(ms, 3)
        print(f"step M={m}: {ms:.2f} ms", flush=True)
    return out


def decode(seqs: list[int], context: int = 128, reps: int = 30, weights: str = "int4") -> dict:
    quantization = None if weights == "bf16" else weights
    runner = ModelRunner(ModelConfig(model="default", dtype="bfloat16", quantization=quantization),
                         CacheConfig(block_size=16), resolve_model("default"))
    per = context // 16 + 1
    runner.allocate_kv_cache(max(seqs) * per)
    program = runner.decode_program
    out = {}
    for s in seqs:
        chunks = [SeqChunk([7], context, list(range(i * per, (i + 1) * per))) for i in range(s)]
        ms: dict[str, list[float]] = {"program": [], "layers": []}
        for i in range(reps + 1):
            for name in (("program", "layers") if i % 2 else ("layers", "program")):
                runner.decode_program = program if name == "program" else None
                t0 = time.perf_counter()
                runner.forward(chunks)
                if i:  # the first round warms up
                    ms[name].append((time.perf_counter() - t0) * 1e3)
        runner.decode_program = program
        row = {f"{k}_ms": round(statistics.median(v), 3) for k, v in ms.items()}
        row["speedup_paired"] = round(statistics.median(b / a for a, b in zip(ms["program"], ms["layers"])), 3)
        out[s] = row
        print(f"decode {s} seqs: {row}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,2,3,4,5,8,12,16,32")
    ap.add_argument("--json")
    ap.add_argument("--steps-only", action="store_true", help="only the whole steps (for A/B runs of two builds)")
    ap.add_argument("--reps", type=int, default=60, help="steps timed per M")
    ap.add_argument("--decode", default="", help="sequence counts of the batched decode steps (e.g. 16,32,48,64)")
    ap.add_argument("--decode-only", action="store_true", help="only the batched decode steps")
    ap.add_argument("--decode-weights", default="int4", choices=["int4", "int8", "bf16"])
    ap.add_argument("--decode-reps", type=int, default=30, help="steps timed per S and path")
    args = ap.parse_args()
    torch.set_num_threads(2)
    rows = [int(r) for r in args.rows.split(",")]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    only = args.steps_only or args.decode_only
    result = {"commit": commit, "linears": {} if only else linears(rows),
              "steps": {} if args.decode_only else steps([r for r in rows if r <= 8], reps=args.reps),
              "decode": decode([int(s) for s in args.decode.split(",")], reps=args.decode_reps,
                                weights=args.decode_weights) if args.decode else {},
              "decode_weights": args.decode_weights}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
