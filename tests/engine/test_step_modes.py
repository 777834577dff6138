"""The engine's step modes give the synchronous loop's greedy tokens (float32): async scheduling,
and k-token steps that verify draft tokens (right, wrong, or partly right), on tiny models of every
architecture and on the default model, with prefill chunking and preemption in the mix."""

from __future__ import annotations

import random

import pytest

from helpers.tiny import TINY_CONFIGS
from rivulet import LLM, SamplingParams
from rivulet.core.request import Request
from rivulet.worker.async_output import resolve

KINDS = sorted(TINY_CONFIGS)


def _workload(vocab: int, n: int = 10, seed: int = 0) -> tuple[list[dict], list[SamplingParams]]:
    rng = random.Random(seed)
    prompts = [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 40))]} for _ in range(n)]
    params = [SamplingParams(temperature=0, max_tokens=rng.randrange(1, 24), ignore_eos=True) for _ in range(n)]
    return prompts, params


def _tokens(llm: LLM, prompts: list[dict], params: list[SamplingParams]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


class Drafts:
    """Proposes k tokens per decoding request: the reference continuation, cut short and padded with a
    wrong token at a random point (so drafts are accepted in full, in part, or not at all)."""

    def __init__(self, reference: dict[tuple[int, ...], list[int]], seed: int = 0) -> None:
        self.reference, self.rng = reference, random.Random(seed)
        self.proposed = 0

    def __call__(self, req: Request) -> list[int]:
        p = req.num_prompt_tokens
        want = self.reference[tuple(req.all_token_ids[:p])][req.num_output_tokens:]
        k = self.rng.randrange(0, 5)
        cut = self.rng.randrange(0, k + 1)
        draft = want[:cut] + [(t + 1) % 200 + 3 for t in want[cut:k]]
        self.proposed += len(draft)
        return draft


def _check_modes(model: str, vocab: int, **kw) -> None:
    prompts, params = _workload(vocab)
    sync = LLM(model, dtype="float32", async_scheduling=False, **kw)
    want = _tokens(sync, prompts, params)
    sync.shutdown()
    llm = LLM(model, dtype="float32", async_scheduling=True, **kw)
    assert llm.engine.core.async_scheduling
    assert _tokens(llm, prompts, params) == want, "async scheduling changed the tokens"
    reference = {tuple(p["prompt_token_ids"]): w for p, w in zip(prompts, want)}
    core = llm.engine.core
    core.proposer = drafts = Drafts(reference)
    accepted, execute = [0], core.executor.execute

    def counting(out, grammar_bitmask=None):
        result = resolve(execute(out, grammar_bitmask))
        accepted[0] += sum(len(t) - 1 for t in result.sampled_token_ids.values())
        return result

    core.executor.execute = counting
    assert _tokens(llm, prompts, params) == want, "draft tokens changed the tokens"
    assert 0 < accepted[0] < drafts.proposed  # drafts were taken and rejected
    assert core.kv_cache_manager.num_free_blocks == core.num_blocks
    assert len(core.executor.runner.batch) == 0  # every row was given back
    llm.shutdown()


@pytest.mark.parametrize("kind", KINDS)
def test_async_and_draft_steps_match_sync_on_tiny_models(kind, tiny_model_dir):
    path, _ = tiny_model_dir(kind)
    _check_modes(str(path), 256, max_model_len=128, max_num_batched_tokens=32, block_size=4)


@pytest.mark.parametrize("kw", [dict(), dict(num_kv_blocks=12, block_size=16)], ids=["roomy", "preempt"])
def test_async_and_draft_steps_match_sync_on_the_default_model(kw):
    _check_modes("default", 40000, max_model_len=192, max_num_batched_tokens=64, **kw)


def test_async_outputs_keep_sampling_logprobs_and_penalties():
    """With async scheduling the tokens reach the host a step late (the next step reads them on the device):
    seeded sampling, penalties (counted on the device), logit bias, min_tokens, logprobs and prompt logprobs
    are the synchronous loop's, with preemption in the mix."""
    prompts, _ = _workload(40000, n=8, seed=3)
    kinds = [dict(temperature=0.8, top_p=0.9, seed=11), dict(temperature=0, presence_penalty=1.5, frequency_penalty=0.5),
             dict(temperature=1.0, top_k=20, repetition_penalty=1.3, seed=5),
             dict(temperature=0, logit_bias={100: 5.0}, min_tokens=6)]
    params = [SamplingParams(max_tokens=10 + i, logprobs=2, prompt_logprobs=1 if i % 3 == 0 else None,
                             **kinds[i % len(kinds)]) for i in range(len(prompts))]

    def lps(entries: list | None) -> list | None:
        return None if entries is None else [None if e is None else {t: v.logprob for t, v in e.items()}
                                             for e in entries]

    def near(got: list | None, want: list | None) -> bool:  # (batches differ: float32 rounding in the last digits)
        return (got is None) == (want is None) and (got is None or len(got) == len(want) and all(
            (g is None) == (w is None) and (g is None or g.keys() == w.keys() and
                                            all(abs(g[t] - w[t]) < 1e-3 for t in g)) for g, w in zip(got, want)))

    def run(async_scheduling: bool) -> tuple[list, dict]:
        llm = LLM("default", dtype="float32", max_model_len=160, max_num_batched_tokens=48, num_kv_blocks=10,
                  block_size=16, async_scheduling=async_scheduling)
        got = [(o.outputs[0].token_ids, lps(o.outputs[0].logprobs), lps(o.prompt_logprobs))
               for o in llm.generate(prompts, params, use_tqdm=False)]
        stats = llm.engine.core.get_stats()
        assert llm.engine.core.executor.runner.async_outputs == async_scheduling
        llm.shutdown()
        return got, stats

    want, _ = run(False)
    got, stats = run(True)
    assert stats["num_preemptions"] > 0
    for (gt, glp, gp), (wt, wlp, wp) in zip(got, want):
        assert gt == wt and len(glp) == len(gt)
        assert near(glp, wlp) and near(gp, wp)


def test_async_rows_longer_than_the_batchs_first_width():
    """The persistent batch starts 256 tokens wide; async steps read the last token back from the device at
    position num_tokens, so a row crossing the width must have grown first."""
    rng = random.Random(5)
    prompt = [{"prompt_token_ids": [rng.randrange(3, 40000) for _ in range(250)]}]
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    got = {}
    for a in (False, True):
        llm = LLM("default", dtype="float32", max_model_len=320, async_scheduling=a)
        got[a] = _tokens(llm, prompt, [sp])
        llm.shutdown()
    assert got[True] == got[False] and len(got[True][0]) == 20


def test_cpu_default_is_synchronous():
    """On CPU the forward pass uses every core: a second busy thread would stall it (docs/cpu.md)."""
    llm = LLM("default", dtype="float32", max_model_len=64, num_kv_blocks=8)
    assert not llm.engine.core.async_scheduling


def test_async_abort_mid_flight_frees_everything():
    llm = LLM("default", dtype="float32", max_model_len=128, async_scheduling=True)
    eng = llm.engine
    prompts, params = _workload(40000, n=6)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        eng.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    for _ in range(4):
        eng.step()
    assert eng.core._in_flight is not None
    for i in range(0, 6, 2):
        eng.abort_request(f"r{i}")
    while eng.has_unfinished_requests() or eng.core.has_unfinished_requests():
        eng.step()
    core = eng.core
    assert core.kv_cache_manager.num_free_blocks == core.num_blocks
    assert len(core.executor.runner.batch) == 0
