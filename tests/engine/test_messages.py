"""The typed messages between processes: every kind survives encode -> decode with its types, and a
message of the wrong shape is refused on arrival instead of reaching the engine."""

from __future__ import annotations

import msgspec
import pytest

from rivulet.core import Request
from rivulet.core.outputs import CachedRequestData, EngineCoreOutput, NewRequestData, SchedulerOutput
from rivulet.engine import messages as m
from rivulet.engine.outputs import ModelInfo, StepOutput
from rivulet.sampling_params import SamplingParams
from rivulet.worker import commands as c
from rivulet.worker.outputs import ModelRunnerOutput, TokenLogprobs


def _params() -> SamplingParams:
    return SamplingParams(temperature=0.7, top_k=5, logit_bias={17: -2.5, 3: 1.0}, stop=["\n\n", "END"], seed=4,
                          max_tokens=9, logprobs=2)


def test_add_request_round_trip_keeps_types() -> None:
    r = Request("r1", [5, 6, 7], 9, eos_token_ids=[2, 1], stop_token_ids=[42], min_tokens=2, priority=-1,
                sampling_params=_params(), use_prefix_cache=False, cache_salt="tenant-7")
    got = m.to_core_decoder.decode(m.encode(m.AddRequest.of(r))).to_request()
    assert isinstance(got.sampling_params, SamplingParams) and got.sampling_params == r.sampling_params
    assert got.sampling_params.logit_bias == {17: -2.5, 3: 1.0}  # int keys come back as ints
    assert (got.request_id, got.prompt_token_ids, got.max_tokens, got.min_tokens, got.priority) == ("r1", [5, 6, 7], 9, 2, -1)
    assert got.eos_token_ids == {1, 2} and got.stop_token_ids == {42} and got.use_prefix_cache is False
    assert got.cache_salt == "tenant-7"


@pytest.mark.parametrize("msg", [m.Abort(["a", "b"]), m.Stop(["c"]), m.GetStats(), m.Shutdown()])
def test_control_messages_round_trip(msg: msgspec.Struct) -> None:
    assert m.to_core_decoder.decode(m.encode(msg)) == msg


def test_outputs_round_trip_with_logprobs() -> None:
    lp = TokenLogprobs(4, -0.25, 1, [4, 9], [-0.25, -1.5])
    outs = [StepOutput(EngineCoreOutput("a", [4], "stop", "END", 3), [lp], (0, [None, lp])),
            StepOutput(EngineCoreOutput("b", [], "error", error="boom"))]
    got = m.from_core_decoder.decode(m.encode(m.Outputs(outs)))
    assert got.outputs == outs and isinstance(got.outputs[0].logprobs[0], TokenLogprobs)
    info = m.from_core_decoder.decode(m.encode(m.Ready(ModelInfo(100, 2048, {2, 0})))).info
    assert info == ModelInfo(100, 2048, {0, 2}) and isinstance(info.eos_token_ids, set)
    assert m.from_core_decoder.decode(m.encode(m.Failed("no such model"))) == m.Failed("no such model")


def test_malformed_messages_are_refused() -> None:
    with pytest.raises(msgspec.ValidationError):
        m.to_core_decoder.decode(msgspec.msgpack.encode(["add", "r1", "not a token list"]))
    with pytest.raises(msgspec.ValidationError):
        m.to_core_decoder.decode(msgspec.msgpack.encode(["launch_missiles"]))
    with pytest.raises(msgspec.ValidationError):  # a front-end-bound message is not a core command
        m.to_core_decoder.decode(m.encode(m.Failed("x")))
    bad = msgspec.msgpack.encode(["add", "r", [1], 4, [], [], 0, 0, True, {"temperature": -1.0}])
    with pytest.raises(msgspec.ValidationError, match="temperature"):  # SamplingParams validates on arrival
        m.to_core_decoder.decode(bad)


def test_worker_commands_round_trip() -> None:
    out = SchedulerOutput(
        num_scheduled_tokens={"a": 3, "b": 1}, total_num_scheduled_tokens=4,
        new_requests=[NewRequestData("a", [1, 2, 3], 3, [7, 8], 0, _params())],
        cached_requests=[CachedRequestData("b", [9], 12)], finished_request_ids={"z"}, preempted_request_ids={"y"},
        sampling_request_ids={"a", "b"}, scheduled_spec_tokens={"b": [5]},
        kv_saves=[(7, 2, "ab" * 32, [1, 2])], kv_deletes=["cd" * 32], kv_loads={"c": [(9, -1, "ef" * 32, [3, 4])]})
    for cmd in (c.Execute(out), c.SetEosTokenIds([2, 5]), c.AllocateKVCache(64), c.AllocateKVCache(8, 4, "/kv"),
                c.Gather("comm"), c.Shutdown()):
        assert c.decode_command(c.encode(cmd)) == cmd
    got = c.decode_command(c.encode(c.Execute(out))).out
    assert isinstance(got.new_requests[0].sampling_params, SamplingParams) and got.finished_request_ids == {"z"}
    result = ModelRunnerOutput({"a": [4]}, {"a": [TokenLogprobs(4, -0.1, 1, [4], [-0.1])]}, {"a": (0, [None])},
                               kv_loaded={"c": 1}, kv_dropped=["ef" * 32], kv_disk_error="disk full")
    assert c.decode_runner_output(c.encode(result)) == result
