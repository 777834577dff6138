"""The n-gram proposer against a brute-force search, its per-request memory, and its configuration."""

from __future__ import annotations

import gc
import random

import numpy as np
import pytest

from rivulet.config import RivuletError, SpeculativeConfig
from rivulet.core.request import Request
from rivulet.engine.args import EngineArgs
from rivulet.spec_decode import NgramProposer, SpecDecodeStats
from rivulet.spec_decode.ngram import propose_ngram


def _brute_force(t: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Longest n first; for that n the most recent earlier occurrence of the last n tokens."""
    length = len(t)
    for n in range(max_n, min_n - 1, -1):
        if length < n + 1:
            continue
        for end in range(length - 2, n - 2, -1):
            if t[end - n + 1:end + 1] == t[length - n:]:
                return t[end + 1:end + 1 + k]
    return []


@pytest.mark.parametrize("alphabet", [2, 3, 6])
def test_propose_ngram_equals_brute_force(alphabet):
    rng = random.Random(alphabet)
    proposed = 0
    for _ in range(1500):
        t = [rng.randrange(alphabet) for _ in range(rng.randrange(0, 40))]
        lo = rng.randrange(1, 5)
        hi = rng.randrange(lo, 7)
        k = rng.randrange(1, 6)
        got = propose_ngram(np.array(t, np.int32), lo, hi, k).tolist()
        assert got == _brute_force(t, lo, hi, k), (t, lo, hi, k)
        proposed += bool(got)
    assert proposed > 300  # the cases exercise matches, not only misses


def test_propose_ngram_prefers_the_longest_then_the_most_recent_match():
    t = np.array([7, 1, 2, 3, 9, 9, 2, 3, 5, 5, 1, 2, 3], np.int32)
    assert propose_ngram(t, 1, 3, 2).tolist() == [9, 9]  # "1 2 3" after the 7 beats the later "2 3"
    assert propose_ngram(t, 1, 2, 2).tolist() == [5, 5]  # up to 2 tokens: the most recent "2 3"
    assert propose_ngram(t, 4, 5, 2).tolist() == []      # nothing of 4 tokens repeats
    assert propose_ngram(t[:1], 1, 3, 2).tolist() == []


def test_proposer_follows_the_request_and_lets_it_go():
    proposer = NgramProposer(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=2))
    req = Request("r", [5, 6, 7, 8, 5, 6], max_tokens=600)
    assert proposer(req) == [7, 8, 5]
    for tok in [7, 1] + list(range(300, 600)):  # outgrows the first buffer
        req.append_output_token_id(tok)
    req.append_output_token_id(7)
    assert proposer(req) == [1, 300, 301]  # the most recent "7" was followed by 1
    assert len(proposer) == 1
    del req
    gc.collect()
    assert len(proposer) == 0  # nothing kept for requests that are gone


def test_speculative_config_follows_vllm_and_rejects_bad_input():
    c = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4}')
    assert (c.prompt_lookup_min, c.prompt_lookup_max, c.num_speculative_tokens) == (4, 4, 5)
    assert SpeculativeConfig.parse({"prompt_lookup_min": 2}).prompt_lookup_max == 2
    assert SpeculativeConfig().prompt_lookup_min == SpeculativeConfig().prompt_lookup_max == 5
    config = EngineArgs(speculative_config={"num_speculative_tokens": 2}).create_engine_config()
    assert type(config).from_json(config.to_json()) == config
    d = SpeculativeConfig.parse({"model": "default", "num_speculative_tokens": 4, "quantization": "int4"})
    assert (d.method, d.model, d.quantization, d.prompt_lookup_min) == ("draft_model", "default", "int4", None)
    config = EngineArgs(speculative_config={"model": "/m", "disable_by_batch_size": 4}).create_engine_config()
    assert type(config).from_json(config.to_json()) == config
    for bad, words in [('{"method": "draft_model"}', "draft_model needs \"model\""),
                       ('{"method": "ngram", "model": "x"}', "are for method draft_model"),
                       ('{"model": "x", "prompt_lookup_max": 3}', "are for method ngram"),
                       ('{"model": "x", "quantization": "fp8"}', "quantization must be int8 or int4"),
                       ('{"num_speculative_tokens": 2, "k": 1}', "unknown key(s) k"),
                       ('{"method": "eagle"}', "method must be one of ngram, draft_model"),
                       ('{"num_speculative_tokens": 0}', "num_speculative_tokens must be"),
                       ('{"prompt_lookup_min": 3, "prompt_lookup_max": 2}', "prompt_lookup_min <= prompt_lookup_max"),
                       ('{"disable_by_batch_size": 0}', "disable_by_batch_size must be"),
                       ("[1]", "must be a JSON object"), ("{x", "is not JSON")]:
        with pytest.raises(RivuletError) as e:
            EngineArgs(speculative_config=bad).create_engine_config()
        assert words in str(e.value), (bad, str(e.value))


def test_stats_count_drafts_by_position():
    s = SpecDecodeStats()
    s.observe(3, 2)
    s.observe(4, 0)
    s.observe(2, 2)
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) == (3, 9, 4)
    assert s.accepted_per_pos == [2, 2, 0, 0]
    assert s.acceptance_rate == pytest.approx(4 / 9) and s.mean_acceptance_length == pytest.approx(1 + 4 / 3)
