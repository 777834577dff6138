"""Counters of speculative decoding, with vLLM's meanings (`vllm:spec_decode_*`)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    """Since the engine started: verify steps of a request that carried drafts (`num_drafts`),
    the draft tokens scheduled, how many were accepted, and accepted counts by draft position."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        """One request's verify step: `num_draft_tokens` scheduled, the first `num_accepted` kept."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_draft_tokens:
            self.accepted_per_pos += [0] * (num_draft_tokens - len(self.accepted_per_pos))
        for j in range(num_accepted):
            self.accepted_per_pos[j] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verify step (accepted drafts + the one sampled after them), vLLM's figure."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
