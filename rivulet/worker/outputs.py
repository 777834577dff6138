"""What a model runner step returns to the engine: plain data, cheap to send between processes."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprobs:
    """Log-probability of one chosen token (sampled or prompt), its rank, and the top-N alternatives."""

    token_id: int
    logprob: float
    rank: int
    top_token_ids: list[int]
    top_logprobs: list[float]


@dataclass
class ModelRunnerOutput:
    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)  # parallel to sampled_token_ids
    # (first prompt position covered this step, one entry per position); the entry of position 0
    # is None (nothing predicts the first token)
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs | None]]] = field(default_factory=dict)
    # a draft model's guesses of each request's next tokens, for the next step to verify
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # the KV tier: loads finished since the last step (request id -> blocks loaded, in order, before the
    # first that failed), block keys whose file is gone or bad or could not be written, a disk failure
    kv_loaded: dict[str, int] = field(default_factory=dict)
    kv_dropped: list[str] = field(default_factory=list)
    kv_disk_error: str | None = None
    # embedding requests of the step: float32 values (native byte order)
    pooled: dict[str, bytes] = field(default_factory=dict)
