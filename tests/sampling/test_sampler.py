"""The batched Sampler: greedy, seeds, exact filter support, penalties, bias, logprobs."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
import torch

from rivulet.layers.sampler import (
    Sampler,
    draw_keys,
    position_seed,
)
from rivulet.layers.sampling_metadata import SamplingMetadata
from rivulet.sampling_params import SamplingParams

VOCAB = 12
# A fixed distribution with distinct probabilities (sums to 1).
PROBS = [0.3, 0.2, 0.15, 0.1, 0.08, 0.06, 0.05, 0.03, 0.02, 0.007, 0.002, 0.001]
LOGITS = torch.tensor(PROBS, dtype=torch.float32).log()


def build(
    params: Sequence[SamplingParams],
    *,
    vocab: int = VOCAB,
    prompts: Sequence[Sequence[int]] | None = None,
    outputs: Sequence[Sequence[int]] | None = None,
    eos: Sequence[set[int]] | None = None,
    generators: Sequence[torch.Generator | None] | None = None,
) -> SamplingMetadata:
    rows = len(params)
    return SamplingMetadata.build(
        params,
        prompt_token_ids=prompts if prompts is not None else [[] for _ in range(rows)],
        output_token_ids=outputs if outputs is not None else [[] for _ in range(rows)],
        eos_token_ids=eos if eos is not None else [set() for _ in range(rows)],
        generators=generators if generators is not None else [None] * rows,
        vocab_size=vocab,
        device="cpu",
    )


def finite_set(row: torch.Tensor) -> set[int]:
    return set(torch.nonzero(torch.isfinite(row)).flatten().tolist())


def sampled_set(params: SamplingParams, logits: torch.Tensor, draws: int = 3000) -> set[int]:
    """Sample ``draws`` times (one big batch of the same row) and return the tokens seen."""
    batch = logits.expand(draws, -1).clone()
    out = Sampler()(batch, build([params] * draws, vocab=logits.shape[-1]))
    return set(out.sampled_token_ids.tolist())


@pytest.fixture(autouse=True)
def _seed_default_generator() -> None:
    torch.manual_seed(1234)


# ------------------------------------------------------------------ greedy


def test_greedy_rows_equal_argmax() -> None:
    logits = torch.randn(6, 50)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.5, top_k=1)] * 3
    metadata = build(params, vocab=50)
    assert metadata.all_greedy and metadata.greedy_mask is None
    out = Sampler()(logits, metadata)
    assert out.sampled_token_ids.tolist() == logits.argmax(dim=-1).tolist()
    assert out.logprobs is None


def test_greedy_rows_in_mixed_batch_equal_argmax() -> None:
    logits = torch.randn(6, 50)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.5),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, top_p=0.5),
        SamplingParams(top_k=1),
        SamplingParams(seed=3),
    ]
    metadata = build(params, vocab=50, generators=[None] * 5 + [torch.Generator().manual_seed(3)])
    assert not metadata.all_greedy and not metadata.all_random
    out = Sampler()(logits, metadata).sampled_token_ids
    argmax = logits.argmax(dim=-1)
    for row in (0, 2, 4):
        assert out[row].item() == argmax[row].item()


def test_bfloat16_logits_are_accepted() -> None:
    logits = torch.randn(3, 40).to(torch.bfloat16)
    out = Sampler()(logits, build([SamplingParams(temperature=0, logprobs=2)] * 3, vocab=40))
    assert out.sampled_token_ids.tolist() == logits.float().argmax(dim=-1).tolist()
    assert out.logprobs is not None and out.logprobs.topk_logprobs.dtype == torch.float32


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0),
    SamplingParams(temperature=0, presence_penalty=1.5),
    SamplingParams(temperature=0, logit_bias={3: 40.0}),
    SamplingParams(temperature=0, min_tokens=2),
], ids=["plain", "penalty", "bias", "min_tokens"])
def test_greedy_bf16_logits_equal_their_float32_copy(params: SamplingParams) -> None:
    """An all-greedy batch with nothing to apply takes the argmax of bf16 logits as they come; with a penalty,
    a bias or min_tokens the logits are widened first: either way the float32 copy's tokens."""
    logits = torch.randn(4, 40).to(torch.bfloat16)
    logits[1, [7, 30]] = logits[1].max() + 1  # a tie: the first index
    outputs, eos = [[7]] * 4, [{0}] * 4
    meta = build([params] * 4, vocab=40, outputs=outputs, eos=eos)
    assert Sampler.processes(meta) == bool(params.presence_penalty or params.logit_bias or params.min_tokens)
    want = Sampler()(logits.float(), build([params] * 4, vocab=40, outputs=outputs, eos=eos)).sampled_token_ids
    got = Sampler()(logits, meta).sampled_token_ids
    assert got.tolist() == want.tolist()
    if not Sampler.processes(meta):
        assert got.tolist() == logits.float().argmax(dim=-1).tolist() and got[1].item() == 7


# ------------------------------------------------------------------- seeds


def _run_steps(
    batch_params: list[SamplingParams],
    batch_logits: torch.Tensor,
    seeds: list[int | None],
    steps: int,
) -> list[list[int]]:
    """Sample ``steps`` times with one generator per seeded row kept across steps."""
    generators = [None if s is None else torch.Generator().manual_seed(s) for s in seeds]
    sampler = Sampler()
    tokens = []
    for _ in range(steps):
        metadata = build(batch_params, vocab=batch_logits.shape[-1], generators=generators)
        tokens.append(sampler(batch_logits, metadata).sampled_token_ids.tolist())
    return [list(col) for col in zip(*tokens)]  # per row


@pytest.mark.parametrize(
    "target",
    [
        SamplingParams(seed=42),
        SamplingParams(seed=42, temperature=0.8, top_k=20),
        SamplingParams(seed=42, temperature=1.3, top_p=0.9, min_p=0.01),
    ],
    ids=["plain", "top_k", "top_p_min_p"],
)
def test_same_seed_same_tokens_alone_and_in_mixed_batches(target: SamplingParams) -> None:
    vocab, steps = 64, 25
    target_logits = torch.randn(vocab) * 0.5  # fairly flat: draws vary from step to step
    alone = _run_steps([target], target_logits[None], [42], steps)[0]
    assert len(set(alone)) > 5  # the draws really are random

    others = torch.randn(4, vocab)
    # Target at row 2 next to another seeded row, an unseeded row and a greedy row.
    batch_a = [
        SamplingParams(seed=7, top_p=0.5),
        SamplingParams(),
        target,
        SamplingParams(temperature=0.0),
        SamplingParams(top_k=3),
    ]
    logits_a = torch.cat([others[:2], target_logits[None], others[2:]])
    rows_a = _run_steps(batch_a, logits_a, [7, None, 42, None, None], steps)
    assert rows_a[2] == alone

    # Target at row 0 of a different batch.
    batch_b = [target, SamplingParams(min_p=0.2, seed=9), SamplingParams(temperature=0)]
    logits_b = torch.cat([target_logits[None], others[:2]])
    rows_b = _run_steps(batch_b, logits_b, [42, 9, None], steps)
    assert rows_b[0] == alone

    other_seed = _run_steps([target], target_logits[None], [43], steps)[0]
    assert other_seed != alone


def test_unseeded_rows_use_default_generator() -> None:
    logits = torch.zeros(1, 1000)
    torch.manual_seed(5)
    first = Sampler()(logits, build([SamplingParams()], vocab=1000)).sampled_token_ids.item()
    torch.manual_seed(5)
    again = Sampler()(logits, build([SamplingParams()], vocab=1000)).sampled_token_ids.item()
    assert first == again
    draws = {Sampler()(logits, build([SamplingParams()], vocab=1000)).sampled_token_ids.item()
             for _ in range(5)}
    assert len(draws) > 1


def test_sampler_draws_follow_the_distribution() -> None:
    """Through the Sampler (the platform's draw): 20,000 unseeded rows of one distribution."""
    probs = [0.0, 0.5, 0.25, 0.15, 0.1, 0.0]
    rows = 20_000
    logits = torch.tensor(probs).log().expand(rows, -1).contiguous()
    torch.manual_seed(0)
    tokens = Sampler()(logits, build([SamplingParams()] * rows, vocab=6)).sampled_token_ids
    freq = torch.bincount(tokens, minlength=6).float() / rows
    assert freq[0].item() == 0.0 and freq[5].item() == 0.0
    assert torch.allclose(freq[1:5], torch.tensor(probs[1:5]), atol=0.015), freq


def test_keys_of_seeded_rows_are_their_position_seeds_and_the_rest_are_drawn() -> None:
    gen = torch.Generator().manual_seed(3)
    seed = position_seed(42, 17)
    torch.manual_seed(1)
    keys = draw_keys(3, {1: gen}, {1: seed})
    torch.manual_seed(1)
    again = draw_keys(3, {1: gen}, {1: seed})
    assert keys[1].item() == seed and torch.equal(keys, again)
    assert keys[0].item() != keys[2].item() and (keys >= 0).all()
    unpositioned = draw_keys(2, {0: torch.Generator().manual_seed(5)})  # from the row's own generator
    assert unpositioned[0].item() == draw_keys(1, {0: torch.Generator().manual_seed(5)})[0].item()


# --------------------------------------------------------- exact supports


@pytest.mark.parametrize(
    ("params", "allowed"),
    [
        (SamplingParams(top_k=4), {0, 1, 2, 3}),
        (SamplingParams(top_k=2, temperature=2.0), {0, 1}),
        (SamplingParams(top_p=0.6), {0, 1, 2}),  # cumsum .30 .50 .65
        (SamplingParams(top_p=0.5001), {0, 1, 2}),
        (SamplingParams(top_p=0.49), {0, 1}),
        (SamplingParams(top_p=0.01), {0}),  # always at least one token
        (SamplingParams(min_p=0.25), {0, 1, 2, 3, 4}),  # keep prob >= 0.075
        (SamplingParams(min_p=0.45), {0, 1, 2}),  # keep prob >= 0.135
        # top-p on the distribution renormalised after top-k: {0..5} mass .89,
        # .30/.89=.337 .50/.89=.562 .65/.89=.730
        (SamplingParams(top_k=6, top_p=0.7), {0, 1, 2}),
        # min-p first (>= .03 keeps 0..7, mass .97), then top-k 5, then top-p .8 of
        # {0..4} (mass .83): .361 .602 .783 .904 -> 4 tokens
        (SamplingParams(min_p=0.1, top_k=5, top_p=0.8), {0, 1, 2, 3}),
        # temperature 0.5 squares the probs before top-p: p0=.51, p0+p1=.737
        (SamplingParams(temperature=0.5, top_p=0.7), {0, 1}),
        (SamplingParams(temperature=1.0, top_p=0.7), {0, 1, 2, 3}),
        (SamplingParams(), set(range(VOCAB))),
    ],
)
def test_filters_restrict_support_exactly(params: SamplingParams, allowed: set[int]) -> None:
    metadata = build([params])
    masked = Sampler().filtered_logits(LOGITS[None].clone(), metadata)[0]
    assert finite_set(masked) == allowed
    # Unmasked logits keep their (temperature-scaled) values.
    expected = LOGITS / params.temperature
    kept = sorted(allowed)
    assert torch.equal(masked[kept], expected[kept])
    seen = sampled_set(params, LOGITS[None])
    assert seen <= allowed
    if len(allowed) <= 5:  # every allowed token is likely enough to show up in 3000 draws
        assert seen == allowed


def test_top_k_keeps_ties_at_the_boundary() -> None:
    logits = torch.tensor([[3.0, 2.0, 2.0, 1.0, 0.0]])
    for params in (SamplingParams(top_k=2), SamplingParams(top_k=3)):
        masked = Sampler().filtered_logits(logits, build([params], vocab=5))[0]
        assert finite_set(masked) == {0, 1, 2}
    masked = Sampler().filtered_logits(logits, build([SamplingParams(top_k=4)], vocab=5))[0]
    assert finite_set(masked) == {0, 1, 2, 3}
    assert sampled_set(SamplingParams(top_k=2), logits) == {0, 1, 2}


def test_top_p_keeps_ties_at_the_boundary() -> None:
    # probs ~ .534 .197 .197 .072: the prefix {0, 1} reaches .6, token 2 ties token 1.
    logits = torch.tensor([[2.0, 1.0, 1.0, 0.0]])
    masked = Sampler().filtered_logits(logits, build([SamplingParams(top_p=0.6)], vocab=4))[0]
    assert finite_set(masked) == {0, 1, 2}
    masked = Sampler().filtered_logits(logits, build([SamplingParams(top_p=0.5)], vocab=4))[0]
    assert finite_set(masked) == {0}
    assert sampled_set(SamplingParams(top_p=0.6), logits) == {0, 1, 2}


def test_min_p_boundary_is_inclusive() -> None:
    logits = torch.tensor([[1.0, 1.0, 0.0, 1.0]])
    masked = Sampler().filtered_logits(logits, build([SamplingParams(min_p=1.0)], vocab=4))[0]
    assert finite_set(masked) == {0, 1, 3}


def test_min_p_by_the_logit_threshold_keeps_the_probability_definition_s_set() -> None:
    """``logit >= max + log(min_p)`` is ``prob >= min_p * max_prob`` without the softmax (up to the boundary's
    rounding: none of these rows has a token that close to it)."""
    logits = torch.randn(8, 50_000, generator=torch.Generator().manual_seed(3)) * 3
    min_p = torch.tensor([0.0, 1e-4, 0.01, 0.05, 0.1, 0.3, 0.9, 1.0])
    probs = logits.softmax(-1)
    want = probs >= min_p.unsqueeze(1) * probs.amax(-1, keepdim=True)
    got = Sampler().filtered_logits(logits, build([SamplingParams(min_p=float(p)) for p in min_p], vocab=50_000))
    assert torch.equal(got > float("-inf"), want)
    assert want[0].all() and want[-1].sum() == 1


def test_filters_are_per_row() -> None:
    params = [SamplingParams(top_k=2), SamplingParams(), SamplingParams(top_p=0.49), SamplingParams(temperature=0)]
    masked = Sampler().filtered_logits(LOGITS.expand(4, -1).clone(), build(params))
    assert finite_set(masked[0]) == {0, 1}
    assert finite_set(masked[1]) == set(range(VOCAB))
    assert finite_set(masked[2]) == {0, 1}
    assert finite_set(masked[3]) == set(range(VOCAB))  # greedy rows are never filtered


def test_top_p_one_keeps_every_token_of_a_large_vocab() -> None:
    logits = torch.randn(2, 50_000) * 4
    params = [SamplingParams(top_p=1.0), SamplingParams(top_p=0.3)]
    masked = Sampler().filtered_logits(logits, build(params, vocab=50_000))
    assert torch.isfinite(masked[0]).all()
    kept = sorted(finite_set(masked[1]))
    probs = logits[1].softmax(-1)
    kept_mass = probs[kept].sum().item()
    assert kept_mass >= 0.3 - 1e-5
    # Smallest such set: dropping its least likely token falls below top_p.
    assert kept_mass - probs[kept].min().item() < 0.3


# --------------------------------------------------- penalties and biases


def test_penalties_follow_formula_exactly() -> None:
    vocab = 10
    logits = torch.tensor(
        [
            [1.5, -0.5, 2.0, -1.0, 0.0, 0.7, -2.0, 3.0, 0.2, -0.3],
            [1.5, -0.5, 2.0, -1.0, 0.0, 0.7, -2.0, 3.0, 0.2, -0.3],
        ]
    )
    prompt = [1, 2, 8, 8]
    output = [2, 3, 3, 5, 3]
    rep, freq, pres = 1.3, 0.4, 0.25
    params = [
        SamplingParams(repetition_penalty=rep, frequency_penalty=freq, presence_penalty=pres),
        SamplingParams(),
    ]
    metadata = build(params, vocab=vocab, prompts=[prompt, prompt], outputs=[output, output])
    got = Sampler.apply_logits_processors(logits, metadata)

    expected = logits[0].tolist()
    for token in range(vocab):
        count = output.count(token)
        if token in prompt or count:
            value = expected[token]
            expected[token] = value / rep if value > 0 else value * rep
        expected[token] -= freq * count + pres * (count > 0)
    torch.testing.assert_close(got[0], torch.tensor(expected), rtol=0, atol=1e-6)
    assert torch.equal(got[1], logits[1])  # the row without penalties is untouched
    # Spot checks by hand: token 3 (logit -1.0, three times in the output):
    assert got[0, 3].item() == pytest.approx(-1.0 * 1.3 - 0.4 * 3 - 0.25)
    assert got[0, 8].item() == pytest.approx(0.2 / 1.3)  # prompt only: repetition only
    assert got[0, 7].item() == 3.0  # never seen


def test_repetition_penalty_changes_greedy_choice() -> None:
    logits = torch.tensor([[3.0, 2.5, 0.0, -1.0]])
    plain = Sampler()(logits, build([SamplingParams(temperature=0)], vocab=4))
    assert plain.sampled_token_ids.item() == 0
    metadata = build(
        [SamplingParams(temperature=0, repetition_penalty=1.5)], vocab=4, prompts=[[0]]
    )
    assert Sampler()(logits, metadata).sampled_token_ids.item() == 1  # 3/1.5 = 2 < 2.5


def test_presence_and_frequency_only_count_output_tokens() -> None:
    logits = torch.zeros(1, 5)
    params = [SamplingParams(presence_penalty=1.0, frequency_penalty=0.5)]
    got = Sampler.apply_logits_processors(
        logits, build(params, vocab=5, prompts=[[0, 0, 1]], outputs=[[1, 1, 4]])
    )
    assert got[0].tolist() == [0.0, -2.0, 0.0, 0.0, -1.5]


def test_logit_bias() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [2.0, 1.0, 0.0, -1.0]])
    params = [SamplingParams(temperature=0, logit_bias={3: 100.0, 0: -0.5}), SamplingParams(temperature=0)]
    metadata = build(params, vocab=4)
    processed = Sampler.apply_logits_processors(logits, metadata)
    assert processed[0].tolist() == [1.5, 1.0, 0.0, 99.0]
    assert torch.equal(processed[1], logits[1])
    assert Sampler()(logits, metadata).sampled_token_ids.tolist() == [3, 0]

    down = build([SamplingParams(temperature=0, logit_bias={0: -100})], vocab=4)
    assert Sampler()(logits[:1], down).sampled_token_ids.item() == 1
    assert logits[0, 0].item() == 2.0  # the caller's logits are not modified


def test_min_tokens_masks_eos_and_stop_ids() -> None:
    logits = torch.tensor([[0.0, 1.0, 5.0, 0.5, 0.0, 4.0]]).expand(4, -1).clone()
    params = [
        SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[5]),
        SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[5]),  # long enough
        SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[5], ignore_eos=True),
        SamplingParams(temperature=0),
    ]
    outputs = [[1, 1], [1, 1, 1], [1], []]
    metadata = build(params, vocab=6, outputs=outputs, eos=[{2}] * 4)
    processed = Sampler.apply_logits_processors(logits, metadata)
    assert processed[0, 2].item() == -math.inf and processed[0, 5].item() == -math.inf
    assert torch.equal(processed[1], logits[1])
    assert processed[2, 2].item() == 5.0 and processed[2, 5].item() == -math.inf
    assert Sampler()(logits, metadata).sampled_token_ids.tolist() == [1, 2, 2, 2]


def test_min_tokens_yields_to_a_grammar_that_allows_only_the_end() -> None:
    """A row whose grammar mask left only EOS (a regex at its longest) samples EOS though min_tokens holds it
    back: masking it too left nothing, and a token outside the grammar was sampled."""
    logits = torch.tensor([[-math.inf, -math.inf, 1.0, -math.inf], [0.5, 2.0, 1.0, -math.inf]])
    params = [SamplingParams(temperature=0.7, seed=1, min_tokens=5), SamplingParams(temperature=0, min_tokens=5)]
    metadata = build(params, vocab=4, outputs=[[1], [1]], eos=[{2}] * 2)
    processed = Sampler.apply_logits_processors(logits, metadata)
    assert torch.equal(processed[0], logits[0])  # only EOS was left: kept
    assert processed[1].tolist() == [0.5, 2.0, -math.inf, -math.inf]  # EOS held back as ever
    assert Sampler()(logits, metadata).sampled_token_ids.tolist() == [2, 1]


def test_min_tokens_masks_eos_for_random_rows() -> None:
    logits = torch.tensor([[0.0, 0.0, 3.0]])
    params = SamplingParams(min_tokens=1)
    batch = logits.expand(500, -1).clone()
    metadata = build([params] * 500, vocab=3, eos=[{2}] * 500)
    assert set(Sampler()(batch, metadata).sampled_token_ids.tolist()) == {0, 1}


# --------------------------------------------------------------- logprobs


def test_logprobs_are_raw_log_softmax_with_rank_and_top_n() -> None:
    logits = torch.tensor(
        [
            [0.1, 2.0, -1.0, 1.5, 0.7, 3.0],
            [1.0, 0.0, 0.5, -0.5, 2.0, 0.25],
            [0.3, 0.2, 0.1, 0.0, -0.1, -0.2],
        ]
    )
    params = [
        SamplingParams(temperature=0, logprobs=3, logit_bias={2: 100.0}),  # picks token 2
        SamplingParams(temperature=0.7, top_k=2, seed=1),
        SamplingParams(temperature=0),  # asked for none: still gets the batch's top-N
    ]
    metadata = build(params, vocab=6, generators=[None, torch.Generator().manual_seed(1), None])
    assert metadata.max_num_logprobs == 3
    out = Sampler()(logits, metadata)
    assert out.logprobs is not None
    raw = torch.log_softmax(logits, dim=-1)
    sampled = out.sampled_token_ids
    assert sampled[0].item() == 2 and sampled[2].item() == 0
    assert sampled[1].item() in {0, 4}

    lp = out.logprobs
    torch.testing.assert_close(lp.sampled_logprobs, raw.gather(1, sampled[:, None]).squeeze(1))
    assert lp.sampled_logprobs[0].item() == pytest.approx(raw[0, 2].item())  # raw, not biased
    expected_ranks = [6, 2 if sampled[1].item() == 0 else 1, 1]
    assert lp.sampled_ranks.tolist() == expected_ranks
    assert lp.topk_token_ids.tolist() == [[5, 1, 3], [4, 0, 2], [0, 1, 2]]
    torch.testing.assert_close(lp.topk_logprobs, raw.gather(1, lp.topk_token_ids))
    assert lp.topk_logprobs[0].tolist() == sorted(lp.topk_logprobs[0].tolist(), reverse=True)


def test_zero_logprobs_returns_only_the_sampled_token() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0]])
    out = Sampler()(logits, build([SamplingParams(temperature=0, logprobs=0)], vocab=3))
    assert out.logprobs is not None
    assert out.logprobs.topk_token_ids.shape == (1, 0)
    assert out.logprobs.sampled_logprobs.item() == pytest.approx(
        torch.log_softmax(logits, -1)[0, 2].item()
    )


# --------------------------------------------------------------- metadata


def test_common_case_metadata_has_no_optional_tensors() -> None:
    metadata = build([SamplingParams(temperature=0)] * 3)
    assert metadata.all_greedy and metadata.no_penalties
    for name in (
        "top_k", "top_p", "min_p", "presence_penalties", "output_token_counts",
        "prompt_token_mask", "logit_bias_rows", "min_tokens_rows", "max_num_logprobs",
    ):
        assert getattr(metadata, name) is None, name
    assert metadata.generators == {}


def test_metadata_build_flags_and_counts() -> None:
    params = [
        SamplingParams(frequency_penalty=0.5, seed=3),
        SamplingParams(temperature=0, seed=4),  # greedy: its generator is not used
        SamplingParams(top_k=100),  # larger than the vocab: disabled
    ]
    gens = [torch.Generator().manual_seed(3), torch.Generator().manual_seed(4), None]
    metadata = build(params, outputs=[[1, 1, 4], [2], [3]], generators=gens)
    assert not metadata.all_greedy and not metadata.all_random
    assert metadata.greedy_mask is not None and metadata.greedy_mask.tolist() == [False, True, False]
    assert metadata.top_k is None
    assert list(metadata.generators) == [0]
    assert metadata.output_token_counts is not None
    assert metadata.output_token_counts[0, :5].tolist() == [0, 2, 0, 0, 1]
    assert metadata.output_token_counts[1:].sum().item() == 0  # rows without penalties
    assert metadata.prompt_token_mask is None  # no repetition penalty in the batch


def test_metadata_build_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="output_token_ids has 1 rows, params has 2"):
        SamplingMetadata.build(
            [SamplingParams()] * 2, [[], []], [[]], [set(), set()], [None, None], 10, "cpu"
        )
    with pytest.raises(ValueError, match="logit_bias token id 10 is outside"):
        build([SamplingParams(logit_bias={10: 1.0})], vocab=10)


def test_empty_batch() -> None:
    metadata = build([])
    assert metadata.all_greedy and not metadata.all_random
    out = Sampler()(torch.zeros(0, VOCAB), metadata)
    assert out.sampled_token_ids.shape == (0,)
