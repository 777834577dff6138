"""Structured output through the served API: the openai SDK's `parse` with a pydantic model, JSON
schemas streamed and not, vLLM's structured_outputs and guided_* fields over raw HTTP, and 400s for bad
grammars (before any response is sent, streaming or not)."""

from __future__ import annotations

import json
import re
from typing import Literal

import httpx
import jsonschema
import openai
import pydantic

from server_helpers import assert_error_body, sse_events

ASK = [{"role": "user", "content": "Give me a city as JSON."}]


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=20)
    country: Literal["France", "Spain", "Italy"]
    population_millions: int = pydantic.Field(ge=0, le=40)
    rivers: list[str] = pydantic.Field(max_length=2)


def test_sdk_parse_with_a_pydantic_model(client: openai.OpenAI) -> None:
    done = client.chat.completions.parse(model="smol", messages=ASK, response_format=City, temperature=0.8,
                                         seed=2, n=2, max_tokens=200)
    for choice in done.choices:
        assert choice.finish_reason == "stop"
        city = choice.message.parsed
        assert isinstance(city, City) and city.country in ("France", "Spain", "Italy")


def test_json_schema_streamed_and_not(client: openai.OpenAI) -> None:
    schema = City.model_json_schema()
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": schema, "strict": True}}
    full = client.chat.completions.create(model="smol", messages=ASK, response_format=fmt, temperature=0,
                                          max_tokens=200)
    jsonschema.validate(json.loads(full.choices[0].message.content), schema)
    chunks = client.chat.completions.create(model="smol", messages=ASK, response_format=fmt, temperature=0,
                                            max_tokens=200, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full.choices[0].message.content
    short = [{"role": "user", "content": 'Return {"status": "done"} as JSON.'}]  # an object that ends soon
    obj = client.chat.completions.create(model="smol", messages=short, response_format={"type": "json_object"},
                                         temperature=0, max_tokens=200)
    assert isinstance(json.loads(obj.choices[0].message.content), dict)


def test_vllm_fields_over_http(http: httpx.Client) -> None:
    cases = [({"structured_outputs": {"choice": ["north", "south"]}}, lambda t: t in ("north", "south")),
             ({"guided_choice": ["red", "blue"]}, lambda t: t in ("red", "blue")),
             ({"guided_regex": r"[0-9]{2}:[0-9]{2}"}, lambda t: re.fullmatch(r"[0-9]{2}:[0-9]{2}", t)),
             ({"structured_outputs": {"grammar": 'root ::= "x" [a-c] [a-c]? [a-c]?'}},
              lambda t: re.fullmatch("x[a-c]{1,3}", t)),
             ({"guided_json": {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
                               "additionalProperties": False}},
              lambda t: isinstance(json.loads(t)["n"], int))]
    for fields, ok in cases:
        r = http.post("/v1/completions", json={"prompt": "The answer:", "max_tokens": 40, "temperature": 0.9,
                                               "seed": 1, "n": 2, **fields})
        assert r.status_code == 200, r.text
        for c in r.json()["choices"]:
            assert c["finish_reason"] == "stop" and ok(c["text"]), (fields, c)


def test_bad_grammars_get_400_before_any_stream(http: httpx.Client) -> None:
    for fields, words in [({"guided_json": {"type": "objectx"}}, "invalid JSON schema"),
                          ({"structured_outputs": {"regex": "(ab"}}, "invalid regular expression"),
                          ({"response_format": {"type": "json_schema"}}, "json_schema"),
                          ({"structured_outputs": {"jsn": {}}}, "unknown key"),
                          ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "not both"),
                          ({"guided_choice": []}, "choice must be")]:
        for stream in (False, True):
            r = http.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 5, "stream": stream, **fields})
            err = assert_error_body(r, 400)
            assert words in err["message"], (fields, err)
    r = http.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 3, "stream": True,
                                                "structured_outputs": {"choice": ["ok"]}})
    assert r.status_code == 200 and sse_events(r.text.splitlines())[-1] == "[DONE]"  # and still serving
