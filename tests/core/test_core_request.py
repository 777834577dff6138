"""Request state and RequestStatus."""

import pickle

from rivulet.core import Request, RequestStatus


def test_finished_statuses_and_openai_reasons() -> None:
    assert [s.is_finished for s in RequestStatus] == [False, False, False, False, True, True, True, True]
    assert RequestStatus.FINISHED_STOPPED.finish_reason == "stop"
    assert RequestStatus.FINISHED_LENGTH.finish_reason == "length"
    assert RequestStatus.FINISHED_ABORTED.finish_reason == "abort"
    assert RequestStatus.FINISHED_ERROR.finish_reason == "error"
    assert RequestStatus.RUNNING.finish_reason is None
    assert RequestStatus.PREEMPTED.finish_reason is None
    assert RequestStatus.WAITING_FOR_KV.finish_reason is None


def test_request_token_bookkeeping() -> None:
    prompt = [5, 6, 7]
    r = Request("a", prompt, max_tokens=4, eos_token_ids=[2], stop_token_ids=(9,), arrival_time=1.0)
    prompt.append(8)  # the request keeps its own copy
    assert r.prompt_token_ids == [5, 6, 7]
    assert (r.num_tokens, r.num_prompt_tokens, r.num_output_tokens) == (3, 3, 0)
    assert r.eos_token_ids == frozenset({2}) and r.stop_token_ids == frozenset({9})
    r.append_output_token_id(11)
    r.append_output_token_id(12)
    assert r.all_token_ids == [5, 6, 7, 11, 12]
    assert r.output_token_ids == [11, 12]
    assert (r.num_tokens, r.num_output_tokens) == (5, 2)
    assert r.status == RequestStatus.WAITING and not r.is_finished
    assert r.num_computed_tokens == 0 and r.num_cached_tokens == -1
    assert r.error is None and r.stop_reason is None and r.num_preemptions == 0
    assert pickle.loads(pickle.dumps(r)).all_token_ids == [5, 6, 7, 11, 12]


def test_sort_key_orders_by_priority_then_arrival_then_creation() -> None:
    a = Request("a", [1], 1, priority=1, arrival_time=0.0)
    b = Request("b", [1], 1, priority=0, arrival_time=5.0)
    c = Request("c", [1], 1, priority=0, arrival_time=5.0)
    d = Request("d", [1], 1, priority=0, arrival_time=2.0)
    order = sorted([a, b, c, d], key=lambda r: r.sort_key)
    assert [r.request_id for r in order] == ["d", "b", "c", "a"]
