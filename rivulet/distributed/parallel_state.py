"""This rank's place among the ranks: its process groups, sizes and parallel modes.

One process is one rank. Until a multi-rank executor sets a state, the defaults describe a single
rank and every collective (`collectives.py`) is the identity, so layers are written once for any
tensor-parallel size. The state is set once per process at start-up (by the worker), never per step.
"""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass

import torch.distributed as dist

from rivulet.distributed.shm import ShmGroup, usable


@dataclass(frozen=True)
class ParallelState:
    """This rank's place. Global rank = pp_rank * tp_size + tp_rank: the ranks of one pipeline stage
    form its tensor-parallel group; expert parallelism (when on) uses that same group."""

    tp_rank: int = 0
    tp_size: int = 1
    tp_group: dist.ProcessGroup | None = None
    pp_rank: int = 0
    pp_size: int = 1
    sequence_parallel: bool = False  # only meaningful with tp_size > 1
    expert_parallel: bool = False
    replicated_experts: tuple[int, ...] = ()
    pp_micro_batches: int = 1  # a step's sequences go through the stages in this many micro-batches
    shm: ShmGroup | None = None  # the TP group's shared-memory segment, when its ranks share a host (CPU)
    world_shm: ShmGroup | None = None  # every rank's (the TP group's without PP): the step's commands (`broadcast_bytes`)

    @property
    def rank(self) -> int:
        return self.pp_rank * self.tp_size + self.tp_rank

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def sp(self) -> bool:
        return self.sequence_parallel and self.tp_size > 1

    def __post_init__(self) -> None:
        # the name a compiled graph calls this state's collectives by (`collectives.py`), unique in the process
        name = f"tp{self.tp_rank}/{self.tp_size}#{next(_NAMES)}"
        object.__setattr__(self, "op_name", name)
        _BY_NAME[name] = self

    def stage_rank(self, pp_rank: int) -> int:
        """The global rank of this rank's tensor-parallel peer in stage `pp_rank`."""
        return pp_rank * self.tp_size + self.tp_rank


_NAMES = itertools.count()
_BY_NAME: weakref.WeakValueDictionary[str, ParallelState] = weakref.WeakValueDictionary()


def state_named(name: str) -> ParallelState:
    """The live state of `op_name` `name`."""
    return _BY_NAME[name]


_STATE = ParallelState()


def init_distributed(rank: int, world_size: int, init_method: str, backend: str,
                     timeout_s: float = 120.0, pipeline_parallel_size: int = 1,
                     sequence_parallel: bool = False, expert_parallel: bool = False,
                     replicated_experts: tuple[int, ...] = (), pp_micro_batches: int | None = None) -> ParallelState:
    """Join the process group, make one tensor-parallel group per pipeline stage, and record this
    rank's place. Every rank creates every group, in the same order (torch.distributed's rule)."""
    import datetime

    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    pp = pipeline_parallel_size
    if world_size % pp:
        raise ValueError(f"world size {world_size} is not a multiple of the pipeline-parallel size {pp}")
    tp = world_size // pp
    group = dist.group.WORLD
    if pp > 1:
        for stage in range(pp):
            g = dist.new_group(list(range(stage * tp, (stage + 1) * tp)))
            if stage == rank // tp:
                group = g
    shm = ShmGroup.create(group) if tp > 1 and usable(group) else None
    # without PP the TP group is every rank: its segment carries the step's commands too. With PP they stay on
    # gloo: a stage spinning for the others' outputs starved the gloo I/O thread its activation sends need
    # (bound to the same core), and pp2 steps went 6.4 -> 9.9 ms
    world_shm = shm if pp == 1 else None
    state = ParallelState(tp_rank=rank % tp, tp_size=tp, tp_group=group, pp_rank=rank // tp, pp_size=pp,
                          sequence_parallel=sequence_parallel, expert_parallel=expert_parallel,
                          replicated_experts=tuple(replicated_experts),
                          pp_micro_batches=max(1, pp_micro_batches or 1), shm=shm, world_shm=world_shm)
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
