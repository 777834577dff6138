"""Embeddings from `LLM(task="embed")` against their references on the same weights: the real
all-MiniLM-L6-v2 against sentence-transformers, tiny random decoders against transformers' hidden states."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers

from helpers.minilm import minilm_dir
from rivulet import LLM, PoolingParams
from rivulet.config import RivuletError

TEXTS = ["The cat sits on the mat.", "Paged attention keeps the KV cache in fixed-size blocks.", "hello",
         "A longer sentence about inference engines, continuous batching and how a scheduler fills each step "
         "with whole prompts when all it serves is embeddings."]


@pytest.fixture(scope="module")
def st_reference() -> torch.Tensor:
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(minilm_dir()), device="cpu")
    return torch.from_numpy(st.encode(TEXTS))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_minilm_matches_sentence_transformers(dtype: str, st_reference: torch.Tensor) -> None:
    llm = LLM(str(minilm_dir()), task="embed", dtype=dtype)
    assert llm.config.model.task == "embed"
    outs = llm.embed(TEXTS, use_tqdm=False)
    got = torch.tensor([o.outputs.embedding for o in outs])
    assert got.shape == (len(TEXTS), 384)
    cos = F.cosine_similarity(got, st_reference)
    assert cos.min() >= (0.99999 if dtype == "float32" else 0.999), cos
    assert torch.allclose(got.norm(dim=-1), torch.ones(len(TEXTS)), atol=1e-4)  # its Normalize module
    # batched (all four in one step) equals one at a time
    alone = torch.tensor([llm.embed(t, use_tqdm=False)[0].outputs.embedding for t in TEXTS])
    assert torch.allclose(alone, got, atol=1e-5 if dtype == "float32" else 2e-2)
    # the sentence-transformers folder sets the context: max_seq_length 256, not BERT's 512 positions
    assert llm.engine.processor.max_model_len == 256
    assert outs[0].prompt_token_ids[0] == 101 and outs[0].prompt_token_ids[-1] == 102  # [CLS] ... [SEP]
    llm.shutdown()


def test_minilm_inputs_and_limits() -> None:
    llm = LLM(str(minilm_dir()), task="embed", dtype="float32", max_num_batched_tokens=300)
    tok = llm.get_tokenizer()
    ids = tok("token ids in, the same vector out").input_ids
    by_text, by_ids = llm.embed(["token ids in, the same vector out", ids], use_tqdm=False)
    assert by_text.outputs.embedding == by_ids.outputs.embedding
    raw = llm.embed("hello", PoolingParams(normalize=False), use_tqdm=False)[0].outputs.embedding
    assert abs(torch.tensor(raw).norm().item() - 1.0) > 0.1  # mean pooling alone is not unit length
    long_text = "word " * 400
    with pytest.raises(RivuletError, match="maximum input length is 256"):
        llm.embed(long_text, use_tqdm=False)
    cut = llm.embed(long_text, PoolingParams(truncate_prompt_tokens=-1), use_tqdm=False)[0]
    assert len(cut.prompt_token_ids) == 256 and cut.prompt_token_ids[-1] == 102  # cut as the tokenizer cuts
    from sentence_transformers import SentenceTransformer

    ref = SentenceTransformer(str(minilm_dir()), device="cpu").encode([long_text])  # truncates to 256 itself
    assert F.cosine_similarity(torch.tensor([cut.outputs.embedding]), torch.from_numpy(ref)).item() > 0.99999
    with pytest.raises(RivuletError, match="Matryoshka"):
        llm.embed("hello", PoolingParams(dimensions=8), use_tqdm=False)
    with pytest.raises(RivuletError, match="serves embeddings"):
        llm.generate("hello")
    llm.shutdown()


def test_an_encoder_must_be_started_for_embeddings() -> None:
    with pytest.raises(RivuletError, match="encoder.*--task embed"):
        LLM(str(minilm_dir()))


def _hf_hidden(model: transformers.PreTrainedModel, ids: list[int]) -> torch.Tensor:
    """transformers' last hidden states (after the final norm) of one sequence [L, H]."""
    with torch.no_grad():
        return model.model(torch.tensor([ids])).last_hidden_state[0]


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_decoder_last_and_mean_pooling_match_transformers(kind: str, tiny_model_dir) -> None:
    path, hf = tiny_model_dir(kind)
    prompts = [[5, 17, 33, 2, 9, 100], [7, 8], list(range(40, 80))]
    hidden = [_hf_hidden(hf, p) for p in prompts]
    llm = LLM(str(path), task="embed", dtype="float32", num_kv_blocks=64)
    last = torch.tensor([o.outputs.embedding for o in llm.embed([{"prompt_token_ids": p} for p in prompts],
                                                                 use_tqdm=False)])
    want = F.normalize(torch.stack([h[-1] for h in hidden]), dim=-1)
    assert torch.allclose(last, want, atol=1e-4), (last - want).abs().max()
    kv = llm.engine.core.kv_cache_manager
    assert kv.block_pool.num_free_blocks == kv.num_blocks  # nothing kept after the step
    llm.shutdown()
    llm = LLM(str(path), task="embed", dtype="float32", num_kv_blocks=64,
              pooler_config={"pooling_type": "MEAN", "normalize": False})
    mean = torch.tensor([o.outputs.embedding for o in llm.embed([{"prompt_token_ids": p} for p in prompts],
                                                                 use_tqdm=False)])
    assert torch.allclose(mean, torch.stack([h.mean(0) for h in hidden]), atol=1e-4)
    with pytest.raises(RivuletError, match="pooling type 'MAX'"):
        LLM(str(path), task="embed", pooler_config={"pooling_type": "MAX"})
    llm.shutdown()


def test_a_generating_model_refuses_embedding_requests(tiny_model_dir) -> None:
    path, _ = tiny_model_dir("llama")
    llm = LLM(str(path), num_kv_blocks=32)
    with pytest.raises(RivuletError, match="--task embed"):
        llm.embed([[1, 2, 3]], use_tqdm=False)
    with pytest.raises(RivuletError, match="--task embed"):
        LLM(str(path), pooler_config={"pooling_type": "MEAN"})
    llm.shutdown()


def test_matryoshka_models_cut_to_the_dimensions_asked(tiny_model_dir, tmp_path) -> None:
    import json
    import shutil

    src, _ = tiny_model_dir("llama")
    path = tmp_path / "matryoshka"
    shutil.copytree(src, path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "matryoshka_dimensions": [16, 32, 64]}))
    llm = LLM(str(path), task="embed", dtype="float32", num_kv_blocks=32)
    prompt = {"prompt_token_ids": [3, 1, 4, 1, 5, 9, 2, 6]}
    full = torch.tensor(llm.embed(prompt, use_tqdm=False)[0].outputs.embedding)
    cut = torch.tensor(llm.embed(prompt, PoolingParams(dimensions=16), use_tqdm=False)[0].outputs.embedding)
    assert full.shape == (64,) and cut.shape == (16,)
    assert torch.allclose(cut, F.normalize(full[:16], dim=0), atol=1e-5)  # the prefix, normalized again
    with pytest.raises(RivuletError, match="exceeds the model's embedding size"):
        llm.embed(prompt, PoolingParams(dimensions=65), use_tqdm=False)
    llm.shutdown()


def test_compiled_encoder_gives_the_eager_embeddings(tmp_path, monkeypatch) -> None:
    """`-O 1` on an encoder, whose forward takes no pipeline input (it once crashed: the compiled forward
    passed one)."""
    monkeypatch.setenv("RIVULET_CACHE_DIR", str(tmp_path))
    runs = []
    for level in (0, 1):
        llm = LLM(str(minilm_dir()), task="embed", dtype="float32", compilation_level=level)
        runs.append(torch.tensor([o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)]))
        runs.append(torch.tensor(llm.embed(TEXTS[2], use_tqdm=False)[0].outputs.embedding))
        compiled = llm.engine.core.executor.runner.forward_fn
        llm.shutdown()
    assert compiled.compiled and compiled.fallbacks == 0
    assert torch.allclose(runs[2], runs[0], atol=1e-5) and torch.allclose(runs[3], runs[1], atol=1e-5)
