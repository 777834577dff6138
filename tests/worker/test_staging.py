"""Moving a step's inputs to the device: one packed copy per dtype into persistent buffers (the GPU's path, forced
here on the CPU with `copy=True`), and whole runs on that path give the tokens of the CPU's direct one."""

from __future__ import annotations

import functools
import random

import numpy as np
import pytest
import torch

from rivulet import LLM, SamplingParams
from rivulet.worker import input_batch
from rivulet.worker.staging import Mirror, Staging

CPU = torch.device("cpu")


def test_staging_packs_each_dtype_into_one_buffer_and_keeps_shapes():
    s = Staging(CPU, copy=True)
    a, b, c = np.arange(5), np.arange(6, dtype=np.int32).reshape(2, 3) * 7, np.array([-1, 2**40])
    ta, tb, tc = s.move([a, b, c], torch.int64)
    assert ta.tolist() == a.tolist() and tb.tolist() == b.tolist() and tc.tolist() == c.tolist()
    assert tb.shape == (2, 3) and tb.dtype == torch.int64
    mirror = s._rings[torch.int64][0]
    base = mirror.device_buf
    assert ta.data_ptr() == base.data_ptr() and tc.data_ptr() == base.data_ptr() + 12 * 8  # packed (aligned): one copy
    assert not np.shares_memory(mirror.np, base.numpy())  # a host half and a device half
    later = [s.move([np.full(3, i)], torch.int64)[0] for i in range(Staging.RING - 1)]
    assert ta.tolist() == a.tolist() and [t.tolist() for t in later] == [[i] * 3 for i in range(Staging.RING - 1)]
    big = np.arange(5000)
    (t,) = s.move([big], torch.int64)  # the ring's first mirror again: grown
    assert t.tolist() == big.tolist() and s._rings[torch.int64][0].numel >= 5000
    (q,) = s.move([np.array([3, 4], np.int64)], torch.int32)
    assert q.dtype == torch.int32 and q.tolist() == [3, 4]


def test_packed_views_start_16_byte_aligned():
    """Triton specializes kernels on 16-byte aligned pointers: a packed view at an odd offset would compile (and
    run) another variant."""
    s = Staging(CPU, copy=True)
    views = s.move([np.arange(3), np.arange(5), np.arange(1), np.arange(2)], torch.int64)
    assert [v.tolist() for v in views] == [[0, 1, 2], [0, 1, 2, 3, 4], [0], [0, 1]]
    assert all(v.data_ptr() % 16 == 0 for v in views)
    views = s.move([np.arange(6, dtype=np.int32).reshape(2, 3), np.arange(3), np.arange(2)], torch.int32)
    assert views[0].tolist() == [[0, 1, 2], [3, 4, 5]] and all(v.data_ptr() % 16 == 0 for v in views)


def test_direct_staging_hands_out_the_arrays():
    a = np.arange(4)
    (t,) = Staging(CPU).move([a], torch.int64)
    assert np.shares_memory(t.numpy(), a)  # no copy on the CPU
    (u,) = Staging(CPU).move([a], torch.int32)
    assert u.dtype == torch.int32 and u.tolist() == [0, 1, 2, 3]


def test_mirror_pushes_only_the_prefix():
    m = Mirror(6, torch.int32, CPU, copy=True)
    m.writable()[:] = [1, 2, 3, 4, 5, 6]
    dev = m.push(2)
    assert dev.tolist() == [1, 2, 0, 0, 0, 0]
    same = Mirror(3, torch.int32, CPU)  # the CPU's own: one buffer
    assert same.device_buf is same.host


def _prompts(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, 256) for _ in range(rng.randrange(3, 40))]} for _ in range(n)]


@pytest.mark.parametrize("mode", ["sync", "async", "draft"])
def test_runs_on_the_copying_path_give_the_direct_paths_tokens(mode, tiny_model_dir, monkeypatch):
    """Prefill chunks, decode, preemption, prompt logprobs, async outputs (tokens read on the device: one more move
    per step) and the draft model's passes and verify steps read their inputs from persistent buffers that later
    steps overwrite: the tokens must not change."""
    path, _ = tiny_model_dir("llama")
    kw = dict(dtype="float32", max_model_len=128, max_num_batched_tokens=24, block_size=4, num_kv_blocks=40,
              async_scheduling=mode == "async")
    if mode == "draft":
        kw["speculative_config"] = {"model": str(path), "num_speculative_tokens": 3}
    prompts = _prompts(8)
    params = [SamplingParams(temperature=0, max_tokens=12 + i, ignore_eos=True, logprobs=1, prompt_logprobs=1)
              for i in range(len(prompts))]

    def run() -> list:
        llm = LLM(str(path), **kw)
        outs = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.engine.core.get_stats()
        runner = llm.engine.core.executor.runner
        stats["copies"], stats["on_cpu"] = runner.batch.staging.copies, runner.device.type == "cpu"
        llm.shutdown()
        return [(c.token_ids, [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)],
                 [None if p is None else next(iter(p.values())).logprob for p in o.prompt_logprobs])
                for o, c in ((o, o.outputs[0]) for o in outs)], stats

    want, direct = run()
    monkeypatch.setattr(input_batch, "Staging", functools.partial(Staging, copy=True))
    got, stats = run()
    assert stats["copies"] and direct["copies"] != direct["on_cpu"] and stats["num_preemptions"] > 0
    for (gt, glp, gp), (wt, wlp, wp) in zip(got, want):
        assert gt == wt
        assert glp == pytest.approx(wlp, abs=1e-5) and gp == pytest.approx(wp, abs=1e-5)
