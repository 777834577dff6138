"""A step's sampled tokens on their way to the host, so that the next step can start before they arrive.

With async scheduling the engine hands step N+1 to the runner before it reads step N's outputs. If the
runner waited for step N's tokens before returning (a device sync), the device would sit idle while the
host builds step N+1's inputs. Instead `sample_tokens` starts non-blocking copies of the sampled ids
(and logprobs) into pinned memory, records an event, and returns an `AsyncModelRunnerOutput` at once:

- the next step reads those requests' input tokens on the device, from the sampled ids themselves
  (`InputBatch.defer_tokens`; the host rows learn them in `settle`, before that step samples);
- the engine thread calls `get()`, which waits for the event only (not for the device's later work)
  and turns the copies into the output's lists, off the step thread.

On the CPU the "copies" are the tensors themselves and the event is absent: the same path, no waiting.
"""

from __future__ import annotations

import numpy as np
import torch

from rivulet.layers.sampler import SamplerOutput
from rivulet.worker.outputs import ModelRunnerOutput, TokenLogprobs


def _to_host(t: torch.Tensor) -> torch.Tensor:
    if t.device.type == "cpu":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t, non_blocking=True)


class AsyncSample:
    """One step's sampled ids (one per request) and logprobs, copied to the host without waiting."""

    def __init__(self, req_ids: list[str], sampled: SamplerOutput, num_logprobs: np.ndarray) -> None:
        self.req_ids = req_ids
        self.num_logprobs = num_logprobs  # per request: top logprobs asked for (-1: none)
        ids = sampled.sampled_token_ids
        self._ids = _to_host(ids)
        lp = sampled.logprobs
        self._lp = None if lp is None else [_to_host(x) for x in (lp.sampled_logprobs, lp.sampled_ranks,
                                                                  lp.topk_token_ids, lp.topk_logprobs)]
        self._event: torch.cuda.Event | None = None
        if ids.device.type == "cuda":
            self._event = torch.cuda.Event()
            self._event.record()

    def token_ids(self) -> np.ndarray:
        """The sampled ids on the host (waits for their copy)."""
        if self._event is not None:
            self._event.synchronize()
        return self._ids.numpy()

    def fill(self, out: ModelRunnerOutput) -> None:
        """Put the tokens (and logprobs) into `out`."""
        ids = self.token_ids().tolist()
        out.sampled_token_ids.update((rid, [t]) for rid, t in zip(self.req_ids, ids))
        if self._lp is None:
            return
        lps, ranks, top_ids, top_lps = self._lp
        for j in np.flatnonzero(self.num_logprobs >= 0).tolist():
            k = int(self.num_logprobs[j])
            out.logprobs[self.req_ids[j]] = [TokenLogprobs(ids[j], float(lps[j]), int(ranks[j]),
                                                           top_ids[j, :k].tolist(), top_lps[j, :k].tolist())]


class AsyncModelRunnerOutput:
    """A step's output whose sampled tokens are still on their way (`get()` waits for them)."""

    def __init__(self, output: ModelRunnerOutput, sample: AsyncSample) -> None:
        self._output, self._sample = output, sample

    def get(self) -> ModelRunnerOutput:
        if self._sample is not None:
            self._sample.fill(self._output)
            self._sample = None
        return self._output


def resolve(output: ModelRunnerOutput | AsyncModelRunnerOutput) -> ModelRunnerOutput:
    """The finished output of a step, whichever the executor returned."""
    return output.get() if isinstance(output, AsyncModelRunnerOutput) else output
