"""The batched sampler: one flat batch of rows, each with its own sampling params.

Order of operations on the logits of one step (vLLM v1 order):

1. logit bias (additive),
2. min-tokens mask (eos / stop token ids -> -inf while the output is too short; not where it would
   leave a row nothing: a grammar that allows only its end ends the output, min_tokens or not),
3. penalties: repetition (HF/vLLM), then frequency and presence (OpenAI),
4. temperature,
5. min-p, 6. top-k, 7. top-p,
8. sample: a Gumbel race (``argmax(logits / t + g)``) whose noise ``g`` is hashed from a 64-bit key per row
   and the token id (`rivulet.kernels.sampling`), so a token's noise is its own. Greedy rows take the
   argmax of the logits after step 3 (in a mixed batch they race at temperature 0, after filters that
   always keep a row's largest logits: the same index).

Logprobs are always those of the model's raw distribution: ``log_softmax`` of the
unprocessed logits in float32.

Support of the filters (exact, ties at the boundary are kept):

* min-p keeps tokens with ``prob >= min_p * max_prob`` (as ``logit >= max_logit + log(min_p)``, in float32);
* top-k keeps tokens whose logit is ``>=`` the k-th largest logit, so tokens tied
  with the k-th one are all kept (the kept set can exceed k);
* top-p keeps the smallest prefix of the tokens sorted by probability whose
  cumulative probability (summed in float64) reaches ``top_p`` (at least one
  token), plus any token whose probability equals that of the prefix's last
  token.  top-p works on the distribution renormalised after min-p and top-k.

top-k and top-p are one op (`top_k_top_p`: a sort in the reference; on CPUs a radix select per row, no sort).

A seeded row's key depends only on its seed and the position of the token being sampled
(`position_seed`), so a seeded token depends only on (seed, position, distribution): the same with or
without speculative drafts, after a preemption, and when a stream is resumed elsewhere as a completion of
prompt + the tokens already sent. And since each token's noise is its own, logits that differ in their last
bits (a recompute after preemption runs other kernels than the decode steps did; a batch of another size
takes another path) change the draw only where two tokens' noisy scores are that close, where an inverse
CDF changed it whenever its one uniform number fell near any of the vocabulary's cumulative sums. Seeded
rows without a position draw their key from their own generator; unseeded rows from torch's default
(CPU) generator.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from rivulet.kernels.ops import get_op
from rivulet.layers.sampling_metadata import SamplingMetadata

_NEG_INF = float("-inf")
_KEY_BOUND = (1 << 63) - 1  # keys are below it (position_seed's are 63 bits)


@dataclass
class LogprobsTensors:
    """Logprobs of one step from the raw distribution, one row per sampled token."""

    sampled_logprobs: torch.Tensor  # float32[rows]
    sampled_ranks: torch.Tensor  # int64[rows]; 1 + number of tokens strictly more likely
    topk_token_ids: torch.Tensor  # int64[rows, N], most likely first
    topk_logprobs: torch.Tensor  # float32[rows, N]


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # int64[rows]
    logprobs: LogprobsTensors | None = None  # None unless some row asked for logprobs


def gather_logprobs(
    logprobs: torch.Tensor, token_ids: torch.Tensor, num_logprobs: int
) -> LogprobsTensors:
    """The given tokens' logprobs and ranks, and the top ``num_logprobs`` of each row.

    ``logprobs`` is float32[rows, vocab] (a ``log_softmax``); ``token_ids`` int64[rows].
    Also serves prompt logprobs, where ``token_ids`` are the next prompt tokens.
    """
    sampled = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
    ranks = (logprobs > sampled.unsqueeze(1)).sum(dim=-1) + 1
    top = logprobs.topk(num_logprobs, dim=-1)
    return LogprobsTensors(sampled, ranks, top.indices, top.values)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """-inf where a row's bitmask (int32 [rows, ceil(vocab / 32)]) has a 0 bit: bit j of word w is token
    32w + j. In place (the platform's kernel: C++ on CPU); returns `logits`."""
    return _bitmask_op()(logits, bitmask)


@functools.cache
def _bitmask_op() -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    return get_op("apply_token_bitmask")  # type: ignore[return-value]


def apply_logit_bias(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    if metadata.logit_bias_rows is None:
        return logits
    index = (metadata.logit_bias_rows, metadata.logit_bias_tokens)
    return logits.index_put(index, metadata.logit_bias_values, accumulate=True)


def apply_min_tokens(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    if metadata.min_tokens_rows is None:
        return logits
    index = (metadata.min_tokens_rows, metadata.min_tokens_tokens)
    masked = logits.index_put(index, torch.full((), _NEG_INF, dtype=logits.dtype, device=logits.device))
    # a row the grammar bitmask left only its stop tokens: it keeps them (no host sync)
    return torch.where(torch.isneginf(masked).all(dim=-1, keepdim=True), logits, masked)


def apply_penalties(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Repetition (prompt or output tokens), then frequency and presence (output tokens).

    repetition: a seen token's logit is divided by the penalty when positive and
    multiplied by it otherwise; then ``logit -= frequency * count + presence * (count > 0)``.
    """
    counts = metadata.output_token_counts
    if counts is None:
        return logits
    output_mask = counts > 0
    if metadata.repetition_penalties is not None:
        seen = output_mask
        if metadata.prompt_token_mask is not None:
            seen = seen | metadata.prompt_token_mask
        penalty = metadata.repetition_penalties.unsqueeze(1)
        penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(seen, penalised, logits)
    assert metadata.frequency_penalties is not None and metadata.presence_penalties is not None
    logits = logits - metadata.frequency_penalties.unsqueeze(1) * counts
    return logits - metadata.presence_penalties.unsqueeze(1) * output_mask


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens with ``prob < min_p * max_prob``, that is ``logit < max_logit + log(min_p)``: no softmax (a row
    with min_p 0 keeps all)."""
    threshold = logits.amax(dim=-1, keepdim=True) + min_p.log().unsqueeze(1)
    return logits.masked_fill(logits < threshold, _NEG_INF)


def position_seed(seed: int, position: int) -> int:
    """The seed of the draw for the token at `position` of a request seeded with `seed` (splitmix64)."""
    z = (seed + (position + 1) * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) >> 1  # 63 bits: what every torch.Generator accepts


def draw_keys(num_rows: int, generators: dict[int, torch.Generator],
              seeds: dict[int, int] | None = None) -> torch.Tensor:
    """int64 [num_rows] on the CPU: each row's key for `sample_rows`. Seeded rows take ``seeds[row]`` when given
    (`position_seed`), else a number from their own generator; the other rows numbers from torch's default
    generator (one call for all of them)."""
    if len(generators) < num_rows:
        keys = torch.randint(_KEY_BOUND, (num_rows,), dtype=torch.int64)
    else:
        keys = torch.empty(num_rows, dtype=torch.int64)
    k = keys.numpy()
    for row, generator in generators.items():
        if seeds and row in seeds:
            k[row] = seeds[row]
        else:
            k[row] = int(torch.randint(_KEY_BOUND, (1,), generator=generator, device=generator.device))
    return keys


class Sampler(nn.Module):
    """Turns one step's logits into token ids (and logprobs when asked)."""

    def __init__(self) -> None:
        super().__init__()
        self._argmax = get_op("argmax_rows")
        self._sample_rows = get_op("sample_rows")
        self._top_k_top_p = get_op("top_k_top_p")

    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """``logits``: float[rows, vocab] (float32, or bf16: widened only where a step needs float32), one row per
        sequence to sample."""
        if metadata.all_greedy and metadata.max_num_logprobs is None and not self.processes(metadata):
            return SamplerOutput(sampled_token_ids=self._argmax(logits), logprobs=None)  # any float dtype
        raw_logprobs = None
        if metadata.max_num_logprobs is not None:
            raw_logprobs = logits.float().log_softmax(dim=-1)
        if self.processes(metadata):
            logits = self.apply_logits_processors(logits.float(), metadata)
        if metadata.all_greedy:
            sampled = self._argmax(logits)
        else:
            temperature = metadata.temperature
            if self.filters(metadata):
                logits = self.filtered_logits(logits.float(), metadata)  # divided by the temperature already
                temperature = torch.ones_like(temperature)
            if metadata.greedy_mask is not None:  # their argmax (the filters keep every row's largest logit)
                temperature = temperature.masked_fill(metadata.greedy_mask, 0.0)
            keys = draw_keys(logits.shape[0], metadata.generators, metadata.seeds)
            sampled = self._sample_rows(logits, temperature, keys.to(logits.device, non_blocking=True))

        logprobs = None
        if raw_logprobs is not None:
            assert metadata.max_num_logprobs is not None
            logprobs = gather_logprobs(raw_logprobs, sampled, metadata.max_num_logprobs)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)

    @staticmethod
    def filters(metadata: SamplingMetadata) -> bool:
        """Whether min-p, top-k or top-p restrict any row of this batch."""
        return metadata.min_p is not None or metadata.top_p is not None or metadata.top_k is not None

    @staticmethod
    def processes(metadata: SamplingMetadata) -> bool:
        """Whether `apply_logits_processors` changes any logit of this batch."""
        return metadata.logit_bias_rows is not None or metadata.min_tokens_rows is not None \
            or metadata.output_token_counts is not None

    @staticmethod
    def apply_logits_processors(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """Steps shared by greedy and random rows: logit bias, min-tokens, penalties."""
        logits = apply_logit_bias(logits, metadata)
        logits = apply_min_tokens(logits, metadata)
        return apply_penalties(logits, metadata)

    def filtered_logits(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """Temperature, then min-p, top-k, top-p: masked tokens are -inf (float32 logits; a new tensor)."""
        logits = logits / metadata.temperature.unsqueeze(1)
        if metadata.min_p is not None:
            logits = apply_min_p(logits, metadata.min_p)
        if metadata.top_k is not None or metadata.top_p is not None:
            logits = self._top_k_top_p(logits, metadata.top_k, metadata.top_p)  # may mask in place: a copy already
        return logits
