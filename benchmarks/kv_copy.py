"""The KV tier's block copies, the reference (tensor indexing per layer) against the CPU kernel (one
memcpy per layer, half and block, over the threads), with the default model's cache shape (30 layers,
blocks of 16 tokens x 3 KV heads x 64, bf16: 12 KiB a half-block): device blocks to host slots and
back, random blocks, rounds alternating.

    python benchmarks/kv_copy.py --blocks 112 --rounds 8 --out benchmarks/results/kv_tier/kv_copy.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from rivulet.bench.offline import machine_info
from rivulet.kernels.cpu.ops import AVAILABLE, copy_blocks
from rivulet.kernels.kv_copy import copy_blocks_ref


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=112)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    assert AVAILABLE, "the CPU kernels did not build"
    layers, cache_blocks, host_slots, n = 30, 2000, 1000, args.blocks
    caches = [torch.randn(2, cache_blocks, 16, 3, 64).to(torch.bfloat16) for _ in range(layers)]
    host = [torch.randn(2, host_slots, 16, 3, 64).to(torch.bfloat16) for _ in range(layers)]  # pages touched
    nbytes = n * layers * 2 * 16 * 3 * 64 * 2
    g = torch.Generator().manual_seed(0)
    ms: dict[str, list[float]] = {f"{impl} {way}": [] for impl in ("reference", "cpu") for way in ("save", "load")}
    for r in range(args.rounds):
        for impl in (("reference", "cpu") if r % 2 == 0 else ("cpu", "reference")):
            fn = copy_blocks_ref if impl == "reference" else copy_blocks
            blocks, slots = torch.randperm(cache_blocks, generator=g)[:n], torch.randperm(host_slots, generator=g)[:n]
            for way, (src, dst, a, b) in (("save", (caches, host, blocks, slots)), ("load", (host, caches, slots, blocks))):
                t0 = time.perf_counter()
                fn(src, dst, a, b)
                ms[f"{impl} {way}"].append(round((time.perf_counter() - t0) * 1000, 2))
    med = {k: statistics.median(v) for k, v in ms.items()}
    result = {"benchmark": "kv_copy", **machine_info(), "blocks": n, "bytes": nbytes, "ms": ms, "median_ms": med,
              "median_gb_s": {k: round(nbytes / v / 1e6, 2) for k, v in med.items()}}
    print(json.dumps({"median_ms": med, "median_gb_s": result["median_gb_s"]}, indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
