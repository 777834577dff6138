"""Random draws by a Gumbel race over hashed noise (`rivulet.kernels.sampling`, the CPU kernel in
`kernels/cpu/sampling.cpp`): the distribution it samples, the kernel against the reference, and the draw's
indifference to logits that differ in their last bits (what the inverse CDF it replaced lacked)."""

from __future__ import annotations

import math
import os
import shutil

import pytest
import torch

from rivulet.kernels.cpu import load_cpu_ext
from rivulet.kernels.sampling import gumbel_noise_ref, sample_rows_ref

ext = load_cpu_ext()
COMPILER = shutil.which(os.environ.get("CXX", "c++")) is not None and os.environ.get("RIVULET_DISABLE_CPU_EXT") != "1"
needs_ext = pytest.mark.skipif(not COMPILER, reason="no C++ compiler on this machine (the reference runs instead)")


def kernel(logits: torch.Tensor, temperature: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    assert ext is not None
    return ext.sample_rows(logits, temperature, keys)


IMPLS = [pytest.param(sample_rows_ref, id="reference"), pytest.param(kernel, id="cpu", marks=needs_ext)]


def keys_of(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint((1 << 63) - 1, (n,), generator=torch.Generator().manual_seed(seed))


def test_noise_is_gumbel() -> None:
    """Mean Euler's constant, variance pi^2 / 6, within the bounds the kernel's skipping relies on."""
    g = gumbel_noise_ref(keys_of(8), 50_000)
    assert abs(g.mean().item() - 0.5772) < 0.01
    assert abs(g.var().item() - math.pi ** 2 / 6) < 0.03
    assert g.min().item() >= -2.82 and g.max().item() <= 16.64
    assert not torch.equal(g[0], g[1])  # every key has its own noise


@needs_ext
@pytest.mark.parametrize("vocab", [7, 1000, 49_152 + 9])
def test_kernel_noise_is_the_reference_noise(vocab: int) -> None:
    """Sixteen tokens at a time and one at a time give the same bits; the reference's `log` differs in the last."""
    assert ext is not None
    keys = torch.cat([keys_of(3), torch.tensor([0, (1 << 63) - 1])])
    vec, one = ext.gumbel_noise_rows(keys, vocab, True), ext.gumbel_noise_rows(keys, vocab, False)
    assert torch.equal(vec, one)
    torch.testing.assert_close(vec, gumbel_noise_ref(keys, vocab), rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_draws_follow_softmax_over_temperature(impl, temperature: float) -> None:
    """40,000 rows of one distribution with zeros at both ends: frequencies within 0.01 of softmax(x / t)."""
    probs = torch.tensor([0.0, 0.5, 0.25, 0.15, 0.1, 0.0])
    logits = probs.log().expand(40_000, -1).contiguous()
    tokens = impl(logits, torch.full((40_000,), temperature), keys_of(40_000))
    freq = torch.bincount(tokens, minlength=6).float() / tokens.numel()
    expected = (probs.log() / temperature).softmax(-1)
    assert freq[0].item() == 0.0 and freq[5].item() == 0.0
    assert torch.allclose(freq, expected, atol=0.01), (freq, expected)


@pytest.mark.parametrize("impl", IMPLS)
def test_a_large_vocabulary_is_sampled_where_blocks_are_skipped(impl) -> None:
    """A 49,152-token row (768 blocks of 64) whose probability sits on a few tokens spread over it: the kernel
    scores only the blocks that can win, and the frequencies are still the distribution's."""
    vocab, rows = 49_152, 1000
    logits = torch.full((vocab,), -30.0)
    hot = torch.tensor([5, 4000, 4001, 30_000, 49_151])
    logits[hot] = torch.tensor([2.0, 1.0, 1.0, 0.5, 1.5])
    tokens = impl(logits.expand(rows, -1).contiguous(), torch.ones(rows), keys_of(rows))
    expected = logits.softmax(-1)[hot]
    freq = torch.stack([(tokens == h).float().mean() for h in hot])
    assert torch.allclose(freq, expected, atol=0.05), (freq, expected)  # (3 standard errors)


def test_zero_probability_tokens_are_never_drawn() -> None:
    logits = torch.full((2000, 6), float("-inf"))
    logits[:, 3] = -80.0  # tiny but not zero: the only possible token
    for impl in (sample_rows_ref, *((kernel,) if COMPILER else ())):
        assert set(impl(logits, torch.ones(2000), keys_of(2000)).tolist()) == {3}


@needs_ext
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", [0.3, 3.0, 30.0], ids=["flat", "llm-like", "peaked"])
def test_kernel_draws_the_reference_tokens(dtype: torch.dtype, scale: float) -> None:
    """Same keys, same tokens: at temperature 0 (the argmax), and wherever the noise's last bits leave the race
    undecided by more than its rounding (all of these rows), on vocabularies that end in partial blocks."""
    gen = torch.Generator().manual_seed(1)
    for vocab in (1000, 49_152, 49_152 + 9):
        logits = (torch.randn(48, vocab, generator=gen) * scale).to(dtype)
        temperature = torch.rand(48, generator=gen) + 0.2
        temperature[::5] = 0.0
        keys = keys_of(48, seed=vocab)
        assert torch.equal(kernel(logits, temperature, keys), sample_rows_ref(logits, temperature, keys))


@needs_ext
def test_kernel_nan_and_masked_rows_answer_like_argmax() -> None:
    x = torch.randn(3, 300)
    x[0, 17] = x[0, 250] = float("nan")  # a NaN: its first index (the reference's argmax over NaN scores)
    x[1] = float("-inf")  # nothing allowed: index 0, never an out-of-range id
    x[2, :] = float("-inf")
    x[2, 299] = 0.0
    got = kernel(x, torch.ones(3), keys_of(3))
    assert got.tolist() == [17, 0, 299]


def test_a_row_draws_the_same_token_in_any_batch() -> None:
    """The noise comes from the key and the token id only: a row's draw does not depend on its neighbours."""
    logits, keys = torch.randn(6, 500), keys_of(6)
    t = torch.ones(6)
    together = sample_rows_ref(logits, t, keys)
    alone = [int(sample_rows_ref(logits[i:i + 1], t[i:i + 1], keys[i:i + 1])) for i in range(6)]
    assert together.tolist() == alone
    if COMPILER:
        assert [int(kernel(logits[i:i + 1], t[i:i + 1], keys[i:i + 1])) for i in range(6)] == \
            kernel(logits, t, keys).tolist()


@pytest.mark.parametrize("impl", IMPLS)
def test_draws_survive_logits_that_differ_in_their_last_bits(impl) -> None:
    """A recompute after preemption or a batch of another shape can change logits by ~1e-6: the draws of 1,000
    rows of a 49k vocabulary at temperature 1 stay (an inverse CDF with one uniform number per row moved 0.9%
    of them at this spread of logits, 0.05-0.25% at others; benchmarks/RESULTS.md)."""
    gen = torch.Generator().manual_seed(3)
    rows, vocab = 1000, 49_152
    logits = torch.randn(rows, vocab, generator=gen) * 2.5
    nudged = logits * (1 + 1e-6 * torch.randn(rows, vocab, generator=gen))
    keys, t = keys_of(rows), torch.ones(rows)
    a, b = impl(logits, t, keys), impl(nudged, t, keys)
    assert (a != b).float().mean().item() < 1e-3
