"""The messages between the front end (AsyncLLM) and the EngineCore process: typed structs, sent as
msgpack by msgspec (one C call to encode or decode a message, checked against its type on arrival).

Front -> core (`ToCore`): `AddRequest`, `Abort`, `Stop` (request ids), `GetStats`, `Shutdown`.
Core -> front (`FromCore`): `Ready` (ModelInfo) or `Failed` once at start-up, then `Outputs` (one
step's StepOutputs) and `Stats`. The payload types (StepOutput, SamplingParams, ...) are the
engine's own dataclasses: msgspec encodes their fields and rebuilds them (SamplingParams'
validation runs again on arrival).
"""

from __future__ import annotations

from typing import Any, Union

import msgspec

from rivulet.core import Request
from rivulet.engine.outputs import ModelInfo, StepOutput
from rivulet.lora_request import LoRARequest
from rivulet.pooling_params import PoolingParams
from rivulet.sampling_params import SamplingParams


class AddRequest(msgspec.Struct, tag="add", array_like=True):
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    eos_token_ids: list[int]
    stop_token_ids: list[int]
    min_tokens: int
    priority: int
    use_prefix_cache: bool
    sampling_params: SamplingParams | None
    cache_salt: str | None = None
    lora: LoRARequest | None = None
    pooling_params: PoolingParams | None = None

    @classmethod
    def of(cls, r: Request) -> AddRequest:
        return cls(r.request_id, r.prompt_token_ids, r.max_tokens, sorted(r.eos_token_ids), sorted(r.stop_token_ids),
                   r.min_tokens, r.priority, r.use_prefix_cache, r.sampling_params, r.cache_salt, r.lora,
                   r.pooling_params)

    def to_request(self) -> Request:
        return Request(self.request_id, self.prompt_token_ids, self.max_tokens, self.eos_token_ids,
                       self.stop_token_ids, self.min_tokens, self.priority, sampling_params=self.sampling_params,
                       use_prefix_cache=self.use_prefix_cache, cache_salt=self.cache_salt, lora=self.lora,
                       pooling_params=self.pooling_params)


class Abort(msgspec.Struct, tag="abort", array_like=True):
    request_ids: list[str]


class Stop(msgspec.Struct, tag="stop", array_like=True):
    """Requests the front end finished (a stop string matched): free them without an output."""

    request_ids: list[str]


class GetStats(msgspec.Struct, tag="get_stats", array_like=True):
    pass


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    pass


class Ready(msgspec.Struct, tag="ready", array_like=True):
    info: ModelInfo


class Failed(msgspec.Struct, tag="failed", array_like=True):
    message: str


class Outputs(msgspec.Struct, tag="outputs", array_like=True):
    outputs: list[StepOutput]


class Stats(msgspec.Struct, tag="stats", array_like=True):
    stats: dict[str, Any]


ToCore = Union[AddRequest, Abort, Stop, GetStats, Shutdown]
FromCore = Union[Ready, Failed, Outputs, Stats]

_encoder = msgspec.msgpack.Encoder()
to_core_decoder = msgspec.msgpack.Decoder(ToCore)
from_core_decoder = msgspec.msgpack.Decoder(FromCore)


def encode(message: msgspec.Struct) -> bytes:
    return _encoder.encode(message)
