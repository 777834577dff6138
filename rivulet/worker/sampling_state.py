"""Per-row sampling state of the persistent batch: scalars in numpy, penalty counts as tensors.

A row's values are written once when its request enters the batch; penalty counts are updated
with each token the row samples. `metadata(rows)` then gathers the `SamplingMetadata` of a
step's sampling rows by indexing, with the same fields `SamplingMetadata.build` computes from
Python lists (the reference; the tests check the two agree). An all-greedy step without
penalties, bias or min-tokens builds no tensor at all but its temperature.
"""

from __future__ import annotations

import numpy as np
import torch

from rivulet.layers.sampler import position_seed
from rivulet.layers.sampling_metadata import SamplingMetadata, check_token_id
from rivulet.sampling_params import SamplingParams
from rivulet.worker.staging import to_device

_FLOATS = ("temperature", "top_p", "min_p", "presence", "frequency", "repetition")


class SamplingState:
    def __init__(self, capacity: int, vocab_size: int, device: torch.device) -> None:
        self.vocab_size, self.device = vocab_size, device
        self.params: list[SamplingParams | None] = [None] * capacity
        self.generators: list[torch.Generator | None] = [None] * capacity
        self.greedy = np.zeros(capacity, bool)
        self.penalized = np.zeros(capacity, bool)
        self.biased = np.zeros(capacity, bool)
        self.top_k = np.zeros(capacity, np.int64)
        self.min_tokens = np.zeros(capacity, np.int64)
        self.logprobs = np.full(capacity, -1, np.int64)
        self.prompt_logprobs = np.full(capacity, -1, np.int64)
        for name in _FLOATS:
            setattr(self, name, np.zeros(capacity, np.float32))
        self.blocked: list[list[int]] = [[] for _ in range(capacity)]  # ids masked until min_tokens
        self.output_counts: torch.Tensor | None = None  # float32[capacity, vocab], rows with penalties
        self.prompt_mask: torch.Tensor | None = None  # bool[capacity, vocab], rows with repetition penalty

    def grow(self, capacity: int) -> None:
        old = len(self.params)
        self.params += [None] * (capacity - old)
        self.generators += [None] * (capacity - old)
        self.blocked += [[] for _ in range(capacity - old)]
        for name in ("greedy", "penalized", "biased", "top_k", "min_tokens", "logprobs", "prompt_logprobs", *_FLOATS):
            a = getattr(self, name)
            setattr(self, name, np.concatenate([a, np.zeros(capacity - old, a.dtype)]))
        for name in ("output_counts", "prompt_mask"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, torch.cat([t, t.new_zeros(capacity - old, t.shape[1])]))

    def set_row(self, row: int, p: SamplingParams, prompt: list[int], outputs: list[int], eos: set[int],
                generator: torch.Generator | None) -> None:
        v = self.vocab_size
        g = p.is_greedy
        self.params[row], self.generators[row], self.greedy[row] = p, generator, g
        self.temperature[row] = 1.0 if g else p.temperature
        self.top_k[row] = p.top_k if not g and 0 < p.top_k < v else v
        self.top_p[row] = 1.0 if g else p.top_p
        self.min_p[row] = 0.0 if g else p.min_p
        self.presence[row], self.frequency[row] = p.presence_penalty, p.frequency_penalty
        self.repetition[row] = p.repetition_penalty
        self.logprobs[row] = -1 if p.logprobs is None else p.logprobs
        self.prompt_logprobs[row] = -1 if p.prompt_logprobs is None else p.prompt_logprobs
        self.min_tokens[row] = p.min_tokens
        blocked = set(p.stop_token_ids or []) | (set() if p.ignore_eos else set(eos))
        self.blocked[row] = sorted(blocked) if p.min_tokens > 0 else []
        for t in self.blocked[row]:
            check_token_id("min_tokens stop token", t, v)
        for t in p.logit_bias or {}:
            check_token_id("logit_bias", t, v)
        self.biased[row] = bool(p.logit_bias)
        self.penalized[row] = p.has_penalties
        if p.has_penalties:
            counts = self._table("output_counts", torch.float32)
            counts[row].zero_()
            if outputs:
                counts[row].index_add_(0, to_device(np.array(outputs, np.int64), self.device),
                                       torch.ones(len(outputs), device=self.device))
        if p.repetition_penalty != 1.0:
            mask = self._table("prompt_mask", torch.bool)
            mask[row].zero_()
            mask[row, to_device(np.array(prompt, np.int64), self.device)] = True

    def clear_row(self, row: int) -> None:
        self.params[row] = self.generators[row] = None
        self.blocked[row] = []
        self.penalized[row] = self.biased[row] = False
        self.prompt_logprobs[row] = -1

    def _table(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        t = getattr(self, name)
        if t is None:
            t = torch.zeros(len(self.params), self.vocab_size, dtype=dtype, device=self.device)
            setattr(self, name, t)
        return t

    def record(self, rows: np.ndarray, token_ids: torch.Tensor) -> None:
        """Count each row's new token for its penalties."""
        pen = self.penalized[rows]
        if pen.any() and self.output_counts is not None:
            r = to_device(rows[pen], self.device)
            ids = token_ids if pen.all() else token_ids[to_device(np.flatnonzero(pen), token_ids.device)]  # no mask:
            self.output_counts.index_put_((r, ids), torch.ones(len(r), device=self.device), accumulate=True)  # a sync

    def metadata(self, rows: np.ndarray, num_outputs: np.ndarray,
                 positions: np.ndarray | None = None) -> SamplingMetadata:
        """The SamplingMetadata of the step's sampling `rows` (in order); `num_outputs[i]`: tokens row i has
        sampled so far; `positions[i]`: where its token lands in the sequence (seeded rows draw with
        `position_seed(seed, position)`; None: their generators go on from where they are)."""
        dev, v = self.device, self.vocab_size

        def f(name: str) -> torch.Tensor:
            return to_device(getattr(self, name)[rows], dev)

        greedy = self.greedy[rows]
        all_greedy, all_random = bool(greedy.all()), not greedy.any() and len(rows) > 0
        rand = ~greedy
        top_k = min_p = top_p = None
        row_k = self.top_k[rows]
        enabled = row_k < v
        if enabled.any():
            top_k = to_device(row_k, dev)
        if (self.top_p[rows][rand] < 1.0).any():
            top_p = f("top_p")
        if (self.min_p[rows][rand] > 0.0).any():
            min_p = f("min_p")
        presence = frequency = repetition = prompt_mask = counts = None
        pen = self.penalized[rows]
        if pen.any():
            presence, frequency = f("presence"), f("frequency")
            index = to_device(rows, dev)
            counts = self.output_counts[index] * to_device(pen, dev)[:, None]  # type: ignore[index]
            if (self.repetition[rows] != 1.0).any():
                repetition = f("repetition")
                rep = to_device(self.repetition[rows] != 1.0, dev)[:, None]
                prompt_mask = self.prompt_mask[index] & rep  # type: ignore[index]
        bias_rows, bias_tokens, bias_values, min_rows, min_toks = [], [], [], [], []
        special = np.flatnonzero(self.biased[rows] | (num_outputs < self.min_tokens[rows]))
        for i in special.tolist():  # only the rows with a logit bias or an unmet min_tokens
            r = int(rows[i])
            for t, val in (self.params[r].logit_bias or {}).items():  # type: ignore[union-attr]
                bias_rows.append(i), bias_tokens.append(t), bias_values.append(val)
            if num_outputs[i] < self.min_tokens[r]:
                min_rows += [i] * len(self.blocked[r])
                min_toks += self.blocked[r]
        logprobs = self.logprobs[rows]
        asked = logprobs[logprobs >= 0]

        def longs(x: list[int]) -> torch.Tensor | None:
            return to_device(np.array(x, np.int64), dev) if x else None

        return SamplingMetadata(
            temperature=f("temperature"),
            greedy_mask=None if all_greedy or all_random else to_device(greedy, dev),
            all_greedy=all_greedy, all_random=all_random,
            top_k=top_k,
            top_p=top_p, min_p=min_p,
            presence_penalties=presence, frequency_penalties=frequency, repetition_penalties=repetition,
            prompt_token_mask=prompt_mask, output_token_counts=counts,
            logit_bias_rows=longs(bias_rows), logit_bias_tokens=longs(bias_tokens),
            logit_bias_values=to_device(np.array(bias_values, np.float32), dev) if bias_rows else None,
            min_tokens_rows=longs(min_rows), min_tokens_tokens=longs(min_toks),
            generators=(gens := {i: g for i, r in enumerate(rows.tolist())
                                 if (g := self.generators[r]) is not None and not self.greedy[r]}),
            seeds={} if positions is None else {
                i: position_seed(self.params[int(rows[i])].seed, int(positions[i]))  # type: ignore[union-attr,arg-type]
                for i in gens},
            max_num_logprobs=int(asked.max()) if len(asked) else None,
        )
