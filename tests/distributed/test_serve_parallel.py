"""`rivulet serve` with parallel flags: the flags reach the engine process (EngineConfig as JSON)."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "server"))
from server_helpers import ServerProcess  # noqa: E402

from rivulet.config import EngineConfig, ParallelConfig


def test_parallel_config_round_trips_as_json():
    c = EngineConfig(parallel=ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2,
                                             enable_sequence_parallel=True, enable_expert_parallel=True,
                                             replicated_experts=[3, 1], distributed_executor_backend="ray"))
    assert EngineConfig.from_json(c.to_json()) == c


@pytest.mark.parametrize("flags", [["--tensor-parallel-size", "3"], ["--pipeline-parallel-size", "2"],
                                   ["--tensor-parallel-size", "3", "--enable-sequence-parallel"]],
                         ids=["tp3", "pp2", "tp3-sp"])
def test_serve_parallel_default_model_same_greedy_text(flags, default_reference):
    """Through `rivulet serve`: the same greedy text as one rank (the default model's 9 heads and
    3 KV heads split over 3 ranks; its 30 layers over 2 stages)."""
    prompts, _, texts = default_reference
    server = ServerProcess(*flags, "--max-model-len", "256", startup_timeout=300)
    try:
        body = {"model": "default", "prompt": prompts, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
        r = httpx.post(f"{server.base_url}/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        got = [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]
        assert got == texts
    finally:
        assert server.stop() == 0


def test_serve_expert_parallel_tiny_moe_same_greedy_tokens(tiny_model_dir):
    """EP=2 with sequence parallelism through `rivulet serve` on a tiny Qwen3-MoE (a weights-only
    folder: token-id prompts, tokens read back from the logprobs as `token_id:N`)."""
    from rivulet import LLM, SamplingParams

    path, _ = tiny_model_dir("qwen3-moe")
    prompts = [[5, 17, 200, 3, 99, 42], list(range(30, 52))]
    llm = LLM(str(path), dtype="float32", max_model_len=128)
    want = [o.outputs[0].token_ids for o in llm.generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
        use_tqdm=False)]
    server = ServerProcess("--model", str(path), "--tensor-parallel-size", "2", "--enable-expert-parallel",
                           "--enable-sequence-parallel", "--max-model-len", "128", startup_timeout=300)
    try:
        got = []
        for p in prompts:
            body = {"model": str(path), "prompt": p, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                    "logprobs": 0}
            r = httpx.post(f"{server.base_url}/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            got.append([int(t.removeprefix("token_id:")) for t in r.json()["choices"][0]["logprobs"]["tokens"]])
        assert got == want
    finally:
        assert server.stop() == 0
