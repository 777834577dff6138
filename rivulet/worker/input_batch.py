"""The persistent batch: each running request owns a row of preallocated numpy arrays.

Rows are written when a request enters (its known tokens, blocks, sampling parameters), extended
when the scheduler hands it new blocks and when it samples a token, and freed when it finishes or
is preempted. Each step's flat batch (input ids, positions, slot mapping, block tables, query
start locations, sequence lengths, logits indices) is then gathered from the rows of the scheduled
requests by vectorized indexing: no per-token Python loop and no per-step list of lists. On a GPU
it reaches the device as two non-blocking copies from pinned memory (`staging.py`), straight into a
CUDA graph's static inputs when the step will replay one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from rivulet.core.outputs import NewRequestData, SchedulerOutput
from rivulet.sampling_params import SamplingParams
from rivulet.worker.batch import FlatBatch, to_device
from rivulet.worker.sampling_state import SamplingState
from rivulet.worker.staging import Staging

if TYPE_CHECKING:
    from rivulet.worker.cuda_graph import DecodeGraphs, StepGraphs


@dataclass
class StepInputs:
    """One step gathered from the batch: the model's inputs and where each request sits in them."""

    flat: FlatBatch  # logits_indices: the last scheduled token of each sampling request
    req_ids: list[str]  # scheduled requests, in batch order
    rows: np.ndarray  # [S] their batch rows
    query_start: np.ndarray  # [S + 1] each request's first token in the flat batch
    starts: np.ndarray  # [S] tokens already computed before this step
    sample: np.ndarray  # [S] bool: the request reaches the end of its known tokens and samples
    pool: np.ndarray  # [S] bool: an embedding request, whole in this step: pooled, not sampled
    num_logits: np.ndarray  # [S] logits rows of each request: 0, 1, or 1 + its draft tokens
    drafts: dict[int, list[int]]  # request index -> its draft tokens (the last scheduled tokens)


class InputBatch:
    def __init__(self, block_size: int, vocab_size: int, device: torch.device, capacity: int = 8,
                 max_len: int = 256, max_blocks: int = 16) -> None:
        self.block_size, self.device = block_size, device
        self.staging = Staging(device)  # each step's inputs to the device (pinned, one copy per dtype on a GPU)
        self.token_ids = np.zeros((capacity, max_len), np.int64)
        self.num_tokens = np.zeros(capacity, np.int64)  # known tokens: prompt then outputs
        self.num_prompt = np.zeros(capacity, np.int64)
        self.num_computed = np.zeros(capacity, np.int64)  # with KV in the cache before the step
        self.block_table = np.zeros((capacity, max_blocks), np.int32)
        self.num_blocks = np.zeros(capacity, np.int64)
        self.lora_slot = np.full(capacity, -1, np.int64)  # the row's LoRA adapter slot (-1: the base model)
        # a token sampled but not yet known here (async outputs): its index in `pending_ids` (on the device), or -1
        self.pending = np.full(capacity, -1, np.int64)
        self.pending_ids: torch.Tensor | None = None
        self.req_ids: list[str | None] = [None] * capacity
        self.row_of: dict[str, int] = {}
        self._free = list(range(capacity - 1, -1, -1))
        self.sampling = SamplingState(capacity, vocab_size, device)
        # kept across preemption so a resumed seeded request continues its random stream
        self.generators: dict[str, torch.Generator] = {}

    def __len__(self) -> int:
        return len(self.row_of)

    @property
    def capacity(self) -> int:
        return len(self.req_ids)

    # ---- rows in and out ----

    def update(self, out: SchedulerOutput, eos_token_ids: set[int]) -> None:
        """Apply a step's changes: drop finished and preempted rows, add new ones, extend the rest."""
        for rid in out.finished_request_ids:
            self.generators.pop(rid, None)
        for rid in out.finished_request_ids | out.preempted_request_ids:
            self.remove(rid)
        for new in out.new_requests:
            self.add(new, eos_token_ids)
        for c in out.cached_requests:
            row = self.row_of[c.request_id]
            self._append_blocks(row, c.new_block_ids)
            self.num_computed[row] = c.num_computed_tokens

    def add(self, new: NewRequestData, eos_token_ids: set[int]) -> int:
        if new.request_id in self.row_of:
            raise ValueError(f"request {new.request_id!r} is already in the batch")
        if not self._free:
            self._grow_rows(2 * self.capacity)
        row = self._free.pop()
        self.req_ids[row], self.row_of[new.request_id] = new.request_id, row
        n = len(new.token_ids)
        self._ensure_len(n + 1)
        self.token_ids[row, :n] = new.token_ids
        self.num_tokens[row], self.num_prompt[row] = n, new.num_prompt_tokens
        self.num_computed[row], self.num_blocks[row] = new.num_computed_tokens, 0
        self.lora_slot[row] = -1  # the runner sets the slot of a request with an adapter
        self.pending[row] = -1  # (a token still pending for the row's previous request is dropped)
        self.block_table[row] = 0  # columns past a row's blocks are padding: block 0, never read
        self._append_blocks(row, new.block_ids)
        params: SamplingParams = new.sampling_params or SamplingParams()
        gen = self.generators.get(new.request_id)
        if gen is None and params.seed is not None:
            gen = self.generators[new.request_id] = torch.Generator(self.device).manual_seed(params.seed)
        p = new.num_prompt_tokens
        self.sampling.set_row(row, params, list(new.token_ids[:p]), list(new.token_ids[p:]), eos_token_ids, gen)
        return row

    def remove(self, req_id: str) -> None:
        row = self.row_of.pop(req_id, None)
        if row is None:
            return
        self.req_ids[row] = None
        self.pending[row] = -1
        self.sampling.clear_row(row)
        self._free.append(row)

    def append_tokens(self, rows: np.ndarray, token_ids: np.ndarray) -> None:
        """One new token for each of `rows`."""
        if len(rows) == 0:
            return
        self._ensure_len(int(self.num_tokens[rows].max()) + 1)
        self.token_ids[rows, self.num_tokens[rows]] = token_ids
        self.num_tokens[rows] += 1

    def defer_tokens(self, rows: np.ndarray, token_ids: torch.Tensor) -> None:
        """One new token for each of `rows`, still on the device: a step gathered before `settle` reads these
        rows' next input from `token_ids` on the device."""
        assert self.pending_ids is None, "settle the tokens deferred before"
        if len(rows):
            self._ensure_len(int(self.num_tokens[rows].max()) + 1)  # a gather reads (then replaces) their slot
        self.pending[rows] = np.arange(len(rows))
        self.pending_ids = token_ids

    def settle(self, rows: np.ndarray, token_ids: np.ndarray) -> None:
        """The tokens deferred for `rows` (the same rows, in order), now on the host; rows whose request left
        the batch meanwhile take none."""
        live = self.pending[rows] >= 0
        self.append_tokens(rows[live], token_ids[live])
        self.pending[rows] = -1
        self.pending_ids = None

    def tokens(self, req_id: str) -> list[int]:
        row = self.row_of[req_id]
        return self.token_ids[row, : self.num_tokens[row]].tolist()

    def params(self, row: int) -> SamplingParams:
        p = self.sampling.params[row]
        assert p is not None
        return p

    # ---- one step ----

    def prepare(self, out: SchedulerOutput, pooling: set[str] = frozenset(),  # type: ignore[assignment]
                graphs: DecodeGraphs | StepGraphs | None = None) -> StepInputs:
        """The flat batch of `out` (its requests must be in the batch: call `update` first); the `pooling`
        requests are pooled instead of sampled; `graphs`: see `gather`."""
        req_ids = list(out.num_scheduled_tokens)
        s = len(req_ids)
        rows = np.fromiter((self.row_of[r] for r in req_ids), np.int64, s)
        n = np.fromiter(out.num_scheduled_tokens.values(), np.int64, s)
        qsl = np.zeros(s + 1, np.int64)
        np.cumsum(n, out=qsl[1:])
        starts = self.num_computed[rows]
        seq_lens = starts + n
        known = self.num_tokens[rows] + (self.pending[rows] >= 0)  # with a token still on the device
        num_drafts = np.zeros(s, np.int64)
        drafts: dict[int, list[int]] = {}
        if out.scheduled_spec_tokens:
            for i, rid in enumerate(req_ids):
                d = out.scheduled_spec_tokens.get(rid)
                if d:  # written after the known tokens (one may still be on the device), where accepted ones land
                    self.write_ahead(int(rows[i]), int(known[i]), d)
                    drafts[i], num_drafts[i] = list(d), len(d)
        if (seq_lens > known + num_drafts).any() or ((num_drafts > 0) & (seq_lens != known + num_drafts)).any():
            raise ValueError("a request is scheduled past its known tokens")
        if (seq_lens > self.num_blocks[rows] * self.block_size).any():
            raise ValueError("a request is scheduled past the blocks it holds")
        pool = np.fromiter((r in pooling for r in req_ids), bool, s) if pooling else np.zeros(s, bool)
        sample = (seq_lens >= known + num_drafts) & ~pool
        num_logits = np.where(sample, num_drafts + 1, 0)
        cum = np.cumsum(num_logits)
        logits_indices = np.repeat(qsl[1:] - cum, num_logits) + np.arange(int(cum[-1]))  # the last L of each
        flat = self.gather(rows, starts, n, qsl, logits_indices, graphs)
        return StepInputs(flat, req_ids, rows, qsl, starts, sample, pool, num_logits, drafts)

    def gather(self, rows: np.ndarray, starts: np.ndarray, n: np.ndarray, qsl: np.ndarray | None = None,
               logits_indices: np.ndarray | None = None, graphs: DecodeGraphs | StepGraphs | None = None) -> FlatBatch:
        """The flat batch of tokens [starts, starts + n) of each of `rows`, read from `token_ids` (past a
        row's known tokens: whatever was written there, draft tokens); logits of each row's last token
        unless `logits_indices` says otherwise. The rows must hold blocks for those positions. A step that
        fits one of `graphs` is staged into its inputs (a replay), the rest moved by `staging`; its tensors
        hold until the next step is gathered."""
        if qsl is None:
            qsl = np.zeros(len(rows) + 1, np.int64)
            np.cumsum(n, out=qsl[1:])
        if logits_indices is None:
            logits_indices = qsl[1:] - 1
        t = int(qsl[-1])
        seq_lens = starts + n
        tok_rows = np.repeat(rows, n)
        positions = np.arange(t) - np.repeat(qsl[:-1] - starts, n)
        input_ids = self.token_ids[tok_rows, positions]
        bs = self.block_size
        slots = self.block_table[tok_rows, positions // bs].astype(np.int64) * bs + positions % bs
        width = int(self.num_blocks[rows].max())
        flat = to_device(input_ids, positions, slots, logits_indices, self.block_table[rows, :width], qsl, seq_lens,
                         self.staging, graphs)
        if self.pending_ids is not None:  # tokens sampled by the step before, read where they are
            src = self.pending[rows]
            at = self.num_tokens[rows]  # the position of the token not known here
            waiting = np.flatnonzero((src >= 0) & (starts <= at) & (at < seq_lens))
            if waiting.size:
                dst = qsl[waiting] + at[waiting] - starts[waiting]
                dst_t, src_t = self.staging.move([dst, src[waiting]], torch.int64)
                flat.input_ids[dst_t] = self.pending_ids[src_t]
        return flat

    def write_ahead(self, row: int, start: int, token_ids: list[int]) -> None:
        """Put tokens at positions start.. of `row` without making them known (draft tokens)."""
        self._ensure_len(start + len(token_ids) + 1)
        self.token_ids[row, start:start + len(token_ids)] = token_ids

    # ---- growth ----

    def _append_blocks(self, row: int, block_ids: list[int]) -> None:
        k, nb = len(block_ids), int(self.num_blocks[row])
        if nb + k > self.block_table.shape[1]:
            self.block_table = _widen(self.block_table, max(2 * self.block_table.shape[1], nb + k))
        self.block_table[row, nb:nb + k] = block_ids
        self.num_blocks[row] = nb + k

    def _ensure_len(self, n: int) -> None:
        if n > self.token_ids.shape[1]:
            self.token_ids = _widen(self.token_ids, max(2 * self.token_ids.shape[1], n))

    def _grow_rows(self, capacity: int) -> None:
        old = self.capacity
        for name in ("token_ids", "num_tokens", "num_prompt", "num_computed", "block_table", "num_blocks", "lora_slot",
                     "pending"):
            a = getattr(self, name)
            fill = -1 if name in ("lora_slot", "pending") else 0
            setattr(self, name, np.concatenate([a, np.full((capacity - old, *a.shape[1:]), fill, a.dtype)]))
        self.req_ids += [None] * (capacity - old)
        self._free = list(range(capacity - 1, old - 1, -1)) + self._free
        self.sampling.grow(capacity)


def _widen(a: np.ndarray, width: int) -> np.ndarray:
    out = np.zeros((a.shape[0], width), a.dtype)
    out[:, : a.shape[1]] = a
    return out
