"""A pipeline stage's part of a step (pipeline parallelism): the step's sequences in micro-batches, each
received from the stage before (but on the first stage), run through this stage's layers, and sent on
(but from the last stage), asynchronously, so a stage starts its next micro-batch while the following
stage works on the one it sent.

The model knows nothing of this: its forward runs its stage's layers on one (micro-)batch, taking the
previous stage's [2, rows, hidden] (hidden states and residual, stacked here) as `received` and returning
the two for the next stage (the final hidden states on the last). So the forward compiles as it does on one
rank.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch

from rivulet.distributed import ParallelState, padded_tokens, pipeline_recv, pipeline_send
from rivulet.kernels.attention import AttentionMetadata, BatchLayout, build_attention_metadata

StageForward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata, "torch.Tensor | None"], Any]


class PipelineStage:
    """Runs a stage's forward over a step's micro-batches; `busy_s` adds up its compute time (waiting for
    the previous stage's hidden states excluded)."""

    def __init__(self, ps: ParallelState, hidden_size: int, dtype: torch.dtype) -> None:
        self.ps, self.hidden_size, self.dtype = ps, hidden_size, dtype
        self.busy_s = 0.0

    def run(self, forward: StageForward, input_ids: torch.Tensor, positions: torch.Tensor,
            meta: AttentionMetadata) -> torch.Tensor | None:
        """Hidden states [T, hidden] on the last stage; None on the others (sent on instead)."""
        ps = self.ps
        outs, pending = [], []
        for q0, q1, sub in micro_batches(meta, ps.pp_micro_batches):
            received = None
            if not ps.is_first_stage:
                t = q1 - q0
                rows = padded_tokens(t, ps) // ps.tp_size if ps.sp else t
                received = pipeline_recv((2, rows, self.hidden_size), self.dtype, input_ids.device, ps)
            start = time.perf_counter()
            out = forward(input_ids[q0:q1], positions[q0:q1], sub, received)
            self.busy_s += time.perf_counter() - start
            if ps.is_last_stage:
                outs.append(out)
            else:
                buf = torch.stack(out)  # (hidden, residual)
                pending.append((pipeline_send(buf, ps, async_op=True), buf))
        for work, _ in pending:
            work.wait()
        return torch.cat(outs) if len(outs) > 1 else (outs[0] if outs else None)


def micro_batches(meta: AttentionMetadata, m: int) -> list[tuple[int, int, AttentionMetadata]]:
    """Split a step's sequences into at most `m` contiguous groups of about equal token counts:
    (first token, end token, the group's attention metadata) each."""
    layout = meta.layout()  # pipeline stages only: a host read of the batch's shape
    qsl, n = layout.query_start_loc, layout.num_seqs
    m = max(1, min(m, n))
    if m == 1:
        return [(0, qsl[-1], meta)]
    bounds, total = [0], qsl[-1]
    for g in range(1, m):
        target = total * g / m
        s = min(range(bounds[-1] + 1, n - (m - g) + 1), key=lambda i: abs(qsl[i] - target))
        bounds.append(s)
    bounds.append(n)
    out = []
    for s0, s1 in zip(bounds, bounds[1:]):
        q0, q1 = qsl[s0], qsl[s1]
        sub = build_attention_metadata(
            BatchLayout([q - q0 for q in qsl[s0:s1 + 1]], layout.seq_lens[s0:s1]), meta.slot_mapping[q0:q1],
            meta.block_tables[s0:s1], meta.query_start_loc[s0:s1 + 1] - q0, meta.seq_lens[s0:s1])
        out.append((q0, q1, sub))
    return out
