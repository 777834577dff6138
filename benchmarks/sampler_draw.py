"""The sampler's random draw: the Gumbel race (`sample_rows`, the platform's kernel) against softmax + inverse CDF
(the draw it replaced, rebuilt here), on the default model's own next-token logits and on random ones.

    .venv/bin/python benchmarks/sampler_draw.py --out benchmarks/results/sampler_draw.json

Also measures how many draws move when the logits change in their last bits (x (1 + 1e-6 N(0, 1))), as they do
between a decode step and the recompute of a preempted sequence: the race's noise is per token, the inverse
CDF's one uniform number per row.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from rivulet.config import CacheConfig, ModelConfig
from rivulet.engine.tokenizer import load_tokenizer
from rivulet.kernels.ops import get_op
from rivulet.models.loader import resolve_model
from rivulet.worker.batch import SeqChunk
from rivulet.worker.model_runner import ModelRunner


def inverse_cdf(logits: torch.Tensor, t: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    probs = (logits / t.unsqueeze(1)).softmax(dim=-1)
    cdf = probs.cumsum(dim=-1)
    return torch.searchsorted(cdf, (1.0 - u) * cdf[:, -1:]).squeeze(1).clamp_(max=probs.shape[-1] - 1)


def median_ms(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def model_logits(rows: int) -> torch.Tensor:
    """The default model's float32 logits for the next token of `rows` random 24-token prompts."""
    runner = ModelRunner(ModelConfig(model="default", dtype="float32"), CacheConfig(block_size=16),
                         resolve_model("default"))
    runner.allocate_kv_cache(4)
    gen = torch.Generator().manual_seed(0)
    vocab = load_tokenizer(resolve_model("default")).vocab_size
    return torch.cat([runner.forward([SeqChunk(torch.randint(vocab, (24,), generator=gen).tolist(), 0, [0, 1])])
                      for _ in range(rows)])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,16,64")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    race = get_op("sample_rows")
    sizes = [int(r) for r in a.rows.split(",")]
    gen = torch.Generator().manual_seed(1)
    sources = {"random N(0, 3^2)": torch.randn(max(sizes), 49_152, generator=gen) * 3}
    sources["default model"] = model_logits(max(sizes))
    results = []
    for name, logits in sources.items():
        for temperature in (0.7, 1.0):
            for rows in sizes:
                x = logits[:rows].contiguous()
                t = torch.full((rows,), temperature)
                keys = torch.randint((1 << 63) - 1, (rows,), generator=gen)
                u = torch.rand(rows, 1, generator=gen)
                r = {"logits": name, "temperature": temperature, "rows": rows,
                     "race_ms": median_ms(lambda: race(x, t, keys), a.reps),
                     "inverse_cdf_ms": median_ms(lambda: inverse_cdf(x, t, u), a.reps)}
                nudged = x * (1 + 1e-6 * torch.randn(x.shape, generator=gen))
                r["race_moved"] = float((race(x, t, keys) != race(nudged, t, keys)).float().mean())
                r["inverse_cdf_moved"] = float((inverse_cdf(x, t, u) != inverse_cdf(nudged, t, u)).float().mean())
                results.append(r)
                print(json.dumps(r))
    doc = {"machine": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
           "results": results}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
