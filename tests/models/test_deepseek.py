"""DeepSeek-V2/V3 beyond the logits check of test_tiny_alignment: greedy generation through the engine
equals transformers', the routing equals transformers' routers, each routing feature matters on these
weights (so matching means it is applied), and the cache holds one latent vector per token."""

from __future__ import annotations

import pytest
import torch
import transformers

from helpers.runner import make_runner, teacher_forced_logits
from helpers.tiny import make_tiny_model
from rivulet import LLM, SamplingParams
from rivulet.kernels.moe import grouped_topk_routing_ref
from rivulet.layers.attention import MLAAttention


@pytest.mark.parametrize("kind", ["deepseek-v2", "deepseek-v3"])
def test_greedy_tokens_equal_transformers_through_chunks_and_the_prefix_cache(kind, tiny_model_dir):
    path, hf = tiny_model_dir(kind)
    g = torch.Generator().manual_seed(11)
    shared = torch.randint(0, 256, (24,), generator=g).tolist()
    prompts = [shared + torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 17)]
    with torch.no_grad():
        want = [hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, min_new_tokens=12)[0, len(p):].tolist()
                for p in prompts]
    llm = LLM(str(path), dtype="float32", max_model_len=128, block_size=4, max_num_batched_tokens=16,
              enable_prefix_caching=True)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    first = llm.generate([{"prompt_token_ids": prompts[0]}], greedy, use_tqdm=False)
    second = llm.generate([{"prompt_token_ids": prompts[1]}], greedy, use_tqdm=False)  # reuses the shared blocks
    assert second[0].num_cached_tokens >= 20
    assert [first[0].outputs[0].token_ids, second[0].outputs[0].token_ids] == want


def _hf_router(cls_name: str, **cfg):
    config = getattr(transformers, f"{cls_name}Config")(hidden_size=16, num_attention_heads=4, n_routed_experts=16,
                                                         num_experts_per_tok=3,
                                                         **cfg)
    module = transformers.models.deepseek_v3.modeling_deepseek_v3 if cls_name == "DeepseekV3" else \
        transformers.models.deepseek_v2.modeling_deepseek_v2
    router = getattr(module, f"{cls_name}TopkRouter")(config)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=g))
        if hasattr(router, "e_score_correction_bias"):
            router.e_score_correction_bias.copy_(torch.randn(16, generator=g) * 0.3)
    return router


@pytest.mark.parametrize("name,cfg,ours", [
    ("DeepseekV2", dict(topk_method="greedy", routed_scaling_factor=1.5), dict(scoring="softmax", scale=1.5)),
    ("DeepseekV2", dict(topk_method="group_limited_greedy", n_group=4, topk_group=2),
     dict(scoring="softmax", n_group=4, topk_group=2, group_by="max")),
    ("DeepseekV3", dict(n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5),
     dict(scoring="sigmoid", n_group=4, topk_group=2, group_by="top2", renormalize=True, scale=2.5)),
])
def test_grouped_routing_equals_transformers(name, cfg, ours):
    router = _hf_router(name, **cfg)
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits, want_w, want_ids = router(x)
    bias = getattr(router, "e_score_correction_bias", None)
    w, ids = grouped_topk_routing_ref(logits, 3, bias=bias, **ours)
    order, want_order = ids.argsort(-1), want_ids.argsort(-1)
    assert torch.equal(ids.gather(1, order), want_ids.gather(1, want_order))
    torch.testing.assert_close(w.gather(1, order), want_w.float().gather(1, want_order))
    if "n_group" in ours:  # the group limit changes some tokens' experts here
        _, free = grouped_topk_routing_ref(logits, 3, bias=bias, **{**ours, "n_group": 1})
        assert not torch.equal(free.sort(-1).values, ids.sort(-1).values)


def _no_bias(r):
    for layer in r.model.model.layers[1:]:
        layer.mlp.gate.e_score_correction_bias.zero_()


def _no_group_limit(r):
    r.model.config.n_group = 1


def _no_shared_experts(r):
    for layer in r.model.model.layers[1:]:
        layer.mlp.shared_experts = None


def _no_routed_scale(r):
    r.model.config.routed_scaling_factor = 1.0


@pytest.mark.parametrize("kind,mutate", [
    ("deepseek-v3", _no_bias), ("deepseek-v3", _no_group_limit), ("deepseek-v3", _no_shared_experts),
    ("deepseek-v2", _no_routed_scale),
])
def test_each_routing_feature_changes_the_logits(kind, mutate, tiny_model_dir):
    path, hf = tiny_model_dir(kind)
    r = make_runner(path)
    mutate(r)
    ids = list(range(100, 140))
    ours = teacher_forced_logits(r, ids, chunks=[40], blocks=list(range(12)))
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    assert (ours - ref).abs().max() > 1e-2 * ref.abs().max()


def test_cache_holds_the_latent_and_rotary_key_only(tiny_model_dir):
    path, hf = tiny_model_dir("deepseek-v3")
    c = hf.config
    r = make_runner(path, block_size=4)
    layers = [a for a in r.attn_layers]
    assert len(layers) == c.num_hidden_layers and all(isinstance(a, MLAAttention) for a in layers)
    assert all(a.kv_cache.data_ptr() == cache.data_ptr() and cache.shape[0] == 1
               for a, cache in zip(layers, r.kv_caches))
    per_token = r.kv_bytes_per_block() // 4
    assert per_token == c.num_hidden_layers * (c.kv_lora_rank + c.qk_rope_head_dim) * 4  # float32
    heads = c.num_attention_heads * (c.qk_nope_head_dim + c.qk_rope_head_dim + c.v_head_dim)
    assert r.model.config.mla_cache_saving() == heads / (c.kv_lora_rank + c.qk_rope_head_dim)


def test_yarn_rope_and_its_score_scale_match_transformers(tmp_path):
    """DeepSeek's long-context checkpoints: YaRN frequencies, cos/sin scaled by the attention factor and the
    MLA scores by mscale_all_dim's mscale squared; 40 positions past the original 32."""
    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
            "beta_fast": 32, "beta_slow": 1, "mscale": 0.9, "mscale_all_dim": 0.7}
    hf = make_tiny_model("deepseek-v3", tmp_path, rope_parameters=yarn)
    ids = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(8)).tolist()
    r = make_runner(tmp_path)
    ours = teacher_forced_logits(r, ids, chunks=[19, 11], blocks=list(range(12)))
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    assert (ours - ref).abs().max() <= 1e-4 * ref.abs().max()
    for layer in r.model.model.layers:  # without the mscale on the scores: far off
        layer.self_attn.attn.scale = (hf.config.qk_nope_head_dim + hf.config.qk_rope_head_dim) ** -0.5
    off = teacher_forced_logits(r, ids, chunks=[40], blocks=list(range(12, 24)))
    assert (off - ref).abs().max() > 1e-2 * ref.abs().max()


def test_bfloat16_follows_float32(tiny_model_dir):
    """bf16 weights and activations (packed linears, the bf16 attention kernels, the float32 router): within
    bf16 rounding of transformers in float32 at almost every position."""
    path, hf = tiny_model_dir("deepseek-v2")
    ids = list(range(100, 140))
    got = teacher_forced_logits(make_runner(path, dtype="bfloat16"), ids, chunks=[23, 17], blocks=list(range(12)))
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    per_position = (got.float() - ref).abs().max(-1).values
    assert per_position.median() < 0.03 * ref.abs().max()
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9
