"""Tensor parallelism over gloo on CPU: every split gives exactly the single-rank greedy tokens."""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch

from helpers.constrained import JSON_PROMPT, constrained_params
from rivulet import LLM, RivuletError, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def _tokens(llm: LLM, prompts) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("kind,tp", [
    ("llama", 2),              # 4 heads, 2 KV heads: one KV head per rank
    ("llama3-rope-tied", 2),   # 1 KV head: replicated on both ranks; tied embeddings split by vocab
    ("qwen3-moe", 2),          # experts' intermediate dimension split, q/k norm
    ("phi3", 2),               # fused checkpoint qkv_proj / gate_up_proj split per rank
    ("gemma2", 2),             # capped scores and logits, sandwich norms, alternating windows
    ("deepseek-v3", 2),        # MLA heads split (the latent replicated), shared + routed experts split
])
def test_tiny_models_tp_equals_single_rank(kind, tp, tiny_model_dir):
    path, _ = tiny_model_dir(kind)
    g = torch.Generator().manual_seed(5)
    prompts = [{"prompt_token_ids": torch.randint(0, 256, (n,), generator=g).tolist()} for n in (5, 23, 40)]
    want = _tokens(LLM(str(path), dtype="float32", max_model_len=128), prompts)
    llm = LLM(str(path), dtype="float32", max_model_len=128, tensor_parallel_size=tp)
    try:
        assert _tokens(llm, prompts) == want
    finally:
        llm.shutdown()


def test_default_model_tp3_and_clear_error_for_tp2(default_reference):
    prompts = default_reference.prompts
    llm = LLM(dtype="float32", max_model_len=256, tensor_parallel_size=3)
    try:
        assert _tokens(llm, prompts) == default_reference.tokens
        # every rank samples: each gets rank 0's grammar bitmask (a rank without it would part ways)
        out = llm.generate(JSON_PROMPT, constrained_params(), use_tqdm=False)[0].outputs[0]
        assert out.token_ids == default_reference.constrained and json.loads(out.text)
        # a dead worker is reported, not waited for
        os.kill(llm.engine.core.executor.procs[0].pid, signal.SIGKILL)
        llm.engine.core.executor.procs[0].wait()
        with pytest.raises((RivuletError, RuntimeError), match="exited|closed|Connection"):
            llm.generate(prompts[0], GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    with pytest.raises(RivuletError, match="does not divide the model's 9 attention heads; choose one of: 1, 3, 9"):
        LLM(dtype="float32", tensor_parallel_size=2)
