"""Whole tiny models on the Triton ops (CPU interpreter, float32) against the same models on the
references, and the CUDA-graph input padding replayed eagerly."""

from __future__ import annotations

import pytest
import torch

from triton_helpers import DEVICE

from helpers.runner import make_runner, teacher_forced_logits
from rivulet.platforms import current_platform
from rivulet.worker.batch import SeqChunk, build_flat_batch
from rivulet.worker.cuda_graph import DecodeGraphs

pytestmark = pytest.mark.skipif(DEVICE.type == "cuda", reason="CPU-interpreter test (the GPU script covers CUDA)")


def _use_triton(monkeypatch) -> None:
    """Layers built from now on take the Triton ops, as on a CUDA platform."""
    p = current_platform()
    monkeypatch.setattr(p, "kernel_backend", lambda: "triton")
    monkeypatch.setattr(p, "attention_backend", lambda: "triton")


@pytest.fixture
def triton_backend(monkeypatch):
    _use_triton(monkeypatch)


def _runners(path, monkeypatch):
    """(runner on the references, runner on the Triton ops) of the same checkpoint."""
    ref = make_runner(path, num_blocks=32)
    _use_triton(monkeypatch)
    return ref, make_runner(path, num_blocks=32)


@pytest.mark.parametrize("kind", ["llama", "mistral-window", "qwen3", "mixtral"])
def test_model_on_triton_ops_matches_references(kind, tiny_model_dir, monkeypatch):
    path, _ = tiny_model_dir(kind)
    ref, tri = _runners(path, monkeypatch)
    ids = torch.randint(0, 256, (15,), generator=torch.Generator().manual_seed(7)).tolist()
    blocks = [3, 9, 1, 20]
    want = teacher_forced_logits(ref, ids, [6, 5], blocks)  # two prefill chunks, then 4 decodes
    got = teacher_forced_logits(tri, ids, [6, 5], blocks)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_mixed_batch_on_triton_ops(tiny_model_dir, monkeypatch):
    path, _ = tiny_model_dir("llama")
    ref, tri = _runners(path, monkeypatch)
    for r in (ref, tri):  # earlier steps fill the cache of sequence 0
        r.forward([SeqChunk(list(range(10, 19)), 0, [4, 5, 6])])
    chunks = [SeqChunk([7], 9, [4, 5, 6]), SeqChunk(list(range(30, 41)), 0, [7, 8, 9])]
    torch.testing.assert_close(tri.forward(chunks, all_logits=True), ref.forward(chunks, all_logits=True),
                               atol=1e-4, rtol=1e-4)


def test_decode_graph_inputs_pad_harmlessly(tiny_model_dir, triton_backend):
    """A decode step copied into a larger bucket's static buffers (padding rows: slot -1, context
    of 1) gives the same hidden states as the step alone; the padding writes no KV entry."""
    path, _ = tiny_model_dir("llama")
    r = make_runner(path, num_blocks=32)
    tables = [[1, 2], [3, 4, 5], [6]]
    prompts = [list(range(5, 12)), list(range(40, 49)), [9, 8, 7]]
    r.forward([SeqChunk(p, 0, t) for p, t in zip(prompts, tables)])
    step = [SeqChunk([100 + i], len(p), t) for i, (p, t) in enumerate(zip(prompts, tables))]
    batch = build_flat_batch(step, 4, torch.device("cpu"))
    caches_before = [c.clone() for c in r.kv_caches]
    want = r.model(batch.input_ids, batch.positions, batch.meta)
    graphs = DecodeGraphs((1, 2, 4), max_blocks_per_seq=4, device=torch.device("cpu"))
    assert graphs.fits(batch.meta) and graphs.bucket_for(3) == 4
    for c, before in zip(r.kv_caches, caches_before):  # undo the eager step's writes
        c.copy_(before)
    graphs.load(batch.input_ids, batch.positions, batch.meta, 4)
    ids, pos, meta = graphs.static_inputs(4)
    got = r.model(ids, pos, meta)[:3]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    written = [c.ne(b).any(dim=(0, 2, 3, 4)).nonzero().flatten().tolist() for c, b in zip(r.kv_caches, caches_before)]
    assert all(w == [2, 5, 6] for w in written)  # the blocks of the 3 real tokens' slots; nothing for padding


def test_decode_graphs_fall_back_for_prefill_and_large_batches():
    graphs = DecodeGraphs((1, 4), max_blocks_per_seq=2, device=torch.device("cpu"))
    prefill = build_flat_batch([SeqChunk([1, 2], 0, [0])], 4, torch.device("cpu")).meta
    wide = build_flat_batch([SeqChunk([1], 11, [0, 1, 2])], 4, torch.device("cpu")).meta
    many = build_flat_batch([SeqChunk([1], 0, [i]) for i in range(5)], 4, torch.device("cpu")).meta
    assert not graphs.fits(prefill) and not graphs.fits(wide) and not graphs.fits(many)
    assert graphs.run(prefill.slot_mapping, prefill.slot_mapping, prefill) is None
