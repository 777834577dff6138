"""The pipeline bubble: per-stage busy time against step time, one batch at a time (1 micro-batch)
against several micro-batches in flight. Bubble = 1 - busy / step, per stage, averaged.

    .venv/bin/python benchmarks/pp_bubble.py [--model default] [--pp 2] [--micro-batches 1,2,4]
"""

from __future__ import annotations

import argparse
import time

import torch

from rivulet import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default")
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--micro-batches", default="1,2,4")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=16)
    a = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(100, 20000, (a.input_len,), generator=g).tolist()}
               for _ in range(a.num_prompts)]
    params = SamplingParams(temperature=0, max_tokens=a.output_len, ignore_eos=True)
    want = None
    print(f"{a.model}, pp={a.pp}, {a.num_prompts} prompts x {a.input_len} tokens + {a.output_len} greedy, float32")
    print("| micro-batches | step ms (mean) | busy ms per stage | bubble per stage | output tok/s | same tokens |")
    print("|---:|---:|---|---|---:|---|")
    for m in [int(x) for x in a.micro_batches.split(",")]:
        llm = LLM(a.model, dtype="float32", max_model_len=512, pipeline_parallel_size=a.pp, pipeline_micro_batches=m)
        try:
            llm.generate(prompts[:2], SamplingParams(max_tokens=2), use_tqdm=False)  # warm up
            ex = llm.engine.core.executor
            ex.collect("reset")
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            wall = time.perf_counter() - t0
            timing = ex.collect("pipeline")
        finally:
            llm.shutdown()
        toks = [o.outputs[0].token_ids for o in outs]
        want = want or toks
        step = timing[0]["step_s"] / timing[0]["steps"]
        busy = [t["busy_s"] / t["steps"] for t in timing]
        bubble = [1 - b / step for b in busy]
        print(f"| {m} | {step * 1e3:.1f} | {', '.join(f'{b * 1e3:.1f}' for b in busy)} | "
              f"{', '.join(f'{x:.0%}' for x in bubble)} | {a.num_prompts * a.output_len / wall:.1f} | {toks == want} |")


if __name__ == "__main__":
    main()
