"""The pre-norm decoder of the Llama family: Llama 2/3, SmolLM2, Mistral, Qwen2 (qkv bias), Qwen3
(q/k norm), Phi-3 (fused checkpoint projections, LongRoPE) and Gemma 2/3.

x -> [RMSNorm -> attention] + x -> [RMSNorm -> MLP] + x, with the residual add fused into the next
norm. What families add is read from the `ArchConfig`, not subclassed: norms after attention and the
MLP too ("sandwich", Gemma), GeGLU, scaled embeddings, a per-layer sliding window and RoPE base,
capped attention scores and logits. The forward pass takes one flat token batch and its attention
metadata; MoE models (moe.py) reuse everything here and swap the MLP, DeepSeek (deepseek.py) the
attention too.
"""

from __future__ import annotations

import re
from typing import Callable, Iterable, Iterator

import torch
from torch import nn

from rivulet.config import RivuletError
from rivulet.distributed import get_parallel_state
from rivulet.distributed import sequence_parallel_all_gather
from rivulet.kernels.attention import AttentionMetadata
from rivulet.layers.activation import ActAndMul
from rivulet.layers.attention import Attention
from rivulet.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from rivulet.layers.layernorm import RMSNorm
from rivulet.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from rivulet.layers.rotary import RotaryEmbedding
from rivulet.models.arch_config import ArchConfig
from rivulet.models.weights import load_named_weights


class LlamaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, act: str = "silu") -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size)
        self.act = ActAndMul(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.gate_up_proj.forward_silu_mul(x) if self.act.name == "silu" else None  # (one kernel when packed)
        return self.down_proj(self.act(self.gate_up_proj(x)) if h is None else h)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ArchConfig, layer_idx: int, rotary_emb: RotaryEmbedding) -> None:
        super().__init__()
        d = cfg.head_dim
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, d, cfg.num_attention_heads, cfg.num_key_value_heads,
                                          bias=cfg.attention_bias)
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * d, cfg.hidden_size)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.rotary_emb = rotary_emb  # one module (and cos/sin table) shared by every layer
        self.attn = Attention(self.qkv_proj.num_heads, d, cfg.attention_scale(), self.qkv_proj.num_kv_heads,
                              cfg.layer_window(layer_idx), cfg.attn_logit_softcapping)
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
    """With sequence parallelism, `x` and `residual` are this rank's token shard; the norms run on it
    and the shard is all-gathered before attention and the MLP (whose last linear reduce-scatters).

    With sandwich norms (Gemma 2/3) the attention and MLP outputs are normed before their residual
    add: post_attention_layernorm is that norm of the attention output, pre_feedforward_layernorm
    the MLP's input norm and post_feedforward_layernorm the norm of its output."""

    def __init__(self, cfg: ArchConfig, attn: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.parallel = get_parallel_state()
        self.self_attn = attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.sandwich = cfg.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        if self.parallel.sp:
            x = sequence_parallel_all_gather(x, self.parallel, positions.shape[0])
        x = self.self_attn(positions, x, meta)
        if self.sandwich:
            x, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(x), residual)
        else:
            x, residual = self.post_attention_layernorm(x, residual)
        if self.parallel.sp:
            x = sequence_parallel_all_gather(x, self.parallel, positions.shape[0])
        x = self.mlp(x)
        return (self.post_feedforward_layernorm(x) if self.sandwich else x), residual


class PPMissingLayer(nn.Identity):
    """Stands for a module that lives on another pipeline stage (keeps layer indices and names)."""


def stage_layers(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """Layers [start, end) of pipeline stage `pp_rank`: an even split, earlier stages get fewer."""
    return pp_rank * num_layers // pp_size, (pp_rank + 1) * num_layers // pp_size


class LlamaModel(nn.Module):
    """Under pipeline parallelism a stage builds only its layers (others are `PPMissingLayer`s), the
    embedding on the first stage and the final norm on the last; the hidden states and the residual
    of every token go to the next stage as one [2, T, hidden] tensor."""

    def __init__(self, cfg: ArchConfig, make_attention: Callable[[int, RotaryEmbedding], nn.Module],
                 make_mlp: Callable[[int], nn.Module]) -> None:
        super().__init__()
        self.parallel = ps = get_parallel_state()
        n = cfg.num_hidden_layers
        if n < ps.pp_size:
            raise RivuletError(f"pipeline_parallel_size {ps.pp_size} exceeds the model's {n} layers")
        self.start_layer, self.end_layer = stage_layers(n, ps.pp_rank, ps.pp_size)
        self.hidden_size = cfg.hidden_size
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size) if ps.is_first_stage else None
        d = cfg.head_dim
        rot_dim = int(d * cfg.partial_rotary_factor)
        rotary = RotaryEmbedding(d, rot_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_interleaved,
                                 cfg.rope_scaling)
        local = rotary if cfg.local_rope_theta is None else RotaryEmbedding(
            d, rot_dim, cfg.max_position_embeddings, cfg.local_rope_theta, cfg.rope_interleaved)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, make_attention(i, local if cfg.layer_window(i) else rotary), make_mlp(i))
            if self.start_layer <= i < self.end_layer else PPMissingLayer() for i in range(n))
        self.embed_scale = cfg.hidden_size**0.5 if cfg.embed_scale else None
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if ps.is_last_stage else None

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype (what stages send each other): a norm weight's, which is never quantized.
        Not kept as an attribute: torch.compile's saved guards lose a module's bare dtype attributes."""
        return self.layers[self.start_layer].input_layernorm.weight.dtype

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                received: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """This stage's layers on one (micro-)batch: the final hidden states [T, hidden] on the last stage,
        else (hidden, residual) [rows, hidden] each for the next one; `received` is what the previous stage
        sent, the two stacked [2, rows, hidden] (none on the first). The micro-batches, sends and receives are
        the runner's (`worker/pipeline.py`)."""
        ps = self.parallel
        if received is None:
            x, residual = self.embed_tokens(input_ids), None  # type: ignore[misc]
            if self.embed_scale is not None:  # rounded to the activation dtype first, as Gemma's checkpoints expect
                x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        else:
            x, residual = received.unbind(0)
        for layer in self.layers[self.start_layer:self.end_layer]:
            x, residual = layer(positions, x, residual, meta)
        if not ps.is_last_stage:
            # stacked by the runner: in a graph the stack's strides over an SP shard made inductor guard on
            # the shard size beyond the step kind's declared range
            return x, residual
        x, _ = self.norm(x, residual)  # type: ignore[misc]
        if ps.sp:
            x = sequence_parallel_all_gather(x, ps, input_ids.shape[0])
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
        self.model = LlamaModel(cfg, self.make_attention, self.make_mlp)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size) if self.model.parallel.is_last_stage else None
        if cfg.tie_word_embeddings and self.lm_head is not None and self.model.embed_tokens is not None:
            self.lm_head.tie(self.model.embed_tokens)

    def make_attention(self, layer_idx: int, rotary_emb: RotaryEmbedding) -> nn.Module:
        return LlamaAttention(self.config, layer_idx, rotary_emb)

    def make_mlp(self, layer_idx: int) -> nn.Module:
        return LlamaMLP(self.config.hidden_size, self.config.intermediate_size, self.config.hidden_act)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                received: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Hidden states [T, hidden] of every token in the flat batch (a pipeline stage's: see `LlamaModel`)."""
        return self.model(input_ids, positions, meta, received)

    def compute_logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        cap = self.config.final_logit_softcapping
        logits = self.lm_head.compute_logits(hidden, float32 or bool(cap))  # type: ignore[union-attr]
        return torch.tanh(logits / cap) * cap if cap else logits

    def stage_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint tensors this pipeline stage holds (all of them with one stage); a last stage
        without the embedding takes a tied LM head from the embedding tensor."""
        m = self.model
        for name, tensor in weights:
            if (layer := re.match(r"model\.layers\.(\d+)\.", name)) and not (
                    m.start_layer <= int(layer.group(1)) < m.end_layer):
                continue
            if name.startswith("model.embed_tokens.") and m.embed_tokens is None:
                if self.config.tie_word_embeddings and self.lm_head is not None:
                    yield "lm_head.weight", tensor
                continue
            if (name.startswith("model.norm.") and m.norm is None) or (name.startswith("lm_head.") and self.lm_head is None):
                continue
            yield name, tensor

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors (Hugging Face names) into the parameters; returns those loaded."""
        tied = self.config.tie_word_embeddings and self.model.embed_tokens is not None
        skip = ("rotary_emb.inv_freq",) + (("lm_head.weight",) if tied else ())
        weights = self.stage_weights(weights)
        if offset := self.config.norm_weight_offset:  # Gemma's norms scale by (1 + w): fold the 1 in
            weights = ((n, t + offset if n.endswith("norm.weight") else t) for n, t in weights)
        return load_named_weights(self, weights, self.stacked_params, skip=skip)
