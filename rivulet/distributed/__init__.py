from rivulet.distributed.parallel_state import (
    ParallelState,
    get_parallel_state,
    get_tp_rank,
    get_tp_size,
    init_distributed,
    set_parallel_state,
)
from rivulet.distributed.collectives import (
    tensor_parallel_all_gather,
    tensor_parallel_all_reduce,
    all_to_all,
    broadcast_bytes,
    padded_tokens,
    pipeline_recv,
    pipeline_send,
    sequence_parallel_all_gather,
    sequence_shard,
    tensor_parallel_reduce_scatter,
)
from rivulet.distributed.comm import get_comm_stats, reset_comm_stats

__all__ = [
    "ParallelState",
    "get_parallel_state",
    "get_tp_rank",
    "get_tp_size",
    "init_distributed",
    "set_parallel_state",
    "tensor_parallel_all_gather",
    "tensor_parallel_all_reduce",
    "all_to_all",
    "broadcast_bytes",
    "get_comm_stats",
    "padded_tokens",
    "pipeline_recv",
    "pipeline_send",
    "reset_comm_stats",
    "sequence_parallel_all_gather",
    "sequence_shard",
    "tensor_parallel_reduce_scatter",
]
