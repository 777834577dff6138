"""Random workloads against the scheduler, KV cache manager and a fake model runner.

After every step: block accounting (no block both free and used, ref counts equal
holders, free + used == total), queue consistency, token budget and sequence cap, and
(in FakeRunner) that every position a request attends to holds its own KV. After
draining: every request finished exactly once, with outputs consistent with its limits,
and every block is free.
"""

from __future__ import annotations

import random

from core_helpers import (
    EOS,
    FakeRunner,
    check_all_free,
    check_invariants,
    check_step,
    make_request,
    make_scheduler,
)
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from rivulet.config import RivuletError
from rivulet.core import EngineCoreOutput, Request, RequestStatus

STOP = 2
VOCAB = st.integers(3, 8)  # a small vocabulary makes shared blocks common
MAX_MODEL_LEN = 40


class Workload:
    """Drives one scheduler and records everything needed for the final checks."""

    def __init__(self, data: st.DataObject) -> None:
        self.data = data
        self.sched = make_scheduler(
            num_blocks=data.draw(st.integers(3, 16), label="num_blocks"),
            block_size=data.draw(st.sampled_from([1, 2, 4]), label="block_size"),
            max_num_seqs=data.draw(st.integers(1, 5), label="max_num_seqs"),
            max_num_batched_tokens=data.draw(st.integers(1, 20), label="budget"),
            max_model_len=MAX_MODEL_LEN,
            prefix_caching=data.draw(st.booleans(), label="prefix_caching"),
        )
        self.rng = random.Random(data.draw(st.integers(0, 2**32 - 1), label="seed"))
        self.runner = FakeRunner(self.sched.kv_cache_manager, self.sample)
        self.shared = [data.draw(st.lists(VOCAB, min_size=8, max_size=24)) for _ in range(2)]
        self.reqs: dict[str, Request] = {}
        self.external: dict[str, RequestStatus] = {}  # aborted / stopped from outside
        self.tokens: dict[str, list[int]] = {}
        self.final: dict[str, EngineCoreOutput] = {}
        self.clock = 0

    def sample(self, rid: str, token_ids: list[int]) -> int:
        x = self.rng.random()
        return EOS if x < 0.04 else STOP if x < 0.06 else self.rng.randrange(3, 9)

    def add(self) -> None:
        draw = self.data.draw
        src = draw(st.sampled_from([None, 0, 1]))
        prompt = [] if src is None else self.shared[src][: draw(st.integers(0, 24))]
        prompt = prompt + draw(st.lists(VOCAB, max_size=8))
        self.clock += draw(st.integers(0, 1))
        kw = dict(
            max_tokens=draw(st.integers(1, 16)),
            priority=draw(st.integers(0, 2)),
            min_tokens=draw(st.integers(0, 3)),
            eos_token_ids=draw(st.sampled_from([(), (EOS,)])),
            stop_token_ids=draw(st.sampled_from([(), (STOP,)])),
            arrival_time=float(self.clock),
        )
        for _ in range(draw(st.integers(1, 3))):  # n > 1: same prompt, separate requests
            req = make_request(f"r{len(self.reqs)}", prompt, **kw)
            if not prompt or len(prompt) + req.max_tokens > MAX_MODEL_LEN:
                try:
                    self.sched.add_request(req)
                except RivuletError:
                    continue
                raise AssertionError("accepted an invalid request")
            self.sched.add_request(req)
            self.reqs[req.request_id] = req

    def pick(self, ids: list[str]) -> str | None:
        return self.data.draw(st.sampled_from(sorted(ids))) if ids else None

    def abort(self) -> None:
        rid = self.pick(list(self.reqs))
        if rid is not None:
            if not self.reqs[rid].is_finished:
                self.external[rid] = RequestStatus.FINISHED_ABORTED
            self.sched.abort_requests(rid)

    def stop_string(self) -> None:
        rid = self.pick([r.request_id for r in self.sched.running])
        if rid is not None:
            self.external[rid] = RequestStatus.FINISHED_STOPPED
            self.sched.finish_requests([rid], RequestStatus.FINISHED_STOPPED)

    def step(self, abort_in_flight: bool = False) -> None:
        out = self.sched.schedule()
        check_step(self.sched, out)
        sampled = self.runner.execute(out)
        if abort_in_flight:
            rid = self.pick(list(out.num_scheduled_tokens))
            if rid is not None:
                self.external[rid] = RequestStatus.FINISHED_ABORTED
                self.sched.abort_requests(rid)
        for o in self.sched.update_from_output(out, sampled):
            assert o.request_id not in self.final and o.request_id not in self.external, o
            self.tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                self.final[o.request_id] = o
        check_invariants(self.sched)
        for r in self.sched.running:  # the runner's view of tokens matches the scheduler's
            st_ = self.runner.reqs.get(r.request_id)
            assert st_ is None or st_.token_ids == r.all_token_ids

    def drain(self, max_steps: int = 5000) -> None:
        for _ in range(max_steps):
            if not self.sched.has_unfinished_requests():
                break
            self.step()
        assert not self.sched.has_unfinished_requests(), "no progress: livelock"
        self.sched.schedule()  # flush finished ids
        check_all_free(self.sched)

    def check_request(self, r: Request) -> None:
        rid, kv = r.request_id, self.sched.kv_cache_manager
        assert r.is_finished
        assert self.tokens.get(rid, []) == r.output_token_ids
        assert r.num_output_tokens <= r.max_tokens
        for k, tok in enumerate(r.output_token_ids[:-1]):  # only the last token may stop
            assert k + 1 < r.min_tokens or tok not in r.eos_token_ids | r.stop_token_ids
        if rid in self.external:
            assert r.status == self.external[rid] and rid not in self.final
            return
        assert self.final[rid].finish_reason == r.status.finish_reason
        if r.status == RequestStatus.FINISHED_LENGTH:
            assert r.num_output_tokens == r.max_tokens
        elif r.status == RequestStatus.FINISHED_STOPPED:
            assert r.output_token_ids[-1] in r.eos_token_ids | r.stop_token_ids
            assert r.num_output_tokens >= r.min_tokens
        else:
            assert r.status == RequestStatus.FINISHED_ERROR and r.error
            assert kv.num_blocks_for(r.num_tokens) > kv.num_blocks  # truly could not fit


OPS = ["add", "add", "step", "step", "step", "abort", "stop", "step_abort"]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_random_workload_keeps_invariants(data: st.DataObject) -> None:
    w = Workload(data)
    for _ in range(data.draw(st.integers(2, 8), label="initial adds")):
        w.add()
    for op in data.draw(st.lists(st.sampled_from(OPS), min_size=5, max_size=40), label="ops"):
        if op == "add":
            w.add()
        elif op == "abort":
            w.abort()
        elif op == "stop":
            w.stop_string()
        else:
            w.step(abort_in_flight=op == "step_abort")
    w.drain()
    for r in w.reqs.values():
        w.check_request(r)
    # shown by --hypothesis-show-statistics: what the examples exercised
    event(f"preemptions: {min(w.sched.num_preemptions, 5)}+")
    event(f"prefix hits: {w.sched.kv_cache_manager.stats.hits > 0}")
    for r in w.reqs.values():
        event(f"finished: {r.status.name}")
