"""Counting what the collectives move, per op kind, in this process (rank).

Every collective in `rivulet.distributed` records two numbers per call:

- payload: the bytes of the tensor the op is about (all-reduce: the tensor; all-gather: the
  gathered output; reduce-scatter: the full input; send/recv: the tensor; all-to-all: the rows
  this rank sends to other ranks, its own rows excluded);
- wire: the bytes this rank sends under the usual algorithms (ring all-reduce 2(n-1)/n x payload,
  ring reduce-scatter and all-gather (n-1)/n x payload, point-to-point and all-to-all as is).

`benchmarks/comm_table.py` turns them into bytes per token; tests compare them with formulas.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class OpStats:
    calls: int = 0
    payload_bytes: int = 0
    wire_bytes: int = 0


_STATS: dict[str, OpStats] = {}


def record(kind: str, payload_bytes: int, wire_bytes: float) -> None:
    s = _STATS.setdefault(kind, OpStats())
    s.calls += 1
    s.payload_bytes += int(payload_bytes)
    s.wire_bytes += int(round(wire_bytes))


def get_comm_stats() -> dict[str, dict[str, int]]:
    """{op kind: {"calls", "payload_bytes", "wire_bytes"}} since the last reset, in this process."""
    return {k: dict(calls=v.calls, payload_bytes=v.payload_bytes, wire_bytes=v.wire_bytes) for k, v in _STATS.items()}


def reset_comm_stats() -> None:
    _STATS.clear()
