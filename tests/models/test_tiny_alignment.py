"""Every architecture, as a tiny random model written by the test, against transformers (float32)."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers.runner import make_runner, teacher_forced_logits
from helpers.tiny import TINY_CONFIGS, make_tiny_model
from rivulet.kernels import rope_cos_sin_cache
from rivulet.worker.batch import SeqChunk

KINDS = sorted(TINY_CONFIGS)


def _reference(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def _assert_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    scale = ref.abs().max().item()
    diff = (ours - ref).abs().max().item()
    assert diff <= 1e-4 * scale, f"max |diff| {diff:.3g} > 1e-4 x logit scale {scale:.3g}"


@pytest.mark.parametrize("kind", KINDS)
def test_prefill_chunks_and_decode_match_transformers(kind, tiny_model_dir):
    path, hf = tiny_model_dir(kind)
    ids = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(7)).tolist()
    r = make_runner(path)
    blocks = [37, 3, 90, 12, 5, 66, 1, 8, 101, 44, 23]  # scattered pages, not 0..n
    ours = teacher_forced_logits(r, ids, chunks=[13, 9, 5], blocks=blocks)  # then 13 decode steps
    _assert_close(ours, _reference(hf, ids))


@pytest.mark.parametrize("kind", ["llama", "qwen3-moe", "gemma3", "deepseek-v3"])
def test_mixed_flat_batch_equals_each_sequence_alone(kind, tiny_model_dir):
    """One step that mixes a first prefill chunk, a middle chunk and two decodes of four sequences."""
    path, hf = tiny_model_dir(kind)
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (21, 30, 17, 9)]
    r = make_runner(path)
    tables = [list(range(i * 10, i * 10 + 10)) for i in range(4)]
    # warm the caches: seq1 has 20 tokens computed, seq2 16, seq3 8
    for s, t, n in [(seqs[1], tables[1], 20), (seqs[2], tables[2], 16), (seqs[3], tables[3], 8)]:
        r.forward([SeqChunk(s[:n], 0, t)])
    logits = r.forward([
        SeqChunk(seqs[0][:11], 0, tables[0]),      # first prefill chunk
        SeqChunk(seqs[1][20:30], 20, tables[1]),   # later chunk
        SeqChunk([seqs[2][16]], 16, tables[2]),    # decode
        SeqChunk([seqs[3][8]], 8, tables[3]),      # decode
    ])
    want = torch.stack([_reference(hf, seqs[0][:11])[-1], _reference(hf, seqs[1])[-1],
                        _reference(hf, seqs[2])[-1], _reference(hf, seqs[3])[-1]])
    _assert_close(logits, want)


def test_sharded_checkpoint_with_index(tmp_path, tiny_model_dir):
    _, hf = tiny_model_dir("qwen2")
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    ids = list(range(5, 25))
    ours = teacher_forced_logits(make_runner(tmp_path), ids, chunks=[20], blocks=list(range(8)))
    _assert_close(ours, _reference(hf, ids))


def test_stacked_expert_tensors(tmp_path, tiny_model_dir):
    """transformers 5 keeps experts stacked as gate_up_proj [E, 2I, H] / down_proj [E, H, I]."""
    path, hf = tiny_model_dir("mixtral")
    tensors = load_file(path / "model.safetensors")
    out = {k: v for k, v in tensors.items() if ".experts." not in k}
    for layer in range(2):
        p = f"model.layers.{layer}.block_sparse_moe.experts"
        e = range(4)
        out[f"{p}.gate_up_proj"] = torch.stack([torch.cat([tensors[f"{p}.{i}.w1.weight"], tensors[f"{p}.{i}.w3.weight"]]) for i in e])
        out[f"{p}.down_proj"] = torch.stack([tensors[f"{p}.{i}.w2.weight"] for i in e])
    save_file(out, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    ids = list(range(30, 50))
    ours = teacher_forced_logits(make_runner(tmp_path), ids, chunks=[20], blocks=list(range(8)))
    _assert_close(ours, _reference(hf, ids))


def test_sliding_window_is_applied(tiny_model_dir):
    """With 40 tokens and a 12-token window, ignoring the window would change the logits."""
    path, hf = tiny_model_dir("mistral-window")
    r = make_runner(path)
    for layer in r.model.model.layers:
        layer.self_attn.attn.sliding_window = None
    ids = list(range(100, 140))
    ours = teacher_forced_logits(r, ids, chunks=[40], blocks=list(range(12)))
    ref = _reference(hf, ids)
    assert (ours - ref).abs().max() > 1e-2 * ref.abs().max()


def test_different_seeds_give_different_models(tmp_path):
    """Guards the tolerance above: two unrelated random models are far apart."""
    a = make_tiny_model("llama", tmp_path / "a", seed=1)
    b = make_tiny_model("llama", tmp_path / "b", seed=2)
    ids = list(range(10))
    assert (_reference(a, ids) - _reference(b, ids)).abs().max() > 0.1


def _drop_attention_cap(r):
    for layer in r.model.model.layers:
        layer.self_attn.attn.softcap = 0.0


def _drop_windows(r):
    for layer in r.model.model.layers:
        layer.self_attn.attn.sliding_window = None


def _drop_logit_cap(r):
    r.model.config.final_logit_softcapping = None


def _plain_scale(r):
    for layer in r.model.model.layers:
        layer.self_attn.attn.scale = r.model.config.head_dim**-0.5


def _no_embed_scale(r):
    r.model.model.embed_scale = None


def _no_sandwich(r):
    for layer in r.model.model.layers:
        layer.sandwich = False


@pytest.mark.parametrize("kind,mutate", [
    ("gemma2", _drop_attention_cap), ("gemma2", _drop_logit_cap), ("gemma2", _drop_windows),
    ("gemma3", _drop_windows), ("gemma3", _plain_scale), ("gemma3", _no_embed_scale), ("gemma3", _no_sandwich),
])
def test_each_gemma_feature_changes_the_logits(kind, mutate, tiny_model_dir):
    """Guards the alignment tests above: without any one of these features the logits move well past
    the tolerance, so matching transformers means each is applied."""
    path, hf = tiny_model_dir(kind)
    r = make_runner(path)
    mutate(r)
    ids = list(range(100, 140))
    ours = teacher_forced_logits(r, ids, chunks=[40], blocks=list(range(12)))
    ref = _reference(hf, ids)
    assert (ours - ref).abs().max() > 1e-2 * ref.abs().max()


def test_phi3_longrope_switches_to_long_factors_past_the_original_length(tmp_path):
    """A 30-token prompt (short factors) decoded to 40 tokens, past the original 32: transformers picks
    the long factors once the sequence is longer than 32, so the last 8 positions use them."""
    hf = make_tiny_model("phi3", tmp_path, original_max_position_embeddings=32, rope_parameters=dict(
        rope_type="longrope", rope_theta=10000.0, short_factor=[1.0 + i / 8 for i in range(8)],
        long_factor=[2.0 + i for i in range(8)], original_max_position_embeddings=32))
    ids = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(5)).tolist()
    ours = teacher_forced_logits(make_runner(tmp_path), ids, chunks=[17, 13], blocks=list(range(12)))
    with torch.no_grad():  # transformers decoding token by token after a 30-token prefill
        out = hf(torch.tensor([ids[:30]]), use_cache=True)
        ref, cache = [out.logits[0]], out.past_key_values
        for i in range(30, 40):
            out = hf(torch.tensor([[ids[i]]]), cache=cache, use_cache=True)
            ref.append(out.logits[0])
    _assert_close(ours, torch.cat(ref).float())
    short_only = make_runner(tmp_path)  # the same model without the switch is far off at positions >= 32
    rot = short_only.model.model.layers[0].self_attn.rotary_emb
    rot.cos_sin_cache[32:] = rope_short_table(rot.cos_sin_cache.shape[0], [1.0 + i / 8 for i in range(8)])[32:]
    wrong = teacher_forced_logits(short_only, ids, chunks=[17, 13], blocks=list(range(12)))
    ref = torch.cat(ref).float()
    assert (wrong[32:] - ref[32:]).abs().max() > 1e-2 * ref.abs().max()


def rope_short_table(n: int, short_factor: list[float]) -> torch.Tensor:
    """Phi-3's cos/sin table with the short factors at every position (head_dim 16, factor 256/32 = 8)."""
    exponents = torch.arange(0, 16, 2).float() / 16
    mscale = math.sqrt(1 + math.log(8) / math.log(32))
    return rope_cos_sin_cache(1.0 / (torch.tensor(short_factor) * 10000.0**exponents), n, mscale)
