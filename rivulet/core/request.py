"""A request as the scheduler sees it: token ids, limits, progress and status."""

from __future__ import annotations

import enum
import itertools
import time
from collections.abc import Iterable
from typing import Any

from rivulet.lora_request import LoRARequest


class RequestStatus(enum.IntEnum):
    """Where a request is in its life; every value after WAITING_FOR_KV is final."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    WAITING_FOR_KV = 3  # its cached blocks are being loaded from the KV tier into its device blocks
    FINISHED_STOPPED = 4
    FINISHED_LENGTH = 5
    FINISHED_ABORTED = 6
    FINISHED_ERROR = 7

    @property
    def is_finished(self) -> bool:
        """True for the four FINISHED_* states."""
        return self > RequestStatus.WAITING_FOR_KV

    @property
    def finish_reason(self) -> str | None:
        """The OpenAI ``finish_reason`` for a finished status, None otherwise."""
        return FINISH_REASONS.get(self)


# Finished status -> OpenAI ``finish_reason``.
FINISH_REASONS: dict[RequestStatus, str] = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


_arrival_counter = itertools.count()


class Request:
    """One sequence to generate: a prompt, its outputs so far, and its limits.

    ``eos_token_ids`` is empty when the user asked to ignore EOS.
    ``priority``: lower values are served first; ties go to the earlier ``arrival_time``.
    ``sampling_params`` is opaque here; it is only carried to the model runner.
    ``num_computed_tokens`` counts tokens whose KV is in the cache or being written by a
    step already scheduled (the scheduler advances it when it schedules); it drops to 0 when
    the request is preempted. ``num_output_placeholders`` counts tokens that scheduled steps
    will sample but that have not arrived yet (at most one per step in flight), so the
    scheduler can schedule step N+1 before step N's tokens are known. ``spec_token_ids``
    are draft tokens to verify in the next step (set by a proposer, consumed by schedule()).
    ``block_hashes`` is filled by the KV cache manager: the chained key of each
    full block of ``all_token_ids`` (tokens never change, so neither do keys); ``cache_salt``
    enters the first key, so only requests with the same salt share cached blocks; so does the
    ``lora`` adapter's identity (None: the base model). A request with ``pooling_params`` is an
    embedding: it samples nothing; one step computes its whole prompt and it finishes with the pooled
    hidden states.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        max_tokens: int,
        eos_token_ids: Iterable[int] = (),
        stop_token_ids: Iterable[int] = (),
        min_tokens: int = 0,
        priority: int = 0,
        arrival_time: float | None = None,
        sampling_params: Any = None,
        use_prefix_cache: bool = True,
        cache_salt: str | None = None,
        lora: LoRARequest | None = None,
        pooling_params: Any = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.max_tokens = max_tokens
        self.eos_token_ids = frozenset(eos_token_ids)
        self.stop_token_ids = frozenset(stop_token_ids)
        self.min_tokens = min_tokens
        self.priority = priority
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.sampling_params = sampling_params
        # off when every prompt position must be computed (e.g. prompt logprobs are wanted)
        self.use_prefix_cache = use_prefix_cache
        self.cache_salt = cache_salt
        self.lora = lora
        # an embedding request: its whole prompt in one step, pooled, then finished (opaque here too)
        self.pooling_params = pooling_params

        self.output_token_ids: list[int] = []
        self._all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_output_placeholders = 0
        self.spec_token_ids: list[int] = []
        self.grammar: Any = None  # structured output: the request's grammar matcher (opaque here but `ended`)
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.num_cached_tokens = -1  # prefix-cache hit tokens; -1 until first scheduled
        self.first_scheduled_time: float | None = None  # wall clock (time.time()) of its first admission
        self.error: str | None = None
        self.num_preemptions = 0
        self.skip_kv_tier = False  # a load from the KV tier failed: compute the rest
        self.block_hashes: list[bytes] = []
        self._seq = next(_arrival_counter)  # breaks ties between equal arrival times

    @property
    def adapter_key(self) -> str | None:
        """The LoRA adapter's identity in block keys (None: the base model)."""
        lora = self.lora
        return None if lora is None else f"{lora.lora_int_id}|{lora.lora_path}|{lora.fingerprint}"

    @property
    def is_pooling(self) -> bool:
        return self.pooling_params is not None

    @property
    def sort_key(self) -> tuple[int, float, int]:
        """Service order: priority (lower first), then arrival, then creation order."""
        return (self.priority, self.arrival_time, self._seq)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt followed by outputs. Read-only view: do not mutate the list."""
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token_id(self, token_id: int) -> None:
        """Record one sampled token (O(1))."""
        self.output_token_ids.append(token_id)
        self._all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"prompt={self.num_prompt_tokens}, out={self.num_output_tokens}, "
            f"computed={self.num_computed_tokens}, priority={self.priority})"
        )
