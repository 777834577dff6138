"""Timing for the device probe: the typical time of a call, alone or in lockstep with the other slices of the
cores (the all-busy probe)."""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

BUSY_WAIT_S = 120.0  # the longest a slice waits for the others at a timing's start


def typical(fn: Callable[[], object], repeat: int = 5, pace: Lockstep | None = None) -> float:
    """The median time of `repeat` calls after a warm-up: the planner predicts typical steps, not the best. With
    `pace`, timed while the other slices of the cores run the same call (the all-busy probe)."""
    if pace is not None:
        return pace.time(fn, repeat)
    fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)



class Lockstep:
    """The slices of the all-busy probe: before each timing they all meet; slice 0 times its calls while the others
    repeat the same call until it is done (so every timed call has company), then they meet again."""

    def __init__(self, start: Any, stop: Any, done: Any, leader: bool) -> None:
        self.start, self.stop, self.done, self.leader = start, stop, done, leader

    def time(self, fn: Callable[[], object], repeat: int) -> float:
        self.start.wait(BUSY_WAIT_S)
        if self.leader:
            t = typical(fn, repeat)
            self.done.value = 1
        else:  # the time of its own calls, which nobody reads
            calls, t0 = 0, time.perf_counter()
            while calls == 0 or not self.done.value:
                fn()
                calls += 1
            t = (time.perf_counter() - t0) / calls
        self.stop.wait(BUSY_WAIT_S)
        if self.leader:
            self.done.value = 0  # every slice is past its loop; none passes the next start before slice 0
        return t

