"""Small steps of a plain Llama-family decoder with weight-only int8/int4 weights as one C++ call.

A decode step of a small model on a CPU is mostly host work: the layer-by-layer forward makes
~11 dispatcher calls a layer, each an OpenMP fork/join, with the interpreter in between (the
default model in int4: ~3 ms of a 5 ms forward, the kernels ~2 ms). `DecodeProgram`
(`kernels/cpu/decode_program.cpp`) runs such a step, embedding to final norm, inside one OpenMP
region with a barrier between a layer's phases, computing a decode step's numbers exactly as the
layer-by-layer path does (the same kernels' arithmetic; tests/models/test_decode_program.py).
It is the CPU's counterpart of a CUDA-graph replay, and `--enforce-eager` turns it off too.

It takes any step of at most `MAX_ROWS` tokens (the steps that read the compact weight copies):
decode steps of up to that many sequences, k-token verify steps, short prefill chunks. Each token
attends to its own context [0, position] with the decode kernel, so a token of a multi-token step
gets exactly the numbers it would get decoded alone (the layer-by-layer path takes multi-token
sequences through the prefill kernel, whose sums run in another order). Bigger steps, and any model
it does not describe, run layer by layer. `build_decode_program` says why a model is not taken.
"""

from __future__ import annotations

import torch

from rivulet.distributed import get_parallel_state
from rivulet.kernels.attention import AttentionMetadata, BatchLayout
from rivulet.kernels.cpu import load_cpu_ext
from rivulet.layers.attention import Attention
from rivulet.layers.quantization import WeightOnly
from rivulet.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, LlamaModel


class DecodeProgram:
    """The native program and the steps it takes (`run` returns None for any other step)."""

    def __init__(self, native: object, max_rows: int) -> None:
        self.native, self.max_rows = native, max_rows

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
            layout: BatchLayout) -> torch.Tensor | None:
        """Hidden states [T, hidden] after the final norm, or None when the step has more than max_rows tokens."""
        t = input_ids.shape[0]
        if not 0 < t <= self.max_rows:
            return None
        seqs = None
        if layout.num_seqs != t:  # some sequence has several tokens: which sequence each token is of
            qsl = layout.query_start_loc
            seqs = torch.tensor([i for i in range(layout.num_seqs) for _ in range(qsl[i + 1] - qsl[i])])
        return self.native.run(input_ids, positions, meta.slot_mapping, meta.block_tables, seqs)  # type: ignore[attr-defined]


def _weights(linear: torch.nn.Module) -> list[torch.Tensor] | None:
    quant = getattr(linear, "quant", None)
    if not isinstance(quant, WeightOnly) or getattr(linear, "lora", None) is not None:
        return None
    return list(quant.tensors)


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why `model` cannot run as a decode program (None: it can)."""
    ext = load_cpu_ext()
    if ext is None or not hasattr(ext, "DecodeProgram"):
        return "the C++ kernels are not built for AVX512-VNNI"
    if not isinstance(model, LlamaForCausalLM) or type(model.model) is not LlamaModel or any(
            getattr(type(model), f) is not getattr(LlamaForCausalLM, f)
            for f in ("forward", "make_attention", "make_mlp")):
        return f"{type(model).__name__} is not the plain Llama decoder"
    if get_parallel_state().world_size > 1:
        return "more than one rank"
    cfg = model.config
    if cfg.qk_norm or cfg.sandwich_norms or cfg.embed_scale or cfg.attn_logit_softcapping or cfg.hidden_act != "silu":
        return "the architecture has q/k norms, sandwich norms, scaled embeddings, capped scores or no SiLU"
    if any(cfg.layer_window(i) for i in range(cfg.num_hidden_layers)):
        return "sliding-window layers"
    emb = model.model.embed_tokens
    if emb is None or emb.weight.is_mkldnn or emb.weight.dtype not in (torch.float32, torch.bfloat16):
        return "the embedding is not a plain float32/bfloat16 table"
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if not isinstance(attn, LlamaAttention) or not isinstance(mlp, LlamaMLP) or type(attn.attn) is not Attention:
            return "a layer is not Llama attention + gated MLP"
        if attn.attn.kv_cache is None or attn.attn.kv_cache.dtype != emb.weight.dtype:
            return "the KV cache is not bound or not in the activation dtype"
        if any(_weights(lin) is None for lin in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)):
            return "the linears do not all have weight-only int8/int4 copies (--quantization int8|int4)"
        if attn.o_proj.bias is not None or mlp.gate_up_proj.bias is not None or mlp.down_proj.bias is not None:
            return "biases beyond the QKV projection"
    return None


def build_decode_program(model: torch.nn.Module) -> tuple[DecodeProgram | None, str | None]:
    """(the program, None) for a model it describes, whose KV cache is bound; else (None, why not)."""
    if (why := unsupported_reason(model)) is not None:
        return None, why
    assert isinstance(model, LlamaForCausalLM)
    cfg, m = model.config, model.model
    first = m.layers[0].self_attn
    max_rows = min(lin.quant.max_rows for layer in m.layers
                   for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                               layer.mlp.down_proj))
    native = load_cpu_ext().DecodeProgram(  # type: ignore[union-attr]
        m.embed_tokens.weight.detach(), m.norm.weight.detach(), first.rotary_emb.cos_sin_cache,
        first.rotary_emb.interleaved, cfg.rms_norm_eps, first.attn.scale, first.attn.num_heads,
        first.attn.num_kv_heads, first.head_dim, m.layers[0].mlp.down_proj.in_features, max_rows)
    for layer in m.layers:
        attn, mlp = layer.self_attn, layer.mlp
        bias = attn.qkv_proj.bias.detach() if attn.qkv_proj.bias is not None else None
        native.add_layer(layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach(),
                         _weights(attn.qkv_proj), bias, _weights(attn.o_proj), _weights(mlp.gate_up_proj),
                         _weights(mlp.down_proj), attn.attn.kv_cache)
    return DecodeProgram(native, max_rows), None
