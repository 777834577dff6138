"""Reasoning content (--reasoning-parser): <think>...</think> split from the answer, in whole responses and
in streams, where reasoning arrives in its own delta field. The default model does not think, so its
answers are forced with guided_choice (thinking "off" in chat_template_kwargs, so the grammar starts at
once rather than after "</think>", as it does for a thinking model: tests/structured covers that)."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from rivulet.entrypoints.openai.reasoning import ReasoningStream, split_reasoning
from server_helpers import ServerProcess

THOUGHT = "<think>\nThe user wants a capital.\n</think>\n\nParis"
ASK = [{"role": "user", "content": "Capital of France?"}]


@pytest.mark.parametrize("parser, text, want", [
    ("qwen3", THOUGHT, ("\nThe user wants a capital.\n", "Paris")),
    ("qwen3", "Paris", (None, "Paris")),  # thinking off
    ("qwen3", "<think>cut short", ("cut short", "")),
    ("deepseek_r1", "Hmm.</think>\n\nParis", ("Hmm.", "Paris")),  # "<think>" was in the prompt
    ("deepseek_r1", "Still thinking", ("Still thinking", "")),
])
def test_split_and_stream_agree(parser, text, want) -> None:
    assert split_reasoning(parser, text) == want
    for step in (1, 2, 5):
        s, r, c = ReasoningStream(parser), "", ""
        for i in range(0, len(text), step):
            dr, dc = s.feed(text[i:i + step], final=i + step >= len(text))
            r, c = r + dr, c + dc
        assert (r, c) == (want[0] or "", want[1]), step


@pytest.mark.parametrize("parser", ["qwen3", "deepseek_r1"])
def test_a_prompt_that_opened_the_thinking(parser) -> None:
    """The template wrote "<think>" (Qwen3's thinking-only models): the answer starts in the thinking."""
    text = "The user wants a capital.\n</think>\n\nParis"
    assert split_reasoning(parser, "<think>" + text) == ("The user wants a capital.\n", "Paris")
    for step in (1, 3):
        s, r, c = ReasoningStream(parser, opened=True), "", ""
        for i in range(0, len(text), step):
            dr, dc = s.feed(text[i:i + step], final=i + step >= len(text))
            r, c = r + dr, c + dc
        assert (r, c) == ("The user wants a capital.\n", "Paris"), step


@pytest.fixture(scope="module")
def rc() -> Iterator[openai.OpenAI]:
    proc = ServerProcess("--max-model-len", "512", "--reasoning-parser", "qwen3")
    try:
        with openai.OpenAI(base_url=proc.base_url, api_key="unused", max_retries=0, timeout=120) as c:
            yield c
    finally:
        proc.stop()


def test_served_reasoning_content(rc: openai.OpenAI) -> None:
    kw = dict(model="default", messages=ASK, max_tokens=40,
              extra_body={"guided_choice": [THOUGHT], "chat_template_kwargs": {"enable_thinking": False}})
    msg = rc.chat.completions.create(**kw).choices[0].message
    assert (msg.reasoning_content, msg.content) == ("\nThe user wants a capital.\n", "Paris")
    assert msg.model_extra["reasoning"] == msg.reasoning_content
    chunks = list(rc.chat.completions.create(**kw, stream=True))
    thought = "".join((c.choices[0].delta.model_extra or {}).get("reasoning_content") or "" for c in chunks)
    said = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert (thought, said) == ("\nThe user wants a capital.\n", "Paris")
    plain = rc.chat.completions.create(model="default", messages=ASK, max_tokens=8, temperature=0).choices[0].message
    assert plain.content and plain.reasoning_content is None  # no <think>: all content (qwen3)
