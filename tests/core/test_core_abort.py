"""Aborting in every state frees blocks and stops all output."""

from core_helpers import FakeRunner, check_all_free, check_invariants, make_request, make_scheduler, step

from rivulet.core import RequestStatus


def setup():
    sched = make_scheduler(num_blocks=8, block_size=4, max_num_batched_tokens=8)
    return sched, FakeRunner(sched.kv_cache_manager)


def test_abort_waiting_and_mid_prefill() -> None:
    sched, runner = setup()
    r = make_request("r", list(range(12)), max_tokens=4)
    w = make_request("w", [5, 6], max_tokens=4)
    sched.add_request(r)
    sched.add_request(w)
    assert step(sched, runner)[0].num_scheduled_tokens == {"r": 8}
    assert w.status == RequestStatus.WAITING and r.num_computed_tokens == 8
    sched.abort_requests("w")
    assert w.status == RequestStatus.FINISHED_ABORTED and sched.num_waiting == 0
    assert sched.kv_cache_manager.num_free_blocks == 6
    sched.abort_requests(["r"])
    assert r.status == RequestStatus.FINISHED_ABORTED
    check_invariants(sched)
    check_all_free(sched)
    assert sched.schedule().finished_request_ids == {"r", "w"}


def test_abort_while_decoding_and_between_schedule_and_update() -> None:
    sched, runner = setup()
    sched.add_request(make_request("d", [3, 4, 5], max_tokens=9))
    sched.add_request(make_request("x", [6, 7, 8], max_tokens=9))
    step(sched, runner)
    sched.abort_requests("d")
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"x": 1} and out.finished_request_ids == {"d"}
    sampled = runner.execute(out)
    sched.abort_requests("x")  # the step is in flight
    assert sched.update_from_output(out, sampled) == []
    check_invariants(sched)
    check_all_free(sched)


def test_abort_preempted_finished_and_unknown() -> None:
    sched = make_scheduler(num_blocks=4, block_size=4, prefix_caching=False)
    runner = FakeRunner(sched.kv_cache_manager)
    sched.add_request(make_request("a", [11, 12, 13, 14, 15], max_tokens=2))
    b = make_request("b", list(range(20, 28)), max_tokens=3, arrival_time=1.0)
    sched.add_request(b)
    step(sched, runner)
    step(sched, runner)  # b preempts itself; a finishes
    assert b.status == RequestStatus.PREEMPTED
    sched.abort_requests(["b", "a", "nope"])  # a already finished, "nope" never existed
    assert b.status == RequestStatus.FINISHED_ABORTED
    assert not sched.has_unfinished_requests()
    check_invariants(sched)
    check_all_free(sched)
    assert sched.schedule().finished_request_ids == {"a", "b"}
