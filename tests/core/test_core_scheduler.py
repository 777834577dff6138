"""Scheduler: batches, chunked prefill, priorities, preemption, aborts, errors, stops."""

import pickle

import pytest
from core_helpers import (
    EOS,
    FakeRunner,
    check_all_free,
    make_request,
    make_scheduler,
    run_all,
    step,
)

from rivulet.config import RivuletError
from rivulet.core import (
    CachedRequestData,
    EngineCoreOutput,
    NewRequestData,
    RequestStatus,
    Scheduler,
)


def runner_for(sched: Scheduler, **kw) -> FakeRunner:
    return FakeRunner(sched.kv_cache_manager, **kw)


def test_prefill_then_decode_until_length() -> None:
    sched = make_scheduler(block_size=4)
    runner = runner_for(sched)
    prompt = list(range(100, 110))
    sched.add_request(make_request("a", prompt, max_tokens=3))
    out, outputs = step(sched, runner)
    assert out.num_scheduled_tokens == {"a": 10} and out.total_num_scheduled_tokens == 10
    assert out.new_requests == [NewRequestData("a", prompt, 10, [0, 1, 2], 0, None)]
    assert out.cached_requests == []
    assert len(outputs) == 1 and len(outputs[0].new_token_ids) == 1 and not outputs[0].finished
    out, outputs = step(sched, runner)
    assert out.num_scheduled_tokens == {"a": 1}
    assert out.cached_requests == [CachedRequestData("a", [], 10)]
    out, outputs = step(sched, runner)
    assert out.cached_requests == [CachedRequestData("a", [], 11)]
    assert outputs[0].finish_reason == "length" and outputs[0].stop_reason is None
    assert not sched.has_unfinished_requests()
    check_all_free(sched)
    last = sched.schedule()
    assert last.finished_request_ids == {"a"} and last.num_scheduled_tokens == {}
    assert sched.schedule().finished_request_ids == set()


def test_long_prompt_is_chunked_and_decodes_run_in_the_same_steps() -> None:
    sched = make_scheduler(max_num_batched_tokens=16)
    runner = runner_for(sched)
    sched.add_request(make_request("d", [7, 8, 9, 10], max_tokens=10))
    assert step(sched, runner)[0].num_scheduled_tokens == {"d": 4}
    sched.add_request(make_request("long", list(range(200, 240)), max_tokens=2))
    out, outputs = step(sched, runner)
    assert out.num_scheduled_tokens == {"d": 1, "long": 15}
    assert [o.request_id for o in outputs] == ["d"]  # mid-prefill: no token for long
    out, outputs = step(sched, runner)
    assert out.num_scheduled_tokens == {"d": 1, "long": 15}
    assert [o.request_id for o in outputs] == ["d"]
    out, outputs = step(sched, runner)
    assert out.num_scheduled_tokens == {"d": 1, "long": 10}
    assert sorted(o.request_id for o in outputs) == ["d", "long"]
    assert step(sched, runner)[0].num_scheduled_tokens == {"d": 1, "long": 1}


def test_long_prompts_go_one_after_another_and_short_ones_still_batch() -> None:
    """long_prefill_token_threshold 8: a prompt with more than 8 tokens left shares a step with at most 8 prefill
    tokens (its own chunk included), so two long prompts finish one after another, not together; prompts of 8
    or fewer batch up to the step's budget, decodes ride along."""
    sched = make_scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=8)
    runner = runner_for(sched)
    sched.add_request(make_request("a", list(range(100, 120)), max_tokens=3))
    sched.add_request(make_request("b", list(range(200, 220)), max_tokens=3))
    got = [step(sched, runner) for _ in range(6)]
    assert [out.num_scheduled_tokens for out, _ in got] == [
        {"a": 8}, {"a": 8}, {"a": 4, "b": 4}, {"a": 1, "b": 8}, {"a": 1, "b": 8}, {"b": 1}]
    firsts = {o.request_id: i for i, (_, outs) in reversed(list(enumerate(got))) for o in outs}
    assert firsts == {"a": 2, "b": 4}  # a's first token two steps before b's (without the threshold: both at step 0)
    for i in range(3):
        sched.add_request(make_request(f"s{i}", list(range(300 + 10 * i, 306 + 10 * i)), max_tokens=2))
    assert step(sched, runner)[0].num_scheduled_tokens == {"b": 1, "s0": 6, "s1": 6, "s2": 6}
    off = make_scheduler(max_num_batched_tokens=64)
    runner = runner_for(off)
    off.add_request(make_request("a", list(range(100, 120)), max_tokens=3))
    off.add_request(make_request("b", list(range(200, 220)), max_tokens=3))
    assert step(off, runner)[0].num_scheduled_tokens == {"a": 20, "b": 20}


def test_higher_priority_prefill_leaves_room_for_decodes() -> None:
    sched = make_scheduler(max_num_batched_tokens=16)
    runner = runner_for(sched)
    sched.add_request(make_request("d", [7, 8, 9, 10], max_tokens=10))
    step(sched, runner)
    sched.add_request(make_request("long", list(range(200, 240)), max_tokens=2, priority=-1))
    assert step(sched, runner)[0].num_scheduled_tokens == {"d": 1, "long": 15}
    out, _ = step(sched, runner)  # long now comes first in the batch, d still decodes
    assert list(out.num_scheduled_tokens.items()) == [("long", 15), ("d", 1)]


def test_token_budget_and_max_num_seqs() -> None:
    sched = make_scheduler(max_num_seqs=3, max_num_batched_tokens=8)
    runner = runner_for(sched)
    reqs = [make_request(f"r{i}", [50 + i] * 5, max_tokens=2, arrival_time=i) for i in range(10)]
    for r in reqs:
        sched.add_request(r)
    assert step(sched, runner)[0].num_scheduled_tokens == {"r0": 5, "r1": 3}
    assert step(sched, runner)[0].num_scheduled_tokens == {"r0": 1, "r1": 2, "r2": 5}
    assert step(sched, runner)[0].num_scheduled_tokens == {"r1": 1, "r2": 1, "r3": 5}
    assert sched.num_running == 1 and sched.num_waiting == 6  # r1, r2 finished
    tokens, final, steps = run_all(sched, runner)  # run_all checks both limits every step
    assert len(final) == 7 and all(o.finish_reason == "length" for o in final.values())
    assert all(r.status == RequestStatus.FINISHED_LENGTH and r.num_output_tokens == 2 for r in reqs)
    assert max(len(s.num_scheduled_tokens) for s in steps) == 3
    assert max(s.total_num_scheduled_tokens for s in steps) == 8


def test_lower_priority_value_first_then_fcfs() -> None:
    sched = make_scheduler(max_num_seqs=1)
    runner = runner_for(sched)
    for rid, prio, t in [("x", 1, 0), ("y", 0, 1), ("z", 0, 2), ("w", 1, 3), ("v", 0, 2)]:
        sched.add_request(make_request(rid, [3, 4, 5], max_tokens=1, priority=prio, arrival_time=t))
    _, final, steps = run_all(sched, runner)
    admitted = [nr.request_id for s in steps for nr in s.new_requests]
    assert admitted == ["y", "z", "v", "x", "w"]  # z and v tie on arrival: creation order
    assert len(final) == 5


def test_request_that_cannot_get_a_block_preempts_itself() -> None:
    sched = make_scheduler(num_blocks=4, block_size=4, prefix_caching=False)
    runner = runner_for(sched)
    a = make_request("a", [11, 12, 13, 14, 15], max_tokens=3)  # room for 3 more tokens
    b = make_request("b", list(range(20, 28)), max_tokens=3, arrival_time=1.0)  # 2 full blocks
    sched.add_request(a)
    sched.add_request(b)
    assert step(sched, runner)[0].num_scheduled_tokens == {"a": 5, "b": 8}
    out, _ = step(sched, runner)  # b's next token needs a 5th block
    assert out.num_scheduled_tokens == {"a": 1} and out.preempted_request_ids == {"b"}
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert sched.num_preemptions == 1 and sched.kv_cache_manager.get_block_ids("b") == []
    out, _ = step(sched, runner)
    assert out.num_scheduled_tokens == {"a": 1}  # b waits: a still holds 2 of 4 blocks
    out, _ = step(sched, runner)
    assert out.num_scheduled_tokens == {"b": 9} and out.finished_request_ids == {"a"}
    assert out.new_requests[0].token_ids == b.all_token_ids[:9]  # prompt + 1st output
    assert len(b.all_token_ids) == 10  # + the token this step sampled
    tokens, final, _ = run_all(sched, runner)
    assert final["b"].finish_reason == "length" and b.num_output_tokens == 3
    assert (a.num_preemptions, b.num_preemptions) == (0, 1)


def test_lowest_priority_request_is_preempted_and_finishes_the_same() -> None:
    def run(num_blocks: int) -> tuple[Scheduler, dict, list]:
        sched = make_scheduler(num_blocks=num_blocks, block_size=4, prefix_caching=False)
        sched.add_request(make_request("a", list(range(30, 38)), max_tokens=8))
        sched.add_request(make_request("b", list(range(40, 48)), max_tokens=8, arrival_time=1))
        tokens, final, steps = run_all(sched, runner_for(sched))
        return sched, tokens, steps

    big, ref_tokens, _ = run(64)
    assert big.num_preemptions == 0
    small, tokens, steps = run(6)
    assert small.num_preemptions >= 1
    preempting = [s for s in steps if s.preempted_request_ids]
    assert all(s.preempted_request_ids == {"b"} and "a" in s.num_scheduled_tokens for s in preempting)
    assert tokens == ref_tokens and len(tokens["a"]) == len(tokens["b"]) == 8
    check_all_free(small)


def test_request_too_big_for_the_whole_cache_errors() -> None:
    sched = make_scheduler(num_blocks=4, block_size=4)
    runner = runner_for(sched)
    big = make_request("big", list(range(17)), max_tokens=2)
    sched.add_request(big)
    sched.add_request(make_request("ok", [5, 6, 7, 8], max_tokens=2))
    out, outputs = step(sched, runner)
    assert out.num_scheduled_tokens == {"ok": 4}
    (err,) = [o for o in outputs if o.request_id == "big"]
    assert err.finish_reason == "error" and err.new_token_ids == []
    assert "needs 5 KV cache blocks" in err.error and "only 4 blocks" in err.error
    assert big.status == RequestStatus.FINISHED_ERROR and big.error == err.error
    assert "big" in sched.schedule().finished_request_ids


def test_request_outgrowing_the_whole_cache_errors_after_its_tokens() -> None:
    sched = make_scheduler(num_blocks=4, block_size=4)
    runner = runner_for(sched)
    g = make_request("g", list(range(16)), max_tokens=5)
    sched.add_request(g)
    tokens, final, _ = run_all(sched, runner)
    assert len(tokens["g"]) == 1 and g.num_output_tokens == 1
    assert final["g"].finish_reason == "error" and "needs 5 KV cache blocks" in final["g"].error
    check_all_free(sched)


def test_add_request_validation() -> None:
    sched = make_scheduler(max_model_len=32)
    with pytest.raises(RivuletError, match=r"prompt \(30 tokens\) \+ max_tokens \(5\) = 35 exceeds max_model_len \(32\)"):
        sched.add_request(make_request("long", [1] * 30, max_tokens=5))
    sched.add_request(make_request("fits", [3] * 27, max_tokens=5))
    with pytest.raises(RivuletError, match="already in use"):
        sched.add_request(make_request("fits", [3], max_tokens=1))
    with pytest.raises(RivuletError, match="empty"):
        sched.add_request(make_request("empty", [], max_tokens=1))
    with pytest.raises(RivuletError, match="max_tokens"):
        sched.add_request(make_request("zero", [3], max_tokens=0))
    assert sched.get_num_unfinished_requests() == 1 and sched.num_waiting == 1


def test_stop_conditions() -> None:
    script = {
        "eos": [20, EOS, 21],
        "min": [EOS, EOS, EOS, 22],
        "stopid": [25, 30, 26],
        "ignore": [EOS, EOS, EOS, EOS],
        "len": [27, 28, 29],
    }
    sched = make_scheduler()
    runner = runner_for(sched, sample=lambda rid, toks: script[rid].pop(0))
    sched.add_request(make_request("eos", [3, 4], max_tokens=3))
    sched.add_request(make_request("min", [3, 4], max_tokens=4, min_tokens=3))
    sched.add_request(make_request("stopid", [3, 4], max_tokens=3, stop_token_ids=[30]))
    sched.add_request(make_request("ignore", [3, 4], max_tokens=3, eos_token_ids=()))
    sched.add_request(make_request("len", [3, 4], max_tokens=2))
    tokens, final, _ = run_all(sched, runner)
    assert tokens == {
        "eos": [20, EOS],
        "min": [EOS, EOS, EOS],
        "stopid": [25, 30],
        "ignore": [EOS, EOS, EOS],
        "len": [27, 28],
    }
    reasons = {rid: (o.finish_reason, o.stop_reason) for rid, o in final.items()}
    assert reasons == {
        "eos": ("stop", None),
        "min": ("stop", None),
        "stopid": ("stop", 30),
        "ignore": ("length", None),
        "len": ("length", None),
    }


def test_finish_requests_for_a_stop_string() -> None:
    sched = make_scheduler()
    runner = runner_for(sched)
    sched.add_request(make_request("a", [3, 4, 5], max_tokens=10))
    sched.add_request(make_request("b", [6, 7, 8], max_tokens=2))
    step(sched, runner)
    with pytest.raises(ValueError):
        sched.finish_requests("a", RequestStatus.RUNNING)
    sched.finish_requests(["a"], RequestStatus.FINISHED_STOPPED)
    assert sched.kv_cache_manager.get_block_ids("a") == []
    out, outputs = step(sched, runner)
    assert out.finished_request_ids == {"a"} and out.num_scheduled_tokens == {"b": 1}
    assert [o.request_id for o in outputs] == ["b"]


def test_n_samples_admitted_together_share_prompt_blocks() -> None:
    sched = make_scheduler(block_size=4)
    runner = runner_for(sched)
    prompt = list(range(60, 72))  # 3 full blocks; hits are capped at 2
    for i in range(3):
        sched.add_request(make_request(f"s{i}", prompt, max_tokens=3))
    out, _ = step(sched, runner)  # the runner checks s1, s2 read KV that s0 writes
    assert out.num_scheduled_tokens == {"s0": 12, "s1": 4, "s2": 4}
    assert [(n.block_ids, n.num_computed_tokens) for n in out.new_requests] == [
        ([0, 1, 2], 0), ([0, 1, 3], 8), ([0, 1, 4], 8)
    ]
    tokens, final, _ = run_all(sched, runner)
    assert [final[f"s{i}"].num_cached_tokens for i in range(3)] == [0, 8, 8]
    assert all(len(t) == 2 for t in tokens.values())  # plus one token from the first step
    kv = sched.kv_cache_manager
    assert (kv.stats.queries, kv.stats.hits) == (36, 16)
    check_all_free(sched)


def test_later_request_hits_the_prefix_cache() -> None:
    sched = make_scheduler(block_size=4)
    runner = runner_for(sched)
    prompt = list(range(80, 90))
    sched.add_request(make_request("a", prompt, max_tokens=2))
    run_all(sched, runner)
    sched.add_request(make_request("b", prompt, max_tokens=2))
    out, _ = step(sched, runner)
    assert out.num_scheduled_tokens == {"b": 2}
    assert out.new_requests[0].num_computed_tokens == 8
    _, final, _ = run_all(sched, runner)
    assert final["b"].num_cached_tokens == 8
    assert sched.get_stats().prefix_cache_hits == 8


def test_messages_pickle() -> None:
    sched = make_scheduler()
    sched.add_request(make_request("a", [3, 4, 5], max_tokens=2, sampling_params={"t": 0.5}))
    out = sched.schedule()
    assert pickle.loads(pickle.dumps(out)) == out
    o = EngineCoreOutput("a", [1], "stop", 7, 0, None)
    assert pickle.loads(pickle.dumps(o)) == o


def test_missing_token_from_the_runner_finishes_with_an_error() -> None:
    sched = make_scheduler()
    sched.add_request(make_request("a", [3, 4, 5], max_tokens=4))
    sched.add_request(make_request("b", [6, 7, 8], max_tokens=4))
    out = sched.schedule()
    outputs = sched.update_from_output(out, {"b": [42]})
    by_id = {o.request_id: o for o in outputs}
    assert by_id["b"].new_token_ids == [42] and not by_id["b"].finished
    assert by_id["a"].finish_reason == "error" and "no token" in by_id["a"].error
    assert sched.get_num_unfinished_requests() == 1 and sched.num_running == 1


def test_stats_snapshot() -> None:
    sched = make_scheduler(num_blocks=10, block_size=4, max_num_seqs=1)
    sched.add_request(make_request("a", list(range(8)), max_tokens=2))
    sched.add_request(make_request("b", [9], max_tokens=2))
    sched.schedule()
    s = sched.get_stats()
    assert (s.num_running, s.num_waiting, s.num_preemptions) == (1, 1, 0)
    assert s.kv_cache_usage == pytest.approx(0.2) and (s.prefix_cache_queries, s.prefix_cache_hits) == (8, 0)
