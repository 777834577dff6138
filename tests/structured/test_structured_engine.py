"""Structured output through the engine: every constrained answer parses and validates (JSON schemas of
many shapes, regex, choice, EBNF), with the real default model and with random weights (the grammar,
not the model, guarantees it); constrained and free requests share a batch without touching each
other; bad grammars are clear errors."""

from __future__ import annotations

import json
import re
import time
from types import SimpleNamespace

import jsonschema
import pytest
import torch

from rivulet import LLM, SamplingParams
from rivulet.config import RivuletError
from rivulet.core.outputs import SchedulerOutput
from rivulet.structured.manager import RequestGrammar
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
    noise that fits the schema, also with n-gram drafts verified under the grammar."""
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


def _record_overlap(llm: LLM):
    """Slow the forward pass and the mask fill down (50 ms each) and record when each ran."""
    core = llm.engine.core
    runner, structured = core.executor.runner, core.structured
    forwards, fills = [], []
    run_model, bitmask = runner._run_model, structured.bitmask

    def timed(fn, into):
        def wrapper(*args):
            t0 = time.monotonic()
            time.sleep(0.05)
            out = fn(*args)
            into.append((t0, time.monotonic()))
            return out
        return wrapper

    runner._run_model, structured.bitmask = timed(run_model, forwards), timed(bitmask, fills)

    def restore():
        del runner._run_model, structured.bitmask
    return forwards, fills, restore


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_the_mask_is_filled_while_the_forward_runs(async_scheduling):
    """Each step's grammar bitmask is filled during its forward pass (asynchronously: once the step
    before has moved the matchers), not before it; the tokens are the same as filled before it."""
    llm = LLM("default", dtype="float32", max_model_len=256, async_scheduling=async_scheduling)
    core = llm.engine.core
    assert core.async_scheduling == async_scheduling
    # synchronous on CPU the mask is filled before the forward by default (a fill beside the forward's thread
    # team measured slower on 2 cores); the overlap is what CUDA does
    assert not core.overlap_grammar
    sp = [SamplingParams(temperature=0, max_tokens=80, structured_outputs=S(json=SCHEMAS["array-enum-range"])),
          SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)]
    plain = [o.outputs[0].token_ids for o in llm.chat([MSGS, MSGS], sp, use_tqdm=False)]
    core.overlap_grammar = True
    forwards, fills, restore = _record_overlap(llm)
    try:
        outs = llm.chat([MSGS, MSGS], sp, use_tqdm=False)
    finally:
        restore()
    assert [o.outputs[0].token_ids for o in outs] == plain
    jsonschema.validate(json.loads(outs[0].outputs[0].text), SCHEMAS["array-enum-range"])
    assert len(fills) >= 5
    for a, b in fills:  # each fill overlaps a forward pass (sequential: a fill ends before its forward starts)
        assert any(a < d and c < b for c, d in forwards), (a, b, forwards)
    llm.shutdown()


def test_draft_rows_are_masked_after_the_drafts(llm):
    """A request's draft rows hold the masks after its drafts; after a draft the grammar refuses, the rows
    are all ones (never reached); the matcher is left as it was."""
    import xgrammar as xgr

    structured = llm.engine.core.structured
    compiled = structured._compile(S(choice=["hello world", "help me"]))
    tok = llm.get_tokenizer()
    good = tok.encode("hello world", add_special_tokens=False)
    assert len(good) >= 2
    words = (structured.vocab_size + 31) // 32

    def expected(prefix):
        m = xgr.GrammarMatcher(compiled)
        for t in prefix:
            assert m.accept_token(t)
        mask = xgr.allocate_token_bitmask(1, structured.vocab_size)
        m.fill_next_token_bitmask(mask, 0)
        return mask[0].tolist()

    bad = tok.encode(" me", add_special_tokens=False)[:1]
    for drafts, valid in [(good, len(good)), (good[:1] + bad, 1)]:
        matcher = xgr.GrammarMatcher(compiled)
        reqs = {"r": SimpleNamespace(grammar=RequestGrammar(matcher, None)), "free": SimpleNamespace(grammar=None)}
        out = SchedulerOutput(num_scheduled_tokens={"free": 1, "r": 1 + len(drafts)},
                              sampling_request_ids={"free", "r"}, scheduled_spec_tokens={"r": list(drafts)})
        rows = torch.frombuffer(bytearray(structured.bitmask(out, reqs)), dtype=torch.int32).view(-1, words)
        assert rows.shape[0] == 2 + len(drafts)
        assert (rows[0] == -1).all()  # the free request
        for i in range(1 + len(drafts)):
            want = expected(drafts[:i]) if i <= valid else [-1] * words
            assert rows[1 + i].tolist() == want, i
        after = xgr.allocate_token_bitmask(1, structured.vocab_size)
        matcher.fill_next_token_bitmask(after, 0)
        assert after[0].tolist() == expected([])  # rolled back


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_drafts_are_verified_under_the_grammar(async_scheduling):
    """n-gram drafts for constrained requests: greedy tokens equal decoding without drafts (float32), some
    drafts are accepted, and sampled answers still validate. With async scheduling asked for (the default on
    GPUs), draft steps run one at a time and still get their grammar masks (they once waited for one forever)."""
    schema = SCHEMAS["array-enum-range"]
    example = '{"tags": ["red", "green"], "score": 7, "ok": true}'
    msgs = [{"role": "user", "content": f"Copy this JSON exactly: {example}"}]
    greedy = SamplingParams(temperature=0, max_tokens=60, structured_outputs=S(json=schema))
    plain = LLM("default", dtype="float32", max_model_len=512)
    want = plain.chat([msgs], greedy, use_tqdm=False)[0].outputs[0].token_ids
    plain.shutdown()
    llm = LLM("default", dtype="float32", max_model_len=512, async_scheduling=async_scheduling,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3})
    assert llm.engine.core.async_scheduling == async_scheduling
    got = llm.chat([msgs], greedy, use_tqdm=False)[0].outputs[0]
    assert got.token_ids == want
    jsonschema.validate(json.loads(got.text), schema)
    stats = llm.engine.core.spec_stats
    assert stats.num_accepted_tokens > 0, stats
    sampled = SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=80, structured_outputs=S(json=schema))
    for c in llm.chat([msgs], sampled, use_tqdm=False)[0].outputs:
        jsonschema.validate(json.loads(c.text), schema)
    llm.shutdown()


def test_a_grammar_at_its_end_stops_the_output_before_min_tokens(llm):
    """min_tokens holds EOS back, a regex at its longest allows nothing else: the grammar wins (the sampler
    once masked every token, sampled one outside the grammar and went on)."""
    for temperature in (0.0, 0.8):
        sp = SamplingParams(temperature=temperature, seed=2, max_tokens=20, min_tokens=12,
                            structured_outputs=S(regex="[a-z]{1,3}"))
        out = llm.generate("Say a short word:", sp, use_tqdm=False)[0].outputs[0]
        assert re.fullmatch("[a-z]{1,3}", out.text), out.text
        assert out.finish_reason == "stop" and len(out.token_ids) < 12
