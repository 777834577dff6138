"""Rivulet's fusion passes (`--compilation-level 2`): each rewrite checked against the unfused graph, on a
hand-written graph (the rewritten graph computes the same outputs and cache bits; what the pass must not
touch stays) and on whole models (the level-2 model gives the eager greedy tokens, and the rewrites
happen once per layer)."""

from __future__ import annotations

import random

import pytest
import torch
from torch import fx

from rivulet import LLM, SamplingParams
from rivulet.compilation import PASSES, FusionPasses, parse_passes
from rivulet.config import RivuletError
from rivulet.kernels.cpu import load_cpu_ext
from rivulet.kernels.rotary import rope_cos_sin_cache

ext = load_cpu_ext()
needs_ext = pytest.mark.skipif(ext is None, reason="no C++ compiler: the kernels are PyTorch references")

T, HQ, HK, D = 7, 4, 2, 16


def _block(positions, qkv, cos_sin, cache, slots):
    """What LlamaAttention + Attention do up to the attention kernel: split, rotate, views, KV write;
    returns the output and the rotated keys."""
    ops = torch.ops.rivulet
    q, k, v = qkv.split([HQ * D, HK * D, HK * D], dim=-1)
    r = ops.apply_rotary.default(positions, q.reshape(T, -1, D), k.reshape(T, -1, D), cos_sin, False)
    q, k = r[0], r[1]
    q = q.view(T, HQ, D)  # a reader of the queries before the write: the pass must move it after
    ops.write_kv_cache.default(k.reshape(T, -1).view(T, HK, D), v.view(T, HK, D), cache, slots)
    out = q * 2 + cache[0, 0, 0, 0, 0]  # reads the cache after the write
    return out, k


def _attention_block(positions, qkv, cos_sin, cache, slots):
    return _block(positions, qkv, cos_sin, cache, slots)[0]


def _leaky_block(positions, qkv, cos_sin, cache, slots):  # the rotated keys are also an output
    return _block(positions, qkv, cos_sin, cache, slots)


def _inputs():
    g = torch.Generator().manual_seed(0)
    cos_sin = rope_cos_sin_cache(1.0 / (10000 ** (torch.arange(0, D, 2).float() / D)), 64)
    cache = torch.zeros(2, 4, 4, HK, D)
    slots = torch.tensor([0, 5, 9, -1, 2, 13, 7])
    return torch.randint(0, 64, (T,), generator=g), torch.randn(T, (HQ + 2 * HK) * D, generator=g), cos_sin, cache, slots


def _run(gm: fx.GraphModule, args):
    args = [a.clone() for a in args]
    return gm(*args), args[3]


@needs_ext
def test_rope_kv_write_pass_rewrites_the_graph_into_one_op_with_the_same_results():
    import rivulet.kernels.cpu.ops  # noqa: F401 - the dispatcher ops and their fake implementations

    gm = fx.symbolic_trace(_attention_block)
    args = _inputs()
    want_out, want_cache = _run(gm, args)
    passes = FusionPasses(["rope_kv_write"])
    passes(gm.graph)
    gm.recompile()
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert passes.applied == {"rope_kv_write": 1}
    assert torch.ops.rivulet.rotary_write_kv_cache.default in targets
    assert torch.ops.rivulet.apply_rotary.default not in targets and torch.ops.rivulet.write_kv_cache.default not in targets
    got_out, got_cache = _run(gm, args)
    assert torch.equal(got_out, want_out) and torch.equal(got_cache, want_cache)
    assert want_cache.abs().sum() > 0  # the block wrote something, so the equality says something


@needs_ext
def test_rope_kv_write_pass_leaves_keys_that_are_read_elsewhere():
    import rivulet.kernels.cpu.ops  # noqa: F401

    gm = fx.symbolic_trace(_leaky_block)
    before = [n.target for n in gm.graph.nodes]
    passes = FusionPasses(["rope_kv_write"])
    passes(gm.graph)
    assert passes.applied == {"rope_kv_write": 0} and [n.target for n in gm.graph.nodes] == before


def test_compilation_passes_are_named_and_need_level_2():
    assert parse_passes(None) == tuple(PASSES) and parse_passes("") == ()
    assert parse_passes(" rope_kv_write, rope_kv_write") == ("rope_kv_write",)
    with pytest.raises(RivuletError, match="unknown compilation pass.*nope.*known: rope_kv_write"):
        parse_passes("rope_kv_write,nope")
    with pytest.raises(RivuletError, match="--compilation-level 2"):
        LLM("default", compilation_level=1, compilation_passes="rope_kv_write")


@needs_ext
@pytest.mark.parametrize("kind", ["llama", "qwen3"])  # qwen3: q/k norms between the split and the rotation
def test_level_2_gives_the_eager_tokens_with_one_fusion_per_layer(kind, tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("RIVULET_CACHE_DIR", str(tmp_path))
    path, hf = tiny_model_dir(kind)
    kw = dict(dtype="float32", max_model_len=128, max_num_batched_tokens=32, block_size=4)
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 256) for _ in range(rng.randrange(1, 40))]} for _ in range(6)]
    params = [SamplingParams(temperature=0, max_tokens=rng.randrange(2, 12), ignore_eos=True) for _ in range(6)]

    def run(**extra) -> tuple[list[list[int]], object]:
        llm = LLM(str(path), **kw, **extra)
        tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        forward = llm.engine.core.executor.runner.forward_fn
        llm.shutdown()
        return tokens, forward

    want, _ = run()
    fused, forward = run(compilation_level=2)
    assert fused == want
    layers = hf.config.num_hidden_layers
    assert forward.fusions == {"rope_kv_write": 2 * layers}  # each layer, in both graphs (one token, more)
    assert forward.fallbacks == 0
    unfused, off = run(compilation_level=2, compilation_passes="")
    assert unfused == want and off.fusions == {} and off.fingerprint != forward.fingerprint
