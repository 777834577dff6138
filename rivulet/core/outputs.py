"""Plain-data messages the scheduler hands out: to the model runner and to the engine.

Only ints, strs, lists, dicts and sets (plus the request's ``SamplingParams``, opaque to the
scheduler), so msgspec encodes them, and rebuilds them from their annotations, across processes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from rivulet.lora_request import LoRARequest  # a leaf module
from rivulet.pooling_params import PoolingParams  # a leaf module
from rivulet.sampling_params import SamplingParams  # a leaf module: carried, never read, by the scheduler

# A step's grammar bitmask, asked for once its forward pass has run: int32 [logits rows, ceil(vocab / 32)]
# as bytes (bit j of word w allows token 32w + j), a row per logits row in batch order; None when no row
# is constrained
GrammarBitmask = Callable[[], "bytes | None"]


@dataclass
class NewRequestData:
    """A request entering the runner's batch this step (fresh, or resumed after preemption).

    ``token_ids`` are all tokens known so far (prompt then outputs);
    ``num_computed_tokens`` of them already have KV in ``block_ids`` (prefix-cache hits).
    """

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int
    sampling_params: SamplingParams | None = None
    lora: LoRARequest | None = None  # its LoRA adapter (None: the base model)
    pooling_params: PoolingParams | None = None  # an embedding request: pooled, not sampled


@dataclass
class CachedRequestData:
    """A request already in the runner's batch: blocks appended this step, progress so far."""

    request_id: str
    new_block_ids: list[int]
    num_computed_tokens: int


@dataclass
class SchedulerOutput:
    """One step: one flat batch.

    ``num_scheduled_tokens`` maps request id -> tokens to compute this step; its
    insertion order is the batch order. The runner computes, for each request, the
    tokens ``[num_computed_tokens, num_computed_tokens + n)`` and samples for each request
    whose known tokens are then all computed (``sampling_request_ids``). A request in
    ``scheduled_spec_tokens`` has its last ``k`` scheduled tokens given there (draft tokens,
    not yet known): the runner returns the longest accepted prefix of them plus one token
    (1..k+1 tokens), and the scheduler takes the rejected ones back.
    A request in ``pooling_request_ids`` (an embedding) is scheduled whole and pooled instead.
    ``finished_request_ids`` (finished or aborted since the previous step) and
    ``preempted_request_ids`` must be dropped from the runner's persistent batch first.
    """

    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    new_requests: list[NewRequestData] = field(default_factory=list)
    cached_requests: list[CachedRequestData] = field(default_factory=list)
    finished_request_ids: set[str] = field(default_factory=set)
    preempted_request_ids: set[str] = field(default_factory=set)
    sampling_request_ids: set[str] = field(default_factory=set)
    pooling_request_ids: set[str] = field(default_factory=set)  # embeddings: whole prompts, pooled this step
    # structured output: some sampling request has a grammar, so the step's bitmask follows the forward pass
    # (the engine fills it while the forward runs; `execute`'s grammar_bitmask, broadcast to every rank)
    grammar_follows: bool = False
    scheduled_spec_tokens: dict[str, list[int]] = field(default_factory=dict)
    # the KV tier (rivulet/core/kv_tier.py): blocks to copy out after this step's forward (device block,
    # host slot or -1, file key or "", token ids), block files to delete, and per request the blocks to load
    # into its device blocks (device block, host slot or -1 for the file, key, token ids), reported when done
    kv_saves: list[tuple[int, int, str, list[int]]] = field(default_factory=list)
    kv_deletes: list[str] = field(default_factory=list)
    kv_loads: dict[str, list[tuple[int, int, str, list[int]]]] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass
class EngineCoreOutput:
    """What one step produced for one request: new tokens and, at the end, why it finished."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that matched
    num_cached_tokens: int = 0
    error: str | None = None
    pooled: bytes | None = None  # an embedding request's result: float32 values, native byte order
    scheduled_time: float | None = None  # on a request's first output: when it was first scheduled (time.time())

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
