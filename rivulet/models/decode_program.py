"""Small steps of a plain Llama-family decoder with int8/int4 or packed bf16 weights as one C++ call.

A decode step of a small model on a CPU is mostly host work: the layer-by-layer forward makes
~11 dispatcher calls a layer, each an OpenMP fork/join, with the interpreter in between (the
default model in int4: ~3 ms of a 5 ms forward, the kernels ~2 ms). `DecodeProgram`
(`kernels/cpu/decode_program.cpp`) runs such a step, embedding to final norm, inside one OpenMP
region with a barrier between a layer's phases, computing a decode step's numbers exactly as the
layer-by-layer path does (the same kernels' arithmetic; tests/models/test_decode_program.py).
It is the CPU's counterpart of a CUDA-graph replay, and `--enforce-eager` turns it off too.

It takes steps with at most `MAX_QUERY` tokens per sequence: with `--quantization int8|int4`, of up to
`small_step_rows()` tokens (32, 8 on AMX CPUs; the steps that read the compact weight copies); with bf16
weights as this CPU's linears pack them (panels on AVX512-BF16 CPUs without AMX, `kernels/cpu/bf16_linear.cpp`;
AMX tiles, `kernels/cpu/amx_linear.cpp`), of up to 64 tokens: decode steps of that many sequences, k-token
verify steps, short prefill chunks. A quantized model whose original weights are packed bf16 gets both
programs: the compact copies' small steps, the originals' up to 64 tokens (the steps its layers would run on
the original weights). Each token
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
from rivulet.kernels.cpu import ops as cpu_ops
from rivulet.layers.attention import Attention
from rivulet.layers.quantization import Prepacked, WeightOnly
from rivulet.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, LlamaModel


BF16_MAX_ROWS = 64  # bf16 weights (panels or AMX tiles): steps of up to this many tokens (any batch the server runs)
MAX_QUERY = 8  # tokens of one sequence in a step the program takes (a verify step's 1 + k, a short chunk)


class DecodeProgram:
    """The native programs, each with the most tokens it takes, fewest first (`run` returns None for any
    other step): one, or a quantized model's compact-copy program and its packed-bf16 program."""

    def __init__(self, natives: list[tuple[int, object]]) -> None:
        self.natives = sorted(natives, key=lambda rn: rn[0])
        self.max_rows = self.natives[-1][0]

    @property
    def native(self) -> object:
        return self.natives[0][1]

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
            layout: BatchLayout) -> torch.Tensor | None:
        """Hidden states [T, hidden] after the final norm, or None when the step has more than max_rows tokens
        or a sequence with more than MAX_QUERY of them."""
        t = input_ids.shape[0]
        if not 0 < t <= self.max_rows or (layout.num_seqs != t and layout.max_query_len > MAX_QUERY):
            return None
        seqs = None
        if layout.num_seqs != t:  # some sequence has several tokens: which sequence each token is of
            qsl = layout.query_start_loc
            seqs = torch.tensor([i for i in range(layout.num_seqs) for _ in range(qsl[i + 1] - qsl[i])])
        native = next(n for rows, n in self.natives if t <= rows)
        return native.run(input_ids, positions, meta.slot_mapping, meta.block_tables, seqs)  # type: ignore[attr-defined]


def _weights(linear: torch.nn.Module, original: bool = False) -> tuple[torch.Tensor, int] | None:
    """A linear's weight as the program reads it (int8/int4, bf16 panels or AMX tiles), and the most rows it serves;
    None if it cannot. `original`: a quantized linear's original weight instead of its compact copy."""
    quant = getattr(linear, "quant", None)  # (a LoRA server's linears have adapter slots: the runner runs
    # the program only for steps in which no row has an adapter)
    if isinstance(quant, WeightOnly):
        if not original:
            return quant.panels, quant.max_rows
        quant = quant.dense
    packed = quant.packed if isinstance(quant, Prepacked) else None
    if packed is None or packed.dtype != torch.bfloat16:
        return None
    if (packed.dim() == 3 and getattr(load_cpu_ext(), "DECODE_PROGRAM_PANELS", False)) or (
            packed.dim() == 4 and cpu_ops.AMX_BF16):
        return packed, BF16_MAX_ROWS
    return None


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
    if cfg.sandwich_norms or cfg.embed_scale or cfg.attn_logit_softcapping or cfg.hidden_act != "silu":
        return "the architecture has sandwich norms, scaled embeddings, capped scores or no SiLU"
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
            return ("the linears do not all have weight-only int8/int4 copies (--quantization int8|int4) or bf16 "
                    "weights packed in panels (AVX512-BF16 CPUs) or AMX tiles")
        if attn.o_proj.bias is not None or mlp.gate_up_proj.bias is not None or mlp.down_proj.bias is not None:
            return "biases beyond the QKV projection"
    return None


def build_decode_program(model: torch.nn.Module) -> tuple[DecodeProgram | None, str | None]:
    """(the program, None) for a model it describes, whose KV cache is bound; else (None, why not)."""
    if (why := unsupported_reason(model)) is not None:
        return None, why
    assert isinstance(model, LlamaForCausalLM)
    layers = model.model.layers
    linears = [(layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
               for layer in layers]
    candidates = [[[_weights(lin) for lin in lins] for lins in linears]]
    if all(isinstance(getattr(lin, "quant", None), WeightOnly) for lins in linears for lin in lins):
        candidates.append([[_weights(lin, original=True) for lin in lins] for lins in linears])
    natives = []
    for ws in candidates:
        if any(w is None for lw in ws for w in lw):
            continue  # a quantized model's original weights that are not packed bf16
        max_rows = min(w[1] for lw in ws for w in lw)  # type: ignore[index]
        try:
            natives.append((max_rows, _native(model, ws, max_rows)))  # type: ignore[arg-type]
        except RuntimeError as e:  # a shape the native code has no kernel for (e.g. an unusual head dim)
            return None, f"the native program refused the model: {str(e).splitlines()[0]}"
    return DecodeProgram(natives), None


def _native(model: LlamaForCausalLM, weights: list[list[tuple[torch.Tensor, int]]], max_rows: int) -> object:
    cfg, m = model.config, model.model
    first = m.layers[0].self_attn
    native = load_cpu_ext().DecodeProgram(  # type: ignore[union-attr]
        m.embed_tokens.weight.detach(), m.norm.weight.detach(), first.rotary_emb.cos_sin_cache,
        first.rotary_emb.interleaved, cfg.rms_norm_eps, first.attn.scale, first.attn.num_heads,
        first.attn.num_kv_heads, first.head_dim, m.layers[0].mlp.down_proj.in_features, max_rows)
    for layer, (qkv, o, gate_up, down) in zip(m.layers, weights):
        attn = layer.self_attn
        bias = attn.qkv_proj.bias.detach() if attn.qkv_proj.bias is not None else None
        qk = (attn.q_norm.weight.detach(), attn.k_norm.weight.detach()) if attn.q_norm is not None else (None, None)
        native.add_layer(layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach(),
                         qkv[0], bias, o[0], gate_up[0], down[0], attn.attn.kv_cache, *qk)
    return native
