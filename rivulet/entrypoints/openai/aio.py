"""Asyncio helpers of the HTTP handlers: deadlines, closing generators, racing work against a client that
leaves, merging streams."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator, Awaitable, TypeVar

from starlette.types import Receive

from rivulet.entrypoints.openai.errors import OpenAIError

logger = logging.getLogger("rivulet.server")
T = TypeVar("T")


class Deadline:
    """When a request must be done (``--request-timeout`` from its arrival)."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.at = asyncio.get_running_loop().time() + timeout

    def left(self) -> float:
        return max(0.0, self.at - asyncio.get_running_loop().time())

    def error(self) -> OpenAIError:
        return OpenAIError(408, f"the request did not finish within {self.timeout:g} s (--request-timeout)",
                           code="request_timeout")


async def close_quietly(gen: Any) -> None:
    """``aclose()`` an async generator; errors are logged, and a cancellation of the caller does not
    interrupt the close (it runs in its own task)."""
    task = asyncio.ensure_future(gen.aclose())
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        raise
    except Exception:  # closing must not fail the caller
        logger.debug("error while closing a stream", exc_info=True)


async def gather_or_cancel(aws: list[Awaitable[T]]) -> list[T]:
    """``asyncio.gather`` that cancels the rest when one fails (or when it is cancelled itself)."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def merge(streams: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Items of several async iterators as they come, as (index, item); the first error raises."""
    queue: asyncio.Queue[tuple[int, Any, BaseException | None, bool]] = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                queue.put_nowait((i, item, None, False))
        except Exception as e:
            queue.put_nowait((i, None, e, True))
            return
        queue.put_nowait((i, None, None, True))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item, err, done = await queue.get()
            if err is not None:
                raise err
            if done:
                remaining -= 1
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class ClientDisconnected(Exception):
    """The client went away before the answer was ready."""


async def wait_for_disconnect(receive: Receive) -> None:
    """Return once the client has disconnected (the request body must already be read)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnected(receive: Receive, aw: Awaitable[T], deadline: Deadline | None = None) -> T:
    """Await ``aw``; if the client disconnects first, cancel it (its engine requests are aborted by
    their streams' cleanup) and raise ClientDisconnected; if `deadline` passes first, cancel it and
    raise the deadline's 408."""
    work = asyncio.ensure_future(aw)
    watch = asyncio.ensure_future(wait_for_disconnect(receive))
    try:
        done, _ = await asyncio.wait({work, watch}, timeout=None if deadline is None else deadline.left(),
                                     return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not work.done():
            work.cancel()
        watch.cancel()
        await asyncio.gather(work, watch, return_exceptions=True)
    if not done and deadline is not None:
        raise deadline.error()
    if work.cancelled():
        if watch in done and not watch.cancelled():
            if watch.exception() is not None:
                logger.warning("reading the client's connection failed: %r", watch.exception())
            raise ClientDisconnected()
        # cancelled from inside the server, with the client still there: an error it must see, not a 499
        logger.error("a request was cancelled inside the server while its client waited")
        raise OpenAIError(500, "the request was cancelled inside the server")
    return work.result()
