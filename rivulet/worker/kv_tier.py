"""The KV tier's copies (the policy is rivulet/core/kv_tier.py): device blocks to a host buffer and to block
files after a step's forward, and back into a waiting request's device blocks, on one I/O thread.

Host copies are made in the step (one gather per layer); file writes and all loads run on the thread, in
the order they were asked for, so a load never overtakes the write of its block. A block file is

    b"RVKV" | u32 version | u32 header length | JSON header | payload

the header naming the block key, its token ids, the KV layout (dtype, block size, heads and head size of
each layer) and the payload's CRC-32; the payload is each layer's keys then values for the block, in the
device layout. A load checks all of it and refuses a missing, short, corrupt or foreign file (the block is
then computed). A failed write (a full disk) switches the disk tier off with one warning.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import threading
import zlib
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path

import torch

from rivulet.core.kv_tier import KVLoadItem, KVSaveItem, block_file
from rivulet.kernels.ops import get_op

logger = logging.getLogger(__name__)

MAGIC, VERSION = b"RVKV", 1
_PREFIX = struct.Struct("<4sII")
MAX_PENDING_WRITE_BYTES = 512 << 20  # writes queued beyond this are dropped (the disk is slower than the steps)


class KVTierWorker:
    """Copies between the device KV cache (one [2, blocks, block_size, heads, head_size] tensor per layer)
    and the host buffer / block files of the tier."""

    def __init__(self, kv_caches: list[torch.Tensor], host_slots: int, disk_dir: str | None,
                 pin_memory: bool = False) -> None:
        self.kv_caches = kv_caches
        c0 = kv_caches[0]
        self.dtype, self.block_size = c0.dtype, c0.shape[2]
        self.layout = [[int(c.shape[3]), int(c.shape[4])] for c in kv_caches]
        # keys and values: 2 halves; a latent cache (MLA): 1
        self.layer_bytes = [c.shape[0] * self.block_size * h * d * self.dtype.itemsize
                            for c, (h, d) in zip(kv_caches, self.layout)]
        self.host = [torch.empty((c.shape[0], host_slots, *c.shape[2:]), dtype=c.dtype, device="cpu",
                                 pin_memory=pin_memory)
                     for c in kv_caches] if host_slots else []
        self.disk_dir = Path(disk_dir) if disk_dir is not None else None
        self.disk_error: str | None = None
        self._reported_disk_error = False
        self._io = ThreadPoolExecutor(1, thread_name_prefix="rivulet-kv-tier")
        self._lock = threading.Lock()
        self._loads: dict[str, Future[int]] = {}
        self._dropped: list[str] = []  # keys whose file is gone, bad or unwritten (guarded by _lock)
        self._pending_bytes = 0
        self._copy_blocks = get_op("copy_blocks")  # every layer's blocks in one call

    # ---- saves (after the forward of the step that computed the blocks) ----

    def save(self, items: list[KVSaveItem]) -> None:
        host = [(b, s) for b, s, _, _ in items if s >= 0]
        if host:
            self._copy_blocks(self.kv_caches, self.host, torch.tensor([b for b, _ in host]),
                              torch.tensor([s for _, s in host]))
        files = [(b, name, toks) for b, _, name, toks in items if name]
        if not files:
            return
        if self.disk_error is not None or self._pending_bytes > MAX_PENDING_WRITE_BYTES:
            with self._lock:
                self._dropped.extend(name for _, name, _ in files)
            return
        copies = [torch.empty((c.shape[0], len(files), *c.shape[2:]), dtype=c.dtype) for c in self.kv_caches]
        self._copy_blocks(self.kv_caches, copies, torch.tensor([b for b, _, _ in files]),
                          torch.arange(len(files)))  # [2, n, bs, h, d] each, taken now
        size = len(files) * sum(self.layer_bytes)
        with self._lock:
            self._pending_bytes += size
        self._io.submit(self._write_all, [(name, toks) for _, name, toks in files], copies, size)

    def delete(self, names: list[str]) -> None:
        if names and self.disk_dir is not None:
            self._io.submit(self._delete_all, names)

    def _write_all(self, blocks: list[tuple[str, list[int]]], copies: list[torch.Tensor], size: int) -> None:
        try:
            for j, (name, tokens) in enumerate(blocks):
                if self.disk_error is None:
                    try:
                        self._write(name, tokens, [c[:, j] for c in copies])
                        continue
                    except FileNotFoundError:  # its folder or temp file removed meanwhile: this block only
                        pass
                    except OSError as e:  # full, read-only, over a quota or a size limit: no disk tier
                        self.disk_error = f"writing {block_file(self._root, name)}: {e}"
                with self._lock:
                    self._dropped.append(name)
        finally:
            with self._lock:
                self._pending_bytes -= size

    @property
    def _root(self) -> Path:
        assert self.disk_dir is not None
        return self.disk_dir

    def _write(self, name: str, tokens: list[int], layers: list[torch.Tensor]) -> None:
        payload = [t.contiguous().view(torch.uint8).numpy() for t in layers]
        crc = 0
        for p in payload:
            crc = zlib.crc32(p, crc)
        header = json.dumps({"key": name, "tokens": tokens, "dtype": str(self.dtype).removeprefix("torch."),
                             "block_size": self.block_size, "layers": self.layout,
                             "payload_bytes": sum(self.layer_bytes), "crc32": crc}).encode()
        path = block_file(self._root, name)
        path.parent.mkdir(exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(_PREFIX.pack(MAGIC, VERSION, len(header)))
                f.write(header)
                for p in payload:
                    f.write(memoryview(p))
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def _delete_all(self, names: list[str]) -> None:
        for name in names:
            block_file(self._root, name).unlink(missing_ok=True)

    # ---- loads (on the I/O thread; the blocks belong to a request that waits for them) ----

    def start_loads(self, loads: dict[str, list[KVLoadItem]]) -> None:
        for rid, items in loads.items():
            self._loads[rid] = self._io.submit(self._load, items)

    def _load(self, items: list[KVLoadItem]) -> int:
        """Fill the device blocks in order; the number filled before the first that failed. Blocks from host
        slots are copied together (one scatter per layer), files one by one."""
        from_host: list[tuple[int, int]] = []
        for n, (block, slot, name, tokens) in enumerate(items):
            if slot >= 0:
                from_host.append((block, slot))
                continue
            self._copy_from_host(from_host)
            layers = self._read(name, tokens)
            if layers is None:
                with self._lock:
                    self._dropped.append(name)
                return n
            for c, t in zip(self.kv_caches, layers):
                c[:, block].copy_(t)
        self._copy_from_host(from_host)
        return len(items)

    def _copy_from_host(self, pairs: list[tuple[int, int]]) -> None:
        """Host slots into device blocks, (block, slot) each; empties ``pairs``."""
        if not pairs:
            return
        self._copy_blocks(self.host, self.kv_caches, torch.tensor([s for _, s in pairs]),
                          torch.tensor([b for b, _ in pairs]))
        pairs.clear()

    def _read(self, name: str, tokens: list[int]) -> list[torch.Tensor] | None:
        """The block's layers from its file, or None (logged) when the file is missing, bad or foreign
        (a bad file is deleted)."""
        if self.disk_dir is None:
            return None
        path = block_file(self.disk_dir, name)
        try:
            data = path.read_bytes()
        except OSError as e:
            logger.warning("KV tier: cannot read %s (%s); computing the block", path, e)
            return None
        why = self._check(data, name, tokens)
        if why is not None:
            logger.warning("KV tier: ignoring %s (%s); computing the block", path, why)
            path.unlink(missing_ok=True)
            return None
        _, _, hlen = _PREFIX.unpack_from(data)
        buf = torch.frombuffer(bytearray(data[_PREFIX.size + hlen:]), dtype=torch.uint8)
        out, at = [], 0
        for c, (h, d), nbytes in zip(self.kv_caches, self.layout, self.layer_bytes):
            out.append(buf[at:at + nbytes].view(self.dtype).view(c.shape[0], self.block_size, h, d))
            at += nbytes
        return out

    def _check(self, data: bytes, name: str, tokens: list[int]) -> str | None:
        """Why the file cannot be used, or None."""
        if len(data) < _PREFIX.size:
            return "truncated header"
        magic, version, hlen = _PREFIX.unpack_from(data)
        if magic != MAGIC or version != VERSION:
            return "not a block file of this version"
        try:
            header = json.loads(data[_PREFIX.size:_PREFIX.size + hlen])
        except ValueError:
            return "unreadable header"
        want = {"key": name, "tokens": tokens, "dtype": str(self.dtype).removeprefix("torch."), "block_size": self.block_size,
                "layers": self.layout, "payload_bytes": sum(self.layer_bytes)}
        for k, v in want.items():
            if header.get(k) != v:
                return f"{k} is {header.get(k)!r}, expected {v!r}"
        payload = memoryview(data)[_PREFIX.size + hlen:]
        if len(payload) != want["payload_bytes"]:
            return f"payload of {len(payload)} bytes, expected {want['payload_bytes']}"
        if zlib.crc32(payload) != header.get("crc32"):
            return "checksum mismatch"
        return None

    # ---- reports ----

    def report(self, wait_s: float = 0.0) -> tuple[dict[str, int], list[str], str | None]:
        """Loads finished since the last report (waiting up to ``wait_s`` for one when none has), the keys
        to forget, and the disk error (once)."""
        if wait_s > 0 and self._loads and not any(f.done() for f in self._loads.values()):
            wait(list(self._loads.values()), timeout=wait_s, return_when="FIRST_COMPLETED")
        done = {rid: f for rid, f in self._loads.items() if f.done()}
        loaded = {}
        for rid, f in done.items():
            del self._loads[rid]
            try:
                loaded[rid] = f.result()
            except Exception:  # noqa: BLE001 - a failed load is a miss: the blocks are computed
                logger.exception("KV tier: loading blocks for %s failed", rid)
                loaded[rid] = 0
        with self._lock:
            dropped, self._dropped = self._dropped, []
        error = None
        if self.disk_error is not None and not self._reported_disk_error:
            self._reported_disk_error = True
            error = self.disk_error
            logger.warning("KV tier: the disk tier is off from now on: %s", error)
        return loaded, dropped, error

    @property
    def loads_pending(self) -> bool:
        return bool(self._loads)

    def shutdown(self) -> None:
        """Finish queued writes and loads."""
        self._io.shutdown(wait=True)
