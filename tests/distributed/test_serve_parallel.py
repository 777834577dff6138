"""`rivulet serve` with parallel flags: the flags reach the engine process (EngineConfig as JSON)."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parents[1] / "server"))
from server_helpers import ServerProcess  # noqa: E402

from rivulet.config import EngineConfig, ParallelConfig


def test_parallel_config_round_trips_as_json():
    c = EngineConfig(parallel=ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2,
                                             enable_sequence_parallel=True, enable_expert_parallel=True,
                                             replicated_experts=[3, 1], distributed_executor_backend="ray"))
    assert EngineConfig.from_json(c.to_json()) == c


def test_serve_tp3_default_model_same_greedy_text(default_reference):
    prompts, _, texts = default_reference
    server = ServerProcess("--tensor-parallel-size", "3", "--max-model-len", "256", startup_timeout=300)
    try:
        body = {"model": "default", "prompt": prompts, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
        r = httpx.post(f"{server.base_url}/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        got = [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]
        assert got == texts
    finally:
        assert server.stop() == 0
