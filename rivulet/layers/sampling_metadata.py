"""The sampling state of one step as tensors (`SamplingMetadata`), what `Sampler` reads.

The engine builds it from its persistent batch (`worker/sampling_state.py`, by indexing rows it keeps up to
date); `SamplingMetadata.build` makes the same fields from plain lists of params and token ids, the
reference the persistent state is tested against and what the sampler's own tests use.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from rivulet.sampling_params import SamplingParams


@dataclass
class SamplingMetadata:
    """Per-row sampling state of one step, as tensors on the logits' device.

    Optional tensors are ``None`` when no row in the batch needs them, so the
    common case (greedy, no penalties, no logprobs) does no extra work.
    """

    temperature: torch.Tensor  # float32[rows]; 1.0 for greedy rows (they never use it)
    greedy_mask: torch.Tensor | None  # bool[rows]; None when all_greedy or all_random
    all_greedy: bool
    all_random: bool
    top_k: torch.Tensor | None  # int64[rows]; vocab_size where a row has no top-k
    top_p: torch.Tensor | None  # float32[rows]; 1.0 where a row has no top-p
    min_p: torch.Tensor | None  # float32[rows]; 0.0 where a row has no min-p
    presence_penalties: torch.Tensor | None  # float32[rows]
    frequency_penalties: torch.Tensor | None  # float32[rows]
    repetition_penalties: torch.Tensor | None  # float32[rows]
    prompt_token_mask: torch.Tensor | None  # bool[rows, vocab]: token occurs in the prompt
    output_token_counts: torch.Tensor | None  # float32[rows, vocab]: occurrences in the output
    logit_bias_rows: torch.Tensor | None  # int64[n]
    logit_bias_tokens: torch.Tensor | None  # int64[n]
    logit_bias_values: torch.Tensor | None  # float32[n]
    min_tokens_rows: torch.Tensor | None  # int64[m]: (row, token) pairs to set to -inf
    min_tokens_tokens: torch.Tensor | None  # int64[m]
    generators: dict[int, torch.Generator] = field(default_factory=dict)  # seeded random rows
    seeds: dict[int, int] = field(default_factory=dict)  # row -> seed its generator takes before the draw
    max_num_logprobs: int | None = None  # top-N to return; None: no logprobs at all

    @property
    def no_penalties(self) -> bool:
        return self.output_token_counts is None

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        prompt_token_ids: Sequence[Sequence[int]],
        output_token_ids: Sequence[Sequence[int]],
        eos_token_ids: Sequence[set[int]],
        generators: Sequence[torch.Generator | None],
        vocab_size: int,
        device: torch.device | str,
    ) -> SamplingMetadata:
        """Build the metadata of one step from per-row Python data.

        Row ``i`` is sampled with ``params[i]``; its prompt and output so far feed
        the penalties and the min-tokens check; ``eos_token_ids[i]`` are masked (with
        ``params[i].stop_token_ids``) while the output is shorter than ``min_tokens``,
        unless ``ignore_eos``; ``generators[i]`` (on ``device``) is used when the row
        is seeded.  Token ids must already be checked with ``validate_for_vocab``.
        """
        num_rows = len(params)
        for name, seq in (
            ("prompt_token_ids", prompt_token_ids),
            ("output_token_ids", output_token_ids),
            ("eos_token_ids", eos_token_ids),
            ("generators", generators),
        ):
            if len(seq) != num_rows:
                raise ValueError(f"{name} has {len(seq)} rows, params has {num_rows}")

        greedy = [p.is_greedy for p in params]
        random_rows = [p for p, g in zip(params, greedy) if not g]
        all_greedy = not random_rows  # also true for an empty batch
        all_random = bool(random_rows) and not any(greedy)

        def floats(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device)

        def longs(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        temperature = floats([1.0 if g else p.temperature for p, g in zip(params, greedy)])
        greedy_mask = None
        if not all_greedy and not all_random:
            greedy_mask = torch.tensor(greedy, dtype=torch.bool, device=device)

        top_k = min_p = top_p = None
        row_top_k = [
            p.top_k if not g and 0 < p.top_k < vocab_size else vocab_size
            for p, g in zip(params, greedy)
        ]
        if any(k < vocab_size for k in row_top_k):
            top_k = longs(row_top_k)
        if any(p.top_p < 1.0 for p in random_rows):
            top_p = floats([1.0 if g else p.top_p for p, g in zip(params, greedy)])
        if any(p.min_p > 0.0 for p in random_rows):
            min_p = floats([0.0 if g else p.min_p for p, g in zip(params, greedy)])

        presence = frequency = repetition = prompt_mask = output_counts = None
        if any(p.has_penalties for p in params):
            presence = floats([p.presence_penalty for p in params])
            frequency = floats([p.frequency_penalty for p in params])
            output_counts = _token_counts(
                [out if p.has_penalties else [] for p, out in zip(params, output_token_ids)],
                vocab_size,
                device,
            )
            if any(p.repetition_penalty != 1.0 for p in params):
                repetition = floats([p.repetition_penalty for p in params])
                prompt_mask = _token_counts(
                    [
                        prompt if p.repetition_penalty != 1.0 else []
                        for p, prompt in zip(params, prompt_token_ids)
                    ],
                    vocab_size,
                    device,
                ) > 0

        bias_rows: list[int] = []
        bias_tokens: list[int] = []
        bias_values: list[float] = []
        for row, p in enumerate(params):
            for token_id, value in (p.logit_bias or {}).items():
                check_token_id("logit_bias", token_id, vocab_size)
                bias_rows.append(row)
                bias_tokens.append(token_id)
                bias_values.append(value)

        min_rows: list[int] = []
        min_tokens: list[int] = []
        for row, (p, out, eos) in enumerate(zip(params, output_token_ids, eos_token_ids)):
            if len(out) >= p.min_tokens:
                continue
            blocked = set(p.stop_token_ids or [])
            if not p.ignore_eos:
                blocked |= set(eos)
            for token_id in sorted(blocked):
                check_token_id("min_tokens stop token", token_id, vocab_size)
                min_rows.append(row)
                min_tokens.append(token_id)

        requested = [p.logprobs for p in params if p.logprobs is not None]
        return cls(
            temperature=temperature,
            greedy_mask=greedy_mask,
            all_greedy=all_greedy,
            all_random=all_random,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            presence_penalties=presence,
            frequency_penalties=frequency,
            repetition_penalties=repetition,
            prompt_token_mask=prompt_mask,
            output_token_counts=output_counts,
            logit_bias_rows=longs(bias_rows) if bias_rows else None,
            logit_bias_tokens=longs(bias_tokens) if bias_rows else None,
            logit_bias_values=floats(bias_values) if bias_rows else None,
            min_tokens_rows=longs(min_rows) if min_rows else None,
            min_tokens_tokens=longs(min_tokens) if min_rows else None,
            generators={
                row: gen
                for row, (gen, g) in enumerate(zip(generators, greedy))
                if gen is not None and not g
            },
            max_num_logprobs=max(requested) if requested else None,
        )


def check_token_id(what: str, token_id: int, vocab_size: int) -> None:
    if not 0 <= token_id < vocab_size:
        raise ValueError(f"{what} token id {token_id} is outside the vocabulary [0, {vocab_size})")


def _token_counts(
    token_ids: Sequence[Sequence[int]], vocab_size: int, device: torch.device | str
) -> torch.Tensor:
    """float32[rows, vocab]: how many times each token occurs in each row's list."""
    num_rows = len(token_ids)
    max_len = max((len(ids) for ids in token_ids), default=0)
    # Pad with an extra id ``vocab_size`` whose column is dropped afterwards.
    padded = [list(ids) + [vocab_size] * (max_len - len(ids)) for ids in token_ids]
    index = torch.tensor(padded, dtype=torch.int64, device=device).view(num_rows, max_len)
    counts = torch.zeros(num_rows, vocab_size + 1, dtype=torch.float32, device=device)
    counts.scatter_add_(1, index, torch.ones_like(index, dtype=torch.float32))
    return counts[:, :vocab_size]
