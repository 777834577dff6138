"""Tiny random-weight Hugging Face checkpoints of each supported architecture, written by tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers

_BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5)

TINY_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", dict(tie_word_embeddings=False)),
    "llama3-rope-tied": ("LlamaConfig", dict(
        tie_word_embeddings=True, num_key_value_heads=1,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 32})),
    "mistral-window": ("MistralConfig", dict(sliding_window=12, head_dim=16)),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=False)),
    "qwen3": ("Qwen3Config", dict(head_dim=24, tie_word_embeddings=True)),
    "qwen3-hd16": ("Qwen3Config", dict(head_dim=16, tie_word_embeddings=True)),  # q/k norms, a head dim of 16
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen3-moe": ("Qwen3MoeConfig", dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=48,
                                         norm_topk_prob=False, head_dim=16, mlp_only_layers=[1],
                                         tie_word_embeddings=False)),
    # Gemma: a 12-token window on the sliding layers, 1/sqrt(24) attention scale (head_dim 16), capped
    # scores and logits (caps low enough to bite on these weights), GeGLU, sandwich and (1 + w) norms
    "gemma2": ("Gemma2Config", dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=12,
                                    attn_logit_softcapping=5.0, final_logit_softcapping=3.0)),
    "gemma3": ("Gemma3TextConfig", dict(
        head_dim=16, query_pre_attn_scalar=24, sliding_window=12, layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0}})),
    # Phi-3: fused qkv_proj / gate_up_proj tensors; LongRoPE (only its short factors below 64 tokens)
    "phi3": ("Phi3Config", dict(pad_token_id=0, original_max_position_embeddings=64, rope_parameters=dict(
        rope_type="longrope", rope_theta=10000.0, short_factor=[1.0 + i / 8 for i in range(8)],
        long_factor=[2.0 + i for i in range(8)], original_max_position_embeddings=64))),
    # DeepSeek: MLA (latent 32 + rotary 8 per token in the cache; V3 with a query bottleneck), a dense first
    # layer, then 8 routed experts in 4 groups (2 groups kept per token) + a shared expert
    "deepseek-v2": ("DeepseekV2Config", dict(
        num_key_value_heads=4, head_dim=8, kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=12, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32,
        first_k_dense_replace=1, topk_method="group_limited_greedy", n_group=4, topk_group=2,
        routed_scaling_factor=1.5)),
    "deepseek-v3": ("DeepseekV3Config", dict(
        num_key_value_heads=4, head_dim=8, kv_lora_rank=32, q_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=12, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32,
        first_k_dense_replace=1, n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True)),
}

# softcapping is computed by transformers' eager attention only
_EAGER = {"gemma2", "gemma3"}


def make_tiny_model(kind: str, path: Path, seed: int = 0, max_shard_size: str | None = None,
                    **overrides: Any) -> transformers.PreTrainedModel:
    """Write `kind`'s config (+ `overrides`) and safetensors to `path`; return the transformers model
    (float32, eval)."""
    cls_name, extra = TINY_CONFIGS[kind]
    cfg = getattr(transformers, cls_name)(**{**_BASE, **extra, **overrides})
    torch.manual_seed(seed)
    attn = "eager" if kind in _EAGER else "sdpa"
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation=attn)
    with torch.no_grad():  # random init is ~N(0, 0.02): widen it so logits are far from uniform
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.15)
            elif p.dim() == 1:
                p.uniform_(0.5, 1.5) if "norm" in "".join(n for n, q in model.named_parameters() if q is p) else p.normal_(0, 0.1)
        for name, b in model.named_buffers():  # DeepSeek-V3's routing correction: make it change choices
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.1)
    kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kw)
    return model.eval()


# Qwen3's chat format, shortened: tools in the system turn, <tool_call> blocks, tool results as <tool_response>
# in a user turn, an empty think block when thinking is off, and (enable_thinking true) the thinking opened
# by the prompt, as Qwen3's thinking-only models do
QWEN3_TEMPLATE = """{%- if tools %}<|im_start|>system
You can call these functions:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
To call one, answer <tool_call>{"name": NAME, "arguments": ARGS}</tool_call>.<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% elif message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{%- for tc in message.tool_calls %}
<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% elif enable_thinking %}<think>
{% endif %}{% endif %}"""
QWEN3_MARKERS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]  # one token each, not special (as Qwen's)


def make_tiny_qwen3_chat(path: Path) -> transformers.PreTrainedModel:
    """A random-weight Qwen3 folder that serves chat: the default model's BPE tokenizer plus Qwen3's markers
    as single tokens, Qwen3's chat template, <|im_end|> as end of sequence."""
    from rivulet.engine.tokenizer import load_tokenizer
    from rivulet.models.loader import resolve_model

    tok = load_tokenizer(resolve_model("default"))
    tok.add_tokens(QWEN3_MARKERS, special_tokens=False)
    tok.chat_template = QWEN3_TEMPLATE
    end = tok.convert_tokens_to_ids("<|im_end|>")
    model = make_tiny_model("qwen3", path, vocab_size=len(tok), eos_token_id=end, max_position_embeddings=1024)
    tok.save_pretrained(str(path))
    return model
