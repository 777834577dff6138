"""The pool of KV cache blocks: reference counts, an LRU free queue, the prefix-cache map, and the
events other parts follow (a block cached, a block evicted, everything forgotten)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class KVCacheEvent:
    """``stored``: a full block was registered under ``block_hash`` (its ``token_ids`` given); ``removed``:
    the block holding ``block_hash`` was evicted for reuse; ``cleared``: every hash was forgotten."""

    kind: Literal["stored", "removed", "cleared"]
    block_hash: bytes | None = None
    block_id: int = -1
    token_ids: tuple[int, ...] = ()


class KVCacheBlock:
    """One block of ``block_size`` token slots in the paged KV cache.

    ``ref_cnt`` is the number of requests holding the block. ``block_hash`` is set
    once the block is full and registered in the prefix cache, with the ``token_ids`` it
    holds (checked on every hit); both survive while the block sits in the free queue and
    are cleared when the block is evicted for reuse.
    """

    __slots__ = ("block_id", "ref_cnt", "block_hash", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        self.token_ids: tuple[int, ...] | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock({self.block_id}, ref={self.ref_cnt}, hash={self.block_hash})"


class BlockPool:
    """All blocks of the cache, plus the free queue and the hash -> block map.

    The free queue holds exactly the blocks with ``ref_cnt == 0``, in eviction order:
    new allocations take from the front. Freed blocks that carry a hash go to the
    back (least recently freed is evicted first); freed blocks without a hash go to
    the front, since keeping them buys nothing. An ``OrderedDict`` gives O(1)
    removal from the middle when a cached free block is hit again. Each registration,
    eviction and reset is handed, as a ``KVCacheEvent``, to every function in ``listeners``.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, KVCacheBlock] = OrderedDict(
            (b.block_id, b) for b in self.blocks
        )
        self.cached: dict[bytes, KVCacheBlock] = {}  # block hash -> block
        self.listeners: list[Callable[[KVCacheEvent], None]] = []

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        """The block registered under ``block_hash``, in use or free, if any."""
        return self.cached.get(block_hash)

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Take ``n`` blocks from the front of the free queue (evicting their hashes)."""
        if n > len(self.free_queue):
            raise RuntimeError(f"asked for {n} blocks, only {len(self.free_queue)} free")
        out: list[KVCacheBlock] = []
        for _ in range(n):
            _, block = self.free_queue.popitem(last=False)
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take one more reference to each block (prefix hits), pulling free ones out."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_queue[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block, in the given order (first freed, first evicted)."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of block {block.block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue[block.block_id] = block
                if block.block_hash is None:
                    self.free_queue.move_to_end(block.block_id, last=False)

    def cache_block(self, block: KVCacheBlock, block_hash: bytes, token_ids: tuple[int, ...] = ()) -> None:
        """Register a full block holding ``token_ids`` under ``block_hash`` unless another block already holds it."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash not in self.cached:
            block.block_hash, block.token_ids = block_hash, token_ids
            self.cached[block_hash] = block
            self._emit(KVCacheEvent("stored", block_hash, block.block_id, token_ids))

    def reset_prefix_cache(self) -> bool:
        """Forget every hash; refused (False) while any block is in use."""
        if len(self.free_queue) != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = block.token_ids = None
        self.cached.clear()
        self._emit(KVCacheEvent("cleared"))
        return True

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
                self._emit(KVCacheEvent("removed", block.block_hash, block.block_id))
            block.block_hash = block.token_ids = None

    def _emit(self, event: KVCacheEvent) -> None:
        for listener in self.listeners:
            listener(event)
