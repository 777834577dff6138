"""The messages between the front end (AsyncLLM) and the EngineCore process, as msgpack.

Each message is ``[kind, payload]`` with payload built from plain lists, dicts, ints, floats and
strings. Front -> core: ``add`` (a core Request), ``abort`` / ``stop`` (request ids), ``stats``,
``shutdown``. Core -> front: ``ready`` (ModelInfo) or ``failed`` (message) once at start-up,
``outputs`` (one step's StepOutputs), ``stats``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack

from rivulet.core import Request
from rivulet.core.outputs import EngineCoreOutput
from rivulet.engine.core import ModelInfo, StepOutput
from rivulet.sampling_params import SamplingParams
from rivulet.worker.outputs import TokenLogprobs


def pack(kind: str, payload: Any = None) -> bytes:
    return msgpack.packb([kind, payload], use_bin_type=True)


def unpack(data: bytes) -> tuple[str, Any]:
    kind, payload = msgpack.unpackb(data, raw=False, strict_map_key=False)
    return kind, payload


def encode_request(r: Request) -> dict[str, Any]:
    return {"id": r.request_id, "prompt": r.prompt_token_ids, "max_tokens": r.max_tokens,
            "eos": sorted(r.eos_token_ids), "stop_ids": sorted(r.stop_token_ids), "min_tokens": r.min_tokens,
            "priority": r.priority, "use_prefix_cache": r.use_prefix_cache,
            "params": dataclasses.asdict(r.sampling_params) if r.sampling_params is not None else None}


def decode_request(d: dict[str, Any]) -> Request:
    params = d["params"]
    if params is not None:
        if params.get("logit_bias"):
            params["logit_bias"] = {int(k): v for k, v in params["logit_bias"].items()}
        params = SamplingParams(**params)
    return Request(d["id"], d["prompt"], d["max_tokens"], d["eos"], d["stop_ids"], d["min_tokens"], d["priority"],
                   sampling_params=params, use_prefix_cache=d["use_prefix_cache"])


def _lp(t: TokenLogprobs | None) -> list | None:
    return None if t is None else [t.token_id, t.logprob, t.rank, t.top_token_ids, t.top_logprobs]


def _unlp(x: list | None) -> TokenLogprobs | None:
    return None if x is None else TokenLogprobs(*x)


def encode_outputs(outs: list[StepOutput]) -> list[list]:
    rows = []
    for so in outs:
        c = so.core
        prompt = None if so.prompt_logprobs is None else [so.prompt_logprobs[0], [_lp(e) for e in so.prompt_logprobs[1]]]
        rows.append([c.request_id, c.new_token_ids, c.finish_reason, c.stop_reason, c.num_cached_tokens, c.error,
                     [_lp(t) for t in so.logprobs], prompt])
    return rows


def decode_outputs(rows: list[list]) -> list[StepOutput]:
    outs = []
    for rid, tokens, finish, stop, cached, error, logprobs, prompt in rows:
        core = EngineCoreOutput(rid, tokens, finish, stop, cached, error)
        pl = None if prompt is None else (prompt[0], [_unlp(e) for e in prompt[1]])
        outs.append(StepOutput(core, [_unlp(t) for t in logprobs], pl))  # type: ignore[misc]
    return outs


def encode_info(info: ModelInfo) -> dict[str, Any]:
    return {"vocab_size": info.vocab_size, "max_model_len": info.max_model_len, "eos": sorted(info.eos_token_ids)}


def decode_info(d: dict[str, Any]) -> ModelInfo:
    return ModelInfo(d["vocab_size"], d["max_model_len"], set(d["eos"]))
