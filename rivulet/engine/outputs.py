"""Results as users of vLLM know them: RequestOutput with one CompletionOutput per sample; and what
the engine core hands the front end (ModelInfo once, StepOutputs every step). Plain data without
torch, so that the API server process never imports it."""

from __future__ import annotations

from dataclasses import dataclass, field

from rivulet.core.outputs import EngineCoreOutput
from rivulet.worker.outputs import TokenLogprobs


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# one position: the chosen token and the top-N alternatives, by token id
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0
    first_scheduled_time: float | None = None  # when the engine first scheduled it (time.time()), for traces

    @property
    def finished(self) -> bool:
        return all(o.finished for o in self.outputs)


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class PoolingRequestOutput:
    """An embedding request's result, as vLLM's `LLM.embed` returns it (`out.outputs.embedding`)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput | None = None  # None until finished
    finished: bool = False
    error: str | None = None  # set when the engine failed the request
    first_scheduled_time: float | None = None  # when the engine scheduled it (time.time()), for traces


@dataclass
class ModelInfo:
    """What the front end must know about the loaded model."""

    vocab_size: int
    max_model_len: int
    eos_token_ids: set[int]
    task: str = "generate"  # or "embed": requests are PoolingParams, results PoolingRequestOutputs
    hidden_size: int = 0  # an embedding's full size
    matryoshka: bool = False  # embeddings may be cut to fewer `dimensions`


@dataclass
class StepOutput:
    """One request's share of a step: the scheduler's verdict plus the runner's logprobs."""

    core: EngineCoreOutput
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: tuple[int, list[TokenLogprobs | None]] | None = None  # (first position, entries)
