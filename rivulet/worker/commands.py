"""What rank 0 tells every other rank to do, one typed struct per call, broadcast as msgpack bytes
(msgspec) instead of pickled Python objects: `Execute` carries the step's SchedulerOutput, the
others the runner's set-up calls; `Shutdown` ends a rank's loop."""

from __future__ import annotations

from typing import Union

import msgspec

from rivulet.core.outputs import SchedulerOutput
from rivulet.worker.outputs import ModelRunnerOutput


class Execute(msgspec.Struct, tag="execute", array_like=True):
    out: SchedulerOutput


class SetEosTokenIds(msgspec.Struct, tag="set_eos", array_like=True):
    ids: list[int]


class AllocateKVCache(msgspec.Struct, tag="allocate_kv_cache", array_like=True):
    num_blocks: int
    host_slots: int = 0  # the KV tier's host buffer, in blocks
    disk_dir: str | None = None  # the KV tier's folder of block files


class Gather(msgspec.Struct, tag="gather", array_like=True):
    """Every rank's statistics `name` (see `Worker.local_stats`)."""

    name: str


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    pass


WorkerCommand = Union[Execute, SetEosTokenIds, AllocateKVCache, Gather, Shutdown]

_encoder = msgspec.msgpack.Encoder()
_command_decoder = msgspec.msgpack.Decoder(WorkerCommand)
_output_decoder = msgspec.msgpack.Decoder(ModelRunnerOutput)


def encode(obj: object) -> bytes:
    return _encoder.encode(obj)


def decode_command(data: bytes) -> WorkerCommand:
    return _command_decoder.decode(data)


def decode_runner_output(data: bytes) -> ModelRunnerOutput:
    return _output_decoder.decode(data)
