"""AsyncLLM: the online engine. Requests come in as async calls, each gets an async stream of
outputs; the EngineCore runs in its own process, reached through ZeroMQ.

    engine = await AsyncLLM.start(config)   # or AsyncLLM.spawn(config), other work, await engine.ready()
    async for out in engine.generate(prompt, params, request_id):  # cumulative RequestOutput snapshots
        ...

Tokenization, detokenization and stop strings happen here, in the caller's process. If the engine
process dies, every stream fails with EngineDeadError at once and `is_healthy` turns False.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator

import zmq
import zmq.asyncio

from rivulet.config import EngineConfig, RivuletError
from rivulet.lora_request import LoRARequest
from rivulet.engine.messages import (Abort, AddRequest, Failed, GetStats, Outputs, Ready, Shutdown, Stats, Stop,
                                     encode, from_core_decoder)
from rivulet.engine.outputs import ModelInfo, PoolingRequestOutput, RequestOutput
from rivulet.engine.processor import PromptType, RequestProcessor
from rivulet.engine.tokenizer import eos_token_ids, load_tokenizer
from rivulet.models.loader import resolve_model
from rivulet.pooling_params import PoolingParams
from rivulet.sampling_params import SamplingParams


class EngineDeadError(RuntimeError):
    """The engine process has exited; no request can complete."""


class AsyncLLM:
    def __init__(self) -> None:  # use `await AsyncLLM.start(config)`
        self._streams: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._stats_waiters: list[asyncio.Future[dict]] = []
        self._dead: str | None = None
        self._tasks: list[asyncio.Task] = []
        self.last_message_at = time.monotonic()  # the engine's last message (a step's outputs or its heartbeat)

    @classmethod
    async def start(cls, config: EngineConfig, startup_timeout: float = 600.0) -> AsyncLLM:
        """Spawn the engine process and wait until its model is loaded (RivuletError if that fails)."""
        return await cls.spawn(config).ready(startup_timeout)

    @classmethod
    def spawn(cls, config: EngineConfig) -> AsyncLLM:
        """Start the engine process, and the tokenizer's load in a thread, without waiting for
        either: the caller builds what it needs (the web app) while the model loads, then
        awaits `ready()`. Call `shutdown()` if it gives up before that."""
        self = cls()
        self.spawned_at = time.monotonic()
        self._source = resolve_model(config.model.model)
        self.lora_config = config.lora
        self._dir = tempfile.mkdtemp(prefix="rivulet-")
        self._ctx = zmq.asyncio.Context()
        self._to_core = self._ctx.socket(zmq.PUSH)
        self._from_core = self._ctx.socket(zmq.PULL)
        self._proc: Any
        if config.parallel.data_parallel_backend == "ray":  # the engine is a Ray actor, maybe on another node
            from rivulet.executor.ray_engine import RayEngineProcess, node_address

            host = node_address()
            addrs = [f"tcp://{host}:{sock.bind_to_random_port(f'tcp://{host}')}"
                     for sock in (self._to_core, self._from_core)]
            self._proc = RayEngineProcess(config, *addrs)
        else:
            self._to_core.bind(f"ipc://{self._dir}/in")
            self._from_core.bind(f"ipc://{self._dir}/out")
            self._proc = subprocess.Popen([sys.executable, "-m", "rivulet.engine.core_proc", f"ipc://{self._dir}/in",
                                           f"ipc://{self._dir}/out"], stdin=subprocess.PIPE, text=True)
            self._proc.stdin.write(config.to_json())  # type: ignore[union-attr]
            self._proc.stdin.close()  # type: ignore[union-attr]
        pool = ThreadPoolExecutor(1, thread_name_prefix="rivulet-tokenizer")
        self._tokenizer_future = pool.submit(load_tokenizer, self._source, config.model.tokenizer)
        pool.shutdown(wait=False)
        return self

    async def ready(self, startup_timeout: float = 600.0) -> AsyncLLM:
        """Wait for the engine's model and the tokenizer; on failure stop the engine and raise."""
        try:
            info = await self._wait_ready(startup_timeout)
            self.tokenizer = await asyncio.wrap_future(self._tokenizer_future)
        except BaseException:
            await self.shutdown()
            raise
        info.eos_token_ids |= eos_token_ids(self._source, [], self.tokenizer)
        self.model_info: ModelInfo = info
        self.processor = RequestProcessor(self.tokenizer, info, lora=self.lora_config)
        self.last_message_at = time.monotonic()
        self._tasks = [asyncio.create_task(self._output_loop()), asyncio.create_task(self._watch_process())]
        return self

    async def _wait_ready(self, timeout: float) -> ModelInfo:
        deadline = asyncio.get_running_loop().time() + timeout
        while asyncio.get_running_loop().time() < deadline:
            if await self._from_core.poll(200):
                msg = from_core_decoder.decode(await self._from_core.recv())
                if isinstance(msg, Ready):
                    return msg.info
                if isinstance(msg, Failed):
                    raise RivuletError(msg.message.strip())
            if self._proc.poll() is not None:
                raise RivuletError(f"the engine process exited during start-up (exit code {self._proc.returncode})")
        raise RivuletError(f"the engine did not start within {timeout:.0f} s")

    # ---- state ----

    @property
    def is_healthy(self) -> bool:
        return self._dead is None

    @property
    def engine_pid(self) -> int | None:
        return self._proc.pid

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.processor.requests)

    # ---- requests ----

    async def generate(self, prompt: PromptType, params: SamplingParams | PoolingParams, request_id: str,
                       priority: int = 0, lora_request: LoRARequest | None = None) -> AsyncIterator[RequestOutput]:
        """Cumulative snapshots of the request's output; the last has `finished` True."""
        if self._dead:
            raise EngineDeadError(self._dead)
        core_requests = self.processor.make_requests(request_id, prompt, params, priority, lora_request)  # RivuletError
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._streams[request_id] = queue
        finished = False
        try:
            for r in core_requests:
                await self._send(encode(AddRequest.of(r)))
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                await self._abort_quietly(request_id)

    async def encode(self, prompt: PromptType, params: PoolingParams, request_id: str,
                     priority: int = 0) -> PoolingRequestOutput:
        """An embedding (a model started with task="embed"); `out.error` is set if the engine failed it."""
        async for out in self.generate(prompt, params, request_id, priority):  # type: ignore[arg-type]
            if out.finished:
                return out  # type: ignore[return-value]
        raise AssertionError("a request's stream ends with its finished output")

    async def abort(self, request_id: str) -> None:
        await self._abort_quietly(request_id)
        queue = self._streams.pop(request_id, None)
        if queue is not None:
            queue.put_nowait(asyncio.CancelledError(f"request {request_id} aborted"))

    async def _send(self, frame: bytes) -> None:
        """Send to the engine. A send blocked on an engine that died (a PUSH socket without its peer waits)
        is cancelled when the socket closes: that is the engine's death, not this task's cancellation."""
        try:
            await self._to_core.send(frame)
        except (asyncio.CancelledError, zmq.ZMQError):
            task = asyncio.current_task()
            if self._dead and (task is None or not task.cancelling()):
                raise EngineDeadError(self._dead) from None
            raise

    async def _abort_quietly(self, request_id: str) -> None:
        ids = self.processor.abort(request_id)
        if ids and not self._dead:
            await self._to_core.send(encode(Abort(ids)))

    async def get_stats(self) -> dict:
        if self._dead:
            raise EngineDeadError(self._dead)
        fut: asyncio.Future[dict] = asyncio.get_running_loop().create_future()
        self._stats_waiters.append(fut)
        await self._to_core.send(encode(GetStats()))
        return await asyncio.wait_for(fut, 10)

    # ---- background tasks ----

    async def _output_loop(self) -> None:
        while True:
            msg = from_core_decoder.decode(await self._from_core.recv())
            self.last_message_at = time.monotonic()
            if isinstance(msg, Outputs):
                outputs, stopped = self.processor.process(msg.outputs)
                if stopped:
                    await self._to_core.send(encode(Stop(stopped)))
                for out in outputs:
                    queue = self._streams.get(out.request_id)
                    if queue is not None:
                        queue.put_nowait(out)
            elif isinstance(msg, Stats):
                while self._stats_waiters:  # a waiter that timed out is already done: skip it
                    fut = self._stats_waiters.pop(0)
                    if not fut.done():
                        fut.set_result(msg.stats)
                        break

    async def _watch_process(self) -> None:
        while self._proc.poll() is None:
            await asyncio.sleep(0.1)
        self._fail(f"the engine process exited unexpectedly (exit code {self._proc.returncode})")

    def kill(self, reason: str) -> None:
        """End a stuck engine process now (SIGKILL: it works on a stopped process too); streams fail with `reason`."""
        if self._proc.poll() is None:
            self._proc.kill()
        self._fail(reason)

    def _fail(self, reason: str) -> None:
        if self._dead is not None:
            return
        self._dead = reason
        for queue in self._streams.values():
            queue.put_nowait(EngineDeadError(reason))
        for fut in self._stats_waiters:
            if not fut.done():
                fut.set_exception(EngineDeadError(reason))
        self._stats_waiters.clear()

    async def shutdown(self) -> None:
        for t in self._tasks:
            t.cancel()
        if self._proc.poll() is None:
            try:
                await asyncio.wait_for(self._to_core.send(encode(Shutdown())), 1)
                await asyncio.get_running_loop().run_in_executor(None, self._proc.wait, 5)
            except (asyncio.TimeoutError, zmq.ZMQError, subprocess.TimeoutExpired):
                self._proc.kill()
                self._proc.wait()
        self._dead = self._dead or "the engine was shut down"
        self._to_core.close(linger=0)
        self._from_core.close(linger=0)
        self._ctx.term()
        for name in ("in", "out"):
            try:
                os.unlink(f"{self._dir}/{name}")
            except OSError:
                pass
        try:
            os.rmdir(self._dir)
        except OSError:
            pass
