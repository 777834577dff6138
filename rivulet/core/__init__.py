"""Request state, the paged KV cache manager and the scheduler. Pure Python: no torch."""

from rivulet.core.block_pool import BlockPool, KVCacheBlock, KVCacheEvent
from rivulet.core.kv_cache_manager import (
    KVCacheManager,
    PrefixCacheStats,
    hash_block_tokens,
    root_key,
)
from rivulet.core.outputs import (
    CachedRequestData,
    EngineCoreOutput,
    NewRequestData,
    SchedulerOutput,
)
from rivulet.core.request import FINISH_REASONS, Request, RequestStatus
from rivulet.core.request_queue import RequestQueue
from rivulet.core.scheduler import Scheduler, SchedulerStats

__all__ = [
    "BlockPool",
    "CachedRequestData",
    "EngineCoreOutput",
    "FINISH_REASONS",
    "KVCacheBlock",
    "KVCacheEvent",
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
    "root_key",
]
