"""The gain of each fusion pass of `--compilation-level 2`, in process: the default model's compiled
forward (bf16) with the pass and without, on the same steps, alternated, median ms of many calls.

Calls alternate between the two (ABAB...), and the speedup is the median of each call pair's ratio:
this VM's speed drifts 20-40% within minutes. Steps: one prefill chunk of N tokens, and a decode step of S sequences (run through the compiled graph
itself: on CPUs the engine sends decode steps of a plain Llama to the decode program, which has its own
fused RoPE + KV write). The KV cache holds zeros: the timing does not depend on its values.

    python benchmarks/fusion_passes.py [--rounds 5] [--iters 20] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import time

import torch

from rivulet.compilation import PASSES
from rivulet.config import CacheConfig, ModelConfig
from rivulet.models.loader import resolve_model
from rivulet.worker.batch import SeqChunk, build_flat_batch
from rivulet.worker.cuda_graph import hidden_states
from rivulet.worker.model_runner import ModelRunner

BLOCK = 16


def _runner(passes: str) -> ModelRunner:
    r = ModelRunner(ModelConfig(model="default", dtype="bfloat16", compilation_level=2, compilation_passes=passes),
                    CacheConfig(block_size=BLOCK), resolve_model("default"))
    r.allocate_kv_cache(2048)
    return r


def _steps(prefill: list[int], decode: list[int]) -> dict[str, list[SeqChunk]]:
    steps = {}
    for n in prefill:
        steps[f"prefill {n}"] = [SeqChunk(list(range(3, 3 + n)), 0, list(range((n + BLOCK - 1) // BLOCK)))]
    for s in decode:  # S sequences with 128 tokens of context each, blocks apart
        per = 128 // BLOCK + 1
        steps[f"decode {s} seqs"] = [SeqChunk([7], 128, list(range(i * per, (i + 1) * per))) for i in range(s)]
    return steps


@torch.inference_mode()
def _alternated(runners: dict[str, ModelRunner], chunks: list[SeqChunk], iters: int) -> dict[str, list[float]]:
    """ms of each call, the configurations called in turn (ABAB...), so the VM's drift hits both alike."""
    batches = {name: build_flat_batch(chunks, BLOCK, r.device) for name, r in runners.items()}
    for name, r in runners.items():
        hidden_states(r.forward_fn, batches[name])  # compiles (or loads) the graph of this kind
    ms: dict[str, list[float]] = {name: [] for name in runners}
    for i in range(iters):
        for name in (list(runners) if i % 2 == 0 else list(reversed(runners))):
            t = time.perf_counter()
            hidden_states(runners[name].forward_fn, batches[name])
            ms[name].append((time.perf_counter() - t) * 1e3)
    return ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--prefill", type=int, nargs="*", default=[128, 512, 1024])
    ap.add_argument("--decode", type=int, nargs="*", default=[16, 64])
    ap.add_argument("--json")
    a = ap.parse_args()
    configs = {"unfused": "", **{name: name for name in PASSES}}
    runners = {name: _runner(spec) for name, spec in configs.items()}
    steps = _steps(a.prefill, a.decode)
    ms: dict[str, dict[str, list[float]]] = {name: {s: [] for s in steps} for name in configs}
    for _ in range(a.rounds):
        for step, chunks in steps.items():
            for name, times in _alternated(runners, chunks, a.iters).items():
                ms[name][step] += times
    rows = []
    for step in steps:
        base = ms["unfused"][step]
        row = {"step": step, "unfused_ms": round(statistics.median(base), 3)}
        for name in PASSES:
            m = ms[name][step]
            paired = statistics.median(b / x for b, x in zip(base, m))  # call by call, neighbours in time
            row[f"{name}_ms"] = round(statistics.median(m), 3)
            row[f"{name}_speedup_paired"] = round(paired, 3)
        rows.append(row)
        print(row)
    result = {
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
        "machine": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
        "rounds": a.rounds, "iters": a.iters, "rows": rows,
        "rewrites": {name: r.forward_fn.fusions for name, r in runners.items()},  # 0 where a saved graph loaded
        "graphs": {name: {"compiled": sorted(r.forward_fn.compiled), "loaded": sorted(r.forward_fn.loaded)}
                   for name, r in runners.items()},
        "per_call_ms": ms,
    }
    print("rewrites:", result["rewrites"])
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
