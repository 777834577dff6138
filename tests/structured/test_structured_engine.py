"""Structured output through the engine: every constrained answer parses and validates (JSON schemas of
many shapes, regex, choice, EBNF), with the real default model and with random weights (the grammar,
not the model, guarantees it); constrained and free requests share a batch without touching each
other; bad grammars are clear errors."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from rivulet import LLM, SamplingParams
from rivulet.config import RivuletError
from rivulet.sampling_params import StructuredOutputsParams as S

SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 12},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False}},
        "required": ["name", "address"], "additionalProperties": False},
    "array-enum-range": {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3},
        "score": {"type": "integer", "minimum": -5, "maximum": 40},
        "ok": {"type": "boolean"}},
        "required": ["tags", "score", "ok"], "additionalProperties": False},
    "optional-fields": {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "note": {"type": "string", "maxLength": 10}, "ratio": {"type": "number"}},
        "required": ["id"], "additionalProperties": False},
    "defs": {"$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0,
                                                                        "maximum": 9},
                                                                  "y": {"type": "integer", "minimum": 0,
                                                                        "maximum": 9}},
                                 "required": ["x", "y"], "additionalProperties": False}},
             "type": "object", "properties": {"a": {"$ref": "#/$defs/point"},
                                             "path": {"type": "array", "items": {"$ref": "#/$defs/point"},
                                                      "maxItems": 2}},
             "required": ["a", "path"], "additionalProperties": False},
}
MSGS = [{"role": "user", "content": "Describe a person as JSON."}]


@pytest.fixture(scope="module")
def llm():
    engine = LLM("default", max_model_len=1024)
    yield engine
    engine.shutdown()


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schemas_always_validate(llm, name):
    schema = SCHEMAS[name]
    # sampled: an unbounded "number" (or free property names) can run on past max_tokens on an unlucky draw,
    # and which draws are unlucky depends on the CPU's bf16 kernels: every answer that ends must validate,
    # and most must end
    sp = SamplingParams(temperature=1.0, seed=4, n=3, max_tokens=300, structured_outputs=S(json=schema))
    outs = llm.chat([MSGS], sp, use_tqdm=False)[0].outputs
    assert sum(c.finish_reason == "stop" for c in outs) >= 2, [c.text for c in outs]
    for c in outs:
        if c.finish_reason == "stop":
            jsonschema.validate(json.loads(c.text), schema)


def test_regex_choice_grammar_and_json_object(llm):
    cases = [(S(regex=r"[A-Z][a-z]{2,6}-\d{3}"), lambda t: re.fullmatch(r"[A-Z][a-z]{2,6}-\d{3}", t)),
             (S(choice=["yes", "no", 'it "depends"']), lambda t: t in ("yes", "no", 'it "depends"')),
             (S(grammar='root ::= "(" num ("," num)* ")"\nnum ::= [1-9] [0-9]?'),
              lambda t: re.fullmatch(r"\([1-9][0-9]?(,[1-9][0-9]?)*\)", t)),
             (S(json_object=True), lambda t: isinstance(json.loads(t), dict))]
    for so, ok in cases:
        outs = llm.chat([MSGS], SamplingParams(temperature=1.0, seed=5, n=4, max_tokens=300, structured_outputs=so),
                        use_tqdm=False)[0].outputs
        if so.json_object:  # any JSON object has no bound: this small model's can run past max_tokens
            assert any(c.finish_reason == "stop" for c in outs), [c.text for c in outs]
            outs = [c for c in outs if c.finish_reason == "stop"]
        for c in outs:
            assert c.finish_reason == "stop" and ok(c.text), (so, c.text)


def test_free_and_constrained_requests_share_a_batch(llm):
    free = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)] * 2
    want = [o.outputs[0].token_ids for o in llm.chat([MSGS, MSGS], free, use_tqdm=False)]
    mixed = [free[0], SamplingParams(temperature=0, max_tokens=100, structured_outputs=S(json=SCHEMAS["nested"])),
             free[1], SamplingParams(temperature=0, max_tokens=20, structured_outputs=S(choice=["alpha", "beta"]),
                                     ignore_eos=True)]
    outs = llm.chat([MSGS] * 4, mixed, use_tqdm=False)
    assert [outs[0].outputs[0].token_ids, outs[2].outputs[0].token_ids] == want
    jsonschema.validate(json.loads(outs[1].outputs[0].text), SCHEMAS["nested"])
    # ignore_eos cannot run a grammar past its end: the answer stops with it
    assert outs[3].outputs[0].text in ("alpha", "beta") and outs[3].outputs[0].finish_reason == "stop"
    assert llm.engine.core.structured.num_waiting == 0


def test_bad_grammars_are_clear_errors(llm):
    for so, words in [(S(json='{"type": "objectx"}'), "invalid JSON schema"), (S(json="{not json"), "invalid JSON schema"),
                      (S(regex="(ab"), "invalid regular expression"), (S(grammar='root ::= "a" |'), "invalid grammar")]:
        with pytest.raises(RivuletError, match=words):
            llm.generate("hi", SamplingParams(structured_outputs=so), use_tqdm=False)
    for bad, words in [(dict(), "exactly one"), (dict(regex="a", choice=["a"]), "exactly one"),
                       (dict(choice=[]), "choice must be"), (dict(choice=[1]), "choice must be")]:
        with pytest.raises(RivuletError, match=words):
            SamplingParams(structured_outputs=bad)
    with pytest.raises(RivuletError, match="unknown key"):
        SamplingParams(structured_outputs={"jsn": {}})


def test_random_weights_still_follow_the_grammar():
    """A random-weight model of the default model's shape (its real tokenizer): the output is noise, but
    noise that fits the schema; with n-gram drafts on, constrained requests simply go without them."""
    llm = LLM("default", load_format="dummy", max_model_len=512,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3})
    schema = SCHEMAS["array-enum-range"]
    sp = SamplingParams(temperature=1.0, seed=11, n=4, max_tokens=400, structured_outputs=S(json=schema))
    for c in llm.generate(["{", "Hello"], sp, use_tqdm=False)[0].outputs:
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), schema)
    llm.shutdown()


def test_a_grammar_can_start_after_given_tokens(llm):
    """`after_token_ids` (the server's --reasoning-parser sets it to "</think>"): free decoding up to and
    including those tokens, the grammar after them."""
    free = llm.chat([MSGS], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0].outputs[0].token_ids
    marker = free[4:6]
    k = next(i for i in range(len(free)) if free[i - 1:i + 1] == marker) + 1
    so = S(choice=["alpha", "beta"], after_token_ids=marker)
    got = llm.chat([MSGS], SamplingParams(temperature=0, max_tokens=40, structured_outputs=so),
                   use_tqdm=False)[0].outputs[0]
    assert list(got.token_ids[:k]) == list(free[:k])
    tail = llm.get_tokenizer().decode(got.token_ids[k:], skip_special_tokens=True)
    assert tail in ("alpha", "beta") and got.finish_reason == "stop"
