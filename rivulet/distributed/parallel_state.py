"""Process groups and collectives that parallel layers ask for.

One process is one rank. Until a multi-rank executor sets a state, the defaults describe a single
rank and every collective is the identity, so layers are written once for any tensor-parallel size.
The state is set once per process at start-up (by the worker), never per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ParallelState:
    tp_rank: int = 0
    tp_size: int = 1
    tp_group: dist.ProcessGroup | None = None


_STATE = ParallelState()


def init_distributed(rank: int, world_size: int, init_method: str, backend: str,
                     timeout_s: float = 120.0) -> ParallelState:
    """Join the process group (all ranks form one tensor-parallel group) and record this rank's place."""
    import datetime

    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    state = ParallelState(tp_rank=rank, tp_size=world_size, tp_group=dist.group.WORLD)
    set_parallel_state(state)
    return state


def set_parallel_state(state: ParallelState) -> None:
    global _STATE
    _STATE = state


def get_parallel_state() -> ParallelState:
    return _STATE


def get_tp_rank() -> int:
    return _STATE.tp_rank


def get_tp_size() -> int:
    return _STATE.tp_size


def tensor_parallel_all_reduce(x: torch.Tensor, state: ParallelState) -> torch.Tensor:
    """Sum `x` over the tensor-parallel group (in place when there is more than one rank).

    Layers pass the state they were built with, so engines of different sizes can share a process."""
    if state.tp_size == 1:
        return x
    dist.all_reduce(x, group=state.tp_group)
    return x


def tensor_parallel_all_gather(x: torch.Tensor, state: ParallelState, dim: int = -1) -> torch.Tensor:
    """Concatenate each rank's `x` along `dim`, in rank order."""
    if state.tp_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(state.tp_size)]
    dist.all_gather(parts, x.contiguous(), group=state.tp_group)
    return torch.cat(parts, dim=dim)
