"""Embedding requests in the scheduler: whole prompts in one step, pooled not sampled, finished by the
update with the runner's result, their blocks freed at once; generation requests beside them unchanged."""

import pytest
from core_helpers import check_all_free, make_request, make_scheduler

from rivulet.config import RivuletError
from rivulet.core import RequestStatus
from rivulet.pooling_params import PoolingParams


def embed_request(rid: str, n: int, **kw):
    return make_request(rid, list(range(100, 100 + n)), max_tokens=1, pooling_params=PoolingParams(),
                        use_prefix_cache=False, **kw)


def test_embeddings_are_scheduled_whole_and_finish_with_their_pooled_result() -> None:
    sched = make_scheduler(block_size=4, max_num_batched_tokens=16)
    for rid, n in (("a", 6), ("b", 7), ("c", 5)):
        sched.add_request(embed_request(rid, n))
    out = sched.schedule()
    # a and b fit (13 tokens); c (5) would be cut at 3: it waits for the next step, nobody overtakes it
    assert out.num_scheduled_tokens == {"a": 6, "b": 7}
    assert out.pooling_request_ids == {"a", "b"} and not out.sampling_request_ids
    assert [n.pooling_params for n in out.new_requests] == [PoolingParams()] * 2
    nxt = sched.schedule()  # async scheduling: the next step before this one's update
    assert nxt.num_scheduled_tokens == {"c": 5}  # a and b are not computed again
    outs = sched.update_from_output(out, {}, {"a": b"A", "b": b"B"})
    assert {(o.request_id, o.finish_reason, o.pooled) for o in outs} == {("a", "stop", b"A"), ("b", "stop", b"B")}
    assert all(o.new_token_ids == [] for o in outs)
    outs = sched.update_from_output(nxt, {}, {"c": b"C"})
    assert [(o.request_id, o.pooled) for o in outs] == [("c", b"C")]
    assert not sched.has_unfinished_requests()
    check_all_free(sched)


def test_a_missing_pooled_result_fails_the_request_instead_of_hanging() -> None:
    sched = make_scheduler(block_size=4)
    sched.add_request(embed_request("a", 5))
    out = sched.schedule()
    [o] = sched.update_from_output(out, {}, {})
    assert o.finish_reason == "error" and "no pooled output" in o.error
    check_all_free(sched)


def test_embedding_inputs_longer_than_a_step_or_the_context_are_refused() -> None:
    sched = make_scheduler(max_num_batched_tokens=16, max_model_len=32)
    with pytest.raises(RivuletError, match="max_num_batched_tokens"):
        sched.add_request(embed_request("a", 17))
    sched = make_scheduler(max_num_batched_tokens=64, max_model_len=32)
    with pytest.raises(RivuletError, match="max_model_len"):
        sched.add_request(embed_request("b", 33))


def test_an_embedding_aborted_in_flight_is_dropped() -> None:
    sched = make_scheduler(block_size=4)
    sched.add_request(embed_request("a", 5))
    out = sched.schedule()
    sched.abort_requests("a")
    assert sched.update_from_output(out, {}, {"a": b"A"}) == []
    assert sched.schedule().finished_request_ids == {"a"}
    check_all_free(sched)


def test_an_embedding_preempted_after_its_step_was_scheduled_still_finishes() -> None:
    sched = make_scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=32)
    sched.add_request(make_request("gen", list(range(7)), max_tokens=8))
    first = sched.schedule()
    sched.update_from_output(first, {"gen": [50]})  # 8 tokens: its 2 blocks are full
    sched.add_request(embed_request("e", 8))  # the other 2 blocks
    out = sched.schedule()
    assert out.pooling_request_ids == {"e"} and out.num_scheduled_tokens == {"gen": 1, "e": 8}
    # async scheduling: gen's next decode (position 8) needs a third block before `out` is updated; e, at
    # the back of the running queue, is preempted
    nxt = sched.schedule()
    assert nxt.preempted_request_ids == {"e"} and sched.requests["e"].status == RequestStatus.PREEMPTED
    outs = {o.request_id: o for o in sched.update_from_output(out, {"gen": [52]}, {"e": b"E"})}
    assert outs["e"].pooled == b"E" and outs["e"].finish_reason == "stop"
    assert "e" not in sched.requests and len(sched.waiting) == 0  # computed whole: never run again
