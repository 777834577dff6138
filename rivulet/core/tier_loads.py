"""The scheduler's side of the KV tier: loads of cached blocks from host memory or disk into the device pool.

A waiting request whose next blocks (after its device prefix hits) are in the tier is given device blocks
for them and waits (WAITING_FOR_KV, no step's budget spent) while the worker loads them. Once the load is
reported, the blocks are in the device pool's prefix cache and the request waits again, at its old place,
to be admitted with them as prefix hits. A request finished meanwhile keeps its blocks until the report
(the load writes into them)."""

from __future__ import annotations

from rivulet.core.kv_cache_manager import KVCacheManager
from rivulet.core.kv_tier import KVTier
from rivulet.core.outputs import SchedulerOutput
from rivulet.core.request import Request, RequestStatus


class TierLoads:
    """Finds a request's blocks in the tier, starts their loads and takes the worker's reports; `loading`
    holds the requests whose load is in flight (WAITING_FOR_KV, or finished meanwhile)."""

    def __init__(self, tier: KVTier, kv_cache_manager: KVCacheManager) -> None:
        self.tier, self.kv = tier, kv_cache_manager
        self.loading: dict[str, Request] = {}
        kv_cache_manager.block_pool.listeners.append(tier.on_event)

    def lookup(self, req: Request, num_hit: int) -> list[tuple[bytes, int]] | None:
        """The request's blocks after its device hits found in the tier (None: wait for a load)."""
        first, end = num_hit // self.kv.block_size, (req.num_tokens - 1) // self.kv.block_size
        if end <= first:
            return []
        keys = self.kv.block_keys(req, first, end)
        found = self.tier.lookup(keys)
        if found is not None:
            self.tier.count_lookup(found, len(keys))
        return found

    def start(self, req: Request, hit_ids: list[int], num_hit: int, found: list[tuple[bytes, int]],
              out: SchedulerOutput) -> bool:
        """Give `req` (taken off the waiting queue by the caller on True) device blocks for its tier hits and
        ask the worker to fill them; False where the device pool has no room for them."""
        kv, bs = self.kv, self.kv.block_size
        if kv.allocate_slots(req, len(found) * bs, hit_ids, register=False) is None:
            return False
        req.status = RequestStatus.WAITING_FOR_KV
        first = num_hit // bs
        block_ids = kv.get_block_ids(req.request_id)[first:first + len(found)]
        tokens = req.all_token_ids
        token_ids = [tokens[(first + j) * bs:(first + j + 1) * bs] for j in range(len(found))]
        out.kv_loads[req.request_id] = self.tier.start_load(req.request_id, found, block_ids, token_ids)
        req.num_computed_tokens = num_hit
        self.loading[req.request_id] = req
        return True

    def report(self, loaded: dict[str, int], dropped: list[str], disk_error: str | None) -> list[Request]:
        """Take the worker's report: finished loads (request id -> blocks loaded before the first that
        failed), block keys whose files are gone or bad, a disk failure that ends the disk tier. Returns the
        loaded requests that wait again (unfinished ones)."""
        tier, kv = self.tier, self.kv
        if disk_error is not None and tier.disk_blocks:
            tier.disable_disk(disk_error)
        tier.drop(dropped)
        again = []
        for rid, num_ok in loaded.items():
            req = self.loading.pop(rid, None)
            if req is None:
                continue
            asked = tier.finish_load(rid, num_ok)
            if not req.is_finished:
                if num_ok < asked:
                    req.skip_kv_tier = True  # its next admission computes what failed to load
                kv.cache_loaded(req, req.num_computed_tokens + num_ok * kv.block_size)
                req.num_computed_tokens = 0
                req.status = RequestStatus.WAITING
                again.append(req)
            kv.free(req)  # the loaded blocks stay in the prefix cache: its admission hits them
        return again
