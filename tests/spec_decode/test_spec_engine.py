"""Speculative decoding through the engine: n-gram drafts verified by k-token steps give the tokens
(and logprobs) of decoding without them, with chunked prefill, preemption, stop strings, max_tokens
and n > 1; sampling keeps the model's distribution; drafts stop above `disable_by_batch_size`."""

from __future__ import annotations

import gc
import math
import random
from collections import Counter

import pytest

from rivulet import LLM, SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def _repeating_prompts(vocab: int, n: int, seed: int = 0) -> list[dict]:
    """Prompts whose end occurs earlier in them (so n-grams match from the first decode on)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a = [rng.randrange(3, vocab) for _ in range(rng.randrange(6, 20))]
        b = [rng.randrange(3, vocab) for _ in range(rng.randrange(0, 12))]
        out.append({"prompt_token_ids": a + b + a[:rng.randrange(2, 5)]})
    return out


def _run(llm: LLM, prompts: list[dict], params: list[SamplingParams]) -> list[tuple[list[int], list[float]]]:
    res = []
    for o in llm.generate(prompts, params, use_tqdm=False):
        c = o.outputs[0]
        res.append((list(c.token_ids), [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs or [])]))
    return res


def _check_same_as_without(model: str, vocab: int, **kw) -> dict:
    rng = random.Random(1)
    prompts = _repeating_prompts(vocab, 10)
    params = [SamplingParams(temperature=0, max_tokens=rng.randrange(1, 30), ignore_eos=True, logprobs=2)
              for _ in prompts]
    plain = LLM(model, dtype="float32", **kw)
    want = _run(plain, prompts, params)
    plain.shutdown()
    llm = LLM(model, dtype="float32", speculative_config=NGRAM, **kw)
    got = _run(llm, prompts, params)
    for (gt, glp), (wt, wlp) in zip(got, want):
        assert gt == wt, "speculative decoding changed the greedy tokens"
        assert glp == pytest.approx(wlp, abs=1e-4)
    core = llm.engine.core
    stats = core.get_stats()
    assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]
    assert core.kv_cache_manager.num_free_blocks == core.num_blocks
    assert len(core.executor.runner.batch) == 0
    gc.collect()
    assert len(core.proposer) == 0  # no token mirror outlives its request
    llm.shutdown()
    return stats


@pytest.mark.parametrize("kind", ["llama", "qwen3-moe"])
def test_ngram_gives_the_tokens_of_plain_decoding_on_tiny_models(kind, tiny_model_dir):
    path, _ = tiny_model_dir(kind)
    _check_same_as_without(str(path), 256, max_model_len=128, max_num_batched_tokens=24, block_size=4)


def test_ngram_gives_the_tokens_of_plain_decoding_on_the_default_model():
    """Chunked prefill and preemption on a real model (the tiny models cover a roomy cache)."""
    stats = _check_same_as_without("default", 40000, max_model_len=160, num_kv_blocks=10, block_size=16,
                                   max_num_batched_tokens=48)
    assert stats["num_preemptions"] > 0


COPY = ("def area(width, height):\n    return width * height\n\n\ndef perimeter(width, height):\n"
        "    return 2 * (width + height)\n")


@pytest.fixture(scope="module")
def copy_runs():
    """The default model asked to repeat code, without and with n-gram drafts (greedy, float32: in bf16 the
    k-token verify steps and plain decode steps run different attention kernels, whose roundings may part at a
    near tie)."""
    msgs = [{"role": "user", "content": f"Repeat this code exactly:\n\n{COPY}"}]
    plain = LLM("default", dtype="float32", max_model_len=512)
    spec = LLM("default", dtype="float32", max_model_len=512, speculative_config=NGRAM)
    yield msgs, plain, spec
    plain.shutdown()
    spec.shutdown()


def test_stop_strings_and_max_tokens_cut_accepted_runs_exactly(copy_runs):
    msgs, plain, spec = copy_runs
    full = plain.chat([msgs], SamplingParams(temperature=0, max_tokens=80), use_tqdm=False)[0].outputs[0]
    assert len(full.text) > 40
    stop = full.text[len(full.text) // 2:len(full.text) // 2 + 6]
    before = spec.engine.core.get_stats()["spec_decode_num_accepted_tokens"]
    for sp in [SamplingParams(temperature=0, max_tokens=80, stop=[stop]),
               SamplingParams(temperature=0, max_tokens=80, stop=[stop], include_stop_str_in_output=True),
               *[SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (1, 5, 17)]]:
        want = plain.chat([msgs], sp, use_tqdm=False)[0].outputs[0]
        got = spec.chat([msgs], sp, use_tqdm=False)[0].outputs[0]
        assert (got.text, list(got.token_ids), got.finish_reason) == (want.text, list(want.token_ids),
                                                                       want.finish_reason), sp
        if sp.ignore_eos:
            assert len(got.token_ids) == sp.max_tokens  # never past max_tokens, drafts or not
    assert spec.engine.core.get_stats()["spec_decode_num_accepted_tokens"] > before + 20  # a copy task: many


def test_n_samples_and_seeds_with_drafts(copy_runs):
    msgs, _, spec = copy_runs
    sp = SamplingParams(temperature=0.7, max_tokens=24, n=3, seed=5, ignore_eos=True)
    a = spec.chat([msgs], sp, use_tqdm=False)[0].outputs
    b = spec.chat([msgs], sp, use_tqdm=False)[0].outputs
    assert len(a) == 3 and all(len(c.token_ids) == 24 for c in a)
    assert [c.token_ids for c in a] == [c.token_ids for c in b]  # seeded: the same draws again


def test_disable_by_batch_size(tiny_model_dir):
    path, _ = tiny_model_dir("llama")
    prompts = _repeating_prompts(256, 8)
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for limit, speculates in [(4, False), (8, True)]:
        llm = LLM(str(path), dtype="float32", max_model_len=128, speculative_config=NGRAM | {
            "disable_by_batch_size": limit})
        llm.generate(prompts, sp, use_tqdm=False)  # all 8 run together from the first step to the last
        assert (llm.engine.core.get_stats()["spec_decode_num_drafts"] > 0) == speculates
        llm.shutdown()


def test_sampling_with_drafts_keeps_the_distribution(tiny_model_dir):
    """The token after a draft is distributed as without drafts: a chi-square test over 4 tokens (the
    rest biased away), with a proposer that always guesses the likeliest one."""
    path, _ = tiny_model_dir("llama")
    bias = {10: 100.0, 11: 99.0, 12: 98.5, 13: 98.0}
    prompt = {"prompt_token_ids": [5, 6, 7, 8]}
    n = 1200

    def second_tokens(llm: LLM, seed0: int) -> Counter:
        params = [SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True, logit_bias=bias, seed=seed0 + i)
                  for i in range(n)]
        return Counter(o.outputs[0].token_ids[1] for o in llm.generate([prompt] * n, params, use_tqdm=False))

    plain = LLM(str(path), dtype="float32", max_model_len=64, max_num_seqs=256)
    want = second_tokens(plain, 0)
    plain.shutdown()
    llm = LLM(str(path), dtype="float32", max_model_len=64, max_num_seqs=256, speculative_config=NGRAM)
    core = llm.engine.core
    core.proposer = lambda req: [10]
    got = second_tokens(llm, 10**6)
    stats = core.get_stats()
    assert stats["spec_decode_num_drafts"] >= n and 0 < stats["spec_decode_num_accepted_tokens"] < n
    # two-sample chi-square, 3 degrees of freedom: 16.27 is the 0.1% point
    cats = sorted(bias)
    assert sum(want[c] for c in cats) == sum(got[c] for c in cats) == n
    chi2 = sum((got[c] - want[c]) ** 2 / (got[c] + want[c]) for c in cats if got[c] + want[c])
    assert chi2 < 16.27, (want, got)
    # and a guess always taken would have been caught: the likeliest token is far from certain
    assert want[10] < 0.8 * n and not math.isclose(got[10], n)
    llm.shutdown()


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculation_with_tensor_parallelism(method, tiny_model_dir):
    """Drafts reach every rank with the step (the whole SchedulerOutput is broadcast; a draft model runs
    sharded on every rank like the target): TP=2 with drafts gives the single rank's tokens."""
    path, _ = tiny_model_dir("qwen2")
    spec = NGRAM if method == "ngram" else {"model": str(path), "num_speculative_tokens": 3}
    prompts = _repeating_prompts(256, 6, seed=3)
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    plain = LLM(str(path), dtype="float32", max_model_len=128)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, sp, use_tqdm=False)]
    plain.shutdown()
    llm = LLM(str(path), dtype="float32", max_model_len=128, tensor_parallel_size=2, speculative_config=spec)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)] == want
    assert llm.engine.core.get_stats()["spec_decode_num_accepted_tokens"] > 0
    llm.shutdown()
