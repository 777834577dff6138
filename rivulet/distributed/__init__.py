from rivulet.distributed.parallel_state import (
    ParallelState,
    get_parallel_state,
    get_tp_rank,
    get_tp_size,
    init_distributed,
    set_parallel_state,
    tensor_parallel_all_gather,
    tensor_parallel_all_reduce,
)

__all__ = [
    "ParallelState",
    "get_parallel_state",
    "get_tp_rank",
    "get_tp_size",
    "init_distributed",
    "set_parallel_state",
    "tensor_parallel_all_gather",
    "tensor_parallel_all_reduce",
]
