"""The top-k / top-p mask (`top_k_top_p` op): the CPU kernel's radix select (`kernels/cpu/top_k_top_p.cpp`) against
the reference's sort (`rivulet.kernels.sampling.top_k_top_p_ref`), and the reference against its definition."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from rivulet.kernels.cpu import load_cpu_ext
from rivulet.kernels.sampling import top_k_top_p_ref

ext = load_cpu_ext()
COMPILER = shutil.which(os.environ.get("CXX", "c++")) is not None and os.environ.get("RIVULET_DISABLE_CPU_EXT") != "1"
needs_ext = pytest.mark.skipif(not COMPILER, reason="no C++ compiler on this machine (the reference runs instead)")
NEG_INF = float("-inf")


def kernel(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    assert ext is not None
    out = logits.clone()
    none = torch.empty(0)
    ext.top_k_top_p_(out, none if top_k is None else top_k, none if top_p is None else top_p)
    return out


def near_boundary(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor) -> torch.Tensor:
    """Rows where some cumulative probability (in the reference's order) is within 1e-6 of top_p: there the kernel's
    float32 exp may decide the boundary token otherwise than the reference's float64 softmax."""
    masked = top_k_top_p_ref(logits, top_k, None) if top_k is not None else logits
    cumulative = masked.sort(dim=-1, descending=True).values.double().softmax(-1).cumsum(-1)
    return ((cumulative - top_p.double().unsqueeze(1)).abs() < 1e-6).any(dim=-1)


def rows(vocab: int, scale: float, n: int = 24, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, vocab, generator=gen) * scale
    x[1::4] = (x[1::4] * 2).round() / 2  # many ties
    x[2::4, ::3] = NEG_INF  # already masked tokens (min-p, a grammar)
    return x


@needs_ext
@pytest.mark.parametrize("vocab", [7, 1000, 49_152 + 9])
@pytest.mark.parametrize("scale", [0.3, 3.0, 30.0], ids=["flat", "llm-like", "peaked"])
def test_kernel_masks_the_reference_tokens(vocab: int, scale: float) -> None:
    x = rows(vocab, scale, seed=vocab)
    n = x.shape[0]
    gen = torch.Generator().manual_seed(1)
    top_k = torch.randint(1, vocab + 1, (n,), generator=gen)
    top_k[::3] = torch.randint(1, min(vocab, 60) + 1, (len(top_k[::3]),), generator=gen)  # small ones too
    top_k[5] = vocab  # no top-k
    top_p = torch.rand(n, generator=gen) * 0.99 + 0.005
    top_p[7] = 1.0  # no top-p
    top_p[8] = 1e-4  # only the largest (and its ties)
    for k, p in ((top_k, None), (None, top_p), (top_k, top_p)):
        want, got = top_k_top_p_ref(x, k, p), kernel(x, k, p)
        differ = ((want == NEG_INF) != (got == NEG_INF)).any(dim=-1)
        if p is not None:
            assert not (differ & ~near_boundary(x, k, p)).any(), (k, p, differ.nonzero())
            assert differ.sum() <= 1
        else:
            assert not differ.any()
        kept = got > NEG_INF
        assert torch.equal(got[kept], x[kept])  # the kept logits are untouched
        assert kept.any(dim=-1)[(x > NEG_INF).any(dim=-1)].all()  # every row keeps a token


def test_reference_keeps_the_smallest_prefix_reaching_top_p_and_its_ties() -> None:
    probs = torch.tensor([[0.4, 0.2, 0.2, 0.1, 0.1]])
    logits = probs.log()
    assert (top_k_top_p_ref(logits, None, torch.tensor([0.4])) > NEG_INF).tolist() == [[1, 0, 0, 0, 0]]
    # 0.4 + 0.2 reaches 0.5: token 2 ties token 1
    assert (top_k_top_p_ref(logits, None, torch.tensor([0.5])) > NEG_INF).tolist() == [[1, 1, 1, 0, 0]]
    # top-k 1 first: the one token renormalised holds all the mass
    assert (top_k_top_p_ref(logits, torch.tensor([1]), torch.tensor([0.9])) > NEG_INF).tolist() == [[1, 0, 0, 0, 0]]
    assert (top_k_top_p_ref(logits, torch.tensor([2]), None) > NEG_INF).tolist() == [[1, 1, 1, 0, 0]]


@needs_ext
def test_kernel_leaves_masked_nan_and_unfiltered_rows_alone() -> None:
    x = torch.randn(4, 300)
    x[0] = NEG_INF
    x[1, 7] = float("nan")
    x[2, 3] = float("inf")
    top_k, top_p = torch.tensor([5, 5, 5, 300]), torch.tensor([0.5, 0.5, 0.5, 1.0])
    got = kernel(x, top_k, top_p)
    assert torch.equal(got[0], x[0]) and torch.equal(got[3], x[3])
    assert torch.equal(got[2], x[2])  # an infinite logit: no probabilities to sum, nothing masked
    assert (got[1] > NEG_INF).sum() >= 1


@needs_ext
def test_kernel_on_a_strided_batch_masks_in_place() -> None:
    """Rows of a wider buffer (a view with a row stride): masked where they lie, the padding untouched."""
    buf = torch.randn(6, 520)
    x = buf[:, :500]
    want = top_k_top_p_ref(x, torch.full((6,), 20), torch.full((6,), 0.8))
    pad = buf[:, 500:].clone()
    ext.top_k_top_p_(x, torch.full((6,), 20), torch.full((6,), 0.8))
    assert torch.equal(x == NEG_INF, want == NEG_INF) and torch.equal(buf[:, 500:], pad)
