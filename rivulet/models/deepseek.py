"""DeepSeek-V2 and V3: multi-head latent attention (MLA) and mixture-of-experts with shared experts.

The decoder is the Llama family's (llama.py) with two modules swapped:

- **MLA.** Keys and values come from one low-rank latent per token: c = norm(x W_dkv) [kv_lora_rank] and a
  rotary key k_pe [qk_rope_head_dim] shared by all heads. The cache holds only [c | k_pe] per token
  (`MLAAttention`), not per-head keys and values. Attention runs in the absorbed form: each head's
  no-rope query is moved into latent space through that head's key up-projection (q_nope W_uk), so
  scores are q_lat . c + q_pe . k_pe, and the output (a mix of latents) goes back through the head's
  value up-projection (W_uv) before o_proj. Queries come from x directly (`q_proj`) or through their
  own low-rank bottleneck (`q_a_proj`, norm, `q_b_proj`). Tensor parallelism splits the heads; the
  latent is replicated.
- **MoE.** Routed experts (`FusedMoE`) chosen by DeepSeek's grouped routing (`grouped_topk_routing_ref`:
  V2 softmax scores, greedy or group-limited; V3 sigmoid scores with a correction bias and groups
  ranked by their top-2 sum), weights scaled by `routed_scaling_factor`, plus always-on shared
  experts (one gated MLP of n_shared_experts x moe_intermediate_size); the first
  `first_k_dense_replace` layers keep a dense MLP.
"""

from __future__ import annotations

import torch
from torch import nn

from rivulet.config import RivuletError
from rivulet.distributed import get_parallel_state
from rivulet.kernels.attention import AttentionMetadata
from rivulet.kernels.moe import grouped_topk_routing_ref
from rivulet.layers.attention import MLAAttention
from rivulet.layers.layernorm import RMSNorm
from rivulet.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from rivulet.layers.moe import FusedMoE
from rivulet.layers.rotary import RotaryEmbedding
from rivulet.models.arch_config import ArchConfig
from rivulet.models.llama import LlamaMLP
from rivulet.models.moe import MoeForCausalLM


class AbsorbedLinear(ColumnParallelLinear):
    """kv_b_proj: its weight is read as per-head matrices (absorbed into the query and the output), never
    applied as one GEMM, so it stays as loaded: neither quantized nor packed."""

    quantizable = packable = False


class MLA(nn.Module):
    def __init__(self, cfg: ArchConfig, rotary_emb: RotaryEmbedding) -> None:
        super().__init__()
        tp = get_parallel_state().tp_size
        if cfg.num_attention_heads % tp:
            raise RivuletError(f"tensor parallelism over {tp} ranks does not divide {cfg.num_attention_heads} heads")
        self.heads = cfg.num_attention_heads // tp
        self.nope, self.rope, self.v_dim, self.latent = cfg.qk_nope_head_dim, cfg.head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        q_out = cfg.num_attention_heads * (self.nope + self.rope)
        if cfg.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(cfg.hidden_size, q_out)
        else:
            self.q_a_proj = ReplicatedLinear(cfg.hidden_size, cfg.q_lora_rank, bias=cfg.attention_bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = ColumnParallelLinear(cfg.q_lora_rank, q_out)
        self.kv_a_proj_with_mqa = ReplicatedLinear(cfg.hidden_size, self.latent + self.rope, bias=cfg.attention_bias)
        self.kv_a_layernorm = RMSNorm(self.latent, cfg.rms_norm_eps)
        self.kv_b_proj = AbsorbedLinear(self.latent, cfg.num_attention_heads * (self.nope + self.v_dim))
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * self.v_dim, cfg.hidden_size, bias=cfg.attention_bias)
        self.rotary_emb = rotary_emb
        self.attn = MLAAttention(self.heads, self.latent, self.rope, cfg.attention_scale())

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        t, h = x.shape[0], self.heads
        q = self.q_proj(x) if hasattr(self, "q_proj") else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_pe = q.view(t, h, self.nope + self.rope).split([self.nope, self.rope], dim=-1)
        c, k_pe = self.kv_a_proj_with_mqa(x).split([self.latent, self.rope], dim=-1)
        c = self.kv_a_layernorm(c.contiguous())
        q_pe, k_pe = self.rotary_emb(positions, q_pe.contiguous(), k_pe.reshape(t, 1, self.rope))
        w = self.kv_b_proj.weight.view(h, self.nope + self.v_dim, self.latent)
        w_uk, w_uv = w[:, :self.nope], w[:, self.nope:]  # [h, nope, latent], [h, v, latent]
        q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [t, h, latent]
        o_lat = self.attn(torch.cat([q_lat, q_pe], dim=-1), torch.cat([c, k_pe.view(t, self.rope)], dim=-1), meta)
        o = torch.bmm(o_lat.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)  # [t, h, v]
        return self.o_proj(o.reshape(t, h * self.v_dim))


class DeepseekMoE(nn.Module):
    def __init__(self, cfg: ArchConfig) -> None:
        super().__init__()
        if cfg.num_experts % cfg.n_group:
            raise RivuletError(f"{cfg.num_experts} experts do not split into {cfg.n_group} groups")
        self.cfg = cfg
        self.gate = Router(cfg.hidden_size, cfg.num_experts, bias=cfg.topk_method == "noaux_tc")
        self.experts = FusedMoE(cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size,
                                cfg.norm_topk_prob)
        self.shared_experts = LlamaMLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts) \
            if cfg.n_shared_experts else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        grouped = c.topk_method in ("group_limited_greedy", "noaux_tc")
        weights, ids = grouped_topk_routing_ref(
            self.gate(x), c.num_experts_per_tok, scoring=c.scoring_func, bias=self.gate.e_score_correction_bias,
            n_group=c.n_group if grouped else 1, topk_group=c.topk_group,
            group_by="top2" if c.topk_method == "noaux_tc" else "max", renormalize=c.norm_topk_prob,
            scale=c.routed_scaling_factor)
        y = self.experts.forward_routed(x, weights, ids)
        return y if self.shared_experts is None else y + self.shared_experts(x)


class Router(nn.Module):
    """The gate, in float32 whatever the model's dtype (as the checkpoints keep it: near-tied experts must
    not swap): router logits, and V3's per-expert correction bias for choosing (not weighting)."""

    def __init__(self, hidden_size: int, num_experts: int, bias: bool) -> None:
        super().__init__()
        f32 = torch.float32
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=f32), requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(torch.empty(num_experts, dtype=f32), requires_grad=False) \
            if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x.float(), self.weight)


class DeepseekV2ForCausalLM(MoeForCausalLM):
    stacked_params = [("gate_proj", "gate_up_proj", 0), ("up_proj", "gate_up_proj", 1)]
    float32_weights = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")  # loaded as stored (the router)

    def make_attention(self, layer_idx: int, rotary_emb: RotaryEmbedding) -> nn.Module:
        return MLA(self.config, rotary_emb)

    def make_mlp(self, layer_idx: int) -> nn.Module:
        c = self.config
        if not c.is_sparse_layer(layer_idx):
            return LlamaMLP(c.hidden_size, c.intermediate_size)
        return DeepseekMoE(c)


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    pass
