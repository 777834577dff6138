"""Reasoning content (`--reasoning-parser`): the thinking of a reasoning model, `<think>...</think>`,
apart from its answer, as `message.reasoning_content` (and vLLM's newer `reasoning`).

    deepseek_r1  the answer starts in thinking (the template may already have written "<think>"),
                 up to "</think>"; with no "</think>" at all, everything is thinking
    qwen3        thinking only when the answer starts with "<think>" (thinking can be switched off),
                 up to "</think>"

Either way, when the chat template itself ends the prompt in "<think>" (Qwen3's thinking-only models),
the answer starts inside the thinking (the server passes `opened`).

Structured output and tool calls apply to what follows the thinking: the server gives the grammar
the tokens of "</think>" to wait for (`StructuredOutputsParams.after_token_ids`).
"""

from __future__ import annotations

from typing import Any

REASONING_PARSERS = ("deepseek_r1", "qwen3")
START, END = "<think>", "</think>"


def split_reasoning(parser: str, text: str, final: bool = True) -> tuple[str | None, str]:
    """(reasoning or None, content) of an answer; of an answer still streaming (`final` False), the
    parts that are certain so far (text that may be the start of a marker is held back). Both grow
    monotonically as the answer grows."""
    body = text.lstrip()
    if body.startswith(START):
        body = body[len(START):]
    elif not final and START.startswith(body):  # nothing yet, or "<thi": undecided
        return None, ""
    elif parser == "qwen3":
        return None, text
    if END in body:
        reasoning, content = body.split(END, 1)
        return reasoning, content.lstrip("\n")
    if final:
        return body, ""
    hold = next((k for k in range(min(len(END) - 1, len(body)), 0, -1) if body.endswith(END[:k])), 0)
    return body[:len(body) - hold], ""


class ReasoningStream:
    """A streamed answer split as it comes: `feed(new, final)` -> (reasoning delta, content delta)."""

    def __init__(self, parser: str, opened: bool = False) -> None:
        self.parser = parser
        self.text = START if opened else ""  # the prompt opened the thinking
        self.sent_reasoning = self.sent_content = 0

    def feed(self, new: str, final: bool = False) -> tuple[str, str]:
        self.text += new
        reasoning, content = split_reasoning(self.parser, self.text, final)
        dr, dc = (reasoning or "")[self.sent_reasoning:], content[self.sent_content:]
        self.sent_reasoning += len(dr)
        self.sent_content += len(dc)
        return dr, dc


def reasoning_fields(reasoning: str | None) -> dict[str, Any]:
    """The message (or delta) fields of some reasoning: vLLM's old and new names."""
    return {} if reasoning is None else {"reasoning_content": reasoning, "reasoning": reasoning}
