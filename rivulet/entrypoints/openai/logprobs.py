"""Engine logprobs (``dict[token_id, Logprob]`` per position) -> OpenAI's logprobs objects."""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

from rivulet.engine.outputs import Logprob, PositionLogprobs
from rivulet.entrypoints.openai.protocol import ChatLogprobs, CompletionLogprobs, TokenLogprob, TopLogprob

# JSON has no -inf; like vLLM, report impossible tokens with this floor.
MIN_LOGPROB = -9999.0

TokenText = Callable[[int], str]


def clamp(value: float) -> float:
    """A JSON-safe logprob: finite, at least ``MIN_LOGPROB``."""
    return value if math.isfinite(value) and value > MIN_LOGPROB else MIN_LOGPROB


def token_text_fn(tokenizer: Any) -> TokenText:
    """How to show a token id: its decoded text, or ``token_id:N`` without a tokenizer (vLLM's form)."""
    if tokenizer is None:
        return lambda t: f"token_id:{t}"
    return lambda t: tokenizer.decode([t])


def _text(token_id: int, lp: Logprob | None, token_text: TokenText) -> str:
    if lp is not None and lp.decoded_token is not None:
        return lp.decoded_token
    return token_text(token_id)


def _top(position: PositionLogprobs, num: int) -> list[tuple[int, Logprob]]:
    """The ``num`` best alternatives at a position, best first (the sampled token only if it is among them)."""
    ranked = sorted(position.items(), key=lambda kv: (kv[1].rank if kv[1].rank is not None else 1 << 30, kv[0]))
    return [(t, lp) for t, lp in ranked if lp.rank is not None and lp.rank <= num][:num]


def completion_logprobs(token_ids: Sequence[int], positions: Sequence[PositionLogprobs | None],
                        num_top: int, token_text: TokenText, text_offset: int = 0) -> CompletionLogprobs:
    """The legacy logprobs object for ``token_ids`` (``positions[i]`` None: no logprob, as for the
    first prompt token). ``top_logprobs`` holds the best ``num_top`` and the chosen token, like vLLM."""
    out = CompletionLogprobs()
    offset = text_offset
    for token_id, position in zip(token_ids, positions):
        chosen = position.get(token_id) if position else None
        text = _text(token_id, chosen, token_text)
        out.tokens.append(text)
        out.text_offset.append(offset)
        offset += len(text)
        if position is None or chosen is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(clamp(chosen.logprob))
        top: dict[str, float] = {}
        if num_top > 0:
            for t, lp in _top(position, num_top):
                top.setdefault(_text(t, lp, token_text), clamp(lp.logprob))
            top.setdefault(text, clamp(chosen.logprob))
        out.top_logprobs.append(top)
    return out


def _entry(token: str, logprob: float) -> TopLogprob:
    return TopLogprob(token=token, logprob=clamp(logprob), bytes=list(token.encode("utf-8", "replace")))


def chat_logprobs(token_ids: Sequence[int], positions: Sequence[PositionLogprobs], num_top: int,
                  token_text: TokenText) -> ChatLogprobs:
    """Chat's ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}``."""
    content: list[TokenLogprob] = []
    for token_id, position in zip(token_ids, positions):
        chosen = position.get(token_id)
        text = _text(token_id, chosen, token_text)
        entry = _entry(text, chosen.logprob if chosen else MIN_LOGPROB)
        tops = [_entry(_text(t, lp, token_text), lp.logprob) for t, lp in _top(position, num_top)] if num_top else []
        content.append(TokenLogprob(**entry.model_dump(), top_logprobs=tops))
    return ChatLogprobs(content=content)
