"""bf16 linears on weights packed once (the CPU backend's `pack_linear_weight` / `packed_linear`): our AMX
tile kernel where AMX-BF16 is usable (`amx_linear.cpp`), our panel kernel on other AVX512-BF16 CPUs
(`vdpbf16ps`) and on AVX2-only ones (fp32 FMAs) (`bf16_linear.cpp`), oneDNN's packed matmul elsewhere.
The tests of "our kernel" run on whichever this CPU has."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rivulet.kernels.cpu import ops as cpu_ops


def randn(*shape: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.skipif(not cpu_ops.PACKED_BF16, reason="no oneDNN bf16 matmul on this CPU (AVX2 only)")
@pytest.mark.parametrize("rows", [1, 5, 16, 64, 256])
@pytest.mark.parametrize("bias", [False, True])
def test_onednn_packed_bf16_linear_equals_f_linear(rows: int, bias: bool) -> None:
    w = randn(1152, 576, dtype=torch.bfloat16)
    b = randn(1152, dtype=torch.bfloat16, seed=2) if bias else None
    packed = torch.ops.mkldnn._reorder_linear_weight(w, None)  # what pack_linear_weight gives without AMX
    x = randn(rows, 576, dtype=torch.bfloat16, seed=1)
    # the same oneDNN kernels on a weight packed once: the same bits at decode and small-prefill sizes
    assert torch.equal(cpu_ops.packed_linear(x, packed, b), F.linear(x, w, b))
    x3 = x.reshape(1, rows, 576)  # leading dims are kept
    assert cpu_ops.packed_linear(x3, packed, b).shape == (1, rows, 1152)


ours = pytest.mark.skipif(not (cpu_ops.AMX_BF16 or cpu_ops.PANEL_BF16),
                          reason="none of AMX-BF16, AVX512-BF16, AVX2 on this CPU (oneDNN's path is used)")


def packed_shape(n: int, k: int) -> tuple[int, ...]:
    return (n // 16, k // 32, 16, 32) if cpu_ops.AMX_BF16 else (n // 16, k // 2, 32)


@ours
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 16, 17, 64, 300, 1000])
@pytest.mark.parametrize("shape", [(960, 576), (576, 1536), (48, 64), (80, 96)])
@pytest.mark.parametrize("bias", [False, True])
def test_our_linear_is_as_exact_as_onednn(rows: int, shape: tuple[int, int], bias: bool) -> None:
    """Against the float32 product: no further off than oneDNN's own bf16 matmul, plus one bf16 step
    of rounding (both accumulate in float32 and round once, in different orders). The shapes leave
    partial row blocks (rows % 6, rows % 16) and panel groups (48 and 80 columns: 3 and 5 panels)."""
    n, k = shape
    w = randn(n, k, dtype=torch.bfloat16)
    b = randn(n, dtype=torch.bfloat16, seed=2) if bias else None
    packed = cpu_ops.pack_linear_weight(w)
    assert packed is not None and tuple(packed.shape) == packed_shape(n, k) and cpu_ops.is_packed(packed)
    x = randn(rows, k, dtype=torch.bfloat16, seed=1)
    ref = x.float() @ w.float().t() + (b.float() if bias else 0)
    got = cpu_ops.packed_linear(x, packed, b)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    ulp = ref.abs().max().item() * 2**-8
    assert (got.float() - ref).abs().max() <= (F.linear(x, w, b).float() - ref).abs().max() + ulp
    assert (got.float() - ref).abs().max() <= ulp  # rounded once: within a bf16 step of the largest value


@pytest.mark.skipif(not cpu_ops.PANEL_BF16, reason="the panel kernel is used on CPUs without AMX")
def test_panel_kernel_takes_k_off_the_amx_grid() -> None:
    """K % 32 != 0 (an AMX tile's depth) still packs for the panel kernel: it needs K even only."""
    w = randn(32, 38, dtype=torch.bfloat16)
    packed = cpu_ops.pack_linear_weight(w)
    assert packed is not None and tuple(packed.shape) == (2, 19, 32)
    x = randn(9, 38, dtype=torch.bfloat16, seed=1)
    ref = x.float() @ w.float().t()
    assert (cpu_ops.packed_linear(x, packed).float() - ref).abs().max() <= ref.abs().max().item() * 2**-8


@ours
def test_our_linear_rows_do_not_depend_on_the_batch() -> None:
    """Each output row is computed from its own input row in one fixed order, whatever the batch:
    a request's numbers do not change with what else is in the step (oneDNN's change at 64 rows)."""
    w = randn(576, 1536, dtype=torch.bfloat16)
    packed = cpu_ops.pack_linear_weight(w)
    # row blocks of 16 and 32, several super blocks (AMX); 1000 rows: split by rows between the threads (AMX, from
    # 512 rows), at row 500, inside a 32-row block; 400 rows: by columns
    for x in (randn(400, 1536, dtype=torch.bfloat16, seed=3), randn(1000, 1536, dtype=torch.bfloat16, seed=4)):
        whole = cpu_ops.packed_linear(x, packed)
        for i in (0, 5, 6, 15, 16, 69, 170, 399, len(x) // 2 - 1, len(x) // 2, len(x) - 1):
            assert torch.equal(cpu_ops.packed_linear(x[i:i + 1], packed)[0], whole[i])
        for lo, hi in ((16, 33), (150, 190), (0, 70), (480, 530)):
            assert torch.equal(cpu_ops.packed_linear(x[lo:hi], packed), whole[lo:hi])


@ours
def test_our_linear_takes_strided_rows_and_keeps_leading_dims() -> None:
    w = randn(64, 64, dtype=torch.bfloat16)
    packed = cpu_ops.pack_linear_weight(w)
    wide = randn(7, 192, dtype=torch.bfloat16, seed=4)
    x = wide[:, 64:128]  # rows 192 apart, as a split of a fused projection
    assert torch.equal(cpu_ops.packed_linear(x, packed), cpu_ops.packed_linear(x.contiguous(), packed))
    assert cpu_ops.packed_linear(x.contiguous().view(1, 7, 64), packed).shape == (1, 7, 64)
    with pytest.raises(RuntimeError, match="features"):
        cpu_ops.packed_linear(randn(2, 32, dtype=torch.bfloat16), packed)


amx = pytest.mark.skipif(not cpu_ops.AMX_BF16, reason="the gate/up kernel with SiLU-and-mul is the AMX linear's")


@amx
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 33, 300, 700])
@pytest.mark.parametrize("shape", [(3072, 576), (192, 64), (96, 96)])
def test_gate_up_with_silu_mul_in_the_kernel_equals_the_two_ops(rows: int, shape: tuple[int, int]) -> None:
    """`packed_linear_silu_mul` on AMX tiles (each block pairs gate block j with up block j and ends in SiLU *
    up): bit for bit `silu_and_mul(packed_linear(...))`, a row's numbers whatever the batch, near float32.
    Rows: 1 x 2 blocks up to 16, 2 x 2 blocks with partial row tiles and super blocks above (split by rows between
    the threads at 700)."""
    n, k = shape
    w = randn(n, k, dtype=torch.bfloat16) * 0.2
    packed = cpu_ops.pack_linear_weight(w)
    x = randn(rows, k, dtype=torch.bfloat16, seed=1)
    got = cpu_ops.packed_linear_silu_mul(x, packed)
    assert got.shape == (rows, n // 2) and got.dtype == torch.bfloat16
    assert torch.equal(got, cpu_ops.silu_and_mul(cpu_ops.packed_linear(x, packed)))
    for i in {0, rows // 2, rows - 1}:
        assert torch.equal(cpu_ops.packed_linear_silu_mul(x[i:i + 1], packed)[0], got[i])
    gu = x.float() @ w.float().t()
    ref = F.silu(gu[:, :n // 2]) * gu[:, n // 2:]
    assert (got.float() - ref).abs().max() <= 0.02 * ref.abs().max().item()
    assert cpu_ops.packed_linear_silu_mul(x.view(1, rows, k), packed).shape == (1, rows, n // 2)


@amx
def test_gate_up_with_silu_mul_needs_two_equal_halves_of_whole_blocks() -> None:
    packed = cpu_ops.pack_linear_weight(randn(48, 64, dtype=torch.bfloat16))  # 3 column blocks of 16
    with pytest.raises(RuntimeError, match="gate/up weight of 2 x"):
        cpu_ops.packed_linear_silu_mul(randn(2, 64, dtype=torch.bfloat16), packed)


def test_shapes_off_the_grids_use_onednn_or_stay_plain() -> None:
    w = randn(24, 40, dtype=torch.bfloat16)  # N % 16 != 0: neither our tiles nor our panels
    packed = cpu_ops.pack_linear_weight(w)
    x = randn(3, 40, dtype=torch.bfloat16, seed=1)
    if not cpu_ops.PACKED_BF16:  # an AVX2-only CPU: no oneDNN bf16 matmul, the plain weight stays
        assert packed is None
        return
    assert packed is not None and packed.is_mkldnn and cpu_ops.is_packed(packed)
    assert torch.equal(cpu_ops.packed_linear(x, packed), F.linear(x, w))


def test_pack_linear_weight_keeps_float32_plain() -> None:
    # float32 matmuls stay on PyTorch's own path (and its numbers): nothing to pack
    assert cpu_ops.pack_linear_weight(randn(8, 16, dtype=torch.float32)) is None
    w = randn(8, 16, dtype=torch.float32)
    x = randn(3, 16, dtype=torch.float32, seed=1)
    assert not cpu_ops.is_packed(w)
    assert torch.equal(cpu_ops.packed_linear(x, w), F.linear(x, w))  # a plain weight works too


def test_packed_experts_equal_the_stacked_ones() -> None:
    """A MoE layer's experts packed once (`prepack_model` on bf16): every expert's weights leave the stacked
    tensors for the packed layout, and the layer's output stays the weighted sum of its experts (against the
    float32 reference on the same weights, as close as the stacked bf16 path); per-row results do not depend
    on which other tokens an expert got."""
    from rivulet.kernels.moe import fused_moe_ref
    from rivulet.layers.moe import FusedMoE
    from rivulet.layers.quantization import prepack_model

    moe = FusedMoE(num_experts=6, top_k=2, hidden_size=64, intermediate_size=96, renormalize=True)
    moe.w13_weight.data = randn(6, 192, 64, dtype=torch.bfloat16) * 0.2
    moe.w2_weight.data = randn(6, 64, 96, dtype=torch.bfloat16, seed=1) * 0.2
    x, logits = randn(11, 64, dtype=torch.bfloat16, seed=2), randn(11, 6, dtype=torch.float32, seed=3)
    w13, w2 = moe.w13_weight.data.clone(), moe.w2_weight.data.clone()
    stacked = moe(x, logits)
    assert prepack_model(moe) == 1 and moe.packed is not None and moe.w13_weight.numel() == 0
    packed = moe(x, logits)
    weights, ids = torch.topk(torch.softmax(logits, -1), 2)
    truth = fused_moe_ref(x.float(), w13.float(), w2.float(), weights / weights.sum(-1, keepdim=True), ids)
    scale = truth.abs().max()
    assert (packed.float() - truth).abs().max() / scale < 0.02
    assert (packed.float() - truth).abs().max() <= 2 * (stacked.float() - truth).abs().max() + 1e-3 * scale
    # token 0 alone gives the bits it got among the eleven
    assert torch.equal(moe(x[:1], logits[:1])[0], packed[0])
