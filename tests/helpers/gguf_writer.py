"""Write a tiny transformers model as a GGUF file, the way llama.cpp's converter lays it out."""

from __future__ import annotations

import math
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as QT
from gguf.quants import quantize

_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up",  # phi3: fused in the checkpoint already
}
# Gemma: norms after attention and around the MLP
_GEMMA_NAMES = {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                "post_feedforward_layernorm": "post_ffw_norm"}


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation (HF rotate-half layout -> interleaved)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(hf_name: str, arch: str = "llama") -> str:
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf_name == "model.norm.weight":
        return "output_norm.weight"
    if hf_name == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = hf_name.split(".", 3)
    module, suffix = rest.rsplit(".", 1)
    names = {**_NAMES, **_GEMMA_NAMES} if arch.startswith("gemma") else _NAMES
    return f"blk.{layer}.{names[module]}.{suffix}"


def write_gguf(hf_model, path: Path, qtype: QT = QT.F32, arch: str = "llama") -> dict[str, np.ndarray]:
    """Write `hf_model` (float32) to `path`; 2-D weights in `qtype`, norms/biases in F32.
    Returns the HF-named float32 tensors the file decodes to (quantization error included)."""
    c = hf_model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    if "rope_theta" in c.rope_parameters:  # Gemma 3: one per layer type (below)
        w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    w.add_eos_token_id(2)
    if arch.startswith("gemma"):  # what llama.cpp's converter writes for them
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)
        w.add_sliding_window(c.sliding_window)
        w.add_sliding_window_pattern([t == "sliding_attention" for t in c.layer_types])
        if arch == "gemma2":
            w.add_attn_logit_softcapping(c.attn_logit_softcapping)
            w.add_final_logit_softcapping(c.final_logit_softcapping)
        else:
            local, full = c.rope_parameters["sliding_attention"], c.rope_parameters["full_attention"]
            w.add_rope_freq_base(full["rope_theta"])
            w.add_rope_freq_base_swa(local["rope_theta"])
            if full.get("rope_type") == "linear":
                w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
                w.add_rope_scaling_factor(full["factor"])
    if arch == "phi3":
        rope = c.rope_parameters
        original = rope["original_max_position_embeddings"]
        w.add_rope_scaling_orig_ctx_len(original)
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(c.max_position_embeddings / original) / math.log(original)))
        w.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], np.float32))
        w.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], np.float32))
    expected: dict[str, np.ndarray] = {}
    state = hf_model.state_dict()
    if c.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    for name, t in state.items():
        a = t.detach().to(torch.float32).numpy()
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            a = a + 1.0  # llama.cpp stores Gemma's (1 + w) norms with the 1 added
        q = qtype if a.ndim == 2 else QT.F32
        # quantization blocks run along rows and the q/k permutation only reorders rows, so the
        # decoded tensor is the decoded original, un-permuted
        expected[name] = gguf.quants.dequantize(quantize(a, q), q).reshape(a.shape).astype(np.float32)
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            a = permute_qk(a, c.num_attention_heads if ".q_proj." in name else c.num_key_value_heads)
        w.add_tensor(gguf_name(name, arch), quantize(a, q), raw_dtype=q)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


_DEEPSEEK_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
    "self_attn.q_a_proj": "attn_q_a", "self_attn.q_a_layernorm": "attn_q_a_norm", "self_attn.q_b_proj": "attn_q_b",
    "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa", "self_attn.kv_a_layernorm": "attn_kv_a_norm",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp", "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
    "mlp.shared_experts.up_proj": "ffn_up_shexp", "mlp.shared_experts.down_proj": "ffn_down_shexp",
}


def write_deepseek_gguf(hf_model, path: Path, mla: bool = True) -> None:
    """A tiny DeepSeek-V2/V3 (float32) as llama.cpp's converter writes "deepseek2": MLA files (key/value
    lengths of the cached latent, the *_mla sizes, one KV head, kv_b_proj split into attn_k_b [H, r, dn]
    (transposed) and attn_v_b [H, dv, r]) or, with mla=False, the older layout (per-head sizes, attn_kv_b
    whole). Experts stacked per projection, the V3 router bias as exp_probs_b.bias, no q/k permutation."""
    c = hf_model.config
    h, r, dr, dn, dv = c.num_attention_heads, c.kv_lora_rank, c.qk_rope_head_dim, c.qk_nope_head_dim, c.v_head_dim
    w = gguf.GGUFWriter(str(path), "deepseek2")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(h)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    w.add_eos_token_id(2)
    arch = "deepseek2"
    if mla:
        w.add_head_count_kv(1)
        w.add_key_length(r + dr)
        w.add_value_length(r)
        w.add_uint32(f"{arch}.attention.key_length_mla", dn + dr)
        w.add_uint32(f"{arch}.attention.value_length_mla", dv)
    else:
        w.add_head_count_kv(h)
        w.add_key_length(dn + dr)
        w.add_value_length(dv)
    w.add_uint32(f"{arch}.attention.kv_lora_rank", r)
    if c.q_lora_rank is not None:
        w.add_uint32(f"{arch}.attention.q_lora_rank", c.q_lora_rank)
    w.add_rope_dimension_count(dr)
    rope = c.rope_parameters
    if rope.get("rope_type") == "yarn":  # llama.cpp keeps one mscale, stored x 0.1
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
        w.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])
    w.add_uint32(f"{arch}.leading_dense_block_count", c.first_k_dense_replace)
    w.add_expert_count(c.n_routed_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    w.add_expert_shared_count(c.n_shared_experts)
    w.add_expert_feed_forward_length(c.moe_intermediate_size)
    w.add_expert_weights_scale(c.routed_scaling_factor)
    if c.norm_topk_prob:
        w.add_expert_weights_norm(True)
    v3 = type(hf_model).__name__.startswith("DeepseekV3")
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if v3 else gguf.ExpertGatingFuncType.SOFTMAX)
    w.add_uint32(f"{arch}.expert_group_count", c.n_group)
    w.add_uint32(f"{arch}.expert_group_used_count", c.topk_group)
    for name, t in hf_model.state_dict().items():
        a = t.detach().to(torch.float32).numpy()
        if name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            w.add_tensor(gguf_name(name), a)
            continue
        _, _, layer, rest = name.split(".", 3)
        module, suffix = rest.rsplit(".", 1)
        blk = f"blk.{layer}"
        if module == "mlp.experts":  # fused in transformers' model: [E, 2I, hidden] gate then up, [E, hidden, I]
            if suffix == "gate_up_proj":
                half = a.shape[1] // 2
                w.add_tensor(f"{blk}.ffn_gate_exps.weight", np.ascontiguousarray(a[:, :half]))
                w.add_tensor(f"{blk}.ffn_up_exps.weight", np.ascontiguousarray(a[:, half:]))
            else:
                w.add_tensor(f"{blk}.ffn_down_exps.weight", a)
        elif suffix == "e_score_correction_bias":
            w.add_tensor(f"{blk}.exp_probs_b.bias", a)
        elif module == "self_attn.kv_b_proj":
            if not mla:
                w.add_tensor(f"{blk}.attn_kv_b.weight", a)
                continue
            kv = a.reshape(h, dn + dv, r)
            w.add_tensor(f"{blk}.attn_k_b.weight", np.ascontiguousarray(kv[:, :dn].transpose(0, 2, 1)))
            w.add_tensor(f"{blk}.attn_v_b.weight", np.ascontiguousarray(kv[:, dn:]))
        else:
            w.add_tensor(f"{blk}.{_DEEPSEEK_NAMES[module]}.{suffix}", a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
