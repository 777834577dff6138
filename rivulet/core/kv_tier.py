"""The KV storage tier's policy: which blocks live in host memory and on disk below the device pool, what
to copy each step, and what a request must load before it runs. Pure Python; the worker does the copies
(rivulet/worker/kv_tier.py) and reports what failed.

Write-through: every block the device pool registers (a ``stored`` event) is copied once, after the step
that computes it, to each tier that lacks it, so evicting a block from the device costs nothing. Each
tier is an LRU of block keys (host: key -> slot of a preallocated buffer; disk: one file per key). A key
being loaded is pinned (never evicted). The disk index is rebuilt from the directory at start (oldest
file first), so the tier survives a restart; the worker checks each file when it loads it.
"""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from rivulet.core.block_pool import KVCacheEvent

# one block to copy after the step's forward: (device block id, host slot or -1, key hex or "" for no file,
# the block's token ids)
KVSaveItem = tuple[int, int, str, list[int]]
# one block to load: (device block id, host slot or -1 to read the file, key hex, the block's token ids)
KVLoadItem = tuple[int, int, str, list[int]]

FILE_SUFFIX = ".kv"
FILE_OVERHEAD = 1024  # bytes a block file takes beyond its KV payload (header), for the disk budget


def block_file(root: Path, key_hex: str) -> Path:
    """Where the file of block ``key_hex`` lives: ``root/ab/abcdef...kv`` (256 subfolders)."""
    return root / key_hex[:2] / (key_hex + FILE_SUFFIX)


@dataclass
class KVTierStats:
    """Cumulative counters, in blocks unless named otherwise. A lookup below the device counts each
    block it finds in host memory or on disk, and one miss for the block where the chain ends."""

    host_hits: int = 0
    disk_hits: int = 0
    misses: int = 0
    saved_host: int = 0
    saved_disk: int = 0
    loaded_host: int = 0
    loaded_disk: int = 0
    load_failures: int = 0  # blocks whose load failed (missing, corrupt, foreign file): recomputed
    loads: int = 0  # completed loads (one per request admission that found blocks)
    load_seconds: float = 0.0  # their total time from issue to report


class KVTier:
    """The index of the host and disk tiers, and the copies each step carries out."""

    def __init__(self, host_slots: int = 0, disk_dir: str | Path | None = None, disk_blocks: int = 0) -> None:
        self.host_slots = host_slots
        self.host: OrderedDict[bytes, int] = OrderedDict()  # key -> host slot, least recently used first
        self._free_slots = list(range(host_slots - 1, -1, -1))
        self.disk_dir = Path(disk_dir) if disk_dir is not None else None
        self.disk_blocks = disk_blocks if self.disk_dir is not None else 0
        self.disk: OrderedDict[bytes, None] = OrderedDict()  # keys with a file, least recently used first
        self.pinned: dict[bytes, int] = {}  # key -> loads in flight reading it
        self.disk_error: str | None = None  # why the disk tier was switched off
        self.stats = KVTierStats()
        self._saves: list[KVSaveItem] = []
        self._deletes: list[str] = []
        self._loads: dict[str, tuple[float, list[tuple[bytes, int]]]] = {}  # request id -> (start, [(key, slot)])
        if self.disk_dir is not None:
            self._scan()

    @property
    def enabled(self) -> bool:
        return self.host_slots > 0 or self.disk_blocks > 0

    def _scan(self) -> None:
        """Index the block files already in the directory, oldest first (left by an earlier run)."""
        assert self.disk_dir is not None
        self.disk_dir.mkdir(parents=True, exist_ok=True)
        found: list[tuple[int, bytes]] = []
        for sub in os.scandir(self.disk_dir):
            if not sub.is_dir():
                continue
            for entry in os.scandir(sub.path):
                name = entry.name
                if name.endswith(".tmp"):  # a write cut short by an earlier exit
                    os.unlink(entry.path)
                    continue
                try:
                    key = bytes.fromhex(name.removesuffix(FILE_SUFFIX))
                except ValueError:
                    continue
                if name.endswith(FILE_SUFFIX) and len(key) == 32:
                    found.append((entry.stat().st_mtime_ns, key))
        for _, key in sorted(found):
            self.disk[key] = None
        while len(self.disk) > self.disk_blocks:  # the budget shrank since
            self._evict_disk()

    # ---- saves: the device pool's events ----

    def on_event(self, event: KVCacheEvent) -> None:
        """A listener of the device pool: plan the copy of each newly registered block; cancel it if the block
        is evicted for reuse before the step that copies it has run."""
        if event.kind == "stored" and event.block_hash is not None:
            self._plan_save(event.block_hash, event.block_id, list(event.token_ids))
        elif event.kind == "removed" and event.block_hash is not None:
            self._cancel_save(event.block_hash, event.block_id)

    def _cancel_save(self, key: bytes, block_id: int) -> None:
        """Drop a planned copy of `block_id` (and its index entries): its block now holds another's KV. (A block
        the KV tier loaded is registered when the load reports and free at once; the next step's allocations
        may reuse it before that step's copies run.)"""
        for item in [s for s in self._saves if s[0] == block_id]:
            self._saves.remove(item)
            _, slot, name, _ = item
            if slot >= 0 and self.host.get(key) == slot:
                del self.host[key]
                self._free_slots.append(slot)
                self.stats.saved_host -= 1
            if name and key in self.disk:
                del self.disk[key]
                self.stats.saved_disk -= 1

    def _plan_save(self, key: bytes, block_id: int, token_ids: list[int]) -> None:
        slot = -1
        if self.host_slots:
            if key in self.host:
                self.host.move_to_end(key)
            else:
                slot = self._take_slot()
                if slot >= 0:
                    self.host[key] = slot
                    self.stats.saved_host += 1
        name = ""
        if self.disk_blocks:
            if key in self.disk:
                self.disk.move_to_end(key)
            elif self._make_disk_room():
                self.disk[key] = None
                name = key.hex()
                self.stats.saved_disk += 1
        if slot >= 0 or name:
            self._saves.append((block_id, slot, name, token_ids))

    def _take_slot(self) -> int:
        if self._free_slots:
            return self._free_slots.pop()
        for key in self.host:  # the least recently used key no load is reading
            if key not in self.pinned:
                return self.host.pop(key)
        return -1

    def _make_disk_room(self) -> bool:
        while len(self.disk) >= self.disk_blocks:
            if not self._evict_disk():
                return False
        return True

    def _evict_disk(self) -> bool:
        for key in self.disk:
            if key not in self.pinned:
                del self.disk[key]
                self._deletes.append(key.hex())
                return True
        return False

    def take_ops(self) -> tuple[list[KVSaveItem], list[str]]:
        """The copies and file deletions planned since the last call (for the step about to run)."""
        saves, deletes = self._saves, self._deletes
        self._saves, self._deletes = [], []
        return saves, deletes

    # ---- loads ----

    def lookup(self, keys: list[bytes]) -> list[tuple[bytes, int]] | None:
        """The blocks below the device for the leading ``keys``, as (key, host slot or -1 for the disk), up to
        the first key in neither tier; None if one of them is being loaded already (wait for that load, then
        find the blocks in the device pool)."""
        found: list[tuple[bytes, int]] = []
        for key in keys:
            if key in self.pinned:
                return None
            slot = self.host.get(key, -1)
            if slot < 0 and key not in self.disk:
                break
            found.append((key, slot))
        return found

    def count_lookup(self, found: list[tuple[bytes, int]], num_keys: int) -> None:
        """Count a lookup of ``num_keys`` blocks below the device that found ``found``."""
        for _, slot in found:
            if slot >= 0:
                self.stats.host_hits += 1
            else:
                self.stats.disk_hits += 1
        if len(found) < num_keys:
            self.stats.misses += 1

    def start_load(self, request_id: str, found: list[tuple[bytes, int]], block_ids: list[int],
                   token_ids: list[list[int]]) -> list[KVLoadItem]:
        """Pin the blocks and return the worker's load list for ``request_id``."""
        for key, _ in found:
            self.pinned[key] = self.pinned.get(key, 0) + 1
            if key in self.host:
                self.host.move_to_end(key)
            if key in self.disk:
                self.disk.move_to_end(key)
        self._loads[request_id] = (time.monotonic(), found)
        return [(b, slot, key.hex(), toks) for (key, slot), b, toks in zip(found, block_ids, token_ids)]

    def finish_load(self, request_id: str, num_ok: int) -> int:
        """The worker loaded the first ``num_ok`` blocks of the request's list (the rest failed); returns
        how many were asked for."""
        start, found = self._loads.pop(request_id)
        for key, _ in found:
            n = self.pinned.pop(key) - 1
            if n:
                self.pinned[key] = n
        s = self.stats
        s.loads += 1
        s.load_seconds += time.monotonic() - start
        for _, slot in found[:num_ok]:
            if slot >= 0:
                s.loaded_host += 1
            else:
                s.loaded_disk += 1
        s.load_failures += len(found) - num_ok
        return len(found)

    @property
    def loading(self) -> bool:
        return bool(self._loads)

    # ---- what the worker reports ----

    def drop(self, keys_hex: list[str]) -> None:
        """Forget blocks the worker could not write or read back (their files are gone or bad)."""
        for h in keys_hex:
            key = bytes.fromhex(h)
            self.disk.pop(key, None)
            slot = self.host.pop(key, None)
            if slot is not None:
                self._free_slots.append(slot)

    def disable_disk(self, reason: str) -> None:
        """The disk failed (full, read-only): no disk tier from now on; what is in host memory stays."""
        self.disk_blocks = 0
        self.disk.clear()
        self.disk_error = reason
