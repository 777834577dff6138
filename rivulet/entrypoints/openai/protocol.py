"""Request and response models of the OpenAI API (the parts Rivulet serves), plus vLLM's extras.

Requests accept unknown fields and ignore them (``extra="allow"``), as OpenAI clients send fields
a server may not know. The ranges here are SamplingParams' own (so the OpenAPI schema documents
them), plus bounds that keep integers inside what can cross the process boundary (int64) and
bound what one request may ask for (``n``, logprobs). ``SamplingParams`` still checks everything
(NaN, infinities, logit_bias keys, min_tokens <= max_tokens, ...).
"""

from __future__ import annotations

import logging
import time
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictInt, model_validator

from rivulet.config import RivuletError

logger = logging.getLogger(__name__)
from rivulet.sampling_params import (MAX_ABS_LOGIT_BIAS, MAX_ABS_PENALTY, MAX_LOGPROBS, SamplingParams,
                                     StructuredOutputsParams)

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_N = 128  # OpenAI's own limit on choices per request

Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
TokenId = Annotated[StrictInt, Field(ge=INT64_MIN, le=INT64_MAX)]
Stop = Union[str, list[str], None]


def _has_lone_surrogate(value: Any) -> bool:
    """True if a string anywhere in ``value`` cannot be encoded as UTF-8 (JSON allows "\\ud800")."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return True
        return False
    if isinstance(value, dict):
        return any(_has_lone_surrogate(k) or _has_lone_surrogate(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_has_lone_surrogate(v) for v in value)
    return False


def as_prompt_list(x: str | list[Any]) -> list[str | list[int]]:
    """A prompt field (a string, a token-id list, or a list of either) as a list of prompts."""
    if isinstance(x, str):
        return [x]
    if x and all(isinstance(t, int) for t in x):
        return [list(x)]
    return list(x)


class OpenAIRequest(BaseModel):
    """Base of request bodies: unknown fields allowed and ignored (named in a warning, as vLLM does: a
    misspelt field shows in the log), strings must be valid Unicode."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        if _has_lone_surrogate(data):
            raise ValueError("the request contains a string that is not valid Unicode (a lone surrogate)")
        return data

    @model_validator(mode="after")
    def _name_ignored_fields(self) -> OpenAIRequest:
        if self.model_extra:
            logger.warning("%s: ignored the unknown field(s) %s", type(self).__name__,
                           ", ".join(sorted(self.model_extra)[:20]))
        return self


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: bool | None = False


class JSONSchemaFormat(BaseModel):
    """``response_format.json_schema``: OpenAI's named schema."""

    model_config = ConfigDict(extra="allow")

    name: str = Field(max_length=64)
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """``response_format``: free text, any JSON object, or JSON following a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs a json_schema object")
        return self


class SamplingFields(OpenAIRequest):
    """The sampling fields completions and chat share (OpenAI's, then vLLM's extras)."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: Annotated[float, Field(ge=0)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    presence_penalty: Annotated[float, Field(ge=-MAX_ABS_PENALTY, le=MAX_ABS_PENALTY)] | None = 0.0
    frequency_penalty: Annotated[float, Field(ge=-MAX_ABS_PENALTY, le=MAX_ABS_PENALTY)] | None = 0.0
    logit_bias: dict[str, Annotated[float, Field(ge=-MAX_ABS_LOGIT_BIAS, le=MAX_ABS_LOGIT_BIAS)]] | None = None
    seed: Int64 | None = None
    stop: Stop = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM extras
    top_k: Annotated[int, Field(ge=-1, le=2**31)] | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0)] | None = None
    ignore_eos: bool = False
    min_tokens: Annotated[int, Field(ge=0, le=INT64_MAX)] = 0
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: Int64 = 0
    cache_salt: Annotated[str, Field(min_length=1)] | None = None  # only requests with the same salt share cached KV
    return_token_ids: bool = False  # answer with the prompt's and the choices' token ids (a router resumes with them)
    truncate_prompt_tokens: Annotated[int, Field(ge=-1, le=INT64_MAX)] | None = None  # keep the prompt's last N
    # structured output: OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def structured(self) -> StructuredOutputsParams | None:
        """The one grammar these fields ask for (RivuletError naming the field when it is malformed)."""
        guided = {k: v for k, v in [("json", self.guided_json), ("regex", self.guided_regex),
                                    ("choice", self.guided_choice), ("grammar", self.guided_grammar)] if v is not None}
        rf = self.response_format if self.response_format and self.response_format.type != "text" else None
        given = [name for name, v in [("response_format", rf), ("structured_outputs", self.structured_outputs),
                                      ("guided_*", guided)] if v]
        if len(given) > 1:
            raise RivuletError(f"give one of {' and '.join(given)}, not both")
        try:
            if rf is not None:
                field = "response_format"
                if rf.type == "json_object":
                    return StructuredOutputsParams(json_object=True)
                assert rf.json_schema is not None
                return StructuredOutputsParams(json=rf.json_schema.schema_ or {})
            if self.structured_outputs:
                field = "structured_outputs"
                unknown = set(self.structured_outputs) - {"json", "regex", "choice", "grammar", "json_object"}
                if unknown:
                    raise RivuletError(f"unknown key(s) {', '.join(sorted(unknown))} "
                                       "(known: json, regex, choice, grammar, json_object)")
                return StructuredOutputsParams(**self.structured_outputs)
            if guided:
                field = "guided_" + "/".join(guided)
                return StructuredOutputsParams(**guided)
        except RivuletError as e:
            raise RivuletError(f"{field}: {e}") from None
        return None

    def sampling_kwargs(self) -> dict[str, Any]:
        """The ``SamplingParams`` arguments these fields give (defaults where a field is null)."""
        return dict(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logit_bias=dict(self.logit_bias) if self.logit_bias else None,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            skip_special_tokens=self.skip_special_tokens,
            structured_outputs=self.structured(),
            truncate_prompt_tokens=self.truncate_prompt_tokens,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


# ---------------------------------------------------------------- completions

CompletionPrompt = Union[list[TokenId], list[list[TokenId]], str, list[str]]


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``."""

    prompt: CompletionPrompt
    max_tokens: Annotated[int, Field(ge=0, le=INT64_MAX)] | None = 16
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    add_special_tokens: bool = True
    prompt_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None

    def prompts(self) -> list[str | list[int]]:
        """The prompts of a (possibly batched) request: strings or token-id lists."""
        return as_prompt_list(self.prompt)

    def to_sampling_params(self, default_max_tokens: int) -> SamplingParams:
        """``SamplingParams`` for one prompt (RivuletError for invalid values).

        ``max_tokens=0`` with ``echo`` scores the prompt without generating: the engine generates
        one token, which the response leaves out.
        """
        max_tokens = default_max_tokens if self.max_tokens is None else self.max_tokens
        if self.max_tokens == 0 and self.echo:
            max_tokens = 1
        prompt_logprobs = self.prompt_logprobs
        if self.echo and self.logprobs is not None:
            prompt_logprobs = max(prompt_logprobs or 0, self.logprobs)
        return SamplingParams(**self.sampling_kwargs(), max_tokens=max_tokens, logprobs=self.logprobs,
                              prompt_logprobs=prompt_logprobs)


class CompletionLogprobs(BaseModel):
    """The legacy completions logprobs object."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_token_ids: list[int] | None = None  # with return_token_ids
    token_ids: list[int] | None = None  # with return_token_ids


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    system_fingerprint: str | None = None


# ---------------------------------------------------------------------- chat

class ContentPart(BaseModel):
    """One part of a message's content; only ``{"type": "text", "text": ...}`` is served."""

    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    """One message; extra fields (``name``, ``tool_calls``, ...) go to the chat template as given."""

    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[ContentPart] | None = None


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Annotated[int, Field(ge=1, le=INT64_MAX)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1, le=INT64_MAX)] | None = None
    logprobs: bool | None = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    # tool calling (rivulet/entrypoints/openai/tools.py): function tools, "none" | "auto" | "required" | a name
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # vLLM extras
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None  # a Jinja template in place of the server's and the model's
    chat_template_kwargs: dict[str, Any] | None = None

    def to_sampling_params(self, default_max_tokens: int) -> SamplingParams:
        """``SamplingParams`` for the conversation (RivuletError for invalid values)."""
        max_tokens = self.max_completion_tokens or self.max_tokens or default_max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return SamplingParams(**self.sampling_kwargs(), max_tokens=max_tokens, logprobs=logprobs)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    refusal: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    reasoning_content: str | None = None  # --reasoning-parser: the thinking (vLLM's name)
    reasoning: str | None = None  # the same (vLLM's newer name)


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # with return_token_ids


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None
    prompt_token_ids: list[int] | None = None  # with return_token_ids


# -------------------------------------------------------------- tokenization

class TokenizeRequest(OpenAIRequest):
    """``POST /tokenize``: either ``prompt`` or ``messages`` (rendered with the chat template)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(OpenAIRequest):
    """``POST /detokenize``."""

    model: str | None = None
    tokens: list[TokenId]


class DetokenizeResponse(BaseModel):
    prompt: str


# -------------------------------------------------------------------- models

class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "rivulet"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    state: Literal["loading", "ready", "unloading"] = "ready"  # Rivulet's: where the model is in its life
    task: Literal["generate", "embed", "pipeline"] | None = None  # what it serves (None for a LoRA adapter)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class LoadModelRequest(BaseModel):
    """``POST /v1/models/load``: a model entry of a deployment file."""

    model_config = ConfigDict(extra="forbid")  # a misspelt key must not load a different model than meant

    name: str
    model: str = "default"
    aliases: list[str] | None = None
    task: Literal["generate", "embed"] = "generate"
    args: dict[str, Any] | None = None


class LoadLoRAAdapterRequest(OpenAIRequest):
    """``POST /v1/load_lora_adapter`` (vLLM's): serve the PEFT adapter at ``lora_path`` as model ``lora_name``."""

    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(OpenAIRequest):
    """``POST /v1/unload_lora_adapter`` (vLLM's)."""

    lora_name: str


# ---------------------------------------------------------------------- embeddings

EmbeddingInput = Union[str, list[str], list[TokenId], list[list[TokenId]]]


class EmbeddingRequest(OpenAIRequest):
    """``POST /v1/embeddings`` (OpenAI's shape, plus vLLM's ``truncate_prompt_tokens`` and
    ``add_special_tokens``)."""

    model: str | None = None
    input: EmbeddingInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1, le=1 << 20)] | None = None
    user: str | None = None
    truncate_prompt_tokens: Annotated[int, Field(ge=-1, le=INT64_MAX)] | None = None
    add_special_tokens: bool = True
    normalize: bool | None = None  # vLLM's extra: None is the model's choice
    priority: Int64 = 0

    def inputs(self) -> list[str | list[int]]:
        """One entry per embedding: a string or a list of token ids."""
        return as_prompt_list(self.input)


class EmbeddingData(BaseModel):
    index: int
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str  # base64: the float32 values, little-endian


class EmbeddingUsage(BaseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0


class EmbeddingResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage
