"""Process groups and collectives that parallel layers ask for.

One process is one rank. Until a multi-rank executor sets a state, the defaults describe a single
rank and every collective is the identity, so layers are written once for any tensor-parallel size.
The state is set once per process at start-up (by the worker), never per step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from rivulet.distributed.comm import record
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

    def stage_rank(self, pp_rank: int) -> int:
        """The global rank of this rank's tensor-parallel peer in stage `pp_rank`."""
        return pp_rank * self.tp_size + self.tp_rank


_STATE = ParallelState()
# torch >= 2.13 names them *_single (the *_tensor names warn)
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


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


def _nbytes(x: torch.Tensor) -> int:
    return x.numel() * x.element_size()


def tensor_parallel_all_reduce(x: torch.Tensor, state: ParallelState) -> torch.Tensor:
    """Sum `x` over the tensor-parallel group (in place when there is more than one rank).

    Layers pass the state they were built with, so engines of different sizes can share a process."""
    if state.tp_size == 1:
        return x
    n = state.tp_size
    record("all_reduce", _nbytes(x), 2 * (n - 1) / n * _nbytes(x))
    y = x.contiguous()
    if state.shm is not None:
        state.shm.all_reduce(y)
    else:
        dist.all_reduce(y, group=state.tp_group)
    if y is not x:
        x.copy_(y)
    return x


def tensor_parallel_all_gather(x: torch.Tensor, state: ParallelState, dim: int = -1) -> torch.Tensor:
    """Concatenate each rank's `x` along `dim`, in rank order."""
    if state.tp_size == 1:
        return x
    n = state.tp_size
    record("all_gather", n * _nbytes(x), (n - 1) * _nbytes(x))
    if state.shm is not None:
        return torch.cat(state.shm.all_gather(x), dim=dim)
    parts = [torch.empty_like(x) for _ in range(n)]
    dist.all_gather(parts, x.contiguous(), group=state.tp_group)
    return torch.cat(parts, dim=dim)


def padded_tokens(num_tokens: int, state: ParallelState) -> int:
    """Tokens padded to a multiple of the tensor-parallel size (sequence-parallel shards)."""
    return -(-num_tokens // state.tp_size) * state.tp_size


def tensor_parallel_reduce_scatter(x: torch.Tensor, state: ParallelState) -> torch.Tensor:
    """Sum `x` [T, ...] over the group and keep this rank's token shard [T_pad / tp, ...] (rows
    padded with zeros to a multiple of tp first)."""
    if state.tp_size == 1:
        return x
    n, t = state.tp_size, x.shape[0]
    pad = padded_tokens(t, state) - t
    if pad:
        x = torch.cat([x, x.new_zeros(pad, *x.shape[1:])])
    x = x.contiguous()
    record("reduce_scatter", _nbytes(x), (n - 1) / n * _nbytes(x))
    if state.shm is not None:  # every rank sums all the rows (a small host's segment: cheaper than a second op),
        summed = x.clone()     # in a copy: the caller's tensor stays as it was, as with a reduce-scatter
        state.shm.all_reduce(summed)
        return sequence_shard(summed, state)
    out = x.new_empty(x.shape[0] // n, *x.shape[1:])
    _reduce_scatter_single(out, x, group=state.tp_group)
    return out


def sequence_parallel_all_gather(x: torch.Tensor, state: ParallelState, num_tokens: int) -> torch.Tensor:
    """Token shards [T_pad / tp, ...] back to the first `num_tokens` rows of the whole [T, ...]."""
    if state.tp_size == 1:
        return x
    n = state.tp_size
    x = x.contiguous()
    record("all_gather", n * _nbytes(x), (n - 1) * _nbytes(x))
    if state.shm is not None:
        return torch.cat(state.shm.all_gather(x))[:num_tokens]
    out = x.new_empty(x.shape[0] * n, *x.shape[1:])
    _all_gather_single(out, x, group=state.tp_group)
    return out[:num_tokens]


def sequence_shard(x: torch.Tensor, state: ParallelState) -> torch.Tensor:
    """This rank's token shard of a replicated [T, ...] tensor (no communication)."""
    if state.tp_size == 1:
        return x
    t_pad = padded_tokens(x.shape[0], state)
    if t_pad != x.shape[0]:
        x = torch.cat([x, x.new_zeros(t_pad - x.shape[0], *x.shape[1:])])
    shard = t_pad // state.tp_size
    return x[state.tp_rank * shard:(state.tp_rank + 1) * shard]


def all_to_all(x: torch.Tensor, send_counts: list[int], recv_counts: list[int], state: ParallelState) -> torch.Tensor:
    """Rows of `x` split by `send_counts` go to the tensor-parallel ranks in order; returns the rows
    received, `recv_counts` from each rank, concatenated in rank order (uneven splits allowed)."""
    x = x.contiguous()
    row = x.element_size() * math.prod(x.shape[1:])
    sent = (sum(send_counts) - send_counts[state.tp_rank]) * row
    record("all_to_all", sent, sent)
    if state.shm is not None:
        return state.shm.all_to_all(x, send_counts, recv_counts)
    out = x.new_empty(sum(recv_counts), *x.shape[1:])
    dist.all_to_all_single(out, x, output_split_sizes=recv_counts, input_split_sizes=send_counts,
                           group=state.tp_group)
    return out


def pipeline_send(x: torch.Tensor, state: ParallelState, async_op: bool = False) -> Any:
    """Send `x` to this rank's peer in the next pipeline stage (`async_op`: return the Work to
    wait on; keep `x` alive until then)."""
    record("send", _nbytes(x), _nbytes(x))
    dst = state.stage_rank(state.pp_rank + 1)
    if async_op:
        return dist.isend(x, dst=dst)
    dist.send(x.contiguous(), dst=dst)
    return None


def pipeline_recv(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, state: ParallelState) -> torch.Tensor:
    """Receive a tensor from this rank's peer in the previous pipeline stage."""
    x = torch.empty(shape, dtype=dtype, device=device)
    record("recv", _nbytes(x), 0)
    dist.recv(x, src=state.stage_rank(state.pp_rank - 1))
    return x


def broadcast_bytes(data: bytes | None, src: int) -> bytes:
    """`data` (not empty) of rank `src` on every rank (the others pass None): through the ranks' shared-memory
    segment where they have one, else as two broadcasts over the default group, its length and then the bytes
    (a control message: not in the comm statistics)."""
    mine = dist.get_rank() == src
    if mine and not data:
        raise ValueError("broadcast_bytes: the source rank must pass a non-empty message")
    if _STATE.world_shm is not None:
        return _STATE.world_shm.broadcast(data if mine else None, src)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    size = torch.tensor([len(data) if mine else 0], dtype=torch.int64, device=device)  # type: ignore[arg-type]
    dist.broadcast(size, src=src)
    if mine:
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)  # type: ignore[arg-type]
    else:
        buf = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(buf, src=src)
    return data if mine else buf.cpu().numpy().tobytes()  # type: ignore[return-value]
