"""Request state, the paged KV cache manager and the scheduler. Pure Python: no torch."""

from rivulet.core.block_pool import BlockPool, KVCacheBlock
from rivulet.core.kv_cache_manager import KVCacheManager, PrefixCacheStats, hash_block_tokens
from rivulet.core.outputs import (
    CachedRequestData,
    EngineCoreOutput,
    NewRequestData,
    SchedulerOutput,
)
from rivulet.core.request import Request, RequestStatus
from rivulet.core.request_queue import RequestQueue
from rivulet.core.scheduler import Scheduler, SchedulerStats

__all__ = [
    "BlockPool",
    "CachedRequestData",
    "EngineCoreOutput",
    "KVCacheBlock",
    "KVCacheManager",
    "NewRequestData",
    "PrefixCacheStats",
    "Request",
    "RequestQueue",
    "RequestStatus",
    "Scheduler",
    "SchedulerOutput",
    "SchedulerStats",
    "hash_block_tokens",
]
