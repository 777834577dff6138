"""The CPU decode-attention kernel as a step reads it: every layer's own cache in turn, so the keys and
values come from memory, not from a cache level (one layer's pages fit in L3 and flatter the kernel).

    .venv/bin/python benchmarks/cpu_decode_attention.py --result-json benchmarks/results/cpu_decode_attention.json
    .venv/bin/python benchmarks/cpu_decode_attention.py --old-sources DIR   # A/B: DIR holds an older build's .cpp files

The default model's shapes (9 query heads, 3 kv heads, head_dim 64, pages of 16 tokens, 30 layers, each
layer's cache in huge pages as `CpuPlatform.zeros` allocates it),
64 sequences of 128-255 tokens, pages scattered over the cache (as a long-running server's are) and
contiguous (a fresh one's). Reports the best of 8 passes over the 30 layers and the K+V bytes per second.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def load_old(sources: Path):  # noqa: ANN201 - a compiled module
    from torch.utils import cpp_extension

    build = Path("/tmp/rivulet_old_cpu_ext")
    build.mkdir(exist_ok=True)
    return cpp_extension.load(
        name="rivulet_old_cpu_ext", sources=[str(p) for p in sorted(sources.glob("*.cpp"))], build_directory=str(build),
        extra_cflags=["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fopenmp"],
        extra_ldflags=["-fopenmp"])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--old-sources", type=Path, default=None)
    ap.add_argument("--result-json", default=None)
    a = ap.parse_args()
    from rivulet.kernels.cpu import load_cpu_ext

    builds = {"current": load_cpu_ext()}
    if a.old_sources is not None:
        builds["old"] = load_old(a.old_sources)
    hq, hk, d, bs, s = 9, 3, 64, 16, a.seqs
    nb = s * 16
    g = torch.Generator().manual_seed(0)
    from rivulet.platforms.cpu import CpuPlatform

    caches = []
    for _ in range(a.layers):  # in huge pages, as the engine allocates them
        c = CpuPlatform().zeros((2, nb, bs, hk, d), torch.bfloat16)
        c.copy_(torch.randn(c.shape, generator=g))
        caches.append(c)
    q = torch.randn(s, hq, d, generator=g).to(torch.bfloat16)
    lens = torch.randint(128, 256, (s,), dtype=torch.int32, generator=g)
    tables = {"scattered": torch.randperm(nb, generator=g).to(torch.int32).view(s, 16).contiguous(),
              "contiguous": torch.arange(nb, dtype=torch.int32).view(s, 16)}
    rows = torch.arange(s)
    nbytes = int(lens.sum()) * hk * d * 2 * 2 * a.layers
    result: dict[str, dict[str, float]] = {}
    for pages, table in tables.items():
        best = {k: float("inf") for k in builds}
        outs = {k: torch.empty_like(q) for k in builds}
        for _ in range(8):  # interleaved, so that a slow phase of the machine hits every build alike
            for k, ext in builds.items():
                t = time.perf_counter()
                for c in caches:
                    ext.decode_attention(q, c, table, lens, rows, rows, outs[k], 0.125, 0)
                best[k] = min(best[k], time.perf_counter() - t)
        if "old" in outs:
            assert torch.equal(outs["old"], outs["current"]), "the builds disagree"
        for k, t in best.items():
            result[f"{k}_{pages}"] = {"ms_per_step": t * 1e3, "gb_per_s": nbytes / t / 1e9}
            print(f"{k:8s} {pages:10s} pages: {t * 1e3:6.2f} ms per {a.layers} layers, {nbytes / t / 1e9:5.1f} GB/s")
    if a.result_json:
        Path(a.result_json).write_text(json.dumps({"seqs": s, "layers": a.layers, "threads": torch.get_num_threads(),
                                                   "results": result}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
