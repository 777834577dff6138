"""Feature combinations against the plainest engine: the default model in float32 serves one mixed workload
(greedy with logprobs, seeded samples, n > 1, stop strings, penalties, three grammars), twice (the second pass
meets the prefix cache and the KV tier), under each engine configuration; every output must equal that of a
synchronous, eager, cache-less engine with the same weights (a configuration's `base` entry overrides that
engine's options). `--quantization int4|int8` is left out: its steps of up to 32 rows read the compact
copies and bigger ones the originals, so prefix hits and chunking change its outputs by design.

Not a test (minutes, and some rows need several cores' worth of processes): a tool to run after changes that
touch the step, the scheduler, the KV tier or the sampler. Seeded samples are compared too; in float32 they
match wherever a step's logits are bitwise those of the plain engine, so a mismatch there is worth a look but
may be a sample drawn at a CDF boundary (a row computed through another kernel, e.g. a verify step in a mixed
batch). Usage:

    .venv/bin/python scripts/feature_sweep.py [NAME ...]     # default: every configuration
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
import traceback
from typing import Any

from rivulet import LLM, SamplingParams

TEXT = ("Rewrite this sentence: The quick brown fox jumps over the lazy dog near the river bank. "
        "The quick brown fox jumps over the lazy dog near the river bank again and again.")
PROMPTS = ["Hello, my name is", "Write a poem about the sea. " * 3, TEXT,
           "List the numbers from one to twenty: one, two, three,", "The capital of France is",
           TEXT + " Please repeat it exactly: The quick brown", "def fibonacci(n):\n    ",
           "Once upon a time in a land far away, there lived a", "Is the sky blue? Answer:",
           "Describe a cat in a few words:", "Give me a person as JSON:"]
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}


def params() -> list[SamplingParams]:
    kinds = [lambda i: SamplingParams(temperature=0, max_tokens=20 + i, ignore_eos=True, logprobs=2),
             lambda i: SamplingParams(temperature=0.8, top_p=0.9, seed=100 + i, max_tokens=24, ignore_eos=True),
             lambda i: SamplingParams(temperature=0, max_tokens=40, stop=[" lazy", "\n\n"]),
             lambda i: SamplingParams(temperature=0.7, n=2, seed=7 + i, max_tokens=18, ignore_eos=True,
                                      repetition_penalty=1.1)]
    return [kinds[i % 4](i) for i in range(8)] + [
        SamplingParams(temperature=0, max_tokens=30, structured_outputs={"choice": ["yes", "no", "maybe later"]}),
        SamplingParams(temperature=0.9, seed=3, max_tokens=30, structured_outputs={"regex": "[a-z]+( [a-z]+){2,4}\\."}),
        SamplingParams(temperature=0, max_tokens=40, structured_outputs={"json": PERSON})]


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
DRAFT = {"method": "draft_model", "model": "default", "num_speculative_tokens": 3}
SMALL = dict(num_kv_blocks=10, max_model_len=160)  # 10 blocks of 16 tokens: requests are preempted
TIER = dict(num_kv_blocks=12, max_model_len=160)
CONFIGS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "async": dict(async_scheduling=True),
    "chunk16+async": dict(max_num_batched_tokens=16, async_scheduling=True),
    "preempt+async": dict(**SMALL, async_scheduling=True),
    "ngram+async": dict(speculative_config=NGRAM, async_scheduling=True),
    "ngram+preempt+chunk": dict(speculative_config=NGRAM, **SMALL, max_num_batched_tokens=24),
    "draft+preempt+chunk": dict(speculative_config=DRAFT, **SMALL, max_num_batched_tokens=24),
    "draft+async": dict(speculative_config=DRAFT, async_scheduling=True),
    "ngram-disable2": dict(speculative_config={**NGRAM, "disable_by_batch_size": 2}),
    "longprefill16": dict(long_prefill_token_threshold=16),
    "bs32": dict(block_size=32),
    "seqs2+async+ngram": dict(max_num_seqs=2, async_scheduling=True, speculative_config=NGRAM),
    "host-tier+ngram+async": dict(**TIER, kv_offload_memory=64 << 20, speculative_config=NGRAM, async_scheduling=True),
    "disk-tier": dict(**TIER, kv_tier_path="{disk}"),
    "disk-tier-again": dict(**TIER, kv_tier_path="{disk}"),  # a restart: the first pass reads the files
    "host+disk-tier+ngram+async": dict(**TIER, kv_tier_path="{disk}", kv_offload_memory=8 << 20,
                                       speculative_config=NGRAM, async_scheduling=True),
    "O1": dict(compilation_level=1),
    "O2+async+ngram": dict(compilation_level=2, async_scheduling=True, speculative_config=NGRAM),
    "O2+preempt+chunk": dict(compilation_level=2, **SMALL, max_num_batched_tokens=24),
    "tp3+ngram+async": dict(tensor_parallel_size=3, speculative_config=NGRAM, async_scheduling=True),
    "tp3+sp+draft": dict(tensor_parallel_size=3, enable_sequence_parallel=True, speculative_config=DRAFT),
    "pp2+preempt": dict(pipeline_parallel_size=2, **SMALL),
    "pp2+mb2+ngram": dict(pipeline_parallel_size=2, pipeline_micro_batches=2, speculative_config=NGRAM),
}
PLAIN = dict(enforce_eager=True, async_scheduling=False, enable_prefix_caching=False)


def run(kw: dict[str, Any], disk: str) -> list:
    kw = {k: (v.format(disk=disk) if isinstance(v, str) else v) for k, v in kw.items() if k != "base"}
    llm = LLM("default", dtype="float32", **kw)
    try:
        return [[[(c.token_ids, c.text, c.finish_reason, [sorted(d) for d in c.logprobs or []]) for c in o.outputs]
                 for o in llm.generate(PROMPTS, params(), use_tqdm=False)] for _ in range(2)]
    finally:
        llm.shutdown()


def main(names: list[str]) -> int:
    disk = tempfile.mkdtemp(prefix="rivulet-sweep-")
    bases: dict[str, list] = {}
    failed = 0
    try:
        for name in names:
            base_kw = CONFIGS[name].get("base", {})
            key = json.dumps(base_kw, sort_keys=True)
            if key not in bases:
                bases[key] = run({**PLAIN, **base_kw}, disk)
            start = time.perf_counter()
            try:
                got = run(CONFIGS[name], disk)
            except Exception as e:  # noqa: BLE001 - reported, the sweep goes on
                traceback.print_exc()
                print(f"{name}: CRASH {type(e).__name__}: {e}", flush=True)
                failed += 1
                continue
            want = bases[key]
            bad = [(p, i) for p in range(2) for i in range(len(PROMPTS)) if got[p][i] != want[p][i]]
            failed += bool(bad)
            print(f"{name}: {'ok' if not bad else f'differs at (pass, prompt) {bad}'} "
                  f"({time.perf_counter() - start:.1f} s)", flush=True)
            for p, i in bad[:3]:
                print(f"    {params()[i]}\n    plain {want[p][i]}\n    got   {got[p][i]}"[:2000], flush=True)
    finally:
        shutil.rmtree(disk, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or list(CONFIGS)))
