"""Speculative decoding: host-side proposers of draft tokens, verified by the engine's k-token steps.

A proposer is called by `EngineCore` before each schedule for the requests that decode; the drafts
it returns go into `Request.spec_token_ids`, the scheduler gives the request 1 + k tokens, and the
model runner keeps the drafts up to the first one that differs from its own sample at that
position (exact: see docs/architecture.md, "k-token steps"). A draft model runs on the device
instead, in the worker (`rivulet.worker.draft_runner`), and its drafts come back with the step."""

from rivulet.spec_decode.ngram import NgramProposer
from rivulet.spec_decode.stats import SpecDecodeStats

__all__ = ["NgramProposer", "SpecDecodeStats"]
