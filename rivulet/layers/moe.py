"""Mixture-of-experts layer: router output in, weighted sum of the chosen experts out."""

from __future__ import annotations

import itertools
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from rivulet.distributed import (all_to_all, get_parallel_state, padded_tokens, sequence_parallel_all_gather,
                                 tensor_parallel_all_reduce, tensor_parallel_reduce_scatter)
from rivulet.kernels.activation import silu_and_mul_ref
from rivulet.kernels.library import graph_op
from rivulet.kernels.ops import get_op

# expert-parallel layers by name, for the op a compiled graph calls (`expert_parallel_moe`)
_EP_LAYERS: weakref.WeakValueDictionary[str, FusedMoE] = weakref.WeakValueDictionary()
_EP_NAMES = itertools.count()


class FusedMoE(nn.Module):
    """All experts' weights stacked: w13 [E, 2I, H] (gate rows, then up rows) and w2 [E, H, I].

    Under tensor parallelism each expert's intermediate dimension is split like an MLP's. Under
    expert parallelism (`ParallelState.expert_parallel`, over the TP ranks) rank r holds whole
    experts [r E/ep, (r+1) E/ep) plus copies of the `replicated_experts`; each rank routes every
    token (the router is replicated), takes its token shard, sends each (token, expert) row to the
    expert's owner with one all-to-all (a replicated expert is computed where the token is), gets the
    weighted results back with a second all-to-all, and all-gathers the shards (sequence parallelism
    keeps the shard). Every rank can work out what it will receive from the routing, so only hidden
    rows travel.

    Routing statistics: `expert_counts` [E] (tokens routed to each expert) and `rank_load` [ep]
    ((token, expert) rows each rank computed), accumulated since the last `reset_load_stats`.
    """

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, renormalize: bool) -> None:
        super().__init__()
        self.parallel = ps = get_parallel_state()
        self.tp_rank, tp = self.parallel.tp_rank, self.parallel.tp_size
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.ep = ps.expert_parallel and tp > 1
        self.ep_size, self.ep_rank = (tp, ps.tp_rank) if self.ep else (1, 0)
        if num_experts % self.ep_size:
            raise ValueError(f"expert parallelism over {tp} ranks does not divide the model's {num_experts} experts")
        per_rank = num_experts // self.ep_size
        local = list(range(self.ep_rank * per_rank, (self.ep_rank + 1) * per_rank))
        self.replicated = sorted(set(ps.replicated_experts)) if self.ep else []
        self.local_experts = local + [e for e in self.replicated if e not in local]
        self.slot_of = {e: i for i, e in enumerate(self.local_experts)}
        self.inter = intermediate_size if self.ep else intermediate_size // tp
        if self.ep:  # whole experts: no split of the intermediate dimension
            self.tp_rank = 0
            self.ep_name = f"moe{next(_EP_NAMES)}"
            _EP_LAYERS[self.ep_name] = self
        n_slots = len(self.local_experts)
        self.w13_weight = nn.Parameter(torch.empty(n_slots, 2 * self.inter, hidden_size), requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(n_slots, hidden_size, self.inter), requires_grad=False)
        # owner rank of each expert (a replicated one: the token's own rank, decided per row)
        self.register_buffer("_owner", torch.arange(num_experts) // per_rank, persistent=False)
        is_rep = torch.zeros(num_experts, dtype=torch.bool)
        is_rep[self.replicated] = True
        self.register_buffer("_replicated_mask", is_rep, persistent=False)
        # written by every forward: Platform.place_module keeps them out of the weights' shared arena (a compiled
        # graph cannot write an input that shares its storage with inputs of another dtype)
        self.written_buffers = ("expert_counts", "rank_load", "cross_rows")
        self.register_buffer("expert_counts", torch.zeros(num_experts, dtype=torch.int64), persistent=False)
        self.register_buffer("rank_load", torch.zeros(self.ep_size, dtype=torch.int64), persistent=False)
        self.register_buffer("cross_rows", torch.zeros((), dtype=torch.int64), persistent=False)
        self.w13_weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        self.w2_weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        self._topk_routing, self._fused_moe = get_op("topk_routing"), get_op("fused_moe")
        # per local slot, w13 and w2 in the backend's packed layout (`pack_experts`, which drops the stacked ones)
        self.packed: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: str, expert_id: int | None = None) -> None:
        """Load one expert's `w1` (gate), `w3` (up) or `w2` (down), or all experts at once
        (expert_id None: `w13` as [E, 2I, H] or `w2` as [E, H, I])."""
        n, r = self.inter, self.tp_rank
        if expert_id is None:
            if len(self.local_experts) != self.num_experts:  # expert parallel: this rank's experts only
                loaded = loaded[torch.tensor(self.local_experts, device=loaded.device)]
            if shard_id == "w13":
                gate, up = loaded.chunk(2, dim=1)
                param.data[:, :n].copy_(gate.narrow(1, r * n, n))
                param.data[:, n:].copy_(up.narrow(1, r * n, n))
            else:
                param.data.copy_(loaded.narrow(2, r * n, n))
            return
        if expert_id not in self.slot_of:  # another rank's expert
            return
        dst = param.data[self.slot_of[expert_id]]
        if shard_id == "w1":
            dst[:n].copy_(loaded.narrow(0, r * n, n))
        elif shard_id == "w3":
            dst[n:].copy_(loaded.narrow(0, r * n, n))
        else:
            dst.copy_(loaded.narrow(1, r * n, n))

    def pack_experts(self, opaque: bool = True) -> bool:
        """Put every local expert's weights in the backend's packed layout for `packed_linear` (the CPU's, for
        bf16) and drop the stacked copies; False (nothing changed) where the backend has no such layout, or
        where it is an opaque tensor's (oneDNN's) and `opaque` is False (a model to compile)."""
        pack = get_op("pack_linear_weight")
        w13 = [pack(w) for w in self.w13_weight.data]
        w2 = [pack(w) for w in self.w2_weight.data]
        if any(p is None or (p.is_mkldnn and not opaque) for p in w13 + w2):
            return False
        self.packed = (w13, w2)
        self._linear, self._act = get_op("packed_linear"), get_op("silu_and_mul")  # (expert parallelism's loop)
        self._packed_moe = get_op("packed_fused_moe")
        for name in ("w13_weight", "w2_weight"):  # read through `packed` from now on
            setattr(self, name, nn.Parameter(getattr(self, name).data.new_empty(0), requires_grad=False))
        return True

    def _experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The chosen experts' weighted sum, without expert parallelism (every expert is local: ids are slots)."""
        if self.packed is not None:
            return self._packed_moe(x, *self.packed, weights, ids)
        return self._fused_moe(x, self.w13_weight, self.w2_weight, weights, ids)

    def reset_load_stats(self) -> None:
        self.expert_counts.zero_()
        self.rank_load.zero_()
        self.cross_rows.zero_()

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] (all tokens, the same on every rank) -> [T, hidden], or this rank's token
        shard under sequence parallelism."""
        weights, ids = self._topk_routing(router_logits, self.top_k, self.renormalize)
        return self.forward_routed(x, weights, ids)

    def forward_routed(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The experts on a routing the caller chose (DeepSeek's grouped routing): weights [T, k] float32,
        expert ids [T, k] int64."""
        flat = ids.flatten()  # index_add_, not bincount: no host sync, so CUDA graphs can capture it
        self.expert_counts.index_add_(0, flat, torch.ones_like(flat))
        if self.ep:
            return expert_parallel_moe(x, weights, ids, self.ep_name)
        self.rank_load.add_(flat.numel())
        y = self._experts(x, weights, ids)
        if self.parallel.sp:
            return tensor_parallel_reduce_scatter(y, self.parallel)
        return tensor_parallel_all_reduce(y, self.parallel)

    def _destinations(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(source rank, computing rank) of each (token, k) row of a padded [T_pad, k] routing: the
        token's shard owner, and the expert's owner (the source itself for a replicated expert)."""
        shard = ids.shape[0] // self.ep_size
        src = (torch.arange(ids.shape[0], device=ids.device) // shard)[:, None].expand_as(ids)
        return src, torch.where(self._replicated_mask[ids], src, self._owner[ids])

    def _forward_ep(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        ps, n, r, k = self.parallel, self.ep_size, self.ep_rank, self.top_k
        t = x.shape[0]
        t_pad = padded_tokens(t, ps)
        valid = torch.arange(t_pad, device=x.device) < t
        if t_pad != t:
            pad = t_pad - t
            ids = torch.cat([ids, ids.new_zeros(pad, k)])
            weights = torch.cat([weights, weights.new_zeros(pad, k)])
        shard = t_pad // n
        src, dest = self._destinations(ids)  # [T_pad, k], the same on every rank
        dest = torch.where(valid[:, None], dest, -1)  # padding rows go nowhere
        self.rank_load += torch.bincount(dest[dest >= 0], minlength=n)
        self.cross_rows += ((dest >= 0) & (dest != src)).sum()
        # what this rank sends: its shard's rows, grouped by destination (stable: token-major, k-minor)
        lo = r * shard
        my_dest = dest[lo:lo + shard].flatten()
        order = torch.sort(my_dest, stable=True).indices
        order = order[my_dest[order] >= 0]
        send_counts = torch.bincount(my_dest[my_dest >= 0], minlength=n).tolist()
        tok = lo + torch.div(order, k, rounding_mode="floor")
        send = x[tok.clamp(max=t - 1)]
        # what this rank receives: rows of every shard whose destination is r, in the senders' order
        flat = dest.view(n, shard * k)
        recv_counts = (flat == r).sum(1).tolist()
        recv_rows = torch.nonzero(dest.flatten() == r).flatten()  # global (token, k) indices, shard by shard
        recv = all_to_all(send, send_counts, recv_counts, ps)
        # compute the received rows, expert by expert, each scaled by its routing weight
        r_ids, r_w = ids.flatten()[recv_rows], weights.flatten()[recv_rows].to(x.dtype)
        out_rows = torch.empty_like(recv)
        w13, w2 = self.packed or (self.w13_weight, self.w2_weight)
        linear, act = (self._linear, self._act) if self.packed is not None else (F.linear, silu_and_mul_ref)
        for e in torch.unique(r_ids).tolist():
            sel = torch.where(r_ids == e)[0]
            slot = self.slot_of[e]
            h = act(linear(recv[sel], w13[slot]))
            out_rows[sel] = linear(h, w2[slot]) * r_w[sel, None]
        back = all_to_all(out_rows, recv_counts, send_counts, ps)
        # combine: each token's rows summed in ascending expert order (as the single-rank kernel does): a returned
        # row (token t, choice j) lands at t * k + (the rank of its expert among t's choices), whole rows at once
        my_ids = ids[lo:lo + shard]
        rank_in_token = torch.argsort(torch.argsort(my_ids, dim=1, stable=True), dim=1)
        place = (torch.arange(shard, device=x.device)[:, None] * k + rank_in_token).flatten()
        y_rows = torch.zeros(shard * k, x.shape[1], dtype=x.dtype, device=x.device)
        y_rows[place[order]] = back
        y_rows = y_rows.view(shard, k, -1)
        y = y_rows[:, 0]
        for j in range(1, k):
            y = y + y_rows[:, j]
        if ps.sp:
            return y
        return sequence_parallel_all_gather(y, ps, t)


def _expert_parallel_like(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, layer: str) -> torch.Tensor:
    ps = _EP_LAYERS[layer].parallel
    if ps.sp:  # this rank's shard of the padded tokens
        return x.new_empty((padded_tokens(x.shape[0], ps) // ps.tp_size, x.shape[1]))
    return x.new_empty(x.shape)


@graph_op("rivulet_ep", "expert_parallel_moe", _expert_parallel_like)
def expert_parallel_moe(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, layer: str) -> torch.Tensor:
    """The expert-parallel layer named `layer` on a routing (`FusedMoE._forward_ep`), as one op in a compiled
    graph: its all-to-alls take split sizes read on the host, which a graph cannot hold."""
    return _EP_LAYERS[layer]._forward_ep(x, weights, ids)
