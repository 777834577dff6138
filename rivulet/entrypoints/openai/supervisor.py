"""Engine supervision inside ``rivulet serve``: restart a dead engine, kill and restart a stuck one.

``SupervisedEngine`` is the ``EngineClient`` the app sees; it forwards to the current ``AsyncLLM``.

- **Death.** When the engine process exits, its streams fail at once with ``EngineDeadError`` (500 /
  an ``engine_dead`` event), ``/health`` answers 503 (``engine_restarting``), and a new engine is
  started after a backoff (1, 2, 4 ... s, at most 30). More than ``max_restarts`` restarts within
  ``restart_window_s`` (or a restart whose engine fails to load) ends the server with exit code 1, so
  that an orchestrator takes over.
- **Watchdog.** While it has unfinished requests the engine sends a message at least every second
  (`core_proc.HEARTBEAT_S`). With ``watchdog_s`` set, an engine silent for that long with work to do
  is killed (SIGKILL: a stopped process too), which is a death as above.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import Any, AsyncIterator, Callable

from rivulet.config import EngineConfig
from rivulet.engine.async_llm import AsyncLLM, EngineDeadError
from rivulet.engine.outputs import ModelInfo, RequestOutput
from rivulet.lora_request import LoRARequest
from rivulet.sampling_params import SamplingParams

logger = logging.getLogger("rivulet.server")


class SupervisedEngine:
    def __init__(self, config: EngineConfig, max_restarts: int = 3, restart_window_s: float = 600.0,
                 watchdog_s: float | None = None, spawn: Callable[[EngineConfig], AsyncLLM] = AsyncLLM.spawn) -> None:
        self.config = config
        self.max_restarts, self.restart_window_s, self.watchdog_s = max_restarts, restart_window_s, watchdog_s
        self._spawn = spawn
        self.engine = spawn(config)
        self.spawned_at = self.engine.spawned_at
        self.restarts: deque[float] = deque()  # when each restart began
        self.restarting = False
        self.fatal: str | None = None  # why the server must exit
        self.on_fatal: Callable[[str], None] = lambda reason: None
        self._task: asyncio.Task[None] | None = None

    async def ready(self) -> SupervisedEngine:
        await self.engine.ready()
        self._task = asyncio.create_task(self._supervise())
        return self

    # ---- the EngineClient interface, forwarded ----

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def model_info(self) -> ModelInfo:
        return self.engine.model_info

    @property
    def processor(self) -> Any:
        return self.engine.processor

    @property
    def is_healthy(self) -> bool:
        return not self.restarting and self.fatal is None and self.engine.is_healthy

    @property
    def engine_pid(self) -> int | None:
        return self.engine.engine_pid

    @property
    def num_unfinished_requests(self) -> int:
        return self.engine.num_unfinished_requests

    def generate(self, prompt: Any, params: SamplingParams, request_id: str,
                 priority: int = 0, lora_request: LoRARequest | None = None) -> AsyncIterator[RequestOutput]:
        if self.restarting:
            return _fails(EngineDeadError("the engine is restarting"))
        return self.engine.generate(prompt, params, request_id, priority, lora_request)

    async def abort(self, request_id: str) -> None:
        await self.engine.abort(request_id)

    async def get_stats(self) -> dict[str, Any]:
        return await self.engine.get_stats()

    async def shutdown(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self.engine.shutdown()

    # ---- supervision ----

    async def _supervise(self) -> None:
        while True:
            await asyncio.sleep(0.1)
            engine = self.engine
            if engine.is_healthy and self.watchdog_s is not None and engine.num_unfinished_requests and \
                    time.monotonic() - engine.last_message_at > self.watchdog_s:
                logger.error("watchdog: the engine has %d unfinished requests and sent nothing for %.0f s: killing it",
                             engine.num_unfinished_requests, time.monotonic() - engine.last_message_at)
                engine.kill(f"the engine was stuck for {self.watchdog_s:.0f} s and was restarted")
            if not engine.is_healthy and not await self._restart():
                return

    async def _restart(self) -> bool:
        """Start a new engine; False when the server should give up instead."""
        now = time.monotonic()
        while self.restarts and now - self.restarts[0] > self.restart_window_s:
            self.restarts.popleft()
        if len(self.restarts) >= self.max_restarts:
            return self._give_up(f"the engine died {len(self.restarts) + 1} times within "
                                 f"{self.restart_window_s:.0f} s")
        self.restarting = True
        self.restarts.append(now)
        delay = min(30.0, 2.0 ** (len(self.restarts) - 1))
        logger.error("the engine process died; restarting it in %.0f s (restart %d of at most %d per %.0f s)", delay,
                     len(self.restarts), self.max_restarts, self.restart_window_s)
        await self.engine.shutdown()
        await asyncio.sleep(delay)
        try:
            engine = self._spawn(self.config)
            await engine.ready()
        except Exception as e:
            return self._give_up(f"the restarted engine did not start: {e}")
        self.engine = engine
        self.restarting = False
        logger.info("the engine is back (restart %d)", len(self.restarts))
        return True

    def _give_up(self, reason: str) -> bool:
        logger.error("%s: stopping the server", reason)
        self.fatal, self.restarting = reason, False
        self.on_fatal(reason)
        return False


async def _fails(error: BaseException) -> AsyncIterator[RequestOutput]:
    raise error
    yield  # pragma: no cover  (makes this an async generator)
