"""`--kv-cache-dtype fp8_e5m2`: a one-byte KV cache (CPU, eager). Its precision on the default model is in
tests/models/test_default_model.py, its kernels in tests/kernels/test_cpu_kernels.py."""

from __future__ import annotations

import pytest
import torch

from rivulet import LLM, RivuletError, SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def _tokens(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_fp8_cache_holds_more_tokens_and_batches_like_alone(tiny_model_dir) -> None:
    """The same memory holds 4x the blocks of a float32 cache (2x of bf16); requests batched with chunked prefills, decodes beside them and
    preemption (few blocks) give the tokens each gets alone."""
    path, _ = tiny_model_dir("llama")
    kw = dict(dtype="float32", max_model_len=128, block_size=4, max_num_batched_tokens=16)
    sizes = []
    for kv in ("auto", "fp8_e5m2"):
        llm = LLM(str(path), kv_cache_memory=1 << 20, kv_cache_dtype=kv, **kw)
        sizes.append(llm.engine.core.num_blocks)
        llm.shutdown()
    assert sizes[1] == 4 * sizes[0]  # 1 byte a value against float32's 4
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (5, 30, 17, 44, 9)]
    llm = LLM(str(path), kv_cache_dtype="fp8_e5m2", num_kv_blocks=40, **kw)
    try:
        assert all(c.dtype == torch.float8_e5m2 for c in llm.engine.core.executor.runner.kv_caches)
        alone = [_tokens(llm, [p])[0] for p in prompts]
        assert _tokens(llm, prompts) == alone
    finally:
        llm.shutdown()


@pytest.mark.parametrize("kw, match", [
    (dict(kv_cache_dtype="fp8"), "fp8_e5m2 is the one fp8 format"),
    (dict(kv_cache_dtype="fp8_e4m3"), "fp8_e5m2 is the one fp8 format"),
    (dict(kv_cache_dtype="int8"), "must be auto or fp8_e5m2"),
    (dict(kv_cache_dtype="fp8_e5m2", compilation_level=1), "--compilation-level 0"),
])
def test_unsupported_kv_cache_dtypes_are_clear_errors(tiny_model_dir, kw, match) -> None:
    path, _ = tiny_model_dir("llama")
    with pytest.raises(RivuletError, match=match):
        LLM(str(path), dtype="float32", **kw)
