"""Per-request sampling parameters, shaped like vLLM's ``SamplingParams``.

Pure Python (no torch) so that the API server and ``rivulet.core`` can build and
validate them without touching a device.  Everything that can be checked without
knowing the model is checked in ``__post_init__``; ``validate_for_vocab`` adds the
checks that need the vocabulary size.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from numbers import Real
from typing import Any

from rivulet.config import RivuletError

# Temperatures below this are treated as greedy: dividing logits by a tiny
# temperature overflows to inf and the softmax turns into NaN.
GREEDY_TEMPERATURE_EPS = 1e-5
# The most top-N logprobs a request may ask for (vLLM's default ``max_logprobs``).
MAX_LOGPROBS = 20
# OpenAI's documented ranges.
MAX_ABS_PENALTY = 2.0
MAX_ABS_LOGIT_BIAS = 100.0


def _is_int(value: object) -> bool:
    """True for a real integer (``bool`` is not accepted as one)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    """True for a finite real number (``bool`` is not accepted as one)."""
    return isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(value)


@dataclass
class StructuredOutputsParams:
    """Constrain the output to a grammar (vLLM's ``StructuredOutputsParams``); exactly one of:
    ``json`` (a JSON schema, dict or string), ``json_object`` (any JSON object), ``regex``,
    ``choice`` (one of these strings), ``grammar`` (EBNF, xgrammar's dialect of GBNF).
    Checked here for shape; the grammar itself is checked when the request is validated
    (`rivulet.structured.check`)."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # constrain only what follows these tokens (the end of a reasoning model's thinking, "</think>"):
    # set by the server's --reasoning-parser, not by clients
    after_token_ids: list[int] | None = None

    def __post_init__(self) -> None:
        given = [k for k in ("json", "regex", "choice", "grammar", "json_object") if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise RivuletError("structured outputs take exactly one of json, regex, choice, grammar, json_object; "
                               f"got {', '.join(given) or 'none'}")
        if isinstance(self.json, dict):
            self.json = json.dumps(self.json)
        if self.json is not None and not isinstance(self.json, str):
            raise RivuletError(f"structured outputs: json must be a JSON schema (object or string), got {self.json!r}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise RivuletError(f"structured outputs: {name} must be a non-empty string, got {value!r}")
        if self.choice is not None and (not isinstance(self.choice, (list, tuple)) or not self.choice
                                        or not all(isinstance(c, str) and c for c in self.choice)):
            raise RivuletError(f"structured outputs: choice must be a non-empty list of non-empty strings, "
                               f"got {self.choice!r}")
        if self.choice is not None:
            self.choice = list(self.choice)
        if self.after_token_ids is not None and (
                not isinstance(self.after_token_ids, (list, tuple)) or not self.after_token_ids
                or not all(isinstance(t, int) and t >= 0 for t in self.after_token_ids)):
            raise RivuletError(f"structured outputs: after_token_ids must be token ids, got {self.after_token_ids!r}")

    @property
    def key(self) -> tuple[str, str]:
        """(kind, text): what the grammar compiler takes, and the cache key of its result."""
        if self.json is not None:
            return "json", self.json
        if self.json_object:
            return "json", '{"type": "object"}'
        if self.regex is not None:
            return "regex", self.regex
        if self.choice is not None:
            return "grammar", "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in self.choice)
        assert self.grammar is not None
        return "grammar", self.grammar


@dataclass
class SamplingParams:
    """How to pick tokens for one request and when to stop.

    ``top_k`` of 0 or -1 disables top-k; ``top_p`` of 1 and ``min_p`` of 0 disable
    those filters.  ``temperature`` 0 (below ``GREEDY_TEMPERATURE_EPS``) or
    ``top_k`` 1 means greedy decoding.  ``logprobs`` asks for the top-N logprobs
    of each sampled position plus the sampled token's own; ``prompt_logprobs``
    the same for every prompt position.  ``truncate_prompt_tokens`` keeps only the
    prompt's last N tokens (-1: as many as the context holds), as in vLLM.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.structured_outputs, dict):
            unknown = set(self.structured_outputs) - {"json", "regex", "choice", "grammar", "json_object"}
            if unknown:
                raise RivuletError(f"structured_outputs: unknown key(s) {', '.join(sorted(unknown))}")
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise RivuletError(f"structured_outputs must be a StructuredOutputsParams, got {self.structured_outputs!r}")
        self._validate_counts()
        self._validate_sampling()
        self._validate_penalties()
        self._normalise_logit_bias()
        self._validate_stops()
        self._validate_logprobs()

    # ------------------------------------------------------------------ checks

    def _validate_counts(self) -> None:
        if not _is_int(self.n) or self.n < 1:
            raise RivuletError(f"n must be an integer >= 1, got {self.n!r}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise RivuletError(f"max_tokens must be an integer >= 1 or None, got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise RivuletError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise RivuletError(
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})"
            )
        if self.seed is not None and not _is_int(self.seed):
            raise RivuletError(f"seed must be an integer or None, got {self.seed!r}")
        t = self.truncate_prompt_tokens
        if t is not None and (not _is_int(t) or (t < 1 and t != -1)):
            raise RivuletError(f"truncate_prompt_tokens must be -1 or an integer >= 1, got {t!r}")

    def _validate_sampling(self) -> None:
        if not _is_real(self.temperature) or self.temperature < 0:
            raise RivuletError(
                f"temperature must be a finite number >= 0, got {self.temperature!r}"
            )
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise RivuletError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise RivuletError(
                f"top_k must be an integer >= -1 (0 or -1 disables it), got {self.top_k!r}"
            )
        if not _is_real(self.min_p) or not 0 <= self.min_p <= 1:
            raise RivuletError(f"min_p must be in [0, 1], got {self.min_p!r}")

    def _validate_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not -MAX_ABS_PENALTY <= value <= MAX_ABS_PENALTY:
                raise RivuletError(
                    f"{name} must be in [-{MAX_ABS_PENALTY}, {MAX_ABS_PENALTY}], got {value!r}"
                )
        if not _is_real(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise RivuletError(
                f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty!r}"
            )

    def _normalise_logit_bias(self) -> None:
        """Check the bias values and turn JSON-style string keys ("50256") into ints."""
        if self.logit_bias is None:
            return
        if not isinstance(self.logit_bias, dict):
            raise RivuletError(f"logit_bias must be a dict of token id to bias, got {self.logit_bias!r}")
        normalised: dict[int, float] = {}
        for key, value in self.logit_bias.items():
            token_id = key
            if isinstance(key, str) and key.strip().lstrip("-").isdigit():
                token_id = int(key)
            if not _is_int(token_id) or token_id < 0:
                raise RivuletError(f"logit_bias keys must be token ids >= 0, got {key!r}")
            if not _is_real(value) or not -MAX_ABS_LOGIT_BIAS <= value <= MAX_ABS_LOGIT_BIAS:
                raise RivuletError(
                    f"logit_bias[{token_id}] must be in [-{MAX_ABS_LOGIT_BIAS}, "
                    f"{MAX_ABS_LOGIT_BIAS}], got {value!r}"
                )
            normalised[token_id] = float(value)
        self.logit_bias = normalised

    def _validate_stops(self) -> None:
        if self.stop is not None:
            stops = [self.stop] if isinstance(self.stop, str) else self.stop
            if not isinstance(stops, (list, tuple)):
                raise RivuletError(f"stop must be a string, a list of strings or None, got {self.stop!r}")
            for item in stops:
                if not isinstance(item, str) or item == "":
                    raise RivuletError(f"stop strings must be non-empty strings, got {item!r}")
        if self.stop_token_ids is not None:
            if not isinstance(self.stop_token_ids, (list, tuple)):
                raise RivuletError(
                    f"stop_token_ids must be a list of token ids or None, got {self.stop_token_ids!r}"
                )
            for token_id in self.stop_token_ids:
                if not _is_int(token_id) or token_id < 0:
                    raise RivuletError(f"stop_token_ids must be token ids >= 0, got {token_id!r}")

    def _validate_logprobs(self) -> None:
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise RivuletError(
                    f"{name} must be an integer in [0, {MAX_LOGPROBS}] or None, got {value!r}"
                )

    def validate_for_vocab(self, vocab_size: int) -> None:
        """Check the token ids this request names against the model's vocabulary."""
        for token_id, value in (self.logit_bias or {}).items():
            if not 0 <= token_id < vocab_size:
                raise RivuletError(
                    f"logit_bias token id {token_id} is outside the vocabulary [0, {vocab_size})"
                )
            if not -MAX_ABS_LOGIT_BIAS <= value <= MAX_ABS_LOGIT_BIAS:
                raise RivuletError(
                    f"logit_bias[{token_id}] must be in [-{MAX_ABS_LOGIT_BIAS}, "
                    f"{MAX_ABS_LOGIT_BIAS}], got {value!r}"
                )
        for token_id in self.stop_token_ids or []:
            if not 0 <= token_id < vocab_size:
                raise RivuletError(
                    f"stop_token_ids entry {token_id} is outside the vocabulary [0, {vocab_size})"
                )

    # ----------------------------------------------------------------- helpers

    @property
    def is_greedy(self) -> bool:
        """Greedy decoding: temperature 0 (below the epsilon) or top_k == 1."""
        return self.temperature < GREEDY_TEMPERATURE_EPS or self.top_k == 1

    @property
    def top_k_enabled(self) -> bool:
        return self.top_k > 0

    @property
    def stop_strings(self) -> list[str]:
        """``stop`` as a list without duplicates, in the order given."""
        if self.stop is None:
            return []
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        return list(dict.fromkeys(stops))

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )
