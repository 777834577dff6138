"""The scheduler one step ahead of its updates (async scheduling) and with draft tokens to verify:
the same tokens as the plain synchronous loop, with every invariant kept after each step."""

from __future__ import annotations

import random

import pytest

from core_helpers import FakeRunner, check_all_free, check_invariants, check_step, det_token, make_request, make_scheduler, run_all
from rivulet.core import RequestStatus, Scheduler


def workload(seed: int) -> list[tuple[str, list[int], int, int]]:
    rng = random.Random(seed)
    return [(f"r{i}", [rng.randrange(2, 60) for _ in range(rng.randrange(1, 30))], rng.randrange(1, 20),
             rng.randrange(0, 3)) for i in range(12)]


def add_all(sched: Scheduler, reqs: list[tuple[str, list[int], int, int]]) -> None:
    for rid, prompt, max_tokens, prio in reqs:
        sched.add_request(make_request(rid, prompt, max_tokens=max_tokens, priority=prio))


def run_async(sched: Scheduler, runner: FakeRunner, abort_at: dict[int, str] | None = None) -> dict[str, list[int]]:
    """Schedule step N+1 before the update of step N, as the engine's async loop does."""
    tokens: dict[str, list[int]] = {}
    finished: set[str] = set()
    in_flight = None
    for n in range(2000):
        if not sched.has_unfinished_requests() and in_flight is None:
            break
        nxt = None
        if sched.has_unfinished_requests():
            nxt = sched.schedule()
            check_step(sched, nxt)
            nxt = (nxt, runner.execute(nxt))  # runs "on the device" right after the step in flight
        if in_flight is not None:
            for o in sched.update_from_output(*in_flight):
                assert o.request_id not in finished, f"output after finish: {o}"
                tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
                if o.finished:
                    finished.add(o.request_id)
            check_invariants(sched)
        if abort_at and n in abort_at:
            sched.abort_requests(abort_at[n])
            finished.add(abort_at[n])
        in_flight = nxt
    assert not sched.has_unfinished_requests()
    return tokens


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("num_blocks", [64, 14])  # roomy, and tight enough to preempt
def test_async_scheduling_gives_the_sync_tokens(seed: int, num_blocks: int) -> None:
    reqs = workload(seed)
    sync = make_scheduler(num_blocks=num_blocks, max_num_batched_tokens=16)
    add_all(sync, reqs)
    want, _, _ = run_all(sync, FakeRunner(sync.kv_cache_manager))
    sched = make_scheduler(num_blocks=num_blocks, max_num_batched_tokens=16)
    add_all(sched, reqs)
    got = run_async(sched, FakeRunner(sched.kv_cache_manager))
    assert got == want
    check_all_free(sched)
    if num_blocks == 14:
        assert sched.num_preemptions > 0


def test_async_abort_with_a_step_in_flight() -> None:
    sched = make_scheduler()
    add_all(sched, workload(1))
    run_async(sched, FakeRunner(sched.kv_cache_manager), abort_at={3: "r0", 5: "r4", 6: "r5"})
    check_all_free(sched)


def test_no_step_is_scheduled_past_the_last_token() -> None:
    """With a step in flight that samples a request's last allowed token, the request is left out."""
    sched = make_scheduler()
    sched.add_request(make_request("a", [5, 6, 7], max_tokens=1))
    first = sched.schedule()
    assert first.sampling_request_ids == {"a"}
    assert sched.schedule().num_scheduled_tokens == {}  # nothing to do until the token arrives
    out = sched.update_from_output(first, {"a": [9]})
    assert out[0].finish_reason == "length"


def oracle(rid: str, tokens: list[int], k: int) -> list[int]:
    """The det_token continuation of `tokens`: drafts that are all accepted."""
    seq = list(tokens)
    for _ in range(k):
        seq.append(det_token(rid, seq))
    return seq[len(tokens):]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("num_blocks", [64, 16])
def test_draft_tokens_give_the_plain_tokens(seed: int, num_blocks: int) -> None:
    """Drafts right, wrong, or right then wrong: the output is the model's own, and rejected
    drafts are taken back (the fake runner checks the KV of every position it attends to). Odd
    seeds also leave a draft model's lookahead slots (more preemption with few blocks)."""
    reqs = workload(seed)
    plain = make_scheduler(num_blocks=num_blocks, max_num_batched_tokens=16)
    add_all(plain, reqs)
    want, _, _ = run_all(plain, FakeRunner(plain.kv_cache_manager))

    rng = random.Random(seed)
    sched = make_scheduler(num_blocks=num_blocks, max_num_batched_tokens=16, num_lookahead_tokens=4 * (seed % 2))
    add_all(sched, reqs)
    runner = FakeRunner(sched.kv_cache_manager)
    tokens: dict[str, list[int]] = {}
    accepted = drafted = 0
    while sched.has_unfinished_requests():
        for r in sched.running:
            if r.num_computed_tokens == r.num_tokens - 1:  # decoding: propose
                k = rng.randrange(0, 5)
                good = oracle(r.request_id, r.all_token_ids, k)
                cut = rng.randrange(0, k + 1)
                r.spec_token_ids = good[:cut] + [0] * (k - cut)  # token 0 is never sampled by det_token
        out = sched.schedule()
        check_step(sched, out)
        for rid, d in out.scheduled_spec_tokens.items():
            assert out.num_scheduled_tokens[rid] == len(d) + 1
        result = runner.execute(out)
        for rid, d in out.scheduled_spec_tokens.items():
            drafted += len(d)
            accepted += len(result[rid]) - 1
        for o in sched.update_from_output(out, result):
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
        check_invariants(sched)
        for r in sched.running:
            assert r.num_computed_tokens <= r.num_tokens
    assert tokens == want
    assert drafted > accepted > 0  # some drafts were accepted, some rejected
    check_all_free(sched)


def test_drafts_stop_at_max_tokens_and_a_stop_token_cuts_them() -> None:
    sched = make_scheduler()
    r = make_request("a", [5, 6, 7], max_tokens=3)
    sched.add_request(r)
    out = sched.schedule()
    sched.update_from_output(out, {"a": [20]})
    r.spec_token_ids = [21, 22, 23, 24]
    out = sched.schedule()
    assert out.scheduled_spec_tokens == {"a": [21]}  # 2 tokens left: one draft plus the bonus token
    assert out.num_scheduled_tokens == {"a": 2}
    [o] = sched.update_from_output(out, {"a": [21, 30]})
    assert o.new_token_ids == [21, 30] and o.finish_reason == "length"

    sched.add_request(b := make_request("b", [5, 6, 7], max_tokens=10))
    sched.update_from_output(sched.schedule(), {"b": [20]})
    b.spec_token_ids = [21, 1, 23]  # 1 is EOS
    out = sched.schedule()
    [o] = sched.update_from_output(out, {"b": [21, 1, 23, 24]})
    assert o.new_token_ids == [21, 1] and o.finish_reason == "stop" and b.status == RequestStatus.FINISHED_STOPPED
    check_all_free(sched)


def test_too_many_tokens_from_the_runner_is_an_error() -> None:
    sched = make_scheduler()
    sched.add_request(make_request("a", [5, 6], max_tokens=5))
    out = sched.schedule()
    [o] = sched.update_from_output(out, {"a": [7, 8]})
    assert o.finish_reason == "error" and "2 tokens for 0 drafts" in o.error
    check_all_free(sched)


def test_lookahead_slots_follow_sampling_steps_only() -> None:
    """With a draft model the scheduler leaves k slots after a step that samples (where the draft writes
    its guesses), none after a prefill chunk, and never past max_model_len."""
    sched = make_scheduler(block_size=4, max_num_batched_tokens=8, num_lookahead_tokens=3, max_model_len=24)
    kv = sched.kv_cache_manager
    sched.add_request(make_request("a", list(range(2, 14)), max_tokens=12))  # 12 tokens: chunks of 8 and 4
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 8} and len(kv.get_block_ids("a")) == 2  # a chunk: no lookahead
    sched.update_from_output(out, {})
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 4} and len(kv.get_block_ids("a")) == 4  # 12 + 3 slots
    sched.update_from_output(out, {"a": [30]})
    r = sched.requests["a"]
    steps = 0
    while r.status == RequestStatus.RUNNING:
        r.spec_token_ids = [31, 32, 33]
        out = sched.schedule()
        assert len(kv.get_block_ids("a")) == -(-min(r.num_computed_tokens + 3, 24) // 4)
        sched.update_from_output(out, {"a": [31, 32, 33, 34][:out.num_scheduled_tokens["a"]]})
        steps += 1
    assert steps == 3  # 1 + 4 + 4 + 3 outputs
    assert r.status == RequestStatus.FINISHED_LENGTH and r.num_tokens == 24
    check_all_free(sched)
