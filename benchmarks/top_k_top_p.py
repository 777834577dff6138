"""The top-k / top-p mask: the platform's `top_k_top_p` op (on CPUs a radix select per row, no sort) against the
reference's whole-vocabulary sort, on the default model's own next-token logits and on random ones; and the
sampler's whole step at temperature 0.7 with each.

    .venv/bin/python benchmarks/top_k_top_p.py --out benchmarks/results/top_k_top_p.json

`differ` counts rows whose kept sets differ from the reference's (allowed only where a cumulative probability
lies within float32 rounding of top_p).
"""

from __future__ import annotations

import argparse
import json
import platform

import torch

from rivulet.kernels.ops import get_op
from rivulet.kernels.sampling import top_k_top_p_ref
from rivulet.layers.sampler import Sampler
from rivulet.layers.sampling_metadata import SamplingMetadata
from rivulet.sampling_params import SamplingParams
from sampler_draw import median_ms, model_logits

CONFIGS = {"top_p 0.9": (None, 0.9), "top_p 0.95": (None, 0.95), "top_k 50": (50, None),
           "top_k 50 + top_p 0.9": (50, 0.9)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,16,64")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    op = get_op("top_k_top_p")
    sizes = [int(r) for r in a.rows.split(",")]
    gen = torch.Generator().manual_seed(1)
    sources = {"random N(0, 3^2)": torch.randn(max(sizes), 49_152, generator=gen) * 3,
               "default model / 0.7": model_logits(max(sizes)) / 0.7}
    results = []
    for name, logits in sources.items():
        for config, (k, p) in CONFIGS.items():
            for rows in sizes:
                x = logits[:rows].contiguous()
                top_k = None if k is None else torch.full((rows,), k)
                top_p = None if p is None else torch.full((rows,), p)
                copies = [x.clone() for _ in range(a.reps + 3)]
                it = iter(copies)
                want, got = top_k_top_p_ref(x, top_k, top_p), op(x.clone(), top_k, top_p)
                r = {"logits": name, "filter": config, "rows": rows,
                     "op_ms": median_ms(lambda: op(next(it), top_k, top_p), a.reps),
                     "sort_ms": median_ms(lambda: top_k_top_p_ref(x, top_k, top_p), max(a.reps // 4, 3)),
                     "kept_per_row": float((got > float("-inf")).sum(-1).float().mean()),
                     "differ": int(((want == float("-inf")) != (got == float("-inf"))).any(-1).sum())}
                results.append(r)
                print(json.dumps(r))
    # the sampler's step (temperature, top-p, the race) for 64 rows of the model's logits
    logits = sources["default model / 0.7"][:64] * 0.7
    params = [SamplingParams(temperature=0.7, top_p=0.9)] * 64
    meta = SamplingMetadata.build(params, prompt_token_ids=[[]] * 64, output_token_ids=[[]] * 64,
                                  eos_token_ids=[set()] * 64, generators=[None] * 64, vocab_size=logits.shape[-1],
                                  device="cpu")
    sampler = Sampler()
    step = {"rows": 64, "params": "temperature 0.7, top_p 0.9",
            "sampler_ms": median_ms(lambda: sampler(logits, meta), a.reps)}
    sampler._top_k_top_p = top_k_top_p_ref
    step["sampler_with_sort_ms"] = median_ms(lambda: sampler(logits, meta), max(a.reps // 4, 3))
    print(json.dumps(step))
    doc = {"machine": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
           "results": results, "sampler_step": step}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
