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


def set_parallel_state(state: ParallelState) -> None:
    global _STATE
    _STATE = state


def get_parallel_state() -> ParallelState:
    return _STATE


def get_tp_rank() -> int:
    return _STATE.tp_rank


def get_tp_size() -> int:
    return _STATE.tp_size


def tensor_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the tensor-parallel group (in place when there is more than one rank)."""
    if _STATE.tp_size == 1:
        return x
    dist.all_reduce(x, group=_STATE.tp_group)
    return x


def tensor_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate each rank's `x` along `dim`, in rank order."""
    if _STATE.tp_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_STATE.tp_size)]
    dist.all_gather(parts, x.contiguous(), group=_STATE.tp_group)
    return torch.cat(parts, dim=dim)
