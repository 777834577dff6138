"""A compiled decode step over a large KV cache, against the eager one: whether the compiled graph writes
the cache in place. A KV write traced into the graph (instead of called as an op) is functionalized into a
copy of the whole cache per step, so its step time grows with the cache. Cases: a tiny Llama on the
reference kernels ("torch" kernel backend, as on a CPU without a compiler) and a tiny DeepSeek-V2 (multi-head
latent attention), float32, one sequence, median of many one-token steps.

    python benchmarks/compiled_kv_write.py [--blocks 200000] [--iters 20] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))

from rivulet.config import CacheConfig, ModelConfig, RivuletError  # noqa: E402
from rivulet.models.loader import resolve_model  # noqa: E402
from rivulet.platforms import current_platform  # noqa: E402
from rivulet.worker.batch import SeqChunk  # noqa: E402
from rivulet.worker.model_runner import ModelRunner  # noqa: E402


def step_ms(path: str, level: int, blocks: int, iters: int) -> float | str:
    try:
        r = ModelRunner(ModelConfig(model=path, dtype="float32", compilation_level=level),  # type: ignore[arg-type]
                        CacheConfig(block_size=4), resolve_model(path))
    except RivuletError as e:
        return f"refused: {e}"
    r.allocate_kv_cache(blocks)
    r.decode_program = None  # the model's forward, compiled or not
    table = list(range(12))
    r.forward([SeqChunk(list(range(3, 20)), 0, table)])
    times = []
    for i in range(iters + 3):  # the first steps compile the one-token graph
        start = time.perf_counter()
        r.forward([SeqChunk([5], 17 + i, table)])
        times.append(time.perf_counter() - start)
    return statistics.median(times[3:]) * 1e3


def main() -> None:
    from helpers.tiny import make_tiny_model

    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=200000)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--json")
    a = ap.parse_args()
    rows = []
    for kind, backend in (("llama", "torch"), ("deepseek-v2", None)):
        path = tempfile.mkdtemp()
        make_tiny_model(kind, Path(path))
        platform = current_platform()
        original = platform.kernel_backend
        if backend is not None:
            platform.kernel_backend = lambda: backend  # type: ignore[method-assign]
        try:
            row = {"model": kind, "kernel_backend": backend or platform.kernel_backend(),
                   "eager_ms": step_ms(path, 0, a.blocks, a.iters), "compiled_ms": step_ms(path, 1, a.blocks, a.iters)}
        finally:
            platform.kernel_backend = original  # type: ignore[method-assign]
        print(json.dumps(row), flush=True)
        rows.append(row)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    if a.json:
        Path(a.json).write_text(json.dumps({"commit": commit, "kv_blocks": a.blocks, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
