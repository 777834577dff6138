"""Huge-page placement of the weights and the KV cache on CPU: same values, sharing kept."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from rivulet.platforms.cpu import CpuPlatform, huge_page_bytes


def test_huge_page_buffer_is_zeroed_and_aligned() -> None:
    t = huge_page_bytes(5 << 20)
    assert t.numel() == 5 << 20 and t.dtype == torch.uint8
    assert t.data_ptr() % (2 << 20) == 0
    assert int(t.count_nonzero()) == 0
    kv = CpuPlatform().zeros((2, 3, 4, 5), torch.bfloat16)
    assert kv.shape == (2, 3, 4, 5) and kv.dtype == torch.bfloat16 and not kv.any()
    kv.fill_(1.5)
    assert float(kv.sum()) == 1.5 * kv.numel()


def test_place_module_keeps_values_and_tied_weights() -> None:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Embedding(10, 6), nn.Linear(6, 10, bias=True))
    m[1].weight = m[0].weight  # tied, as an LM head and its embedding
    m.register_buffer("table", torch.arange(7, dtype=torch.float32), persistent=False)
    before = {k: v.clone() for k, v in m.state_dict().items()} | {"table": m.table.clone()}
    CpuPlatform().place_module(m)
    after = dict(m.state_dict()) | {"table": m.table}
    for k, v in before.items():
        assert torch.equal(after[k], v), k
    assert m[1].weight is m[0].weight
    m[0].weight.data.add_(1)  # still one tensor: an update shows through both
    assert torch.equal(m[1].weight, before["0.weight"] + 1)
    ptrs = sorted(t.data_ptr() for t in [m[0].weight, m[1].bias, m.table])
    assert ptrs[-1] - ptrs[0] < 1 << 20  # one arena


def _in_arena(t: torch.Tensor, arena_ptr: int) -> bool:
    return abs(t.data_ptr() - arena_ptr) < 1 << 20


def test_place_module_leaves_a_looked_up_table_unless_a_tied_head_reads_it_whole() -> None:
    """The embedding table only serves row lookups: it stays put, while the norms (read whole) move.
    Tied to an LM head that multiplies by it (no compact or packed copy), it moves too."""
    from rivulet.layers.embedding import ParallelLMHead, VocabParallelEmbedding
    from rivulet.layers.quantization import Prepacked

    def model(tied_head_quant: object) -> nn.Module:
        m = nn.Module()
        m.embed, m.head, m.norm = VocabParallelEmbedding(10, 6), ParallelLMHead(10, 6), nn.LayerNorm(6)
        m.head.tie(m.embed)
        m.head.quant = tied_head_quant
        return m

    packed = model(Prepacked(torch.zeros(10, 6)))
    table = packed.embed.weight.data_ptr()
    CpuPlatform().place_module(packed)
    assert packed.embed.weight.data_ptr() == table  # not copied
    assert not _in_arena(packed.embed.weight, packed.norm.weight.data_ptr())

    plain = model(None)
    table = plain.embed.weight.data_ptr()
    CpuPlatform().place_module(plain)
    assert plain.embed.weight.data_ptr() != table and plain.head.weight is plain.embed.weight
    assert _in_arena(plain.embed.weight, plain.norm.weight.data_ptr())


def _resident_fraction(t: torch.Tensor) -> float:
    """The fraction of `t`'s pages that are in memory (mincore), anonymous ones included."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    addr, n = t.data_ptr(), t.numel() * t.element_size()
    page = addr & ~4095
    pages = -(-(n + addr - page) // 4096)
    vec = (ctypes.c_ubyte * pages)()
    assert libc.mincore(ctypes.c_void_p(page), ctypes.c_size_t(n + addr - page), vec) == 0, ctypes.get_errno()
    return sum(v & 1 for v in vec) / pages


def test_prefault_faults_in_every_region_and_keeps_the_zeros() -> None:
    """The KV cache's pages are faulted in by the background thread, keys and values of every layer,
    without changing a byte; nothing was resident before (the first writes would have faulted)."""
    platform = CpuPlatform()
    caches = [platform.zeros((2, 40, 16, 3, 64), torch.bfloat16) for _ in range(3)]  # ~0.5 MB halves
    caches[1][1, 7].fill_(2.0)  # a written block stays as written
    regions = [half for c in caches for half in c.unbind(0)]
    assert _resident_fraction(caches[0]) == 0.0
    thread = platform.prefault(regions)
    if thread is None:
        pytest.skip("no SCHED_IDLE on this OS: pages fault in on first write")
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert thread.populated == sum(r.numel() * r.element_size() for r in regions)
    for c in caches:
        assert _resident_fraction(c) == 1.0
    assert int(caches[1][1, 7].eq(2.0).sum()) == caches[1][1, 7].numel()
    caches[1][1, 7].zero_()
    assert not any(c.any() for c in caches)


def test_prefault_stops_when_the_cache_is_freed() -> None:
    """The thread holds weak references only: a cache dropped before it ran (an engine rebuilt in the
    same process) is neither kept alive nor walked."""
    import gc
    import weakref

    from rivulet.platforms.cpu import Prefaulter

    cache = CpuPlatform().zeros((2, 400, 16, 3, 64), torch.bfloat16)
    thread = Prefaulter(list(cache.unbind(0)))
    alive = weakref.ref(cache)
    del cache
    gc.collect()
    assert alive() is None
    thread.start()
    thread.join(timeout=30)
    assert not thread.is_alive() and thread.populated == 0


def test_place_module_leaves_weights_a_kernel_packed() -> None:
    """A module's `packed_params` (prepack_model's AMX tiles) stay where the kernel wrote them; the
    rest of the module moves."""
    m = nn.Linear(32, 16)
    m.weight = nn.Parameter(torch.randn(1, 1, 16, 32), requires_grad=False)  # a packed layout
    m.packed_params = ("weight",)
    weight, bias = m.weight.data_ptr(), m.bias.data_ptr()
    values = m.weight.detach().clone()
    CpuPlatform().place_module(m)
    assert m.weight.data_ptr() == weight and torch.equal(m.weight, values)
    assert m.bias.data_ptr() != bias and m.bias.data_ptr() % 64 == 0


def test_place_module_leaves_the_buffers_a_forward_writes() -> None:
    """An MoE layer's routing counts (its `written_buffers`) keep their own storage, apart from the weights'
    arena: a compiled graph that writes them could not take them as views of one storage with float weights."""
    from rivulet.layers.moe import FusedMoE

    moe = FusedMoE(num_experts=4, top_k=2, hidden_size=8, intermediate_size=16, renormalize=True)
    nn.init.normal_(moe.w13_weight)
    CpuPlatform().place_module(moe)
    arena = moe.w13_weight.untyped_storage().data_ptr()
    assert moe.w2_weight.untyped_storage().data_ptr() == arena and moe._owner.untyped_storage().data_ptr() == arena
    for name in moe.written_buffers:
        assert getattr(moe, name).untyped_storage().data_ptr() != arena, name
