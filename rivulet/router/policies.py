"""Routing policies: which available worker takes a request. One registry, sglang-router's names.

- ``round_robin``: the next worker in turn.
- ``power_of_two``: the less loaded of two workers drawn at random.
- ``consistent_hash``: a hash ring keyed on the request's session (a header, else the ``user``
  field, else its text), so one session keeps its worker while the pool is unchanged.
- ``cache_aware``: the worker whose remembered text shares the longest prefix with the request,
  when the match covers more than ``cache_threshold`` of it; otherwise the worker holding the
  least text (most cache room). When load is imbalanced (``max - min > balance_abs_threshold``
  and ``max > balance_rel_threshold * min``) the least loaded worker wins instead.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import random
from dataclasses import dataclass
from typing import Callable

from rivulet.router.prefix_tree import PrefixTree
from rivulet.router.workers import Worker


@dataclass
class RouteInput:
    """What a policy may look at: the request's text and its session key (None when it has none)."""

    text: str
    session: str | None = None


@dataclass
class CacheAwareConfig:
    cache_threshold: float = 0.5
    balance_abs_threshold: int = 32
    balance_rel_threshold: float = 1.0001
    max_tree_size: int = 1 << 24  # characters remembered per worker


class Policy:
    name = ""
    last_reason = "policy"  # why the last choice was made (a metrics label)

    def choose(self, workers: list[Worker], req: RouteInput) -> Worker:
        raise NotImplementedError

    def routed(self, worker: Worker, req: RouteInput) -> None:
        """`req` went to `worker` (after any retry): policies that learn from it do."""

    def forget(self, url: str) -> None:
        """`url` left the pool."""

    def maintain(self) -> None:
        """Periodic housekeeping (eviction)."""


class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, workers: list[Worker], req: RouteInput) -> Worker:
        return workers[next(self._counter) % len(workers)]


class PowerOfTwo(Policy):
    name = "power_of_two"

    def __init__(self, rng: random.Random | None = None) -> None:
        self.rng = rng or random.Random()

    def choose(self, workers: list[Worker], req: RouteInput) -> Worker:
        if len(workers) == 1:
            return workers[0]
        a, b = self.rng.sample(workers, 2)
        return a if a.load <= b.load else b


def _hash(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")


class ConsistentHash(Policy):
    name = "consistent_hash"
    replicas = 160  # points per worker on the ring

    def __init__(self) -> None:
        self._ring: tuple[tuple[str, ...], list[tuple[int, str]]] = ((), [])

    def choose(self, workers: list[Worker], req: RouteInput) -> Worker:
        urls = tuple(sorted(w.url for w in workers))
        if self._ring[0] != urls:  # rebuilt only when the available workers change
            self._ring = (urls, sorted((_hash(f"{u}#{i}"), u) for u in urls for i in range(self.replicas)))
        ring = self._ring[1]
        by_url = {w.url: w for w in workers}
        key = _hash(req.session if req.session is not None else req.text)
        i = bisect.bisect(ring, (key, "")) % len(ring)
        return by_url[ring[i][1]]


class CacheAware(Policy):
    name = "cache_aware"

    def __init__(self, cfg: CacheAwareConfig | None = None) -> None:
        self.cfg = cfg or CacheAwareConfig()
        self.tree = PrefixTree()

    def choose(self, workers: list[Worker], req: RouteInput) -> Worker:
        cfg = self.cfg
        loads = [w.load for w in workers]
        hi, lo = max(loads), min(loads)
        if hi - lo > cfg.balance_abs_threshold and hi > cfg.balance_rel_threshold * lo:
            self.last_reason = "balance"
            return workers[loads.index(lo)]
        matched, tenant = self.tree.match(req.text)
        if tenant is not None and req.text and matched / len(req.text) > cfg.cache_threshold:
            for w in workers:
                if w.url == tenant:
                    self.last_reason = "prefix"
                    return w
        self.last_reason = "room"
        return min(workers, key=lambda w: (self.tree.chars.get(w.url, 0), w.load))

    def routed(self, worker: Worker, req: RouteInput) -> None:
        if req.text:
            self.tree.insert(req.text, worker.url)

    def forget(self, url: str) -> None:
        self.tree.remove_tenant(url)

    def maintain(self) -> None:
        for tenant in list(self.tree.chars):
            self.tree.evict(tenant, self.cfg.max_tree_size)


POLICIES: dict[str, Callable[..., Policy]] = {p.name: p for p in (RoundRobin, PowerOfTwo, ConsistentHash, CacheAware)}
