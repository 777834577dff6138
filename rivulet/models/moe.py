"""Sparse mixture-of-experts decoders: Mixtral and Qwen3-MoE.

They are Llama-family decoders (Qwen3-MoE with q/k norm) whose MLP is a router plus experts.
Mixtral always renormalises the top-k routing weights; Qwen3-MoE does when `norm_topk_prob`.
Qwen3-MoE may keep dense MLPs in some layers (`mlp_only_layers`, `decoder_sparse_step`).
"""

from __future__ import annotations

import re
from typing import Iterable, Iterator

import torch
from torch import nn

from rivulet.layers.linear import ReplicatedLinear
from rivulet.layers.moe import FusedMoE
from rivulet.models.llama import LlamaForCausalLM, LlamaMLP

# checkpoint expert projection name -> FusedMoE shard id
_EXPERT_SHARDS = {"w1": "w1", "w3": "w3", "w2": "w2", "gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
_PER_EXPERT = re.compile(r"(.*)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(\w+)\.weight$")
_STACKED_EXPERTS = re.compile(r"(.*)\.(?:block_sparse_moe|mlp)\.experts\.(gate_up_proj|down_proj)$")


class SparseMoeBlock(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, renormalize: bool) -> None:
        super().__init__()
        self.gate = ReplicatedLinear(hidden_size, num_experts, bias=False)
        self.experts = FusedMoE(num_experts, top_k, hidden_size, intermediate_size, renormalize)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.gate(x))


class MoeForCausalLM(LlamaForCausalLM):
    def make_mlp(self, layer_idx: int) -> nn.Module:
        c = self.config
        if not c.is_sparse_layer(layer_idx):
            return LlamaMLP(c.hidden_size, c.intermediate_size)
        return SparseMoeBlock(c.hidden_size, c.moe_intermediate_size, c.num_experts, c.num_experts_per_tok,
                              c.norm_topk_prob)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded: set[str] = set()
        params = dict(self.named_parameters())

        def dense(ws: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in ws:
                name = name.replace(".block_sparse_moe.", ".mlp.")
                if m := _PER_EXPERT.match(name):
                    prefix, expert, proj = m.groups()
                    shard = _EXPERT_SHARDS[proj]
                    target = f"{prefix}.mlp.experts.{'w2' if shard == 'w2' else 'w13'}_weight"
                    params[target].weight_loader(params[target], tensor, shard, int(expert))
                    loaded.add(target)
                elif m := _STACKED_EXPERTS.match(name):  # all experts in one tensor (transformers >= 5)
                    prefix, proj = m.groups()
                    target = f"{prefix}.mlp.experts.{'w13' if proj == 'gate_up_proj' else 'w2'}_weight"
                    params[target].weight_loader(params[target], tensor, "w13" if proj == "gate_up_proj" else "w2")
                    loaded.add(target)
                else:
                    yield name, tensor

        return loaded | super().load_weights(dense(self.stage_weights(weights)))


class MixtralForCausalLM(MoeForCausalLM):
    pass


class Qwen3MoeForCausalLM(MoeForCausalLM):
    pass
