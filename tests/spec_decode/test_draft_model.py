"""Speculative decoding with a draft model: greedy tokens and logprobs of plain decoding whatever the
draft (the target itself: every draft accepted; an unrelated random model: almost none), through chunked
prefill, prefix caching and preemption; the draft's state and KV go with the request."""

from __future__ import annotations

import random

import pytest

from rivulet import LLM, SamplingParams
from rivulet.config import RivuletError


def _prompts(vocab: int, n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(rng.randrange(3, 40))]} for _ in range(n)]


def _run(llm: LLM, prompts: list[dict], params: list[SamplingParams]) -> list[tuple[list[int], list[float]]]:
    res = []
    for o in llm.generate(prompts, params, use_tqdm=False):
        c = o.outputs[0]
        res.append((list(c.token_ids), [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs or [])]))
    return res


def _check_same_as_without(model: str, draft: str, vocab: int, k: int = 3, repeat: bool = False, **kw) -> dict:
    rng = random.Random(1)
    prompts = _prompts(vocab, 10)
    prompts += prompts[:4] if repeat else []  # again: prefix-cache hits for the target's and the draft's KV
    params = [SamplingParams(temperature=0, max_tokens=rng.randrange(1, 30), ignore_eos=True, logprobs=2)
              for _ in prompts]
    plain = LLM(model, dtype="float32", **kw)
    want = _run(plain, prompts, params)
    plain.shutdown()
    llm = LLM(model, dtype="float32", speculative_config={"model": draft, "num_speculative_tokens": k}, **kw)
    got = _run(llm, prompts, params)
    for (gt, glp), (wt, wlp), sp in zip(got, want, params):
        assert gt == wt, "speculative decoding changed the greedy tokens"
        assert len(gt) == sp.max_tokens
        assert glp == pytest.approx(wlp, abs=1e-4)
    core = llm.engine.core
    stats = core.get_stats()
    assert stats["spec_decode_num_drafts"] > 0
    assert core.kv_cache_manager.num_free_blocks == core.num_blocks
    assert len(core.executor.runner.batch) == 0 and len(core.executor.runner.drafter) == 0
    llm.shutdown()
    return stats


@pytest.mark.parametrize("kind", ["llama", "qwen3-moe"])
def test_a_draft_model_keeps_the_tokens_of_plain_decoding_on_tiny_models(kind, tiny_model_dir):
    path, _ = tiny_model_dir(kind)
    kw = dict(max_model_len=128, max_num_batched_tokens=24, block_size=4)
    same = _check_same_as_without(str(path), str(path), 256, **kw)  # the target as its own draft
    assert same["spec_decode_num_accepted_tokens"] == same["spec_decode_num_draft_tokens"]
    tight = _check_same_as_without(str(path), str(path), 256, **kw | dict(num_kv_blocks=34))  # draft KV preempted too
    assert tight["num_preemptions"] > 0
    assert tight["spec_decode_num_accepted_tokens"] == tight["spec_decode_num_draft_tokens"]
    other = "qwen2" if kind == "llama" else "llama"
    unrelated = _check_same_as_without(str(path), str(tiny_model_dir(other)[0]), 256, k=2, **kw)
    assert unrelated["spec_decode_num_accepted_tokens"] < 0.2 * unrelated["spec_decode_num_draft_tokens"]


def test_the_default_model_as_its_own_draft():
    """A real model, prompts repeated for prefix-cache hits (preemption: the tiny models above)."""
    stats = _check_same_as_without("default", "default", 40000, k=4, repeat=True, max_model_len=160)
    assert stats["prefix_cache_hits"] > 0
    # float32 on both sides: the same model's guesses are the target's tokens
    assert stats["spec_decode_num_accepted_tokens"] >= 0.98 * stats["spec_decode_num_draft_tokens"]


def test_seeded_samples_and_stops_with_a_draft_model(tiny_model_dir):
    path, _ = tiny_model_dir("llama")
    llm = LLM(str(path), dtype="float32", max_model_len=128,
              speculative_config={"model": str(path), "num_speculative_tokens": 3})
    prompt = _prompts(256, 1, seed=4)
    sp = SamplingParams(temperature=0.8, max_tokens=20, n=3, seed=7, ignore_eos=True)
    a = llm.generate(prompt, sp, use_tqdm=False)[0].outputs
    b = llm.generate(prompt, sp, use_tqdm=False)[0].outputs
    assert [c.token_ids for c in a] == [c.token_ids for c in b] and all(len(c.token_ids) == 20 for c in a)
    greedy = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0].token_ids
    stop = greedy[9]
    first = greedy.index(stop)  # a stop token cuts a run of accepted drafts where it first appears
    got = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert list(got.token_ids) == greedy[:first + 1] and got.finish_reason == "stop"
    llm.shutdown()


def test_draft_model_disable_by_batch_size(tiny_model_dir):
    path, _ = tiny_model_dir("llama")
    prompts = _prompts(256, 8)
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for limit, speculates in [(4, False), (8, True)]:
        llm = LLM(str(path), dtype="float32", max_model_len=128, speculative_config={
            "model": str(path), "num_speculative_tokens": 2, "disable_by_batch_size": limit})
        llm.generate(prompts, sp, use_tqdm=False)  # all 8 run together from the first step to the last
        assert (llm.engine.core.get_stats()["spec_decode_num_drafts"] > 0) == speculates
        llm.shutdown()


def test_draft_model_errors(tiny_model_dir, tmp_path):
    path, _ = tiny_model_dir("llama")
    with pytest.raises(RivuletError, match="speculative_config draft model not found"):
        LLM(str(path), dtype="float32", speculative_config={"model": str(tmp_path / "missing")})
    with pytest.raises(RivuletError, match="vocabulary"):  # the default model's 49152 tokens > 256
        LLM(str(path), dtype="float32", speculative_config={"model": "default"})
