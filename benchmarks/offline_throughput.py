"""Offline throughput: N requests x P prompt tokens x O output tokens on one model, Rivulet's
`LLM.generate` against transformers' batched `generate` on the same weights, in one run.

    .venv/bin/python benchmarks/offline_throughput.py --num-prompts 64 --input-len 128 --output-len 128 \
        --dtypes bfloat16,float32 --result-json benchmarks/results/offline_throughput.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import time

import torch


def rivulet_run(model: str, dtype: str, prompts: list[list[int]], output_len: int) -> dict:
    from rivulet import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model, dtype=dtype, max_model_len=len(prompts[0]) + output_len + 16, max_num_seqs=len(prompts),
              max_num_batched_tokens=4096)
    load_s = time.perf_counter() - t0
    sp = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"system": "rivulet", "dtype": dtype, "load_s": load_s, "elapsed_s": elapsed, "output_tokens": n_out}


def transformers_run(src, dtype: str, prompts: list[list[int]], output_len: int) -> dict:
    from transformers import AutoModelForCausalLM

    td = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    t0 = time.perf_counter()
    kw = {"gguf_file": src.gguf_file} if src.is_gguf else {}
    model = AutoModelForCausalLM.from_pretrained(str(src.path), dtype=td, **kw).eval()
    model.generation_config.eos_token_id = None
    load_s = time.perf_counter() - t0
    ids = torch.tensor(prompts)
    gen = dict(do_sample=False, attention_mask=torch.ones_like(ids), pad_token_id=0)
    model.generate(ids[:2], max_new_tokens=2, **gen | {"attention_mask": torch.ones_like(ids[:2])})  # warm-up
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=output_len, min_new_tokens=output_len, **gen)
    elapsed = time.perf_counter() - t0
    n_out = int((out.shape[1] - ids.shape[1]) * ids.shape[0])
    return {"system": "transformers", "dtype": dtype, "load_s": load_s, "elapsed_s": elapsed, "output_tokens": n_out}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--systems", default="rivulet,transformers")
    ap.add_argument("--result-json", default=None)
    a = ap.parse_args()
    from rivulet.models.loader import resolve_model

    src = resolve_model(a.model)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(100, 40000, (a.num_prompts, a.input_len), generator=g).tolist()
    runs = []
    for dtype in a.dtypes.split(","):
        for system in a.systems.split(","):
            r = rivulet_run(a.model, dtype, prompts, a.output_len) if system == "rivulet" else \
                transformers_run(src, dtype, prompts, a.output_len)
            r["output_tok_s"] = r["output_tokens"] / r["elapsed_s"]
            r["total_tok_s"] = (r["output_tokens"] + a.num_prompts * a.input_len) / r["elapsed_s"]
            print(json.dumps(r), flush=True)
            runs.append(r)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = {"benchmark": "offline_throughput", "model": a.model, "num_prompts": a.num_prompts,
              "input_len": a.input_len, "output_len": a.output_len, "commit": commit,
              "date": time.strftime("%Y-%m-%d"), "machine": f"{platform.processor() or platform.machine()}, "
              f"{os.cpu_count()} cores, torch {torch.__version__}", "runs": runs}
    if a.result_json:
        with open(a.result_json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
