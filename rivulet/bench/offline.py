"""`rivulet bench throughput` and `rivulet bench latency`: the engine in-process (`rivulet.LLM`), no HTTP.

throughput: N random prompts of exactly `input_len` token ids, `output_len` tokens each (EOS ignored),
through `LLM.generate`, or through transformers' batched `generate` on the same weights (`backend
"transformers"`), so Rivulet and its peer run in one command.

latency: one request at a time. Prefill time is the time to the first token of an `input_len`-token prompt;
decode time per token is the time between consecutive steps of that request over `output_len` tokens.
"""

from __future__ import annotations

import os
import platform
import subprocess
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from rivulet.config import RivuletError

BACKENDS: tuple[str, ...] = ("rivulet", "transformers")


def _id_bound(model: str, high: int = 40000) -> int:
    """Prompt token ids stay below both `high` and the model's vocabulary size (from config.json, or the length
    of a GGUF model's tokenizer, which the engine caches after its first load)."""
    from rivulet.engine.tokenizer import load_tokenizer
    from rivulet.models.loader.source import resolve_model

    src = resolve_model(model)
    if not src.is_gguf:
        cfg = src.read_json("config.json") or {}
        vocab = cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size")
        return min(high, int(vocab)) if vocab else high
    tok = load_tokenizer(src)
    return min(high, len(tok)) if tok is not None else high


def random_token_prompts(num: int, input_len: int, seed: int = 0, low: int = 100, high: int = 40000) -> list[list[int]]:
    """Token-id prompts of exact length (ids from [low, high): ordinary tokens of the default model's vocab)."""
    rng = np.random.default_rng(seed)
    low = min(low, high // 2)
    return rng.integers(low, high, size=(num, input_len)).tolist()


def machine_info() -> dict[str, str]:
    import torch

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip()
    return {"commit": commit, "date": time.strftime("%Y-%m-%d"),
            "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
                       f"torch {torch.__version__}, {torch.get_num_threads()} threads"}


def rivulet_throughput(model: str, dtype: str, prompts: list[list[int]], output_len: int,
                       **llm_kwargs: Any) -> dict[str, Any]:
    from rivulet import LLM, SamplingParams

    t0 = time.perf_counter()
    kw: dict[str, Any] = dict(max_model_len=max(len(p) for p in prompts) + output_len + 16,
                              max_num_seqs=len(prompts), max_num_batched_tokens=4096)
    llm = LLM(model, dtype=dtype, **(kw | llm_kwargs))
    load_s = time.perf_counter() - t0
    sp = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    llm.shutdown()
    return {"system": "rivulet", "dtype": dtype, "load_s": load_s, "elapsed_s": elapsed, "output_tokens": n_out}


def transformers_throughput(model: str, dtype: str, prompts: list[list[int]], output_len: int) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    from rivulet.models.loader import resolve_model

    if dtype not in ("float32", "bfloat16", "float16"):
        raise RivuletError(f"the transformers backend needs an explicit --dtype, not {dtype!r}")
    src = resolve_model(model)
    td = getattr(torch, dtype)
    t0 = time.perf_counter()
    kw = {"gguf_file": src.gguf_file} if src.is_gguf else {}
    hf = AutoModelForCausalLM.from_pretrained(str(src.path), dtype=td, **kw).eval()
    hf.generation_config.eos_token_id = None
    load_s = time.perf_counter() - t0
    ids = torch.tensor(prompts)
    gen = dict(do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        hf.generate(ids[:2], max_new_tokens=2, attention_mask=torch.ones_like(ids[:2]), **gen)  # warm-up
        t0 = time.perf_counter()
        out = hf.generate(ids, max_new_tokens=output_len, min_new_tokens=output_len,
                          attention_mask=torch.ones_like(ids), **gen)
        elapsed = time.perf_counter() - t0
    n_out = int((out.shape[1] - ids.shape[1]) * ids.shape[0])
    return {"system": "transformers", "dtype": dtype, "load_s": load_s, "elapsed_s": elapsed, "output_tokens": n_out}


def run_throughput(model: str, backends: Sequence[str], dtypes: Sequence[str], num_prompts: int, input_len: int,
                   output_len: int, prompt_seed: int = 0, log: Any = print, **llm_kwargs: Any) -> dict[str, Any]:
    """Every (dtype, backend) on the same prompts; one JSON-able result with a run per pair."""
    if num_prompts < 1 or input_len < 1 or output_len < 1:
        raise RivuletError("--num-prompts, --input-len and --output-len must be >= 1")
    for b in backends:
        if b not in BACKENDS:
            raise RivuletError(f"unknown backend {b!r} (choose from {', '.join(BACKENDS)})")
    prompts = random_token_prompts(num_prompts, input_len, prompt_seed, high=_id_bound(model))
    runs = []
    for dtype in dtypes:
        for backend in backends:
            r = rivulet_throughput(model, dtype, prompts, output_len, **llm_kwargs) if backend == "rivulet" else \
                transformers_throughput(model, dtype, prompts, output_len)
            r["output_tok_s"] = r["output_tokens"] / r["elapsed_s"]
            r["total_tok_s"] = (r["output_tokens"] + num_prompts * input_len) / r["elapsed_s"]
            log(r)
            runs.append(r)
    return {"benchmark": "offline_throughput", "model": model, "num_prompts": num_prompts, "input_len": input_len,
            "output_len": output_len, **machine_info(), "runs": runs}


def _stats(name: str, values: Sequence[float]) -> dict[str, float]:
    a = np.asarray(values, dtype=np.float64)
    return {f"{name}_mean": float(a.mean()), f"{name}_p50": float(np.percentile(a, 50)),
            f"{name}_p90": float(np.percentile(a, 90))}


def _timed_request(engine: Any, prompt: list[int], params: Any) -> tuple[float, list[float]]:
    """(time to the first token, gaps between the following tokens) of one request run alone."""
    t0 = time.perf_counter()
    rid = engine.add_request(None, {"prompt_token_ids": prompt}, params)
    times: list[float] = []
    seen = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == rid:
                n = len(out.outputs[0].token_ids)
                now = time.perf_counter()
                times.extend([now] * (n - seen))
                seen = n
    if not times:
        raise RivuletError("the latency request produced no tokens")
    return times[0] - t0, list(np.diff(times))


def run_latency(model: str, dtype: str, input_len: int, output_len: int, iterations: int = 5, warmup: int = 1,
                profile_dir: str | None = None, prompt_seed: int = 0, log: Any = print,
                **llm_kwargs: Any) -> dict[str, Any]:
    """Prefill and per-token decode times of single requests (prefix caching off, fresh prompt each time)."""
    from rivulet import LLM, SamplingParams

    if input_len < 1 or output_len < 2 or iterations < 1:
        raise RivuletError("--input-len >= 1, --output-len >= 2 and --num-iters >= 1 are needed")
    kw: dict[str, Any] = dict(max_model_len=input_len + output_len + 16, max_num_seqs=1,
                              max_num_batched_tokens=max(input_len, 2048), enable_prefix_caching=False)
    llm = LLM(model, dtype=dtype, **(kw | llm_kwargs))
    engine = llm.engine
    prompts = random_token_prompts(warmup + iterations + 1, input_len, prompt_seed, high=_id_bound(model))
    decode_params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    for p in prompts[:warmup]:
        _timed_request(engine, p, decode_params)
    prefill, decode, e2e = [], [], []
    for p in prompts[warmup:warmup + iterations]:
        t0 = time.perf_counter()
        ttft, gaps = _timed_request(engine, p, decode_params)
        e2e.append(time.perf_counter() - t0)
        prefill.append(ttft)
        decode.append(float(np.mean(gaps)))
    result: dict[str, Any] = {"benchmark": "latency", "model": model, "dtype": dtype, "input_len": input_len,
                              "output_len": output_len, "iterations": iterations, **machine_info()}
    result.update(_stats("prefill_s", prefill))
    result.update(_stats("decode_token_s", decode))
    result.update(_stats("e2e_s", e2e))
    result["prefill_tok_s"] = input_len / result["prefill_s_mean"]
    result["decode_tok_s"] = 1.0 / result["decode_token_s_mean"]
    if profile_dir:
        result["profile_trace"] = profile_one(engine, prompts[-1], decode_params, profile_dir)
    llm.shutdown()
    log(result)
    return result


def profile_one(engine: Any, prompt: list[int], params: Any, out_dir: str) -> str:
    """A torch.profiler chrome trace of one request (prefill + decode) in out_dir/trace.json."""
    from torch.profiler import ProfilerActivity, profile

    try:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RivuletError(f"cannot create --profile folder {out_dir}: {e}") from None
    path = str(Path(out_dir) / "trace.json")
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        _timed_request(engine, prompt, params)
    prof.export_chrome_trace(path)
    return path
