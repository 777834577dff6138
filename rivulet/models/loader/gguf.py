"""GGUF files (llama.cpp's format): metadata -> Hugging Face config dict, tensors -> HF names.

Quantized tensors are dequantized to float32 by torch here for the common block types (Q8_0, Q4_0,
Q4_1: bitwise the `gguf` package's values, ~10x faster than its numpy path, a start-up cost) and by
the `gguf` package's reference dequantizers for the others. llama.cpp
stores the q/k projections of "llama"-architecture models permuted for interleaved RoPE; they are
permuted back here so every model uses the Hugging Face (neox) rotary layout.
"""

from __future__ import annotations

import re
import warnings
from functools import cached_property
from typing import Any, Iterator

import numpy as np
import torch
from gguf import GGMLQuantizationType as QT
from gguf.quants import dequantize

from rivulet.config import RivuletError
from rivulet.kernels.ops import get_op
from rivulet.kernels.quant import GGUF_BLOCK_BYTES
from rivulet.models.loader.gguf_file import GGUFFile
from rivulet.models.loader.source import ModelSource

SUPPORTED_TYPES = {
    QT.F32, QT.F16, QT.BF16, QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1,
    QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K,
}

# gguf architecture -> (HF architecture, HF architecture when it has experts)
_ARCHS = {
    "llama": ("LlamaForCausalLM", "MixtralForCausalLM"),
    "mistral": ("MistralForCausalLM", "MixtralForCausalLM"),
    "qwen2": ("Qwen2ForCausalLM", None),
    "qwen3": ("Qwen3ForCausalLM", None),
    "qwen3moe": (None, "Qwen3MoeForCausalLM"),
    "phi3": ("Phi3ForCausalLM", None),
    "gemma2": ("Gemma2ForCausalLM", None),
    "gemma3": ("Gemma3ForCausalLM", None),
    "deepseek2": ("DeepseekV2ForCausalLM", "DeepseekV2ForCausalLM"),  # V3 by its sigmoid gating (below)
}
_PERMUTED_QK = {"llama", "mistral"}

_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
}
# where an architecture names a block tensor differently: Gemma's norms after attention and around the MLP,
# Phi-3's fused projections (kept fused, as in its HF checkpoints)
_ARCH_BLOCK_NAMES = {
    "gemma2": {"ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm"},
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    # DeepSeek's MLA projections, shared experts and the V3 router's correction bias; kv_b_proj comes whole
    # (attn_kv_b, older files) or as attn_k_b + attn_v_b, put back together in `weights`
    "deepseek2": {"attn_q_a": "self_attn.q_a_proj", "attn_q_a_norm": "self_attn.q_a_layernorm",
                  "attn_q_b": "self_attn.q_b_proj", "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
                  "attn_kv_a_norm": "self_attn.kv_a_layernorm", "attn_kv_b": "self_attn.kv_b_proj",
                  "ffn_gate_shexp": "mlp.shared_experts.gate_proj", "ffn_up_shexp": "mlp.shared_experts.up_proj",
                  "ffn_down_shexp": "mlp.shared_experts.down_proj"},
}
_ARCH_BLOCK_NAMES["gemma3"] = _ARCH_BLOCK_NAMES["gemma2"]
_ROPE_FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")  # Phi-3's LongRoPE, read into the config
_EXPERT_NAMES = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")


class GGUFCheckpoint:
    def __init__(self, src: ModelSource) -> None:
        try:
            self.reader = GGUFFile(str(src.gguf_path))
        except (OSError, ValueError) as e:
            raise RivuletError(f"cannot read GGUF file {src.gguf_path}: {e}") from None
        self.arch = str(self.field("general.architecture"))
        if self.arch not in _ARCHS:
            raise RivuletError(f"unsupported GGUF architecture {self.arch!r}; supported: {', '.join(_ARCHS)}")
        bad = sorted({f"{t.name} ({t.tensor_type.name})" for t in self.reader.tensors if t.tensor_type not in SUPPORTED_TYPES})
        if bad:
            raise RivuletError(f"unsupported GGUF tensor type in {src.gguf_file}: {', '.join(bad[:3])}; "
                               f"supported: {', '.join(sorted(t.name for t in SUPPORTED_TYPES))}")
        if any(t.name == "rope_freqs.weight" for t in self.reader.tensors):
            raise RivuletError("GGUF rope frequency factors (rope_freqs.weight) are not supported yet")

    def field(self, key: str, default: Any = None) -> Any:
        return self.reader.fields.get(key, default)

    def arch_field(self, key: str, default: Any = None) -> Any:
        return self.field(f"{self.arch}.{key}", default)

    @cached_property
    def hf_config(self) -> dict[str, Any]:
        """The metadata as a Hugging Face config.json dict."""
        names = {t.name for t in self.reader.tensors}
        experts = self.arch_field("expert_count", 0) or 0
        dense_arch, moe_arch = _ARCHS[self.arch]
        arch = moe_arch if experts else dense_arch
        if arch is None:
            raise RivuletError(f"GGUF architecture {self.arch!r} with expert_count={experts} is not supported")
        heads = self.arch_field("attention.head_count")
        hidden = self.arch_field("embedding_length")
        vocab = self.arch_field("vocab_size") or len(self.field("tokenizer.ggml.tokens", []))
        cfg: dict[str, Any] = {
            "architectures": [arch],
            "vocab_size": vocab,
            "hidden_size": hidden,
            "intermediate_size": self.arch_field("feed_forward_length", 0),
            "num_hidden_layers": self.arch_field("block_count"),
            "num_attention_heads": heads,
            "num_key_value_heads": self.arch_field("attention.head_count_kv", heads),
            "head_dim": self.arch_field("attention.key_length", hidden // heads),
            "rms_norm_eps": self.arch_field("attention.layer_norm_rms_epsilon", 1e-6),
            "max_position_embeddings": self.arch_field("context_length", 2048),
            "rope_theta": self.arch_field("rope.freq_base", 10000.0),
            "tie_word_embeddings": "output.weight" not in names,
            "attention_bias": "blk.0.attn_q.bias" in names,
            "bos_token_id": self.field("tokenizer.ggml.bos_token_id"),
            "eos_token_id": self.field("tokenizer.ggml.eos_token_id"),
        }
        rot = self.arch_field("rope.dimension_count")
        if rot and rot != cfg["head_dim"]:
            cfg["partial_rotary_factor"] = rot / cfg["head_dim"]
        scaling = self.arch_field("rope.scaling.type")
        if scaling and scaling != "none":
            cfg["rope_scaling"] = {"rope_type": scaling, "factor": self.arch_field("rope.scaling.factor", 1.0)}
        if self.arch_field("attention.sliding_window"):
            cfg["sliding_window"] = self.arch_field("attention.sliding_window")
        if self.arch.startswith("gemma"):
            cfg.update(self._gemma_config(cfg))
        if self.arch == "phi3" and "rope_factors_long.weight" in names:
            cfg["rope_scaling"] = self._longrope(cfg)
        if experts:
            cfg.update(num_experts=experts, num_experts_per_tok=self.arch_field("expert_used_count"),
                       moe_intermediate_size=self.arch_field("expert_feed_forward_length", cfg["intermediate_size"]),
                       norm_topk_prob=True)
        if self.arch == "deepseek2":  # head_dim and a partial rotary factor mean other things there
            cfg.update(self._deepseek_config(cfg))
            cfg.pop("head_dim")
            cfg.pop("partial_rotary_factor", None)
        return cfg

    def _deepseek_config(self, cfg: dict[str, Any]) -> dict[str, Any]:
        """llama.cpp's deepseek2 keys as DeepSeek's config: MLA sizes (files written for MLA carry
        key/value_length_mla, key_length being the cached latent + rope width; older ones the per-head
        sizes), the routing (gating 2 = sigmoid with the correction bias: V3), YaRN's mscale (stored x 0.1)."""
        rope = self.arch_field("rope.dimension_count")
        mla_k, mla_v = self.arch_field("attention.key_length_mla"), self.arch_field("attention.value_length_mla")
        key = mla_k or self.arch_field("attention.key_length")
        v3 = self.arch_field("expert_gating_func") == 2
        groups = self.arch_field("expert_group_count", 1) or 1
        out: dict[str, Any] = {
            "architectures": ["DeepseekV3ForCausalLM" if v3 else "DeepseekV2ForCausalLM"],
            "num_key_value_heads": cfg["num_attention_heads"],
            "kv_lora_rank": self.arch_field("attention.kv_lora_rank"),
            "q_lora_rank": self.arch_field("attention.q_lora_rank"),
            "qk_rope_head_dim": rope, "qk_nope_head_dim": key - rope,
            "v_head_dim": mla_v or self.arch_field("attention.value_length"),
            "rope_interleave": True,  # llama.cpp rotates pairs of neighbours here: the checkpoint's order
            "first_k_dense_replace": self.arch_field("leading_dense_block_count", 0),
            "n_shared_experts": self.arch_field("expert_shared_count", 0),
            "routed_scaling_factor": self.arch_field("expert_weights_scale") or 1.0,
            "norm_topk_prob": bool(self.arch_field("expert_weights_norm", False)),
            "n_group": groups, "topk_group": self.arch_field("expert_group_used_count", 1) or 1,
            "scoring_func": "sigmoid" if v3 else "softmax",
            "topk_method": "noaux_tc" if v3 else ("group_limited_greedy" if groups > 1 else "greedy"),
        }
        if cfg.get("rope_scaling", {}).get("rope_type") == "yarn":
            mscale = (self.arch_field("rope.scaling.yarn_log_multiplier") or 0.0) / 0.1
            out["rope_scaling"] = {
                "rope_type": "yarn", "factor": cfg["rope_scaling"]["factor"],
                "original_max_position_embeddings": self.arch_field("rope.scaling.original_context_length"),
                "beta_fast": self.arch_field("rope.scaling.yarn_beta_fast", 32.0),
                "beta_slow": self.arch_field("rope.scaling.yarn_beta_slow", 1.0),
                "mscale": mscale, "mscale_all_dim": mscale}
        return out

    def _gemma_config(self, cfg: dict[str, Any]) -> dict[str, Any]:
        """What llama.cpp's Gemma files leave implicit: norms stored with their 1 added, the query scale
        (1/sqrt(head_dim), but 1/sqrt(hidden / heads) for the 27B models, as llama.cpp decides), which
        layers slide (the pattern key, else every 2nd (Gemma 2) or 6th (Gemma 3) layer is global)."""
        n = cfg["num_hidden_layers"]
        big = (self.arch == "gemma2" and n == 46) or (self.arch == "gemma3" and n == 62)
        out: dict[str, Any] = {
            "hidden_activation": "gelu_pytorch_tanh", "norm_weight_offset": 0.0,
            "query_pre_attn_scalar": cfg["hidden_size"] // cfg["num_attention_heads"] if big else cfg["head_dim"],
            "attn_logit_softcapping": self.arch_field("attn_logit_softcapping"),
            "final_logit_softcapping": self.arch_field("final_logit_softcapping"),
        }
        pattern = self.arch_field("attention.sliding_window_pattern")
        if isinstance(pattern, list):
            out["layer_types"] = ["sliding_attention" if p else "full_attention" for p in pattern]
        else:
            p = int(pattern or (2 if self.arch == "gemma2" else 6))
            out["layer_types"] = ["full_attention" if (i + 1) % p == 0 else "sliding_attention" for i in range(n)]
        if self.arch == "gemma3":
            out["rope_local_base_freq"] = self.arch_field("rope.freq_base_swa", 10000.0)
        return out

    def _longrope(self, cfg: dict[str, Any]) -> dict[str, Any]:
        tensors = {t.name: t for t in self.reader.tensors if t.name in _ROPE_FACTORS}
        factors = {name: dequantize_tensor(t.data, t.tensor_type).tolist() for name, t in tensors.items()}
        scaling: dict[str, Any] = {
            "rope_type": "longrope", "long_factor": factors["rope_factors_long.weight"],
            "short_factor": factors["rope_factors_short.weight"],
            "original_max_position_embeddings": self.arch_field("rope.scaling.original_context_length",
                                                                cfg["max_position_embeddings"])}
        if (attn := self.arch_field("rope.scaling.attn_factor")) is not None:
            scaling["attention_factor"] = attn
        return scaling

    def weights(self, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        """(Hugging Face name, dequantized tensor) pairs."""
        cfg = self.hf_config
        block_names = {**_BLOCK_NAMES, **_ARCH_BLOCK_NAMES.get(self.arch, {})}
        k_b: dict[str, torch.Tensor] = {}  # DeepSeek's attn_k_b of a layer, until its attn_v_b
        for t in self.reader.tensors:
            if t.name in _ROPE_FACTORS:
                continue
            shape = tuple(int(d) for d in reversed(t.shape))  # gguf lists dimensions fastest-first
            w = dequantize_tensor(t.data, t.tensor_type, dtype).view(shape)
            name = _NAMES.get(t.name)
            if name is None:
                m = _BLOCK.match(t.name)
                if m is None:
                    raise RivuletError(f"unexpected GGUF tensor {t.name!r}")
                layer, kind, suffix = m.groups()
                prefix = f"model.layers.{layer}"
                if kind in _EXPERT_NAMES:
                    for e in range(w.shape[0]):
                        yield f"{prefix}.mlp.experts.{e}.{_EXPERT_NAMES[kind]}.weight", w[e].to(dtype)
                    continue
                if kind == "exp_probs_b":  # DeepSeek-V3's router correction bias
                    yield f"{prefix}.mlp.gate.e_score_correction_bias", w.to(dtype)
                    continue
                if kind in ("attn_k_b", "attn_v_b"):  # kv_b_proj split per head: k_b [H, r, dn], v_b [H, dv, r]
                    other = k_b.pop(layer, None)
                    if other is None:
                        k_b[layer] = w
                        continue
                    kb, vb = (w, other) if kind == "attn_k_b" else (other, w)
                    kv = torch.cat([kb.transpose(1, 2), vb], dim=1)  # [H, dn + dv, r], k rows first per head
                    yield f"{prefix}.self_attn.kv_b_proj.weight", kv.reshape(-1, kv.shape[-1]).to(dtype)
                    continue
                if kind not in block_names:
                    raise RivuletError(f"unexpected GGUF tensor {t.name!r}")
                name = f"{prefix}.{block_names[kind]}.{suffix}"
                if self.arch in _PERMUTED_QK and kind in ("attn_q", "attn_k"):
                    n_head = cfg["num_attention_heads"] if kind == "attn_q" else cfg["num_key_value_heads"]
                    w = unpermute_qk(w, n_head)
            yield name, w.to(dtype)


_BLOCK_KINDS = {QT.Q8_0: "q8_0", QT.Q4_0: "q4_0", QT.Q4_1: "q4_1"}  # kernels.quant's GGUF block kinds


def dequantize_tensor(data: np.ndarray, ttype: QT, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A GGUF tensor's values as a flat tensor: the `gguf` package's float32 dequantization, bitwise,
    rounded to `dtype`. The common block types go through the `dequantize_gguf_blocks` op, straight
    from the memory map (the C++ one on CPU: ~20x the torch reference's speed)."""
    kind = _BLOCK_KINDS.get(ttype)
    if kind is None:
        arr = np.asarray(dequantize(data, ttype), dtype=np.float32).reshape(-1)
        return torch.from_numpy(arr if arr.flags.writeable else arr.copy()).to(dtype)
    with warnings.catch_warnings():  # the map is read-only, and the op only reads it
        warnings.simplefilter("ignore", UserWarning)
        blocks = torch.from_numpy(np.ascontiguousarray(data).reshape(-1, GGUF_BLOCK_BYTES[kind]))
    return get_op("dequantize_gguf_blocks")(blocks, kind, dtype)


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's per-head (interleaved-RoPE) row permutation of a q/k weight or bias."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
