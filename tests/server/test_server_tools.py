"""Tool calling through a served model (the default model with a Qwen-style tools template given by
--chat-template, hermes parser): a named function and "required" are grammars, so the arguments always
parse and follow the schema; "auto" parses <tool_call> blocks (forced here with guided_choice, as the
small model seldom calls tools on its own); streaming sends OpenAI's tool_call deltas; follow-up turns
with tool results render."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import jsonschema
import openai
import pytest

from helpers.tiny import QWEN3_TEMPLATE
from server_helpers import ServerProcess, assert_error_body

TEMPLATE = QWEN3_TEMPLATE  # Qwen3's tool format, given to the default model by --chat-template

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                   "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                       "required": ["zone"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def tool_server(tmp_path_factory) -> Iterator[ServerProcess]:
    template = tmp_path_factory.mktemp("tpl") / "tools.jinja"
    template.write_text(TEMPLATE)
    proc = ServerProcess("--max-model-len", "1024", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                         "--chat-template", str(template))
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def tc(tool_server: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=tool_server.base_url, api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def _args_valid(call, tool) -> dict:
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, tool["function"]["parameters"])
    return args


def test_named_function_and_required(tc: openai.OpenAI) -> None:
    named = tc.chat.completions.create(model="default", messages=ASK, tools=[WEATHER, TIME], temperature=0.9, seed=3,
                                       n=2, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    for choice in named.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        [call] = choice.message.tool_calls
        assert call.type == "function" and call.function.name == "get_weather" and call.id
        _args_valid(call, WEATHER)
    req = tc.chat.completions.create(model="default", messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                     temperature=0.9, seed=4, max_tokens=300)
    calls = req.choices[0].message.tool_calls
    assert req.choices[0].finish_reason == "tool_calls" and calls
    for call in calls:
        _args_valid(call, {"get_weather": WEATHER, "get_time": TIME}[call.function.name])


def test_streamed_tool_calls_reassemble(tc: openai.OpenAI) -> None:
    for choice in ({"type": "function", "function": {"name": "get_weather"}}, "required"):
        full = tc.chat.completions.create(model="default", messages=ASK, tools=[WEATHER, TIME], tool_choice=choice,
                                          temperature=0, max_tokens=300)
        calls: dict[int, dict] = {}
        finish = None
        for chunk in tc.chat.completions.create(model="default", messages=ASK, tools=[WEATHER, TIME],
                                                tool_choice=choice, temperature=0, max_tokens=300, stream=True):
            delta = chunk.choices[0].delta
            assert not delta.content
            for d in delta.tool_calls or []:
                c = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                c["id"] = c["id"] or d.id
                c["name"] += d.function.name or "" if d.function else ""
                c["arguments"] += (d.function.arguments or "") if d.function else ""
            finish = chunk.choices[0].finish_reason or finish
        want = full.choices[0].message.tool_calls
        assert finish == "tool_calls" and [c["id"] is not None for c in calls.values()] == [True] * len(want)
        assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == \
            [(w.function.name, json.loads(w.function.arguments)) for w in want]


def test_auto_parses_tool_calls_and_leaves_text(tc: openai.OpenAI, tool_server: ServerProcess) -> None:
    said = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
    for stream in (False, True):
        kw = dict(model="default", messages=ASK, tools=[WEATHER, TIME], max_tokens=60,
                  extra_body={"guided_choice": [said]})
        if not stream:
            out = tc.chat.completions.create(**kw)
            msg = out.choices[0].message
            assert out.choices[0].finish_reason == "tool_calls" and msg.content is None
            assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == \
                [("get_time", {"zone": "CET"})]
            continue
        chunks = list(tc.chat.completions.create(**kw, stream=True))
        deltas = [d for ch in chunks for d in (ch.choices[0].delta.tool_calls or [])]
        assert [d.function.name for d in deltas if d.function and d.function.name] == ["get_time"]
        assert json.loads("".join(d.function.arguments or "" for d in deltas)) == {"zone": "CET"}
        assert not "".join(ch.choices[0].delta.content or "" for ch in chunks)
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
    plain = tc.chat.completions.create(model="default", messages=ASK, tools=[WEATHER], max_tokens=12, temperature=0,
                                       extra_body={"guided_choice": ["It is sunny."]})
    assert plain.choices[0].message.content == "It is sunny." and plain.choices[0].message.tool_calls is None
    assert plain.choices[0].finish_reason == "stop"


def test_follow_up_turn_with_a_tool_result(tc: openai.OpenAI, tool_server: ServerProcess) -> None:
    first = tc.chat.completions.create(model="default", messages=ASK, tools=[WEATHER], temperature=0,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = first.choices[0].message.tool_calls[0]
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                     {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"}]
    with httpx.Client(base_url=tool_server.url, timeout=60) as http:
        r = http.post("/tokenize", json={"messages": history, "tools": [WEATHER]})
        assert r.status_code == 200, r.text
        text = http.post("/detokenize", json={"tokens": r.json()["tokens"]}).json()["prompt"]
    assert "<tool_response>\n18 degrees and sunny\n</tool_response>" in text
    assert f'"arguments": {json.dumps(json.loads(call.function.arguments))}' in text  # a dict, not a string
    assert '"name": "get_weather"' in text.split("<tools>")[1]  # the tools rendered too
    reply = tc.chat.completions.create(model="default", messages=history, tools=[WEATHER], tool_choice="none",
                                       max_tokens=16, temperature=0)
    assert reply.choices[0].message.content and reply.choices[0].message.tool_calls is None


def test_tool_errors(tool_server: ServerProcess, http: httpx.Client) -> None:
    with httpx.Client(base_url=tool_server.url, timeout=60) as h:
        for body, words in [({"tool_choice": "required"}, "needs tools"),
                            ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
                             "not in tools"),
                            ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
                             "tool_choice")]:
            err = assert_error_body(h.post("/v1/chat/completions", json={"messages": ASK, **body}), 400)
            assert words in err["message"], (body, err)
    # the shared server runs without a tool call parser: auto is refused, never silently plain text
    err = assert_error_body(http.post("/v1/chat/completions", json={"messages": ASK, "tools": [WEATHER]}), 400)
    assert "--enable-auto-tool-choice" in err["message"]


def test_langchain_structured_output_and_tools(tool_server: ServerProcess) -> None:
    """LangChain's ChatOpenAI against the server: with_structured_output (a json_schema response_format)
    and bind_tools with a named tool_choice."""
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class Weather(BaseModel):
        """The weather in a city."""

        city: str = Field(max_length=20)
        unit: str = Field(pattern="^(celsius|fahrenheit)$")

    llm = ChatOpenAI(base_url=tool_server.base_url, api_key="unused", model="default", temperature=0, max_tokens=120,
                     max_retries=0)
    got = llm.with_structured_output(Weather, method="json_schema").invoke("The weather in Paris, as JSON.")
    assert isinstance(got, Weather) and got.unit in ("celsius", "fahrenheit")
    msg = llm.bind_tools([WEATHER], tool_choice="get_weather").invoke("What is the weather in Paris?")
    [call] = msg.tool_calls
    assert call["name"] == "get_weather" and call["id"]
    jsonschema.validate(call["args"], WEATHER["function"]["parameters"])
