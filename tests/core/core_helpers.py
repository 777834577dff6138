"""Shared test helpers for rivulet.core: factories, a fake model runner, invariant checks."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from rivulet.config import SchedulerConfig
from rivulet.core import (
    EngineCoreOutput,
    KVCacheManager,
    Request,
    RequestStatus,
    Scheduler,
    SchedulerOutput,
)

EOS = 1


def make_request(
    rid: str, prompt: list[int], max_tokens: int = 4, arrival_time: float | None = None, **kw
) -> Request:
    kw.setdefault("eos_token_ids", {EOS})
    t = arrival_time if arrival_time is not None else 0.0
    return Request(rid, prompt, max_tokens=max_tokens, arrival_time=t, **kw)


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 32,
    max_model_len: int = 128,
    prefix_caching: bool = True,
    num_lookahead_tokens: int = 0,
    long_prefill_token_threshold: int = 0,
) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, prefix_caching)
    cfg = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        long_prefill_token_threshold=long_prefill_token_threshold,
    )
    return Scheduler(cfg, kv, num_lookahead_tokens)


def det_token(rid: str, token_ids: list[int]) -> int:
    """A deterministic 'model': the next token depends on the request and its length only."""
    return 10 + hash((rid, len(token_ids), token_ids[0])) % 1000


@dataclass
class _RunnerReq:
    token_ids: list[int]
    block_ids: list[int]
    num_computed: int
    prefix_hashes: list[int] = field(default_factory=list)

    def prefix_hash(self, pos: int, drafts: list[int] = ()) -> int:  # type: ignore[assignment]
        """Stands in for the KV at ``pos``: it depends on every token up to ``pos`` (the known
        tokens, then this step's draft tokens)."""
        seq = self.token_ids + list(drafts)
        while len(self.prefix_hashes) <= pos:
            i = len(self.prefix_hashes)
            parent = self.prefix_hashes[-1] if i else None
            self.prefix_hashes.append(hash((parent, seq[i])))
        return self.prefix_hashes[pos]


class FakeRunner:
    """Mimics a model runner with a persistent batch and a paged KV cache.

    It rebuilds each request's state only from SchedulerOutputs, "writes KV" for every
    scheduled token of the whole batch, then checks that every position each request
    attends to holds that request's own KV (so a wrong prefix hit or a reused block
    is caught), and samples one token for requests whose known tokens are all computed.
    Draft tokens (``scheduled_spec_tokens``) are verified against what the "model" samples
    after each accepted prefix: the accepted drafts plus one token come back.
    """

    def __init__(self, kv: KVCacheManager, sample: Callable[[str, list[int]], int] = det_token):
        self.block_size = kv.block_size
        self.sample = sample
        self.slots: dict[int, int] = {}
        self.reqs: dict[str, _RunnerReq] = {}

    def _slot(self, st: _RunnerReq, pos: int) -> int:
        return st.block_ids[pos // self.block_size] * self.block_size + pos % self.block_size

    def execute(self, out: SchedulerOutput) -> dict[str, list[int]]:
        for rid in out.finished_request_ids | out.preempted_request_ids:
            self.reqs.pop(rid, None)
        for nr in out.new_requests:
            assert nr.request_id not in self.reqs, nr.request_id
            self.reqs[nr.request_id] = _RunnerReq(
                list(nr.token_ids), list(nr.block_ids), nr.num_computed_tokens
            )
        for cr in out.cached_requests:
            st = self.reqs[cr.request_id]
            assert st.num_computed == cr.num_computed_tokens, cr
            st.block_ids.extend(cr.new_block_ids)
        ids = [r.request_id for r in out.cached_requests] + [r.request_id for r in out.new_requests]
        assert sorted(ids) == sorted(out.num_scheduled_tokens), (ids, out.num_scheduled_tokens)
        for rid, n in out.num_scheduled_tokens.items():  # write KV for the whole batch first
            st = self.reqs[rid]
            drafts = out.scheduled_spec_tokens.get(rid, [])
            assert n >= 1 and st.num_computed + n <= len(st.token_ids) + len(drafts)
            assert not drafts or st.num_computed + n == len(st.token_ids) + len(drafts)
            assert len(st.block_ids) * self.block_size >= st.num_computed + n
            assert len(set(st.block_ids)) == len(st.block_ids)
            for pos in range(st.num_computed, st.num_computed + n):
                self.slots[self._slot(st, pos)] = st.prefix_hash(pos, drafts)
        sampled: dict[str, list[int]] = {}
        for rid, n in out.num_scheduled_tokens.items():  # then "attend" and sample
            st = self.reqs[rid]
            drafts = out.scheduled_spec_tokens.get(rid, [])
            for pos in range(st.num_computed + n):
                assert self.slots.get(self._slot(st, pos)) == st.prefix_hash(pos, drafts), (rid, pos)
            st.num_computed += n
            if st.num_computed == len(st.token_ids) + len(drafts):
                assert rid in out.sampling_request_ids
                accepted: list[int] = []
                for j in range(len(drafts) + 1):
                    accepted.append(self.sample(rid, st.token_ids + accepted))
                    if j == len(drafts) or drafts[j] != accepted[-1]:
                        break
                st.token_ids += accepted
                st.num_computed -= len(drafts) + 1 - len(accepted)
                del st.prefix_hashes[st.num_computed:]  # rejected positions held the drafts' KV
                sampled[rid] = accepted
            else:
                assert rid not in out.sampling_request_ids
        return sampled


def step(sched: Scheduler, runner: FakeRunner) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
    out = sched.schedule()
    check_step(sched, out)
    outputs = sched.update_from_output(out, runner.execute(out))
    check_invariants(sched)
    return out, outputs


def run_all(
    sched: Scheduler, runner: FakeRunner, max_steps: int = 1000
) -> tuple[dict[str, list[int]], dict[str, EngineCoreOutput], list[SchedulerOutput]]:
    """Step until no request is left: (tokens per request, final output per request, steps)."""
    tokens: dict[str, list[int]] = {}
    final: dict[str, EngineCoreOutput] = {}
    steps: list[SchedulerOutput] = []
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            break
        out, outputs = step(sched, runner)
        steps.append(out)
        for o in outputs:
            assert o.request_id not in final, f"output after finish: {o}"
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                final[o.request_id] = o
    assert not sched.has_unfinished_requests(), "did not drain"
    return tokens, final, steps


def check_step(sched: Scheduler, out: SchedulerOutput) -> None:
    """Per-step limits: token budget and sequence cap."""
    cfg = sched.config
    assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values())
    assert out.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
    assert len(out.num_scheduled_tokens) <= cfg.max_num_seqs
    assert all(n >= 1 for n in out.num_scheduled_tokens.values())
    assert not (out.preempted_request_ids & set(out.num_scheduled_tokens))


def check_invariants(sched: Scheduler) -> None:
    """Block accounting and queue consistency."""
    kv = sched.kv_cache_manager
    pool = kv.block_pool
    holders = Counter(b.block_id for blocks in kv.req_to_blocks.values() for b in blocks)
    for block in pool.blocks:
        assert block.ref_cnt == holders[block.block_id], block
        assert (block.ref_cnt == 0) == (block.block_id in pool.free_queue), block
        if block.block_hash is not None:
            assert pool.cached.get(block.block_hash) is block, block
    assert all(b.block_hash == h for h, b in pool.cached.items())
    num_used = sum(1 for b in pool.blocks if b.ref_cnt > 0)
    assert kv.num_free_blocks + num_used == kv.num_blocks
    running = {r.request_id for r in sched.running}
    waiting = {r.request_id for r in sched.waiting}
    loading = set(sched.loading)  # KV tier loads in flight (some of finished requests, holding blocks till then)
    assert not running & waiting and not loading & (running | waiting)
    assert running | waiting == set(sched.requests) - loading
    assert all(r.status == RequestStatus.WAITING_FOR_KV or r.is_finished for r in sched.loading.values())
    assert {rid for rid, r in sched.loading.items() if not r.is_finished} <= set(sched.requests)
    assert set(kv.req_to_blocks) == running | loading
    assert len(running) <= sched.config.max_num_seqs
    for r in sched.running:
        assert r.status == RequestStatus.RUNNING
        blocks = kv.req_to_blocks[r.request_id]
        assert len({b.block_id for b in blocks}) == len(blocks)
        assert len(blocks) * kv.block_size >= r.num_computed_tokens
    for r in sched.waiting:
        assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        assert r.num_computed_tokens == 0
    keys = [r.sort_key for r in sched.running]
    assert keys == sorted(keys)
    keys = [r.sort_key for r in sched.waiting]
    assert keys == sorted(keys)


def check_all_free(sched: Scheduler) -> None:
    kv = sched.kv_cache_manager
    assert not kv.req_to_blocks
    assert all(b.ref_cnt == 0 for b in kv.block_pool.blocks)
    assert kv.num_free_blocks == kv.num_blocks
    assert kv.usage == 0.0
