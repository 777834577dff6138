"""Collectives of a tensor-parallel group whose ranks share one host, through shared memory.

gloo moves every collective through loopback TCP and its I/O threads: on a small CPU host one all-reduce of
a decode step's few kilobytes takes 0.2-0.5 ms and now and then 4 ms (a wake-up that waits for a scheduler
tick), and a decode step runs two per layer. Here each rank owns a slot in a segment of /dev/shm: it copies
its tensor into its slot, publishes the op's sequence number in its flag, spins until every rank's flag has
reached it, and reads the others' slots. Two sets of slots alternate, so one wait per op is enough: a rank
writes set s again only after every rank has published the op after the one that last used s, which they do
only after reading it. Every rank sums the slots in rank order, so all ranks hold bit-identical results.

Without pipeline parallelism the same segment carries rank 0's command to every rank each step (`broadcast`); a
rank waiting longer than 50 ms naps between looks (0.2 ms, 1 ms after a second), so idle workers keep no core busy.

Flags are plain 8-byte stores and loads: ordered as needed on x86-64 (stores are not reordered with stores,
nor loads with loads), so the segment is used there only; elsewhere the collectives stay on gloo.
A rank that dies mid-collective is noticed (its process is gone) and the waiting ranks raise, as gloo does.
"""

from __future__ import annotations

import math
import os
import platform
import socket
import time
import uuid
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

SLOT_BYTES = 8 << 20  # per rank and set; larger tensors go in pieces
_LINE = 64  # one cache line per rank's flag; a slot's header (the all-to-all's row counts) is whole lines too
SPIN_S, TIMEOUT_S = 1e-3, 300.0  # spin this long before yielding the core; give up after this
IDLE_S, NAP_S = 0.05, 2e-4  # waited this long, a rank is idle (a worker between requests): it naps between looks


def usable(group: dist.ProcessGroup) -> bool:
    """Whether the ranks of `group` can share a segment: x86-64 Linux, gloo, every rank on this host (the
    hostname and boot id agree) and a core for each (the ranks' allowed cores together number at least the
    ranks: a rank that spins while the one it waits for needs its core would slow both; gloo's waits sleep).
    A one-time exchange: every rank of the group must call it."""
    ok = platform.machine().lower() in ("x86_64", "amd64") and Path("/dev/shm").is_dir()
    ok = ok and dist.get_backend(group) == "gloo" and os.environ.get("RIVULET_SHM_COLLECTIVES", "1") != "0"
    boot = Path("/proc/sys/kernel/random/boot_id")
    host = (socket.gethostname(), boot.read_text().strip() if boot.is_file() else "")
    me = (host, ok, sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [])
    ranks: list[object] = [None] * dist.get_world_size(group)
    dist.all_gather_object(ranks, me, group=group)
    cores = {c for r in ranks for c in r[2]}  # type: ignore[index]
    return all(r[0] == host and r[1] for r in ranks) and len(cores) >= len(ranks)  # type: ignore[index]


class ShmGroup:
    """The segment of one group, mapped in each rank (`ShmGroup.create` is collective)."""

    def __init__(self, path: str, rank: int, size: int, pids: list[int], slot_bytes: int) -> None:
        self.rank, self.size, self.pids, self.slot = rank, size, pids, slot_bytes
        self.header = -(-8 * (size + 1) // _LINE) * _LINE  # the all-to-all's row counts and the bytes sent
        total = _LINE * size + 2 * size * slot_bytes
        self.buf = torch.from_file(path, shared=True, size=total, dtype=torch.uint8)
        self.flags = self.buf[:_LINE * size].numpy().view(np.int64)[::_LINE // 8]
        self.seq = int(self.flags[rank])

    @classmethod
    def create(cls, group: dist.ProcessGroup, slot_bytes: int = SLOT_BYTES) -> ShmGroup:
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        names: list[object] = [f"/dev/shm/rivulet-tp-{uuid.uuid4().hex}" if rank == 0 else None, os.getpid()]
        out: list[object] = [None] * size
        dist.all_gather_object(out, names, group=group)
        path = str(out[0][0])  # type: ignore[index]
        if rank == 0:
            with open(path, "wb") as f:
                f.truncate(_LINE * size + 2 * size * slot_bytes)
        dist.barrier(group=group)
        try:
            me = cls(path, rank, size, [int(o[1]) for o in out], slot_bytes)  # type: ignore[index]
        finally:
            dist.barrier(group=group)
            if rank == 0:
                os.unlink(path)  # mapped everywhere now: gone with the last process, whatever happens
        return me

    def _slot(self, seq: int, rank: int) -> torch.Tensor:
        start = _LINE * self.size + ((seq & 1) * self.size + rank) * self.slot
        return self.buf[start:start + self.slot]

    def _exchange(self, data: torch.Tensor, header: list[int] | None = None) -> int:
        """Publish `data` (bytes, contiguous) in this rank's slot of the next op and wait for every rank's."""
        self.seq += 1
        slot = self._slot(self.seq, self.rank)
        if header is not None:
            slot[:self.header].view(torch.int64)[:len(header)] = torch.tensor(header)
        slot[self.header:self.header + data.numel()].copy_(data)
        self.flags[self.rank] = self.seq
        self._wait(self.seq)
        return self.seq

    def _wait(self, seq: int) -> None:
        flags, start = self.flags, time.perf_counter()
        check = start + 1.0
        while int(flags.min()) < seq:
            now = time.perf_counter()
            if now - start < SPIN_S:
                continue
            if now - start < IDLE_S:
                os.sched_yield()  # let whatever else this host runs have the core (and the GIL)
            else:  # no core kept busy by an idle rank; after a second, fewer wake-ups (the first step after: +1 ms)
                time.sleep(NAP_S if now - start < 1.0 else 1e-3)
            if now > check:
                check = now + 1.0
                self._check_peers(now - start)

    def _check_peers(self, waited: float) -> None:
        for r, pid in enumerate(self.pids):
            if not _alive(pid):
                raise RuntimeError(f"rank {r} of the shared-memory group (pid {pid}) has exited")
        if waited > TIMEOUT_S:
            raise RuntimeError(f"a shared-memory collective waited {waited:.0f} s for its peers")

    def _bytes(self, x: torch.Tensor) -> torch.Tensor:
        return x.contiguous().view(-1).view(torch.uint8)

    def _peer(self, seq: int, rank: int, like: torch.Tensor, numel: int, offset: int = 0) -> torch.Tensor:
        """`numel` elements of `like`'s dtype from `rank`'s slot of op `seq`, starting at element `offset`."""
        b = like.element_size()
        raw = self._slot(seq, rank)[self.header + offset * b:self.header + (offset + numel) * b]
        return raw.view(like.dtype)

    def all_reduce(self, x: torch.Tensor) -> None:
        """Sum `x` (contiguous) over the group in place, in pieces of a slot."""
        flat = x.view(-1)
        step = (self.slot - self.header) // x.element_size()
        for lo in range(0, flat.numel(), step):
            part = flat[lo:lo + step]
            seq = self._exchange(self._bytes(part))
            total = self._peer(seq, 0, part, part.numel()).clone()
            for r in range(1, self.size):
                total += self._peer(seq, r, part, part.numel())
            part.copy_(total)

    def _exchange_all(self, data: torch.Tensor, header: list[int]) -> tuple[list[list[int]], list[torch.Tensor]]:
        """Every rank's `data` (bytes; sizes may differ) and `header`: in one op when each fits a slot (then views
        of the slots, valid until the op after next), else in as many as the largest needs."""
        cap = self.slot - self.header
        seq = self._exchange(data[:cap], [data.numel(), *header])
        heads = [self._slot(seq, r)[:self.header].view(torch.int64)[:1 + len(header)].tolist() for r in range(self.size)]
        sizes = [h[0] for h in heads]
        got = [self._slot(seq, r)[self.header:self.header + min(cap, n)] for r, n in enumerate(sizes)]
        if max(sizes) > cap:
            got = [torch.cat([g, g.new_empty(n - g.numel())]) for g, n in zip(got, sizes)]
            for lo in range(cap, max(sizes), cap):
                seq = self._exchange(data[lo:lo + cap])
                for r, n in enumerate(sizes):
                    if n > lo:
                        got[r][lo:min(n, lo + cap)].copy_(self._slot(seq, r)[self.header:self.header + min(cap, n - lo)])
        return [h[1:] for h in heads], got

    def broadcast(self, data: bytes | None, src: int) -> bytes:
        """Rank `src`'s bytes on every rank (the others pass None); every rank takes part in the op."""
        payload = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
        _, got = self._exchange_all(payload, [])
        return data if self.rank == src else got[src].numpy().tobytes()  # type: ignore[return-value]

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `x` (the same shape on each), in rank order."""
        _, got = self._exchange_all(self._bytes(x), [])
        return [x.contiguous() if r == self.rank else g.view(x.dtype).view(x.shape).clone() for r, g in enumerate(got)]

    def all_to_all(self, x: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
        """Rows of `x` split by `send_counts` to the ranks in order; the rows each rank sent here, in rank order."""
        row = math.prod(x.shape[1:])
        heads, got = self._exchange_all(self._bytes(x), send_counts)
        parts = []
        for r, (counts, g) in enumerate(zip(heads, got)):
            if counts[self.rank] != recv_counts[r]:
                raise RuntimeError(f"all_to_all: rank {r} sends {counts[self.rank]} rows here, {recv_counts[r]} expected")
            lo = sum(counts[:self.rank]) * row
            parts.append(g.view(x.dtype)[lo:lo + recv_counts[r] * row].view(-1, *x.shape[1:]))
        return torch.cat(parts)


def _alive(pid: int) -> bool:
    """Whether process `pid` still runs (an exited child that its parent has not reaped yet does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")
