"""The OpenAI API of a real ``rivulet serve``, driven with the official ``openai`` SDK (and raw httpx
where the SDK would not send the request)."""

from __future__ import annotations

import math

import httpx
import openai
import pytest

from server_helpers import ServerProcess, assert_error_body, sse_events

PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name three rivers in Europe."}]


def tokenize(http: httpx.Client, text: str, add_special_tokens: bool = True) -> list[int]:
    r = http.post("/tokenize", json={"prompt": text, "add_special_tokens": add_special_tokens})
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def test_models_version_health(client: openai.OpenAI, http: httpx.Client) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == ["smol"]
    assert client.models.retrieve("smol").max_model_len == 512  # type: ignore[attr-defined]
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")
    assert http.get("/version").json()["version"]
    assert http.get("/health").status_code == 200


def test_chat_stream_joined_equals_non_stream(client: openai.OpenAI) -> None:
    full = client.chat.completions.create(model="smol", messages=CHAT, temperature=0, max_tokens=24)
    choice = full.choices[0]
    assert full.id.startswith("chatcmpl-") and full.object == "chat.completion" and full.model == "smol"
    assert choice.message.role == "assistant" and choice.message.refusal is None and choice.message.content
    u = full.usage
    assert u.completion_tokens <= 24 and u.total_tokens == u.prompt_tokens + u.completion_tokens

    chunks = list(client.chat.completions.create(model="smol", messages=CHAT, temperature=0, max_tokens=24,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [choice.finish_reason]
    su = chunks[-1].usage
    assert chunks[-1].choices == [] and su.model_dump(exclude={"prompt_tokens_details"}) == \
        u.model_dump(exclude={"prompt_tokens_details"})
    # the streamed request came second: its whole-block prefix was cached by the first
    assert su.prompt_tokens_details.cached_tokens == (u.prompt_tokens - 1) // 16 * 16
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_stream_joined_equals_non_stream_with_n(client: openai.OpenAI) -> None:
    full = client.completions.create(model="smol", prompt=PROMPT, temperature=0, max_tokens=12, n=2)
    assert full.id.startswith("cmpl-") and full.object == "text_completion"
    assert [c.index for c in full.choices] == [0, 1]
    assert full.choices[0].text == full.choices[1].text  # greedy: both samples agree
    assert full.choices[0].text.startswith(" Paris")
    chunks = list(client.completions.create(model="smol", prompt=PROMPT, temperature=0, max_tokens=12, n=2,
                                            stream=True))
    for i in range(2):
        mine = [c.choices[0] for c in chunks if c.choices[0].index == i]
        assert "".join(c.text for c in mine) == full.choices[i].text
        assert [c.finish_reason for c in mine if c.finish_reason] == [full.choices[i].finish_reason]
    assert {c.choices[0].index for c in chunks} == {0, 1}


def test_max_tokens_gives_length_and_usage(client: openai.OpenAI) -> None:
    out = client.completions.create(model="smol", prompt=PROMPT, max_tokens=5, temperature=0.8, n=3, seed=7,
                                    extra_body={"ignore_eos": True})
    assert [c.finish_reason for c in out.choices] == ["length"] * 3
    assert out.usage.completion_tokens == 15 and out.usage.prompt_tokens == 5
    assert out.usage.total_tokens == 20
    chat = client.chat.completions.create(model="smol", messages=CHAT, max_completion_tokens=5,
                                          extra_body={"ignore_eos": True})
    assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 5
    assert chat.usage.total_tokens == chat.usage.prompt_tokens + 5


def test_cached_tokens_in_usage_and_cache_salt(client: openai.OpenAI, http: httpx.Client) -> None:
    doc = "Salted document: " + " ".join(f"line {i} of the shared manual." for i in range(12))  # > 5 blocks

    def cached(**extra: object) -> int:
        out = client.completions.create(model="smol", prompt=doc, max_tokens=1, extra_body=extra)
        return out.usage.prompt_tokens_details.cached_tokens

    assert cached(cache_salt="a") == 0
    hit = cached(cache_salt="a")
    assert hit >= 64 and hit % 16 == 0  # whole blocks of the same tenant's prompt
    assert cached(cache_salt="b") == 0 and cached() == 0  # another tenant, or none, sees nothing of it
    chat = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": doc}], max_tokens=1,
                                          extra_body={"cache_salt": "a"})
    again = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": doc}], max_tokens=1,
                                           extra_body={"cache_salt": "a"})
    assert chat.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens >= 64
    r = http.post("/v1/completions", json={"model": "smol", "prompt": doc, "max_tokens": 1, "cache_salt": ""})
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"


def test_completion_logprobs(client: openai.OpenAI) -> None:
    out = client.completions.create(model="smol", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2)
    c = out.choices[0]
    lp = c.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert "".join(lp.tokens) == c.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert value <= 0 and token in top and 2 <= len(top) <= 3
        assert max(top.values()) == pytest.approx(value, abs=1e-4)  # greedy: the chosen token is the best


def test_echo_scores_the_prompt_like_generation(client: openai.OpenAI, http: httpx.Client) -> None:
    """lm-eval's loglikelihood: echo + logprobs (+ max_tokens=0) scores prompt tokens, the first with null."""
    ids = tokenize(http, PROMPT)
    gen = client.completions.create(model="smol", prompt=ids, max_tokens=1, temperature=0, logprobs=1)
    next_id_logprob = gen.choices[0].logprobs.token_logprobs[0]
    next_ids = tokenize(http, gen.choices[0].text, add_special_tokens=False)
    assert len(next_ids) == 1

    scored = client.completions.create(model="smol", prompt=ids + next_ids, max_tokens=0, echo=True, logprobs=1)
    c = scored.choices[0]
    assert c.text == PROMPT + gen.choices[0].text and c.finish_reason == "length"
    assert scored.usage.completion_tokens == 0 and scored.usage.prompt_tokens == len(ids) + 1
    assert c.logprobs.token_logprobs[0] is None and c.logprobs.top_logprobs[0] is None
    assert len(c.logprobs.tokens) == len(ids) + 1
    assert all(v is not None and v <= 0 for v in c.logprobs.token_logprobs[1:])
    assert c.logprobs.token_logprobs[-1] == pytest.approx(next_id_logprob, abs=2e-3)

    echoed = client.completions.create(model="smol", prompt=PROMPT, max_tokens=3, echo=True, logprobs=0,
                                       temperature=0)
    e = echoed.choices[0]
    assert e.text.startswith(PROMPT) and len(e.logprobs.tokens) == len(ids) + 3
    assert e.logprobs.token_logprobs[0] is None and echoed.usage.completion_tokens == 3


def test_chat_logprobs(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(model="smol", messages=CHAT, max_tokens=5, temperature=0, logprobs=True,
                                         top_logprobs=2)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens == 5
    assert "".join(t.token for t in content) == out.choices[0].message.content
    for t in content:
        assert t.logprob <= 0 and bytes(t.bytes).decode("utf-8", "replace") == t.token
        assert len(t.top_logprobs) == 2 and t.top_logprobs[0].token == t.token  # greedy
    stream = list(client.chat.completions.create(model="smol", messages=CHAT, max_tokens=5, temperature=0,
                                                 logprobs=True, stream=True))
    streamed = [t for c in stream if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in content]


def test_token_ids_and_batched_prompts(client: openai.OpenAI, http: httpx.Client) -> None:
    ids = tokenize(http, PROMPT)
    by_text = client.completions.create(model="smol", prompt=PROMPT, max_tokens=6, temperature=0)
    by_ids = client.completions.create(model="smol", prompt=ids, max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    batch = client.completions.create(model="smol", prompt=[PROMPT, "def add(a, b):"], max_tokens=4, temperature=0,
                                      n=2, extra_body={"ignore_eos": True})
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert batch.choices[0].text == by_text.choices[0].text[:len(batch.choices[0].text)]
    assert batch.usage.completion_tokens == 16 and batch.choices[2].text == batch.choices[3].text
    batch_ids = client.completions.create(model="smol", prompt=[ids, ids[:3]], max_tokens=3, temperature=0)
    assert [c.index for c in batch_ids.choices] == [0, 1]
    assert batch_ids.usage.prompt_tokens == len(ids) + 3


def test_sampling_fields_are_honoured(client: openai.OpenAI, http: httpx.Client) -> None:
    def complete(**kw):
        kw.setdefault("max_tokens", 8)
        return client.completions.create(model="smol", prompt=PROMPT, **kw).choices[0]

    a, b = complete(temperature=1.0, seed=123), complete(temperature=1.0, seed=123)
    assert a.text == b.text
    assert complete(temperature=0).text == complete(temperature=1.0, extra_body={"top_k": 1}).text
    full = complete(temperature=0, max_tokens=20, extra_body={"ignore_eos": True}).text
    stop = full[10:14]
    stopped = complete(temperature=0, stop=["@@nothing", stop], max_tokens=20, extra_body={"ignore_eos": True})
    assert stopped.text == full[:full.index(stop)] and stopped.finish_reason == "stop"
    assert stopped.stop_reason == stop  # type: ignore[attr-defined]
    ids = tokenize(http, " river", add_special_tokens=False)
    biased = client.completions.create(model="smol", prompt=PROMPT, max_tokens=4, temperature=0,
                                       logit_bias={str(ids[0]): 100})
    assert biased.choices[0].text == " river" * 4
    parts = client.chat.completions.create(
        model="smol", max_tokens=6, temperature=0,
        messages=[{"role": "user", "content": [{"type": "text", "text": "Name three rivers in Europe."}]}])
    plain = client.chat.completions.create(model="smol", max_tokens=6, temperature=0, messages=CHAT)
    assert parts.choices[0].message.content == plain.choices[0].message.content


def test_penalties_min_p_and_min_tokens_change_the_output(client: openai.OpenAI) -> None:
    """Each field changes greedy output the way it should; a field the server ignored would leave it as is."""
    loop = "the cat and the dog and the cat and the dog and the cat and the dog and the"

    def run(prompt: str = loop, temperature: float = 0.0, **kw):
        extra = {"ignore_eos": True, **kw.pop("extra_body", {})}
        return client.completions.create(model="smol", prompt=prompt, max_tokens=24, temperature=temperature,
                                         logprobs=0, extra_body=extra, **kw).choices[0]

    def repeats(choice) -> int:  # generated tokens that are a repeat of an earlier one
        return len(choice.logprobs.tokens) - len(set(choice.logprobs.tokens))

    base = run()
    for kw in ({"presence_penalty": 2.0}, {"frequency_penalty": 2.0}, {"extra_body": {"repetition_penalty": 1.8}}):
        penalised = run(**kw)
        assert penalised.text != base.text and repeats(penalised) < repeats(base), (kw, base.text, penalised.text)

    # min_p near 1 keeps only the most likely token: sampling at a high temperature becomes greedy
    greedy = run(PROMPT)
    hot = dict(temperature=1.5, seed=7)
    assert run(PROMPT, **hot).text != greedy.text
    assert run(PROMPT, **hot, extra_body={"min_p": 0.999}).text == greedy.text

    # min_tokens holds back an end of sequence that comes early without it
    ask = [{"role": "user", "content": "Answer with one word: what colour is the sky on a clear day?"}]
    short = client.chat.completions.create(model="smol", messages=ask, max_tokens=64, temperature=0)
    n = short.usage.completion_tokens
    assert short.choices[0].finish_reason == "stop" and n < 48
    held = client.chat.completions.create(model="smol", messages=ask, max_tokens=64, temperature=0,
                                          extra_body={"min_tokens": n + 8})
    assert held.usage.completion_tokens >= n + 8
    assert held.choices[0].message.content.startswith(short.choices[0].message.content)


def test_unknown_fields_are_ignored(http: httpx.Client) -> None:
    r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "nonsense": {"a": 1}, "user": "u"})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    r = http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2, "tools": [],
                                                "frobnicate": True})
    assert r.status_code == 200


def test_truncate_prompt_tokens_and_a_request_chat_template(http: httpx.Client) -> None:
    """vLLM's `truncate_prompt_tokens` keeps a prompt's last N tokens (it was ignored: a prompt over the context
    was refused); a chat request's own `chat_template` renders its prompt (it was ignored)."""
    long = " ".join(["river"] * 700)  # over the 512-token context
    r = http.post("/v1/completions", json={"prompt": long, "max_tokens": 2, "truncate_prompt_tokens": 100})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 100
    assert http.post("/v1/completions", json={"prompt": long, "max_tokens": 2}).status_code == 400
    r = http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2, "truncate_prompt_tokens": -1})
    assert r.status_code == 200, r.text
    bare = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    r = http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2, "chat_template": bare})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len(tokenize(http, CHAT[0]["content"], add_special_tokens=False))
    t = http.post("/tokenize", json={"messages": CHAT, "chat_template": bare}).json()
    assert t["tokens"] == tokenize(http, CHAT[0]["content"], add_special_tokens=False)
    err = assert_error_body(http.post("/v1/chat/completions", json={"messages": CHAT, "chat_template": "{{ bad"}), 400)
    assert "chat template" in err["message"]
    err = assert_error_body(http.post("/v1/completions", json={"prompt": PROMPT, "truncate_prompt_tokens": 0}), 400)
    assert "truncate_prompt_tokens" in err["message"]


def test_tokenize_detokenize(http: httpx.Client, client: openai.OpenAI) -> None:
    t = http.post("/tokenize", json={"prompt": PROMPT, "return_token_strs": True}).json()
    assert t["count"] == len(t["tokens"]) == len(t["token_strs"]) and t["max_model_len"] == 512
    assert http.post("/detokenize", json={"tokens": t["tokens"]}).json()["prompt"] == PROMPT
    chat = http.post("/tokenize", json={"messages": CHAT}).json()
    usage = client.chat.completions.create(model="smol", messages=CHAT, max_tokens=1).usage
    assert chat["count"] == usage.prompt_tokens
    assert_error_body(http.post("/detokenize", json={"tokens": [10**9]}), 400)
    assert_error_body(http.post("/tokenize", json={}), 400)


ERROR_CASES = [
    # (path, body or raw bytes, status, fragment of the message)
    ("/v1/completions", b"[1, 2, 3]", 400, "valid dictionary or object"),
    ("/v1/completions", b'"just a string"', 400, "valid dictionary or object"),
    ("/v1/completions", b"{not json", 400, "not valid JSON"),
    ("/v1/completions", {"max_tokens": 3}, 400, "prompt: Field required"),
    ("/v1/completions", {"prompt": PROMPT, "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": PROMPT, "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": PROMPT, "n": 0}, 400, "n: Input should be greater than or equal to 1"),
    ("/v1/completions", {"prompt": PROMPT, "logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "word " * 600}, 400, "maximum context length"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 10**6}, 400, "maximum context length"),
    ("/v1/completions", {"prompt": [1, 2, 10**7]}, 400, "outside the vocabulary"),
    ("/v1/completions", {"prompt": [[1, 2], [-5]]}, 400, "outside the vocabulary"),
    ("/v1/completions", {"prompt": []}, 400, "empty"),
    ("/v1/completions", {"prompt": PROMPT, "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": PROMPT, "logit_bias": {"999999999": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": PROMPT, "logit_bias": {"5": 1000}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": PROMPT, "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("/v1/completions", {"prompt": PROMPT, "stop": [""]}, 400, "stop"),
    ("/v1/completions", {"prompt": PROMPT, "seed": 2**70}, 400, "seed"),
    ("/v1/completions", {"prompt": PROMPT, "min_tokens": 50, "max_tokens": 5}, 400, "min_tokens"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", b'{"prompt": "\\ud800 lone surrogate"}', 400, "Unicode"),
    ("/v1/completions", b'{"prompt": "ok", "stop": ["\\udfff"]}', 400, "Unicode"),
    ("/v1/completions", b'{"prompt": "ok", "temperature": NaN}', 400, "temperature"),
    ("/v1/completions", b'{"prompt": "ok", "top_p": Infinity}', 400, "top_p"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, 400, "logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "stream_options": {"include_usage": True}}, 400, "stream"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url",
                                                                        "image_url": {"url": "x"}}]}]}, 400, "text"),
    ("/v1/chat/completions", {"messages": [{"content": "no role"}]}, 400, "role"),
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 10**6}, 400, "maximum context length"),
    ("/v1/chat/completions", {"messages": CHAT, "model": "gpt-4"}, 404, "gpt-4"),
    ("/v1/completions", {"prompt": PROMPT, "model": "gpt-4"}, 404, "does not exist"),
]


@pytest.mark.parametrize("path,body,status,fragment", ERROR_CASES)
def test_invalid_requests_get_openai_errors(http: httpx.Client, path: str, body: object, status: int,
                                            fragment: str) -> None:
    if isinstance(body, bytes):
        r = http.post(path, content=body, headers={"content-type": "application/json"})
    else:
        r = http.post(path, json=body)
    err = assert_error_body(r, status)
    assert fragment in err["message"], err
    if "maximum context length" in fragment:
        assert err["code"] == "context_length_exceeded"


def test_errors_through_the_sdk_and_server_keeps_serving(client: openai.OpenAI, http: httpx.Client) -> None:
    def greedy() -> str:
        return client.chat.completions.create(model="smol", messages=CHAT, max_tokens=6,
                                              temperature=0).choices[0].message.content

    before = greedy()
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="smol", prompt="word " * 600)
    assert "maximum context length" in e.value.message
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="smol", messages=CHAT, temperature=-3)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="smol", messages=CHAT, stream=True, logit_bias={"-4": 3})
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="other", messages=CHAT)
    assert_error_body(http.get("/v1/nothing-here"), 404)
    assert_error_body(http.get("/v1/completions"), 405)
    assert before and greedy() == before  # the same answer after the refusals: nothing of them stayed behind


def test_metrics_count_requests(server: ServerProcess, client: openai.OpenAI) -> None:
    before = server.metrics()
    client.completions.create(model="smol", prompt=PROMPT, max_tokens=4, n=2, extra_body={"ignore_eos": True})
    after = server.metrics()
    key = 'rivulet:request_success_total{finished_reason="length",model_name="smol"}'
    assert after[key] - before.get(key, 0) == 2
    assert after["rivulet:generation_tokens_total"] - before.get("rivulet:generation_tokens_total", 0) == 8
    assert after["rivulet:prompt_tokens_total"] - before.get("rivulet:prompt_tokens_total", 0) == 5
    for name in ("time_to_first_token_seconds", "time_per_output_token_seconds", "inter_token_latency_seconds",
                 "e2e_request_latency_seconds", "request_queue_time_seconds"):
        assert after[f"rivulet:{name}_count"] > before.get(f"rivulet:{name}_count", 0), name
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_hit_rate"):
        assert f"rivulet:{gauge}" in after
    assert after["rivulet:prefix_cache_queries_total"] > 0 and "rivulet:num_preemptions_total" in after
    assert after["rivulet:kv_cache_usage_perc"] == 0 and after["rivulet:num_requests_running"] == 0
    assert 0 <= after["rivulet:prefix_cache_hit_rate"] <= 1 and not math.isnan(after["rivulet:prefix_cache_hit_rate"])


def test_raw_stream_format(http: httpx.Client) -> None:
    with http.stream("POST", "/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, "stream": True,
                                                      "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(list(r.iter_lines()))
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == 3


def _stream(http: httpx.Client, path: str, body: dict) -> list:
    with http.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        return [e for e in sse_events(list(r.iter_lines())) if e != "[DONE]"]


def test_return_token_ids(http: httpx.Client) -> None:
    """vLLM's return_token_ids: the prompt's ids and each choice's ids, streamed (per delta) or not; the
    ids decode to the text, and prompt + ids resumes the generation exactly (what a router fails over with)."""
    ids = tokenize(http, PROMPT)
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    full = http.post("/v1/completions", json=body).json()["choices"][0]
    assert full["prompt_token_ids"] == ids and len(full["token_ids"]) == 8
    assert http.post("/detokenize", json={"tokens": full["token_ids"]}).json()["prompt"] == full["text"]
    events = _stream(http, "/v1/completions", body)
    assert events[0]["choices"][0]["prompt_token_ids"] == ids
    assert all("prompt_token_ids" not in e["choices"][0] for e in events[1:])
    assert sum((e["choices"][0]["token_ids"] for e in events), []) == full["token_ids"]
    rest = http.post("/v1/completions", json={**body, "prompt": ids + full["token_ids"][:3], "max_tokens": 5}).json()
    assert full["token_ids"][:3] + rest["choices"][0]["token_ids"] == full["token_ids"]
    plain = http.post("/v1/completions", json={**body, "return_token_ids": False}).json()["choices"][0]
    assert plain["token_ids"] is None and plain["prompt_token_ids"] is None

    chat = {"messages": CHAT, "max_tokens": 6, "temperature": 0, "return_token_ids": True}
    reply = http.post("/v1/chat/completions", json=chat).json()
    prompt_ids = http.post("/tokenize", json={"messages": CHAT}).json()["tokens"]
    assert reply["prompt_token_ids"] == prompt_ids and len(reply["choices"][0]["token_ids"]) == 6
    events = _stream(http, "/v1/chat/completions", chat)
    assert events[0]["prompt_token_ids"] == prompt_ids and events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert sum((e["choices"][0]["token_ids"] for e in events), []) == reply["choices"][0]["token_ids"]
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == reply["choices"][0]["message"]["content"]
