"""Mixture-of-experts layer: router output in, weighted sum of the chosen experts out."""

from __future__ import annotations

import torch
from torch import nn

from rivulet.distributed import get_parallel_state, tensor_parallel_all_reduce
from rivulet.kernels.ops import get_op


class FusedMoE(nn.Module):
    """All experts' weights stacked: w13 [E, 2I, H] (gate rows, then up rows) and w2 [E, H, I].

    Under tensor parallelism each expert's intermediate dimension is split like an MLP's.
    """

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, renormalize: bool) -> None:
        super().__init__()
        self.parallel = get_parallel_state()
        self.tp_rank, tp = self.parallel.tp_rank, self.parallel.tp_size
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.inter = intermediate_size // tp
        self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * self.inter, hidden_size), requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, self.inter), requires_grad=False)
        self.w13_weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        self.w2_weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        self._topk_routing, self._fused_moe = get_op("topk_routing"), get_op("fused_moe")

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: str, expert_id: int | None = None) -> None:
        """Load one expert's `w1` (gate), `w3` (up) or `w2` (down), or all experts at once
        (expert_id None: `w13` as [E, 2I, H] or `w2` as [E, H, I])."""
        n, r = self.inter, self.tp_rank
        if expert_id is None:
            if shard_id == "w13":
                gate, up = loaded.chunk(2, dim=1)
                param.data[:, :n].copy_(gate.narrow(1, r * n, n))
                param.data[:, n:].copy_(up.narrow(1, r * n, n))
            else:
                param.data.copy_(loaded.narrow(2, r * n, n))
            return
        dst = param.data[expert_id]
        if shard_id == "w1":
            dst[:n].copy_(loaded.narrow(0, r * n, n))
        elif shard_id == "w3":
            dst[n:].copy_(loaded.narrow(0, r * n, n))
        else:
            dst.copy_(loaded.narrow(1, r * n, n))

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        weights, ids = self._topk_routing(router_logits, self.top_k, self.renormalize)
        y = self._fused_moe(x, self.w13_weight, self.w2_weight, weights, ids)
        return tensor_parallel_all_reduce(y, self.parallel)
