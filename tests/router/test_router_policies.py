"""The router's pure parts: the approximate prefix tree, the policies, retry backoff, and what a resumed stream asks."""

from __future__ import annotations

import random
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from rivulet.router.failover import StreamState, resumable, strip_token_ids, strip_token_ids_raw
from rivulet.router.policies import CacheAware, CacheAwareConfig, ConsistentHash, PowerOfTwo, RoundRobin, RouteInput
from rivulet.router.prefix_tree import PrefixTree
from rivulet.router.proxy import RetryConfig
from rivulet.router.workers import BreakerConfig, HealthConfig, Worker, WorkerPool


def test_prefix_tree_longest_match_and_most_recent_tenant() -> None:
    t = PrefixTree()
    t.insert("hello world", "a", now=1)
    t.insert("hello there", "b", now=2)
    assert t.match("hello world, again") == (11, "a")
    assert t.match("hello there!") == (11, "b")
    assert t.match("hello") == (5, "b")  # both saw it; b more recently
    assert t.match("help") == (3, "b")
    assert t.match("xyz") == (0, None)
    assert t.chars == {"a": 11, "b": 11}  # "hello " shared, counted once per tenant
    t.insert("hello world", "b", now=3)
    assert t.match("hello world") == (11, "b") and t.chars["b"] == 16


def test_prefix_tree_evicts_least_recently_used_leaves_per_tenant() -> None:
    t = PrefixTree()
    t.insert("aaaa-old", "a", now=1)
    t.insert("aaaa-new", "a", now=5)
    t.insert("bbbb", "b", now=2)
    assert t.chars["a"] == 11  # "aaaa-" + "old" + "new"
    dropped = t.evict("a", 9)
    assert dropped == 3 and t.chars["a"] == 8  # "old" went first
    assert t.match("aaaa-old") == (5, "a") and t.match("aaaa-new") == (8, "a")
    t.evict("a", 0)
    assert t.chars["a"] == 0 and t.match("aaaa-new") == (0, None) and t.match("bbbb") == (4, "b")
    t.remove_tenant("b")
    assert t.match("bbbb") == (0, None) and not t.root.children


def test_prefix_tree_random_against_brute_force() -> None:
    rng = random.Random(0)
    t, seen = PrefixTree(), {}
    for step in range(300):
        text = "".join(rng.choice("ab") for _ in range(rng.randint(1, 12)))
        tenant = rng.choice("xyz")
        t.insert(text, tenant, now=step)
        seen.setdefault(tenant, set()).add(text)
        q = "".join(rng.choice("ab") for _ in range(rng.randint(1, 12)))
        best = max((max(_common(q, s) for s in texts) for texts in seen.values()), default=0)
        assert t.match(q)[0] == best
    for tenant, texts in seen.items():  # chars = size of the union of prefixes of the tenant's texts
        assert t.chars[tenant] == len({s[:i] for s in texts for i in range(1, len(s) + 1)})


def _common(a: str, b: str) -> int:
    i = 0
    while i < min(len(a), len(b)) and a[i] == b[i]:
        i += 1
    return i


def _workers(n: int) -> list[Worker]:
    return [Worker(f"http://w{i}") for i in range(n)]


def test_round_robin_power_of_two_and_consistent_hash() -> None:
    ws = _workers(3)
    rr = RoundRobin()
    assert [rr.choose(ws, RouteInput("x")).url for _ in range(4)] == ["http://w0", "http://w1", "http://w2", "http://w0"]
    ws[0].in_flight, ws[1].in_flight, ws[2].in_flight = 5, 0, 9
    p2 = PowerOfTwo(random.Random(1))
    picks = Counter(p2.choose(ws, RouteInput("x")).url for _ in range(300))
    assert picks["http://w2"] == 0 and picks["http://w1"] > picks["http://w0"] > 0  # never the most loaded of 3
    ch = ConsistentHash()
    sessions = [f"user-{i}" for i in range(200)]
    first = {s: ch.choose(ws, RouteInput("t", s)).url for s in sessions}
    assert all(ch.choose(ws, RouteInput("other text", s)).url == first[s] for s in sessions)
    assert len(set(first.values())) == 3
    moved = {s: ch.choose(ws[:2], RouteInput("t", s)).url for s in sessions}  # w2 leaves: only its sessions move
    assert all(moved[s] == first[s] for s in sessions if first[s] != "http://w2")


def test_cache_aware_prefix_then_room_then_balance() -> None:
    ws = _workers(2)
    ca = CacheAware(CacheAwareConfig(cache_threshold=0.5, balance_abs_threshold=4, balance_rel_threshold=1.5))
    doc_a, doc_b = "A" * 100, "B" * 100
    for doc in (doc_a, doc_b):
        w = ca.choose(ws, RouteInput(doc + " q0"))
        assert ca.last_reason == "room"
        ca.routed(w, RouteInput(doc + " q0"))
    homes = {doc: ca.choose(ws, RouteInput(doc)).url for doc in (doc_a, doc_b)}
    assert homes[doc_a] != homes[doc_b]  # the second document went to the worker with room
    for i in range(1, 6):
        for doc in (doc_a, doc_b):
            req = RouteInput(doc + f" q{i}")
            w = ca.choose(ws, req)
            assert ca.last_reason == "prefix" and w.url == homes[doc]
            ca.routed(w, req)
    busy = next(w for w in ws if w.url == homes[doc_a])
    busy.in_flight = 10
    w = ca.choose(ws, RouteInput(doc_a + " q9"))
    assert ca.last_reason == "balance" and w.url != busy.url
    ca.forget(busy.url)
    busy.in_flight = 0
    assert ca.tree.match(doc_a)[1] is None


def test_retry_backoff_grows_with_jitter_and_caps() -> None:
    cfg = RetryConfig(initial_backoff=0.1, max_backoff=1.0, multiplier=2.0, jitter=0.2)
    rng = random.Random(0)
    for attempt, base in [(0, 0.1), (1, 0.2), (2, 0.4), (5, 1.0)]:
        waits = [cfg.backoff(attempt, rng) for _ in range(50)]
        assert all(0.8 * base <= x <= 1.2 * base for x in waits) and len(set(waits)) > 1


def test_breaker_opens_after_failures_and_half_opens() -> None:
    pool = WorkerPool(["w0", "http://w1/"], HealthConfig(), BreakerConfig(failures=2, timeout=0.05))
    assert sorted(pool.workers) == ["http://w0", "http://w1"]
    w0 = pool.workers["http://w0"]
    pool.failed(w0, "x")
    assert w0 in pool.available()
    pool.failed(w0, "x")
    assert [w.url for w in pool.available()] == ["http://w1"]
    import time
    time.sleep(0.06)
    assert w0 in pool.available()  # half-open: one request may try
    w0.in_flight = 1
    assert w0 not in pool.available()  # ... only one
    w0.in_flight = 0
    pool.succeeded(w0)
    assert w0.breaker_state(0, pool.breaker) == "closed"


def test_what_can_be_resumed_and_the_resume_request() -> None:
    assert resumable("completions", {"prompt": "x"}) is None
    assert resumable("completions", {"prompt": ["x", "y"]}) == "several prompts"
    assert resumable("completions", {"prompt": "x", "n": 2}) == "n > 1"
    assert resumable("completions", {"prompt": "x", "logprobs": 0}) == "echo or logprobs"
    assert resumable("chat", {"messages": [], "tools": [{}]}) == "tools"
    assert resumable("chat", {"messages": [], "response_format": {"type": "text"}}) is None
    assert resumable("chat", {"messages": [], "response_format": {"type": "json_object"}}) == "response_format"
    s = StreamState("chat", {"messages": [], "max_tokens": 10, "min_tokens": 4, "seed": 7, "temperature": 0,
                             "stream_options": {"include_usage": True}})
    s.observe({"id": "c1", "created": 5, "model": "m", "prompt_token_ids": [1, 2],
               "choices": [{"index": 0, "delta": {"role": "assistant"}}]})
    s.observe({"id": "c1", "choices": [{"index": 0, "delta": {"content": "a"}, "token_ids": [9, 8, 7]}]})
    body = s.continuation()
    assert body["prompt"] == [1, 2, 9, 8, 7] and body["max_tokens"] == 7 and body["min_tokens"] == 1
    assert body["seed"] == 7 and body["return_token_ids"] and "messages" not in body
    chunk = s.rewrite({"id": "cmpl-x", "choices": [{"index": 0, "text": " b", "token_ids": [6],
                                                    "finish_reason": None}]}, 3)
    assert chunk is not None and chunk["id"] == "c1" and chunk["object"] == "chat.completion.chunk"
    assert chunk["choices"][0]["delta"] == {"content": " b"} and chunk["created"] == 5
    usage = s.rewrite({"id": "cmpl-x", "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 7}}, 3)
    assert usage is not None and usage["usage"] == {"prompt_tokens": 2, "completion_tokens": 10, "total_tokens": 12}
    assert StreamState("chat", {"messages": []}, prompt_ids=[1]).continuation()["max_tokens"] is None


_TEXT = st.lists(st.sampled_from(list('ab "\\[],:{}') + ['"token_ids":[1]', '"finish_reason":"stop"', '"usage":{',
                                                         '"error"']), max_size=8).map("".join)
_CHOICE = st.fixed_dictionaries({"index": st.just(0), "text": _TEXT},
                                optional={"token_ids": st.lists(st.integers(0, 99999), max_size=3) | st.none(),
                                          "prompt_token_ids": st.lists(st.integers(0, 9), max_size=2),
                                          "finish_reason": st.sampled_from(["stop", "length"]) | st.none()})
_CHUNK = st.fixed_dictionaries({"id": st.just("c1"), "choices": st.lists(_CHOICE, max_size=2)},
                               optional={"usage": st.none() | st.just({"prompt_tokens": 1}), "model": _TEXT})


@settings(max_examples=300, deadline=None)
@given(st.lists(_CHUNK, min_size=1, max_size=5), st.booleans(), st.booleans())
def test_the_relay_hot_path_on_event_bytes_equals_parsing_them(chunks, compact, key_first) -> None:
    """Stripping token ids from an event's bytes, and reading ids/finish/usage from them unparsed, give what
    parsing gives: whatever the text holds (quotes, brackets, the keys themselves) and however it is spaced."""
    import json as _json

    sep = (",", ":") if compact else (", ", ": ")
    raw, parsed = StreamState("chat", {}), StreamState("chat", {})
    for chunk in chunks:
        if key_first:  # a token-id field first in its object
            chunk["choices"] = [{"token_ids": [3], **c} for c in chunk["choices"]]
        data = _json.dumps(chunk, separators=sep).encode()
        assert _json.loads(strip_token_ids_raw(data)) == strip_token_ids(_json.loads(data))
        raw.observe(_json.loads(data)) if raw.needs_parse(data) else raw.observe_raw(data)
        parsed.observe(_json.loads(data))
    assert (raw.token_ids, raw.finished, raw.usage_sent) == (parsed.token_ids, parsed.finished, parsed.usage_sent)
