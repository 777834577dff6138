"""AsyncLLM with the EngineCore in its own process."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from rivulet import LLM, RivuletError, SamplingParams
from rivulet.config import EngineConfig, ModelConfig
from rivulet.engine.async_llm import AsyncLLM, EngineDeadError

PROMPTS = ["The capital of France is", "def add(a, b):", "Three fruits are", "Rivers flow into"]


def _run(coro):
    return asyncio.run(coro)


async def _collect(engine: AsyncLLM, prompt, params, rid):
    last = None
    async for out in engine.generate(prompt, params, rid):
        last = out
    return last


def test_concurrent_streams_equal_offline_greedy():
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(dtype="float32").generate(PROMPTS, greedy, use_tqdm=False)]

    async def main():
        engine = await AsyncLLM.start(EngineConfig(model=ModelConfig(dtype="float32")))
        try:
            outs = await asyncio.gather(*[_collect(engine, p, greedy, f"r{i}") for i, p in enumerate(PROMPTS)])
            stats = await engine.get_stats()
            return outs, stats, engine.num_unfinished_requests
        finally:
            await engine.shutdown()

    outs, stats, unfinished = _run(main())
    assert [o.outputs[0].token_ids for o in outs] == want
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outs)
    assert stats["kv_cache_usage"] == 0 and stats["num_running"] == 0 and unfinished == 0


def test_abort_on_close_errors_and_engine_death():
    async def main():
        engine = await AsyncLLM.start(EngineConfig(model=ModelConfig(dtype="float32")))
        try:
            # closing a stream early aborts the request and frees its blocks
            gen = engine.generate(PROMPTS[0], SamplingParams(max_tokens=300, ignore_eos=True), "long")
            async for out in gen:
                if len(out.outputs[0].token_ids) >= 3:
                    break
            assert (await engine.get_stats())["kv_cache_usage"] > 0
            await gen.aclose()
            for _ in range(100):  # the abort reaches the engine between its steps (a loaded machine: slowly)
                stats = await engine.get_stats()
                if stats["num_running"] == 0:
                    break
                await asyncio.sleep(0.1)
            assert stats["kv_cache_usage"] == 0 and stats["num_running"] == 0
            # invalid input fails before the first output, engine unharmed
            with pytest.raises(RivuletError, match="maximum context length"):
                await _collect(engine, "word " * 9000, SamplingParams(), "too-long")
            ok = await _collect(engine, PROMPTS[1], SamplingParams(temperature=0, max_tokens=3), "ok")
            assert ok.finished
            # killing the engine process fails in-flight streams within seconds
            gen = engine.generate(PROMPTS[2], SamplingParams(max_tokens=500, ignore_eos=True), "doomed")
            t0 = None
            with pytest.raises(EngineDeadError):
                async for out in gen:
                    if t0 is None and out.outputs[0].token_ids:
                        t0 = time.monotonic()
                        os.kill(engine.engine_pid, signal.SIGKILL)
            assert time.monotonic() - t0 < 2  # a 0.1 s poll of the process; room for two loaded cores
            assert not engine.is_healthy
            with pytest.raises(EngineDeadError):
                await _collect(engine, PROMPTS[0], SamplingParams(), "after")
        finally:
            await engine.shutdown()

    _run(main())


def test_start_failure_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["NopeForCausalLM"], "vocab_size": 8}')

    async def main():
        await AsyncLLM.start(EngineConfig(model=ModelConfig(model=str(tmp_path))))

    with pytest.raises(RivuletError, match="unsupported architecture 'NopeForCausalLM'"):
        _run(main())


CHILD = """
import asyncio, sys
from rivulet import SamplingParams
from rivulet.config import EngineConfig, ModelConfig
from rivulet.engine.async_llm import AsyncLLM

async def main():
    engine = await AsyncLLM.start(EngineConfig(model=ModelConfig(dtype="float32")))
    busy = sys.argv[1] == "busy"
    if busy:  # a long request in flight when the parent dies
        gen = engine.generate("Once upon a time", SamplingParams(max_tokens=2000, ignore_eos=True), "long")
        await anext(gen)
    print(engine.engine_pid, flush=True)
    await asyncio.sleep(600)

asyncio.run(main())
"""


@pytest.mark.parametrize("state", ["idle", "busy"])
def test_engine_exits_when_its_parent_dies(state):
    """The engine process outlives no front end: SIGKILL the process that spawned it, idle or mid-request."""
    import subprocess
    import sys

    parent = subprocess.Popen([sys.executable, "-c", CHILD, state], stdout=subprocess.PIPE, text=True)
    try:
        engine_pid = int(parent.stdout.readline())
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 15  # it notices within a 0.5 s poll; a loaded machine gets room
    while time.monotonic() < deadline:
        try:
            os.kill(engine_pid, 0)
        except ProcessLookupError:
            return
        with open(f"/proc/{engine_pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":  # exited, waiting to be reaped by init
                return
        time.sleep(0.1)
    os.kill(engine_pid, signal.SIGKILL)
    pytest.fail(f"the engine process outlived its parent ({state}) by 15 s")


class _BlockedSocket:
    """A PUSH socket whose peer is gone: a send waits until the socket closes, which cancels it (as pyzmq does)."""

    def __init__(self) -> None:
        self.pending: asyncio.Future | None = None

    async def send(self, frame: bytes) -> None:
        self.pending = asyncio.get_running_loop().create_future()
        await self.pending

    def close(self) -> None:
        assert self.pending is not None
        self.pending.cancel()


def test_a_send_cut_by_the_engine_dying_is_engine_death_not_cancellation():
    async def main():
        engine = AsyncLLM()
        engine._to_core = sock = _BlockedSocket()
        send = asyncio.ensure_future(engine._send(b"add"))
        await asyncio.sleep(0)
        engine._fail("the engine process exited unexpectedly")
        sock.close()  # the supervisor's shutdown of the dead engine closes its sockets
        with pytest.raises(EngineDeadError, match="exited unexpectedly"):
            await send
        # the caller's own cancellation stays a cancellation
        send = asyncio.ensure_future(engine._send(b"add"))
        await asyncio.sleep(0)
        send.cancel()
        with pytest.raises(asyncio.CancelledError):
            await send

    _run(main())
