"""A Qwen3-shaped chat model served end to end (random weights; the default model's tokenizer with Qwen3's
markers <think>, </think>, <tool_call>, </tool_call> as single added tokens, Qwen3's chat template): the
hermes tool parser and the qwen3 reasoning parser on Qwen3's own format, and the grammar that starts after
the one-token "</think>". The grammar, not the model, makes the answers valid."""

from __future__ import annotations

import json
from collections.abc import Iterator

import jsonschema
import openai
import pytest

from helpers.tiny import make_tiny_qwen3_chat
from server_helpers import ServerProcess

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}, "unit": {"enum": ["C", "F"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
OK = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
      "required": ["ok", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3-chat")
    make_tiny_qwen3_chat(path)
    return path


@pytest.fixture(scope="module")
def client(model_dir) -> Iterator[openai.OpenAI]:
    proc = ServerProcess("--model", str(model_dir), "--served-model-name", "qwen3", "--max-model-len", "1024",
                         "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3")
    try:
        with openai.OpenAI(base_url=proc.base_url, api_key="unused", max_retries=0, timeout=120) as c:
            yield c
    finally:
        proc.stop()


def test_the_markers_are_single_tokens_and_the_template_renders_tools(model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    assert [len(tok.encode(m, add_special_tokens=False)) for m in ("<think>", "</think>", "<tool_call>")] == [1, 1, 1]
    text = tok.apply_chat_template(ASK, tools=[WEATHER], tokenize=False, add_generation_prompt=True)
    assert '"name": "get_weather"' in text and text.endswith("<|im_start|>assistant\n")


def test_named_and_auto_tool_calls(client: openai.OpenAI) -> None:
    off = {"chat_template_kwargs": {"enable_thinking": False}}  # else the grammar waits for "</think>"
    named = {"type": "function", "function": {"name": "get_weather"}}  # one call (random weights would
    msg = client.chat.completions.create(model="qwen3", messages=ASK, tools=[WEATHER], tool_choice=named,  # list
                                         max_tokens=400, extra_body=off).choices[0].message  # calls on "required")
    call = msg.tool_calls[0]
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    forced = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}\n</tool_call>'
    choice = client.chat.completions.create(
        model="qwen3", messages=ASK, tools=[WEATHER], max_tokens=60,
        extra_body={"guided_choice": [forced], **off}).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content in (None, "")
    assert json.loads(choice.message.tool_calls[0].function.arguments) == {"city": "Oslo", "unit": "C"}


def test_the_grammar_starts_after_the_one_token_end_of_thinking(client: openai.OpenAI, model_dir) -> None:
    """Thinking on: the schema constrains only what follows "</think>" (one token here), which a logit bias
    makes the first thing the random model says; then the JSON. Over HTTP the qwen3 parser keeps an answer
    that does not open with "<think>" as content (Qwen3 opens its thinking itself), so the content is
    "</think>" and the JSON."""
    from transformers import AutoTokenizer

    end = AutoTokenizer.from_pretrained(str(model_dir)).convert_tokens_to_ids("</think>")
    kw = dict(model="qwen3", messages=ASK, max_tokens=200, temperature=0, logit_bias={str(end): 100},
              response_format={"type": "json_schema", "json_schema": {"name": "ok", "schema": OK}})
    msg = client.chat.completions.create(**kw).choices[0].message
    assert msg.content.startswith("</think>") and msg.reasoning_content is None
    jsonschema.validate(json.loads(msg.content.removeprefix("</think>")), OK)
    chunks = list(client.chat.completions.create(**kw, stream=True))
    said = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert said == msg.content
    # a template that opens the thinking in the prompt (Qwen3's thinking-only models): the answer starts in it,
    # so what precedes "</think>" is reasoning (empty here) and the JSON is the content, whole and streamed
    opened = {**kw, "extra_body": {"chat_template_kwargs": {"enable_thinking": True}}}
    msg = client.chat.completions.create(**opened).choices[0].message
    assert msg.reasoning_content == ""
    jsonschema.validate(json.loads(msg.content), OK)
    chunks = list(client.chat.completions.create(**opened, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == msg.content
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == ""
    # offline, the same request as token ids: the grammar waits for the one token, then constrains
    from rivulet import LLM, SamplingParams
    from rivulet.sampling_params import StructuredOutputsParams

    llm = LLM(str(model_dir), dtype="float32", max_model_len=256)
    sp = SamplingParams(temperature=0, max_tokens=200, logit_bias={end: 100},
                        structured_outputs=StructuredOutputsParams(json=OK, after_token_ids=[end]))
    out = llm.chat([ASK], sp, use_tqdm=False)[0].outputs[0]
    llm.shutdown()
    assert out.token_ids[0] == end and out.finish_reason == "stop"
    jsonschema.validate(json.loads(out.text.removeprefix("</think>")), OK)
