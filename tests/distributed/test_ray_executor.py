"""The Ray executor on a local Ray cluster: TP=2 gives exactly the single-rank greedy tokens, and a
killed actor is reported; the caller's thread has its cores back after. Ray is an optional extra of Rivulet and part of the test extra."""

from __future__ import annotations

import os
import time

import pytest
import ray
import torch

from rivulet import LLM, RivuletError, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def test_ray_tp2_equals_single_rank_and_dead_actor(tiny_model_dir):
    path, _ = tiny_model_dir("llama")
    g = torch.Generator().manual_seed(5)
    prompts = [{"prompt_token_ids": torch.randint(0, 256, (n,), generator=g).tolist()} for n in (5, 23, 40)]
    want = [o.outputs[0].token_ids for o in LLM(str(path), dtype="float32", max_model_len=128)
            .generate(prompts, GREEDY, use_tqdm=False)]
    cores = os.sched_getaffinity(0)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        llm = LLM(str(path), dtype="float32", max_model_len=128, tensor_parallel_size=2,
                  distributed_executor_backend="ray")
        try:
            got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
            assert got == want
            ex = llm.engine.core.executor
            assert type(ex).__name__ == "RayExecutor" and len(ex.actors) == 1
            ray.kill(ex.actors[0])
            deadline = time.monotonic() + 30
            with pytest.raises((RivuletError, RuntimeError), match="exited|closed|Connection"):
                while time.monotonic() < deadline:  # the kill lands asynchronously (50 quick requests once beat it)
                    llm.generate(prompts[0], GREEDY, use_tqdm=False)
        finally:
            llm.shutdown()
        assert os.sched_getaffinity(0) == cores  # rank 0's thread, bound to its share, got its cores back
    finally:
        ray.shutdown()
