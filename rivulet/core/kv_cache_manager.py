"""Which KV cache blocks each request holds, and the prefix cache over them."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

from rivulet.core.block_pool import BlockPool, KVCacheBlock
from rivulet.core.request import Request

KEY_VERSION = b"rivulet-kv-1"


def root_key(namespace: bytes = b"", cache_salt: str | None = None, adapter: str | None = None) -> bytes:
    """The parent key of a request's first block: the cache's ``namespace`` (the model's identity, so
    two models never share a key), the request's ``cache_salt`` (tenants with different salts never
    hit each other's blocks, so none can probe what another has cached) and its LoRA ``adapter``'s
    identity (an adapter changes every layer's keys and values)."""
    salt = b"" if cache_salt is None else b"\x01" + cache_salt.encode()
    if adapter is not None:
        salt += b"\x02" + adapter.encode()
    return hashlib.sha256(KEY_VERSION + b"\x00" + namespace + b"\x00" + salt).digest()


def hash_block_tokens(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """The key of one full block: sha256 of its parent block's key (``root_key`` for the first) and its
    token ids (int32, little-endian). The same in every process and on every machine, so a key can name
    a block on disk or in another replica; a collision would need one of sha256.
    """
    return hashlib.sha256(parent + array("i", token_ids).tobytes()).digest()


@dataclass
class PrefixCacheStats:
    """Cumulative prefix-cache counters, in tokens (one query per request admission)."""

    queries: int = 0
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    """Allocates paged KV blocks to requests and shares full blocks by content hash."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 namespace: bytes = b"") -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.namespace = namespace  # the model's identity: part of every block key
        self.block_pool = BlockPool(num_blocks, enable_prefix_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}  # per request: blocks already registered
        self.stats = PrefixCacheStats()

    @property
    def num_free_blocks(self) -> int:
        """Blocks with no holder (some may still carry a reusable prefix hash)."""
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by at least one request."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """The longest cached prefix of full blocks: (block ids, number of tokens).

        At most ``num_tokens - 1`` tokens (rounded down to a block) can hit, so the
        last token is always computed and the model produces logits for it.
        """
        if not (self.enable_prefix_caching and request.use_prefix_cache):
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        self._update_block_hashes(request, max_blocks)
        hits: list[int] = []
        bs, tokens = self.block_size, request.all_token_ids
        for i, block_hash in enumerate(request.block_hashes[:max_blocks]):
            block = self.block_pool.get_cached_block(block_hash)
            if block is None or block.token_ids != tuple(tokens[i * bs:(i + 1) * bs]):  # a hit is checked
                break
            hits.append(block.block_id)
        return hits, len(hits) * self.block_size

    def allocate_slots(
        self, request: Request, num_new_tokens: int, new_computed_blocks: list[int] | None = None,
        num_lookahead_tokens: int = 0, register: bool = True,
    ) -> list[int] | None:
        """Give ``request`` room for ``num_new_tokens`` more tokens (and ``num_lookahead_tokens``
        after them: scratch room, e.g. for a draft model's guesses, never cached).

        ``new_computed_blocks`` are prefix hits from ``get_computed_blocks`` (only for a
        request that holds no blocks yet); they are shared, not copied. Returns the ids
        of newly allocated blocks, or None, allocating nothing, if too few are free.
        ``register=False`` (blocks the KV tier is about to fill): the new blocks are not put in the
        prefix cache and the admission is not counted; ``cache_loaded`` registers them once filled.
        """
        hits = [self.block_pool.blocks[i] for i in new_computed_blocks or ()]
        req_blocks = self.req_to_blocks.get(request.request_id)
        if hits and req_blocks:
            raise ValueError("prefix hits can only be given to a request with no blocks")
        num_held = len(req_blocks) if req_blocks else 0
        num_computed = request.num_computed_tokens + len(hits) * self.block_size
        num_needed = self.num_blocks_for(num_computed + num_new_tokens + num_lookahead_tokens) - num_held - len(hits)
        num_evictable_hits = sum(1 for b in hits if b.ref_cnt == 0)
        if max(num_needed, 0) + num_evictable_hits > self.num_free_blocks:
            return None

        if req_blocks is None:
            req_blocks = self.req_to_blocks[request.request_id] = []
            self.num_cached_blocks[request.request_id] = 0
            if register:
                self.stats.queries += request.num_tokens
                self.stats.hits += len(hits) * self.block_size
        self.block_pool.touch(hits)
        req_blocks.extend(hits)
        new_blocks = self.block_pool.get_new_blocks(max(num_needed, 0))
        req_blocks.extend(new_blocks)
        if self.enable_prefix_caching:
            self.num_cached_blocks[request.request_id] += len(hits)
            if register:
                self._cache_full_blocks(request, min(num_computed + num_new_tokens, request.num_tokens))
        return [b.block_id for b in new_blocks]

    def cache_loaded(self, request: Request, num_tokens: int) -> None:
        """Register the request's blocks up to ``num_tokens`` (a whole number of blocks the KV tier filled)."""
        if self.enable_prefix_caching and request.request_id in self.req_to_blocks:
            self._cache_full_blocks(request, num_tokens)

    def block_keys(self, request: Request, first: int, end: int) -> list[bytes]:
        """The keys of the request's full blocks ``first .. end - 1``."""
        self._update_block_hashes(request, end)
        return request.block_hashes[first:end]

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first so the tail is evicted first. Idempotent."""
        blocks = self.req_to_blocks.pop(request.request_id, None)
        self.num_cached_blocks.pop(request.request_id, None)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))

    def reset_prefix_cache(self) -> bool:
        """Drop all prefix-cache entries; returns False (and does nothing) while blocks are in use."""
        return self.block_pool.reset_prefix_cache()

    def _cache_full_blocks(self, request: Request, num_known_tokens: int) -> None:
        """Register the request's blocks that are full of known tokens."""
        rid = request.request_id
        num_full = num_known_tokens // self.block_size
        start = self.num_cached_blocks[rid]
        if num_full <= start:
            return
        self._update_block_hashes(request, num_full)
        blocks, bs, tokens = self.req_to_blocks[rid], self.block_size, request.all_token_ids
        for i in range(start, num_full):
            self.block_pool.cache_block(blocks[i], request.block_hashes[i], tuple(tokens[i * bs:(i + 1) * bs]))
        self.num_cached_blocks[rid] = num_full

    def _update_block_hashes(self, request: Request, num_full_blocks: int) -> None:
        """Extend ``request.block_hashes`` to cover its first ``num_full_blocks`` blocks."""
        hashes = request.block_hashes
        bs = self.block_size
        tokens = request.all_token_ids
        for i in range(len(hashes), num_full_blocks):
            parent = hashes[-1] if hashes else root_key(self.namespace, request.cache_salt, request.adapter_key)
            hashes.append(hash_block_tokens(parent, tokens[i * bs:(i + 1) * bs]))
