"""The collectives that parallel layers ask for: all-reduce, all-gather, reduce-scatter and the
sequence-parallel all-gather over the tensor-parallel group, expert parallelism's all-to-all, the
pipeline's sends and receives, and the step's command broadcast. Each counts what it moves (`comm.py`).
A group whose ranks share a host goes through its shared-memory segment (`shm.py`), others through
torch.distributed. With one rank every collective is the identity.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
import torch.distributed as dist

from rivulet.distributed.comm import record
from rivulet.distributed.parallel_state import ParallelState, get_parallel_state, state_named

# torch >= 2.13 names them *_single (the *_tensor names warn)
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _nbytes(x: torch.Tensor) -> int:
    return x.numel() * x.element_size()


def _dispatch(name: str, impl: Callable[..., torch.Tensor], x: torch.Tensor, state: ParallelState,
              *args: Any) -> torch.Tensor:
    """`x` itself with one rank; `impl(x, state, *args)` eagerly; the op `rivulet_dist::<name>` (below) while
    Dynamo traces (an op that returns nothing reduced `x` in place)."""
    if state.tp_size == 1:
        return x
    if torch.compiler.is_compiling():
        out = getattr(torch.ops.rivulet_dist, name)(x, state.op_name, *args)
        return x if out is None else out
    return impl(x, state, *args)


def tensor_parallel_all_reduce(x: torch.Tensor, state: ParallelState) -> torch.Tensor:
    """Sum `x` over the tensor-parallel group (in place when there is more than one rank and the model runs
    eagerly; callers use the returned tensor).

    Layers pass the state they were built with, so engines of different sizes can share a process."""
    return _dispatch("all_reduce", _all_reduce, x, state)


def _all_reduce(x: torch.Tensor, state: ParallelState) -> torch.Tensor:
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
    return _dispatch("all_gather", _all_gather, x, state, dim)


def _all_gather(x: torch.Tensor, state: ParallelState, dim: int) -> torch.Tensor:
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
    return _dispatch("reduce_scatter", _reduce_scatter, x, state)


def _reduce_scatter(x: torch.Tensor, state: ParallelState) -> torch.Tensor:
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
    return _dispatch("sp_all_gather", _sp_all_gather, x, state, num_tokens)


def _sp_all_gather(x: torch.Tensor, state: ParallelState, num_tokens: int) -> torch.Tensor:
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
    world_shm = get_parallel_state().world_shm
    if world_shm is not None:
        return world_shm.broadcast(data if mine else None, src)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    size = torch.tensor([len(data) if mine else 0], dtype=torch.int64, device=device)  # type: ignore[arg-type]
    dist.broadcast(size, src=src)
    if mine:
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)  # type: ignore[arg-type]
    else:
        buf = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(buf, src=src)
    return data if mine else buf.cpu().numpy().tobytes()  # type: ignore[return-value]


# ---- the collectives as dispatcher ops, for torch.compile ----
# A compiled model holds each collective as one opaque node, called with the `op_name` of the state its layer
# was built with (the op finds the state by it); the functions above call them only while Dynamo traces, so
# eager steps skip the dispatcher. The all-reduce sums its input in place (inductor keeps it in place: no
# copy of the activations); the others return new tensors.
# Expert parallelism's all-to-all and the pipeline's sends are not ops: those modes run eagerly.

@torch.library.custom_op("rivulet_dist::all_reduce", mutates_args=("x",))
def _all_reduce_op(x: torch.Tensor, group: str) -> None:
    _all_reduce(x, state_named(group))


@_all_reduce_op.register_fake
def _(x, group):
    return None


@torch.library.custom_op("rivulet_dist::all_gather", mutates_args=())
def _all_gather_op(x: torch.Tensor, group: str, dim: int) -> torch.Tensor:
    return _all_gather(x, state_named(group), dim)


@_all_gather_op.register_fake
def _(x, group, dim):
    shape = list(x.shape)
    shape[dim] *= state_named(group).tp_size
    return x.new_empty(shape)


@torch.library.custom_op("rivulet_dist::reduce_scatter", mutates_args=())
def _reduce_scatter_op(x: torch.Tensor, group: str) -> torch.Tensor:
    return _reduce_scatter(x, state_named(group))


@_reduce_scatter_op.register_fake
def _(x, group):
    return x.new_empty((-(-x.shape[0] // state_named(group).tp_size), *x.shape[1:]))


@torch.library.custom_op("rivulet_dist::sp_all_gather", mutates_args=())
def _sp_all_gather_op(x: torch.Tensor, group: str, num_tokens: int) -> torch.Tensor:
    return _sp_all_gather(x, state_named(group), num_tokens)


@_sp_all_gather_op.register_fake
def _(x, group, num_tokens):
    return x.new_empty((num_tokens, *x.shape[1:]))
