"""The Llama family: Llama 2/3, SmolLM2, Mistral, Qwen2 (qkv bias) and Qwen3 (q/k norm).

A pre-norm decoder: x -> [RMSNorm -> attention] + x -> [RMSNorm -> MLP] + x, with the residual
add fused into the next norm. The forward pass takes one flat token batch and its attention
metadata; MoE models (moe.py) reuse everything here and swap the MLP.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from rivulet.kernels import AttentionMetadata
from rivulet.layers.activation import SiluAndMul
from rivulet.layers.attention import Attention
from rivulet.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from rivulet.layers.layernorm import RMSNorm
from rivulet.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from rivulet.layers.rotary import RotaryEmbedding
from rivulet.models.arch_config import ArchConfig
from rivulet.models.weights import load_named_weights


class LlamaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ArchConfig) -> None:
        super().__init__()
        d = cfg.head_dim
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, d, cfg.num_attention_heads, cfg.num_key_value_heads,
                                          bias=cfg.attention_bias)
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * d, cfg.hidden_size)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.rotary_emb = RotaryEmbedding(d, int(d * cfg.partial_rotary_factor), cfg.max_position_embeddings,
                                          cfg.rope_theta, cfg.rope_interleaved, cfg.rope_scaling)
        self.attn = Attention(self.qkv_proj.num_heads, d, d**-0.5, self.qkv_proj.num_kv_heads, cfg.sliding_window)
        self.head_dim = d

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        t, d = x.shape[0], self.head_dim
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = q.reshape(t, -1, d), k.reshape(t, -1, d)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q.reshape(t, -1), k.reshape(t, -1), v, meta))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ArchConfig, mlp: nn.Module) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ArchConfig, make_mlp: "callable[[int], nn.Module]") -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, make_mlp(i)) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, meta)
        x, _ = self.norm(x, residual)
        return x


class LlamaForCausalLM(nn.Module):
    # checkpoint name fragment -> (fused parameter fragment, shard id)
    stacked_params = [
        ("q_proj", "qkv_proj", "q"),
        ("k_proj", "qkv_proj", "k"),
        ("v_proj", "qkv_proj", "v"),
        ("gate_proj", "gate_up_proj", 0),
        ("up_proj", "gate_up_proj", 1),
    ]

    def __init__(self, cfg: ArchConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg, self.make_mlp)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
        if cfg.tie_word_embeddings:
            self.lm_head.tie(self.model.embed_tokens)

    def make_mlp(self, layer_idx: int) -> nn.Module:
        return LlamaMLP(self.config.hidden_size, self.config.intermediate_size)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states [T, hidden] of every token in the flat batch."""
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors (Hugging Face names) into the parameters; returns those loaded."""
        skip = ("rotary_emb.inv_freq",) + (("lm_head.weight",) if self.config.tie_word_embeddings else ())
        return load_named_weights(self, weights, self.stacked_params, skip=skip)
