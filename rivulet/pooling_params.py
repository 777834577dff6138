"""What an embedding request asks of the pooled output (vLLM's `PoolingParams`): its size and whether it
is normalized. The model's pooling (last token, mean, CLS) is the engine's, not the request's."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PoolingParams:
    # keep the first `dimensions` values (Matryoshka models only), then normalize; None: the model's size
    dimensions: int | None = None
    # None: the model's own choice (a sentence-transformers Normalize module, else True)
    normalize: bool | None = None
    # cut a longer input to this many tokens (-1: the model's max_model_len) as the tokenizer truncates
    # (from the end for most); None: a longer input is an error
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        t = self.truncate_prompt_tokens
        if t is not None and (not isinstance(t, int) or (t < 1 and t != -1)):
            raise ValueError(f"truncate_prompt_tokens must be -1 or an integer >= 1, got {t!r}")
        if self.dimensions is not None and (not isinstance(self.dimensions, int) or self.dimensions < 1):
            raise ValueError(f"dimensions must be an integer >= 1, got {self.dimensions!r}")
