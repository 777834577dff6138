"""Greedy sampling's argmax: torch.argmax against the C++ `argmax_rows` (rivulet/kernels/cpu/cpu_ops.cpp) on
[rows, 49152] float32 logits (the default model's vocabulary), the same tensors, alternated, 2 threads.

    .venv/bin/python benchmarks/argmax_rows.py --result-json benchmarks/results/argmax_rows.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

from rivulet.kernels.cpu.ops import argmax_rows


def ms(fn, reps: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps * 1e3


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--result-json", default=None)
    a = ap.parse_args()
    torch.set_num_threads(2)
    rows_out = []
    for rows in (1, 8, 64, 256):
        x = torch.randn(rows, a.vocab, generator=torch.Generator().manual_seed(rows))
        assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
        reps = max(20, 4000 // rows)
        torch_ms, ours_ms = [], []
        for _ in range(a.rounds):  # alternated
            torch_ms.append(ms(lambda: x.argmax(dim=-1), reps))
            ours_ms.append(ms(lambda: argmax_rows(x), reps))
        row = {"rows": rows, "vocab": a.vocab, "torch_ms": min(torch_ms), "argmax_rows_ms": min(ours_ms),
               "speedup": min(torch_ms) / min(ours_ms)}
        rows_out.append(row)
        print(json.dumps(row), flush=True)
    if a.result_json:
        with open(a.result_json, "w") as f:
            json.dump({"machine": platform.processor() or platform.machine(), "torch": torch.__version__,
                       "threads": 2, "rows": rows_out}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
