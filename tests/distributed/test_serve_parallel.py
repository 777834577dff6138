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
    prompts, texts = default_reference.prompts, default_reference.texts
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


def test_serve_reports_a_dead_worker_rank_as_a_dead_engine(tiny_model_dir):
    """SIGKILL one worker rank of a TP=2 server: /health turns 503 and requests get 500 engine_dead (none hangs)."""
    import os
    import signal

    from server_helpers import assert_error_body, wait_until

    path, _ = tiny_model_dir("llama")
    server = ServerProcess("--model", str(path), "--tensor-parallel-size", "2", "--max-model-len", "128",
                           startup_timeout=300)
    try:
        body = {"model": str(path), "prompt": [5, 17, 200], "max_tokens": 4, "temperature": 0}
        assert httpx.post(f"{server.base_url}/completions", json=body, timeout=120).status_code == 200
        engine = server.engine_pid()
        workers = [int(p) for p in os.listdir("/proc") if p.isdigit() and _is_worker_of(int(p), engine)]
        assert workers, "no worker rank found under the engine process"
        os.kill(workers[0], signal.SIGKILL)
        assert wait_until(lambda: httpx.get(f"{server.url}/health").status_code == 503, timeout=30)
        r = httpx.post(f"{server.base_url}/completions", json=body, timeout=60)
        assert assert_error_body(r, 500)["code"] == "engine_dead"
    finally:
        server.stop()


def _is_worker_of(pid: int, engine_pid: int) -> bool:
    try:
        ppid = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
        return ppid == engine_pid and "rivulet.worker.worker" in open(f"/proc/{pid}/cmdline").read()
    except OSError:
        return False
