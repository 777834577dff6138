"""Tool calling's pieces without a server: what each tool_choice makes of a request, and the parsers of
free output (hermes, llama3_json, mistral)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from rivulet.config import RivuletError
from rivulet.entrypoints.openai.tools import parse_tool_calls, plan_tools, streamable_prefix

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"},
                                                "unit": {"enum": ["celsius", "fahrenheit"]}},
                                                "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


def test_plans_follow_tool_choice() -> None:
    assert plan_tools(None, None, False).mode == "none"
    assert plan_tools([WEATHER], "none", False).render is None  # not rendered, as vLLM does by default
    auto = plan_tools([WEATHER], None, True)  # OpenAI's default with tools: auto
    assert auto.mode == "auto" and auto.render == [WEATHER] and auto.structured is None
    named = plan_tools([WEATHER, TIME], {"type": "function", "function": {"name": "get_weather"}}, False)
    assert named.mode == "named" and json.loads(named.structured.json) == WEATHER["function"]["parameters"]
    req = plan_tools([WEATHER, TIME], "required", False)
    schema = json.loads(req.structured.json)
    jsonschema.validate([{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "X"}}],
                        schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_weather", "parameters": {}}], schema)  # city is required
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([], schema)  # at least one call
    content, calls = req.calls('[{"name": "get_weather", "parameters": {"city": "Oslo"}}]', None)
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Oslo"})]
    content, calls = named.calls('{"city":  "Rome"}', None)
    assert content is None and calls[0].name == "get_weather" and json.loads(calls[0].arguments) == {"city": "Rome"}
    assert calls[0].id.startswith("chatcmpl-tool-") and calls[0].as_dict()["type"] == "function"


@pytest.mark.parametrize("tools, choice, auto, words", [
    ([WEATHER], None, False, "--enable-auto-tool-choice"),
    ([WEATHER], "auto", False, "--enable-auto-tool-choice"),
    (None, "required", True, "needs tools"),
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, True, "not in tools"),
    ([WEATHER], "sometimes", True, "tool_choice is"),
    ([{"type": "function", "function": {}}], "required", True, "each tool is"),
])
def test_bad_tool_requests(tools, choice, auto, words) -> None:
    with pytest.raises(RivuletError, match=words):
        plan_tools(tools, choice, auto)


def test_parsers() -> None:
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n' \
           '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    content, calls = parse_tool_calls("hermes", text)
    assert content == "Let me check." and [c.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0].arguments) == {"city": "Paris"} and calls[0].id != calls[1].id
    assert parse_tool_calls("hermes", "Just text.") == ("Just text.", [])
    assert parse_tool_calls("hermes", "<tool_call>{not json</tool_call>")[1] == []  # stays content
    content, calls = parse_tool_calls("llama3_json", '<|python_tag|>{"name": "get_time", "parameters": {"tz": "UTC"}}')
    assert content is None and json.loads(calls[0].arguments) == {"tz": "UTC"}
    content, calls = parse_tool_calls("mistral", '[TOOL_CALLS][{"name": "get_time", "arguments": {}}]')
    assert content is None and calls[0].name == "get_time"
    with pytest.raises(RivuletError, match="unknown tool call parser"):
        parse_tool_calls("pythonic", "x")
    assert streamable_prefix("hermes", "Sure <tool_") == 5 and streamable_prefix("hermes", "Sure, here") == 10
    assert streamable_prefix("hermes", "a <b") == 4 and streamable_prefix("hermes", "ok <tool_call>{") == 3
    assert streamable_prefix("mistral", "[TOOL_CALLS][{") == 0 and streamable_prefix("mistral", "Hi") == 2
    assert streamable_prefix("llama3_json", ' {"name"') == 0 and streamable_prefix("llama3_json", "Hello") == 5
