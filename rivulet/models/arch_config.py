"""The shape of a decoder model, read from a Hugging Face `config.json` dict.

GGUF metadata is first translated into the same dict (see `loader/gguf.py`), so there is one
path from any checkpoint to a model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from rivulet.config import RivuletError

# Per-architecture facts that the config dict leaves implicit.
_ARCH_DEFAULTS: dict[str, dict[str, Any]] = {
    "Qwen2ForCausalLM": {"attention_bias": True},
    "Qwen3ForCausalLM": {"qk_norm": True},
    "Qwen3MoeForCausalLM": {"qk_norm": True},
    "MixtralForCausalLM": {"norm_topk_prob": True},
    # DeepSeek: V2 routes by softmax scores, V3 by sigmoid scores plus a correction bias, groups by their top-2 sum
    "DeepseekV2ForCausalLM": {"scoring_func": "softmax"},
    "DeepseekV3ForCausalLM": {"scoring_func": "sigmoid", "topk_method": "noaux_tc"},
    # Gemma: (1 + weight) norms, embeddings scaled by sqrt(hidden), tied head, norms around attention and MLP
    "Gemma2ForCausalLM": {"norm_weight_offset": 1.0, "embed_scale": True, "sandwich_norms": True,
                          "tie_word_embeddings": True},
    # BERT (sentence-transformers encoders): bidirectional attention, post-norm LayerNorms, plain GELU MLP
    "BertModel": {"is_encoder": True},
    "Gemma3ForCausalLM": {"norm_weight_offset": 1.0, "embed_scale": True, "sandwich_norms": True,
                          "tie_word_embeddings": True, "qk_norm": True},
}

ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
ENCODER_ACTIVATIONS = ("gelu",)  # an encoder's plain (ungated) MLP
LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass
class ArchConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    rope_interleaved: bool = False
    partial_rotary_factor: float = 1.0
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    layer_types: list[str] | None = None  # per layer: "full_attention" or "sliding_attention"
    local_rope_theta: float | None = None  # RoPE base of the sliding-window layers, when it differs
    hidden_act: str = "silu"  # the gated MLP's activation: silu (SwiGLU) or gelu_pytorch_tanh (GeGLU)
    query_pre_attn_scalar: float | None = None  # attention scale 1/sqrt(this) instead of 1/sqrt(head_dim)
    attn_logit_softcapping: float | None = None  # scores -> cap * tanh(scores / cap)
    final_logit_softcapping: float | None = None
    sandwich_norms: bool = False  # norms after attention and the MLP too (Gemma 2/3)
    embed_scale: bool = False  # embeddings times sqrt(hidden_size)
    norm_weight_offset: float = 0.0  # checkpoint norm weights w mean (offset + w); folded in at load
    # mixture of experts
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    n_shared_experts: int = 0  # always-on experts beside the routed ones (DeepSeek)
    scoring_func: str = "softmax"  # routing scores: softmax, or sigmoid (DeepSeek-V3)
    topk_method: str = "greedy"  # greedy | group_limited_greedy (V2) | noaux_tc (V3: bias-corrected, grouped)
    n_group: int = 1  # experts in n_group groups; tokens choose among the best topk_group groups only
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    # multi-head latent attention (DeepSeek-V2/V3); head_dim is then the rotary part of a head
    kv_lora_rank: int = 0
    q_lora_rank: int | None = None
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    # tokens
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    torch_dtype: str | None = None
    # encoders (BERT): every token attends to its whole sequence, nothing is cached; rms_norm_eps is then
    # the LayerNorms' eps, and token type 0's embedding is added to every token
    is_encoder: bool = False
    type_vocab_size: int = 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    def mla_cache_saving(self) -> float:
        """How many times larger per-head keys and values would be than MLA's cached [latent | rotary key]."""
        heads = self.num_attention_heads * (self.qk_nope_head_dim + self.head_dim + self.v_head_dim)
        return heads / (self.kv_lora_rank + self.head_dim)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_sparse_layer(self, i: int) -> bool:
        return self.is_moe and i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0

    def layer_window(self, i: int) -> int | None:
        """Layer i's sliding window (None: full attention)."""
        if self.layer_types is not None and self.layer_types[i] != "sliding_attention":
            return None
        return self.sliding_window

    def attention_scale(self) -> float:
        if self.is_mla:  # over the whole query head (no-rope and rope parts), times YaRN's mscale squared
            m = _yarn_mscale(self.rope_scaling)
            return (self.qk_nope_head_dim + self.head_dim) ** -0.5 * m * m
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ArchConfig:
        try:
            return cls._from_hf(cfg)
        except KeyError as e:
            raise RivuletError(f"the model config lacks the field {e.args[0]!r}") from None

    @classmethod
    def _from_hf(cls, cfg: dict[str, Any]) -> ArchConfig:
        archs = cfg.get("architectures") or []
        if not archs:
            raise RivuletError("config.json has no 'architectures' entry")
        arch = archs[0]
        c = {**_ARCH_DEFAULTS.get(arch, {}), **cfg}
        act = c.get("hidden_activation") or c.get("hidden_act") or "silu"
        encoder = bool(c.get("is_encoder"))
        allowed = ENCODER_ACTIVATIONS if encoder else ACTIVATIONS
        if act not in allowed:
            raise RivuletError(f"unsupported activation {act!r} (supported: {', '.join(allowed)})")
        if encoder and c.get("position_embedding_type", "absolute") != "absolute":
            raise RivuletError(f"unsupported position embeddings {c['position_embedding_type']!r} (supported: absolute)")
        if c.get("mlp_bias"):
            raise RivuletError("MLP biases are not supported")
        if c.get("use_bidirectional_attention"):
            raise RivuletError("bidirectional attention (an encoder) is not supported")
        heads = c["num_attention_heads"]
        layer_types = c.get("layer_types") or _default_layer_types(arch, c)
        if layer_types is not None and (bad := set(layer_types) - set(LAYER_TYPES)):
            raise RivuletError(f"unsupported layer types {sorted(bad)} (supported: {', '.join(LAYER_TYPES)})")
        rope = c.get("rope_parameters") or {}
        local_theta = None
        if "full_attention" in rope:  # one RoPE per layer type (Gemma 3)
            local = rope.get("sliding_attention") or {}
            if local.get("rope_type", "default") != "default":
                raise RivuletError("scaled RoPE on sliding-window layers is not supported")
            local_theta, rope = local.get("rope_theta"), rope["full_attention"]
        elif c.get("rope_local_base_freq"):
            local_theta = c["rope_local_base_freq"]
        scaling = dict(rope) if rope else c.get("rope_scaling")
        if scaling and scaling.get("rope_type", scaling.get("type", "default")) == "default":
            scaling = None
        if scaling and "original_max_position_embeddings" not in scaling and c.get("original_max_position_embeddings"):
            scaling["original_max_position_embeddings"] = c["original_max_position_embeddings"]  # Phi-3
        eos = c.get("eos_token_id")
        mla = bool(c.get("kv_lora_rank"))
        dense_first = list(range(c.get("first_k_dense_replace") or 0))  # DeepSeek's dense first layers
        window = c.get("sliding_window") if c.get("use_sliding_window", True) else None
        return cls(
            architecture=arch,
            vocab_size=c["vocab_size"],
            hidden_size=c["hidden_size"],
            intermediate_size=c.get("intermediate_size", 0),
            num_hidden_layers=c["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=c.get("num_key_value_heads") or heads,
            head_dim=c["qk_rope_head_dim"] if mla else (c.get("head_dim") or c["hidden_size"] // heads),
            rms_norm_eps=c.get("rms_norm_eps", c.get("layer_norm_eps", 1e-6)),
            max_position_embeddings=c.get("max_position_embeddings", 2048),
            rope_theta=rope.get("rope_theta", c.get("rope_theta", 10000.0)),
            rope_scaling=scaling,
            rope_interleaved=c.get("rope_interleave", True) if mla else c.get("rope_interleaved", False),
            partial_rotary_factor=rope.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0)),
            tie_word_embeddings=c.get("tie_word_embeddings", False),
            attention_bias=c.get("attention_bias", False),
            qk_norm=c.get("qk_norm", False),
            sliding_window=window,
            layer_types=list(layer_types) if layer_types is not None else None,
            local_rope_theta=local_theta,
            hidden_act=act,
            query_pre_attn_scalar=c.get("query_pre_attn_scalar"),
            attn_logit_softcapping=c.get("attn_logit_softcapping"),
            final_logit_softcapping=c.get("final_logit_softcapping"),
            sandwich_norms=c.get("sandwich_norms", False),
            embed_scale=c.get("embed_scale", False),
            norm_weight_offset=c.get("norm_weight_offset", 0.0),
            num_experts=c.get("num_experts") or c.get("num_local_experts") or c.get("n_routed_experts") or 0,
            num_experts_per_tok=c.get("num_experts_per_tok", 0),
            moe_intermediate_size=c.get("moe_intermediate_size") or c.get("intermediate_size", 0),
            norm_topk_prob=c.get("norm_topk_prob", False),
            decoder_sparse_step=c.get("decoder_sparse_step") or c.get("moe_layer_freq") or 1,
            mlp_only_layers=sorted(set(c.get("mlp_only_layers") or []) | set(dense_first)),
            n_shared_experts=c.get("n_shared_experts") or 0,
            scoring_func=c.get("scoring_func") or "softmax",
            topk_method=c.get("topk_method") or "greedy",
            n_group=c.get("n_group") or 1,
            topk_group=c.get("topk_group") or 1,
            routed_scaling_factor=c.get("routed_scaling_factor") or 1.0,
            kv_lora_rank=c.get("kv_lora_rank") or 0,
            q_lora_rank=c.get("q_lora_rank"),
            qk_nope_head_dim=c.get("qk_nope_head_dim") or 0,
            v_head_dim=c.get("v_head_dim") or 0,
            bos_token_id=c.get("bos_token_id"),
            eos_token_ids=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
            torch_dtype=c.get("dtype") or c.get("torch_dtype"),
            is_encoder=encoder,
            type_vocab_size=c.get("type_vocab_size", 0) if encoder else 0,
        )


def _yarn_mscale(scaling: dict[str, Any] | None) -> float:
    """YaRN's attention temperature on the scores of DeepSeek's MLA (1 without YaRN or `mscale_all_dim`)."""
    if not scaling or scaling.get("rope_type", scaling.get("type")) != "yarn" or not scaling.get("mscale_all_dim"):
        return 1.0
    factor = scaling["factor"]
    return 1.0 if factor <= 1 else 0.1 * scaling["mscale_all_dim"] * math.log(factor) + 1.0


def _default_layer_types(arch: str, c: dict[str, Any]) -> list[str] | None:
    """Older Gemma configs name the sliding-window layers by a pattern instead of a list."""
    n = c["num_hidden_layers"]
    if arch == "Gemma2ForCausalLM":  # even layers slide
        return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
    if arch == "Gemma3ForCausalLM" and (p := c.get("sliding_window_pattern")):
        return ["full_attention" if (i + 1) % p == 0 else "sliding_attention" for i in range(n)]
    return None
