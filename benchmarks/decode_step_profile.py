"""Where a decode step of N streams goes, in-process: N requests x 128/128 (or --input-len; random prompt ids, greedy,
`ignore_eos`) through `LLM.generate`; the median wall time of the decode-only steps (execute + sample), and
torch.profiler's op table over 20 of them (from the 40th), the C++ kernels by name.

    .venv/bin/python benchmarks/decode_step_profile.py --streams 64 --result-json benchmarks/results/decode_step_64.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch.profiler import ProfilerActivity, profile

from rivulet import LLM, SamplingParams


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128, help="long prompts: enough that all N decode together")
    ap.add_argument("--result-json", default=None)
    a = ap.parse_args()
    n = a.streams
    llm = LLM(a.model, dtype=a.dtype, quantization=a.quantization, max_num_seqs=n, max_model_len=2048,
              kv_cache_dtype=a.kv_cache_dtype, kv_cache_memory=n * (a.input_len + a.output_len + 32) * 23040)
    runner = llm.engine.core.executor.runner
    g = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(100, 40000, (a.input_len,), generator=g).tolist()} for _ in range(n)]
    state: dict = {"decodes": 0, "prof": None, "times": []}
    execute, sample = runner.execute_model, runner.sample_tokens

    def timed_execute(out):
        state["decode"] = out.total_num_scheduled_tokens == n and len(out.num_scheduled_tokens) == n
        if state["decode"]:
            state["decodes"] += 1
            if state["decodes"] == 40:
                state["prof"] = profile(activities=[ProfilerActivity.CPU])
                state["prof"].__enter__()
        state["t0"] = time.perf_counter()
        return execute(out)

    def timed_sample(*args, **kwargs):
        result = sample(*args, **kwargs)
        if state["decode"]:
            state["times"].append(time.perf_counter() - state["t0"])
            if state["decodes"] == 59 and state["prof"] is not None:
                state["prof"].__exit__(None, None, None)
        return result

    runner.execute_model, runner.sample_tokens = timed_execute, timed_sample
    t0 = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=a.output_len, ignore_eos=True), use_tqdm=False)
    elapsed = time.perf_counter() - t0
    llm.shutdown()
    times = sorted(state["times"])
    ops = sorted(state["prof"].key_averages(), key=lambda e: -e.self_cpu_time_total)[:12]
    total = sum(e.self_cpu_time_total for e in state["prof"].key_averages())
    result = {"streams": n, "input_len": a.input_len, "output_len": a.output_len, "dtype": a.dtype, "quantization": a.quantization, "kv_cache_dtype": a.kv_cache_dtype,
              "output_tok_s": n * a.output_len / elapsed,
              "decode_steps": len(times), "median_step_ms": times[len(times) // 2] * 1e3,
              "ops": [{"name": e.key, "ms_per_step": e.self_cpu_time_total / 1e3 / 20, "share": e.self_cpu_time_total / total,
                       "calls_per_step": e.count / 20} for e in ops]}
    print(json.dumps(result, indent=1))
    if a.result_json:
        with open(a.result_json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
