"""Continuous batching must not change results: every request in a big mixed batch gets exactly
the greedy tokens it gets alone (float32, default model), whatever the chunking, prefix caching
and preemption."""

from __future__ import annotations

import random

import pytest

from rivulet import LLM, SamplingParams

N = 24


def _workload(tokenizer) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(0)
    words = "river stone cloud engine paper light garden number silver market music window".split()
    shared = tokenizer("You are a careful assistant. Answer briefly and precisely. Question:").input_ids  # 16+ tokens
    prompts, params = [], []
    for i in range(N):
        body = tokenizer(" ".join(rng.choice(words) for _ in range(rng.randint(1, 40)))).input_ids
        prompts.append((shared + body) if i % 3 == 0 else body)
        params.append(SamplingParams(temperature=0, max_tokens=rng.randint(4, 12), ignore_eos=i % 4 == 0))
    return prompts, params


@pytest.fixture(scope="module")
def alone():
    llm = LLM(dtype="float32", max_model_len=512, seed=0)
    prompts, params = _workload(llm.get_tokenizer())
    outs = [llm.generate({"prompt_token_ids": p}, sp, use_tqdm=False)[0] for p, sp in zip(prompts, params)]
    return prompts, params, [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("engine_kwargs", [
    dict(),
    dict(max_num_batched_tokens=8, max_num_seqs=64),  # prompts chunked 8 tokens at a time
    dict(enable_prefix_caching=False),
    dict(num_kv_blocks=40, block_size=16, max_num_seqs=64),  # far too small for 24 requests: preemption
], ids=["default", "chunk8", "no-prefix-cache", "preempt"])
def test_batched_equals_alone(alone, engine_kwargs):
    prompts, params, want = alone
    llm = LLM(dtype="float32", max_model_len=512, seed=0, **engine_kwargs)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outs]
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == w, f"request {i} differs in a batch: {g} vs alone {w}"
    core = llm.engine.core
    if "num_kv_blocks" in engine_kwargs:
        assert core.scheduler.num_preemptions > 0
    if engine_kwargs.get("enable_prefix_caching", True):
        assert core.kv_cache_manager.stats.hits > 0  # the shared system prefix was reused
    assert core.kv_cache_manager.num_free_blocks == core.num_blocks  # everything returned


def test_seeded_sampling_survives_preemption():
    """A seeded request keeps its random stream when it is preempted and recomputed: the same tokens as alone."""
    rng = random.Random(1)
    words = "river stone cloud engine paper light garden number silver market music window".split()
    llm = LLM(dtype="float32", max_model_len=128, seed=0, num_kv_blocks=10, block_size=16, max_num_seqs=16)
    tok = llm.get_tokenizer()
    prompts = [{"prompt_token_ids": tok(" ".join(rng.choice(words) for _ in range(rng.randint(12, 30)))).input_ids}
               for _ in range(10)]
    params = [SamplingParams(temperature=1.0, seed=100 + i, max_tokens=16, ignore_eos=True) for i in range(10)]
    alone = [llm.generate(p, sp, use_tqdm=False)[0].outputs[0].token_ids for p, sp in zip(prompts, params)]
    before = llm.engine.core.scheduler.num_preemptions
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert llm.engine.core.scheduler.num_preemptions > before  # 10 requests of ~40 tokens in 10 blocks of 16
    assert together == alone
