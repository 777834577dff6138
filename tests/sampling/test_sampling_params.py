"""SamplingParams: defaults, validation messages, vocabulary checks and helpers."""

from __future__ import annotations

import math

import pytest

from rivulet.config import RivuletError
from rivulet.sampling_params import SamplingParams


def test_defaults_match_vllm() -> None:
    params = SamplingParams()
    assert (params.n, params.temperature, params.top_p, params.top_k, params.min_p) == (
        1, 1.0, 1.0, 0, 0.0,
    )
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (
        0.0, 0.0, 1.0,
    )
    assert params.max_tokens == 16 and params.min_tokens == 0
    assert params.logit_bias is None and params.seed is None
    assert params.skip_special_tokens is True and params.ignore_eos is False
    assert params.stop_strings == []
    assert not params.is_greedy
    assert not params.has_penalties


def test_rivulet_error_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        SamplingParams(temperature=-1)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -0.5}, r"temperature .*-0\.5"),
        ({"temperature": math.nan}, r"temperature .*nan"),
        ({"temperature": math.inf}, r"temperature .*inf"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\], got 0\.0"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\], got 1\.5"),
        ({"top_k": -2}, r"top_k .*-2"),
        ({"top_k": 2.5}, r"top_k .*2\.5"),
        ({"min_p": -0.1}, r"min_p must be in \[0, 1\], got -0\.1"),
        ({"min_p": 1.1}, r"min_p must be in \[0, 1\], got 1\.1"),
        ({"n": 0}, r"n must be an integer >= 1, got 0"),
        ({"max_tokens": 0}, r"max_tokens .*got 0"),
        ({"min_tokens": -1}, r"min_tokens .*got -1"),
        ({"min_tokens": 5, "max_tokens": 4}, r"min_tokens \(5\) must be <= max_tokens \(4\)"),
        ({"presence_penalty": 2.5}, r"presence_penalty must be in \[-2\.0, 2\.0\], got 2\.5"),
        ({"frequency_penalty": -2.01}, r"frequency_penalty .*-2\.01"),
        ({"repetition_penalty": 0.0}, r"repetition_penalty .*> 0, got 0\.0"),
        ({"repetition_penalty": -1.0}, r"repetition_penalty .*-1\.0"),
        ({"logprobs": -1}, r"logprobs must be an integer in \[0, 20\] or None, got -1"),
        ({"logprobs": 21}, r"logprobs .*got 21"),
        ({"prompt_logprobs": 21}, r"prompt_logprobs .*got 21"),
        ({"logit_bias": {5: 101.0}}, r"logit_bias\[5\] must be in \[-100\.0, 100\.0\], got 101\.0"),
        ({"logit_bias": {-3: 1.0}}, r"logit_bias keys .*-3"),
        ({"stop": ["ok", ""]}, r"stop strings must be non-empty strings, got ''"),
        ({"stop": 5}, r"stop must be .*5"),
        ({"stop_token_ids": [1, -4]}, r"stop_token_ids .*-4"),
        ({"seed": 1.5}, r"seed .*1\.5"),
    ],
)
def test_invalid_values_name_field_and_value(kwargs: dict, message: str) -> None:
    with pytest.raises(RivuletError, match=message):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 0.0},
        {"top_p": 1.0, "top_k": -1},
        {"top_k": 0, "min_p": 1.0},
        {"presence_penalty": -2.0, "frequency_penalty": 2.0, "repetition_penalty": 3.0},
        {"max_tokens": None, "min_tokens": 1000},
        {"min_tokens": 4, "max_tokens": 4},
        {"logprobs": 0, "prompt_logprobs": 20},
        {"logit_bias": {0: -100, 7: 100}},
        {"seed": -5},
    ],
)
def test_boundary_values_are_accepted(kwargs: dict) -> None:
    params = SamplingParams(**kwargs)
    for name, value in kwargs.items():  # kept as given (logit_bias values as floats)
        got = getattr(params, name)
        assert got == ({k: float(v) for k, v in value.items()} if name == "logit_bias" else value), (name, got)


def test_logit_bias_string_keys_become_ints() -> None:
    params = SamplingParams(logit_bias={"50": -3, 7: 2})
    assert params.logit_bias == {50: -3.0, 7: 2.0}
    assert all(type(key) is int for key in params.logit_bias)


def test_validate_for_vocab() -> None:
    SamplingParams(logit_bias={99: 1.0}, stop_token_ids=[0, 99]).validate_for_vocab(100)
    with pytest.raises(RivuletError, match=r"logit_bias token id 100 is outside .*\[0, 100\)"):
        SamplingParams(logit_bias={100: 1.0}).validate_for_vocab(100)
    with pytest.raises(RivuletError, match=r"stop_token_ids entry 250 is outside .*\[0, 100\)"):
        SamplingParams(stop_token_ids=[3, 250]).validate_for_vocab(100)
    params = SamplingParams(logit_bias={1: 1.0})
    params.logit_bias = {1: 500.0}  # mutated after construction
    with pytest.raises(RivuletError, match=r"logit_bias\[1\] .*500\.0"):
        params.validate_for_vocab(100)


@pytest.mark.parametrize(
    ("kwargs", "greedy"),
    [
        ({"temperature": 0.0}, True),
        ({"temperature": 1e-7}, True),
        ({"temperature": 0.7, "top_k": 1}, True),
        ({"temperature": 0.7, "top_k": 2}, False),
        ({"temperature": 0.01}, False),
    ],
)
def test_is_greedy(kwargs: dict, greedy: bool) -> None:
    assert SamplingParams(**kwargs).is_greedy is greedy


def test_stop_strings_normalised() -> None:
    assert SamplingParams(stop="END").stop_strings == ["END"]
    assert SamplingParams(stop=["b", "a", "b"]).stop_strings == ["b", "a"]
    assert SamplingParams(stop=None).stop_strings == []


def test_has_penalties() -> None:
    assert SamplingParams(presence_penalty=0.1).has_penalties
    assert SamplingParams(frequency_penalty=-0.1).has_penalties
    assert SamplingParams(repetition_penalty=1.1).has_penalties
    assert not SamplingParams(repetition_penalty=1.0).has_penalties
