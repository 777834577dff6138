"""The draft-model proposer: a smaller model with the target's tokenizer that guesses, right after each
step's sampling, the next k tokens of every request that sampled (`--speculative-config
'{"model": PATH, "num_speculative_tokens": k}'`). The next step verifies them (k-token steps).

Its KV cache uses the target's blocks: the same block ids and block tables, its own tensors, sized
into the same memory budget. So the scheduler's allocation, preemption, prefix caching and freeing
cover the draft's KV with no bookkeeping of its own; the scheduler allocates k lookahead slots after a
sampling step, where the draft writes its guesses.

Per request the draft remembers up to where its KV is right (`valid`) and which guesses it wrote
from there. At the next proposal the request's real tokens show how many of those guesses were
right; the draft computes the rest of its tokens (1 or 2 after a verify step, the whole prompt
after the first prefill) in one forward pass, whose last logits give draft 1, then one token per
forward pass for drafts 2..k. Drafts are the draft model's greedy tokens: a deterministic guess,
which the runner's verification keeps with exactly the target's probability (see
`ModelRunner._sample`). Prefill chunks that do not sample yet are caught up in the same first pass,
so by the end of every step the draft's KV covers what the target computed, and prefix-cache hits
(a preempted request's own blocks included) hold the draft's KV too; only steps skipped under
`disable_by_batch_size` leave gaps, which cost acceptance, never correctness.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import torch

from rivulet.config import ModelConfig, RivuletError, SpeculativeConfig
from rivulet.core.outputs import SchedulerOutput
from rivulet.distributed import get_parallel_state
from rivulet.kernels.ops import get_op
from rivulet.layers.attention import Attention
from rivulet.models.arch_config import ArchConfig
from rivulet.models.loader import load_model, resolve_model
from rivulet.platforms import current_platform
from rivulet.worker.cuda_graph import DEFAULT_BUCKETS, DecodeGraphs, hidden_states
from rivulet.worker.input_batch import InputBatch

logger = logging.getLogger(__name__)


class DraftRunner:
    def __init__(self, spec: SpeculativeConfig, model_config: ModelConfig, dtype: torch.dtype,
                 device: torch.device, target: ArchConfig, max_model_len: int) -> None:
        assert spec.model is not None
        if get_parallel_state().pp_size > 1:
            raise RivuletError("speculative decoding with a draft model runs without pipeline parallelism")
        cfg = dataclasses.replace(model_config, model=spec.model, tokenizer=None, quantization=spec.quantization,
                                  compilation_level=0)  # (the draft runs eager)
        try:
            source = resolve_model(spec.model)
        except RivuletError as e:
            raise RivuletError(f"speculative_config draft {e}") from None
        self.device = device
        self._argmax = get_op("argmax_rows")  # greedy guesses
        self.model, self.arch = load_model(cfg, source, dtype, device)
        current_platform().place_module(self.model)
        if self.arch.vocab_size > target.vocab_size:
            raise RivuletError(f"the draft model's vocabulary ({self.arch.vocab_size}) is larger than the target's "
                               f"({target.vocab_size}): it needs the target's tokenizer")
        if self.arch.max_position_embeddings < max_model_len:
            raise RivuletError(f"the draft model's context ({self.arch.max_position_embeddings}) is shorter than "
                               f"max_model_len {max_model_len}")
        self.attn_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        self.k = spec.num_speculative_tokens
        self.disable_by_batch_size = spec.disable_by_batch_size
        self.max_model_len = max_model_len
        # request id -> (draft KV right below this position, guesses written from there)
        self._state: dict[str, tuple[int, list[int]]] = {}
        self.graphs: DecodeGraphs | None = None  # its decode passes as CUDA graphs (captured by the runner)
        logger.info("draft model %s: %d layers, %d proposals per step", spec.model, len(self.attn_layers), self.k)

    def capture_graphs(self, max_blocks_per_seq: int) -> None:
        """CUDA graphs of the draft's one-token passes (drafts 2..k, and catch-ups of one token), over its KV
        cache just allocated. On failure the runner stays eager."""
        graphs = DecodeGraphs(DEFAULT_BUCKETS, max_blocks_per_seq, self.device)
        graphs.capture(self.model)
        self.graphs = graphs

    def __len__(self) -> int:
        """Requests the draft keeps state for (for tests of memory release)."""
        return len(self._state)

    def update(self, out: SchedulerOutput) -> None:
        """Follow the batch: drop finished and preempted requests, start new ones at their prefix hit."""
        for rid in out.finished_request_ids | out.preempted_request_ids:
            self._state.pop(rid, None)
        for new in out.new_requests:
            self._state[new.request_id] = (new.num_computed_tokens, [])

    @torch.inference_mode()
    def propose(self, batch: InputBatch, req_ids: list[str], eos_token_ids: set[int],
                chunks: dict[str, int] | None = None) -> dict[str, list[int]]:
        """Up to k greedy draft tokens after the known tokens of each of `req_ids` (requests that just
        sampled), as many as max_tokens, max_model_len and the row's blocks leave room for. `chunks`
        (request -> tokens computed after this step, for prefill chunks that did not sample): the draft
        computes its KV that far too, so its KV in every block the prefix cache keeps is right."""
        if self.disable_by_batch_size is not None and len(batch) > self.disable_by_batch_size:
            return {}
        ids, rows, starts, depth, ends_list = [], [], [], [], []
        for rid, end in (chunks or {}).items():
            valid = self._state[rid][0]
            if end > valid:
                ids.append(rid)
                rows.append(batch.row_of[rid])
                starts.append(valid)
                depth.append(0)  # catch up only
                ends_list.append(end)
                self._state[rid] = (end, [])
        for rid in req_ids:
            row = batch.row_of[rid]
            n = int(batch.num_tokens[row])
            valid, written = self._state[rid]
            m = min(len(written), n - valid)
            right = np.asarray(written[:m]) == batch.token_ids[row, valid:valid + m]
            f = min(valid + (int(np.argmin(right)) if not right.all() else m), n - 1)
            self._state[rid] = (f, [])
            params = batch.params(row)
            room = self.max_model_len - n
            if params.max_tokens is not None:
                room = min(room, params.max_tokens - (n - int(batch.num_prompt[row])))
            d = min(self.k, room - 1, int(batch.num_blocks[row]) * batch.block_size - n + 1)
            if d < 1 or (not params.ignore_eos and int(batch.token_ids[row, n - 1]) in eos_token_ids):
                continue
            ids.append(rid)
            rows.append(row)
            starts.append(f)
            depth.append(d)
            ends_list.append(n)
        if not ids:
            return {}
        rows_np, depth_np = np.array(rows, np.int64), np.array(depth, np.int64)
        ends = np.array(ends_list, np.int64)
        drafts = np.zeros((len(ids), max(1, int(depth_np.max()))), np.int64)  # pass 0 also catches chunks up
        starts_np = np.array(starts, np.int64)
        active = np.arange(len(ids))
        for j in range(drafts.shape[1]):  # j = 0: catch up to the last known token; then one guess per pass
            s = starts_np[active] if j == 0 else ends[active] + j - 1
            n = ends[active] - s if j == 0 else np.ones(len(active), np.int64)
            flat = batch.gather(rows_np[active], s, n, graphs=self.graphs)
            hidden = hidden_states(self.model, flat)  # a replay when one token per sequence
            logits = self.model.compute_logits(hidden[flat.logits_indices], float32=False)
            drafts[active, j] = self._argmax(logits).cpu().numpy()
            for i in active.tolist():
                if depth[i]:  # (a prefill chunk's next position holds a known prompt token)
                    batch.write_ahead(rows[i], int(ends[i]) + j, [int(drafts[i, j])])
            active = active[depth_np[active] > j + 1]
            if not active.size:
                break
        out = {}
        for i, rid in enumerate(ids):
            if not depth[i]:
                continue
            guess = drafts[i, :depth[i]].tolist()
            out[rid] = guess
            self._state[rid] = (int(ends[i]), guess[:-1])  # the last guess was never an input
        return out
