"""The CPU prefill-attention kernels on one layer of the default model (9 query heads, 3 kv heads of 64,
pages of 16 tokens, scattered): AMX tiles (where usable), AVX-512 dot products, and the SDPA-per-chunk
fallback, on the steps a server runs. Best of 5, interleaved; outputs checked against each other.

    .venv/bin/python benchmarks/cpu_prefill_attention.py --result-json benchmarks/results/cpu_prefill_attention.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

STEPS = {  # name: (cached, new) chunks
    "1 x 1024 from 0": [(0, 1024)],
    "2 x 1024 from 0": [(0, 1024), (0, 1024)],
    "1024 after 1024 cached": [(1024, 1024)],
    "8 x 128 from 0": [(0, 128)] * 8,
}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--result-json", default=None)
    a = ap.parse_args()
    from rivulet.kernels.cpu import load_cpu_ext
    from rivulet.kernels.cpu.attention import paged_attention_cpu
    from rivulet.worker.batch import SeqChunk, build_flat_batch

    ext = load_cpu_ext()
    hq, hk, d, bs = 9, 3, 64, 16
    g = torch.Generator().manual_seed(0)
    variants = {"avx512": lambda: ext.prefill_attention_amx(False)}
    if ext.amx_linear_available():
        variants["amx"] = lambda: ext.prefill_attention_amx(True)
    result: dict[str, dict[str, float]] = {}
    for name, spec in STEPS.items():
        num_blocks = sum(-(-(c + n) // bs) for c, n in spec)
        perm = torch.randperm(num_blocks, generator=g).tolist()
        chunks = []
        for cached, new in spec:
            nb = -(-(cached + new) // bs)
            chunks.append(SeqChunk([0] * new, cached, perm[:nb]))
            perm = perm[nb:]
        meta = build_flat_batch(chunks, bs, torch.device("cpu")).meta
        cache = torch.randn(2, num_blocks, bs, hk, d, generator=g).to(torch.bfloat16)
        q = torch.randn(len(meta.slot_mapping), hq, d, generator=g).to(torch.bfloat16)
        flops = sum(4 * hq * d * n * (c + (n + 1) / 2) for c, n in spec)  # QK^T and PV over the causal part
        seqs = torch.arange(len(spec))
        runs = {k: (lambda f=f: (f(), paged_attention_cpu(q, cache, meta, d**-0.5))[1]) for k, f in variants.items()}
        runs["sdpa"] = lambda: _sdpa(q, cache, meta, seqs, d**-0.5)
        best = {k: float("inf") for k in runs}
        outs = {}
        for _ in range(5):
            for k, run in runs.items():
                t = time.perf_counter()
                outs[k] = run()
                best[k] = min(best[k], time.perf_counter() - t)
        for k, o in outs.items():
            torch.testing.assert_close(o.float(), outs["sdpa"].float(), rtol=2e-2, atol=2e-2)
        result[name] = {k: t * 1e3 for k, t in best.items()}
        print(f"{name:24s} " + "  ".join(f"{k} {t * 1e3:6.2f} ms ({flops / t / 1e9:4.0f} GFLOP/s)" for k, t in best.items()))
    ext.prefill_attention_amx(True)
    if a.result_json:
        Path(a.result_json).write_text(json.dumps({"threads": torch.get_num_threads(), "ms": result}, indent=2))
    return 0


def _sdpa(q: torch.Tensor, cache: torch.Tensor, meta, seqs: torch.Tensor, scale: float) -> torch.Tensor:  # noqa: ANN001
    out = torch.empty_like(q)
    torch.ops.rivulet.cpu_sdpa_prefill(q, cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, seqs, out,
                                       scale, 0, 0.0)
    return out


if __name__ == "__main__":
    raise SystemExit(main())
