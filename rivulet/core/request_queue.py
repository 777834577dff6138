"""A queue of requests kept in service order: priority, then arrival."""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator

from rivulet.core.request import Request


class RequestQueue:
    """Requests sorted by ``Request.sort_key``: the front is served first, the back
    is the first to be preempted. A preempted request keeps its key, so it goes back
    to the place it had, ahead of later arrivals of the same priority. A request's
    priority and arrival time must not change while it is queued.
    """

    def __init__(self) -> None:
        self._items: list[Request] = []
        self._keys: list[tuple[int, float, int]] = []

    def add(self, request: Request) -> None:
        key = request.sort_key
        pos = bisect.bisect_right(self._keys, key)
        self._keys.insert(pos, key)
        self._items.insert(pos, request)

    def remove(self, request: Request) -> None:
        pos = bisect.bisect_left(self._keys, request.sort_key)
        if pos == len(self._items) or self._items[pos] is not request:
            raise ValueError(f"{request.request_id} is not in the queue")
        del self._keys[pos]
        del self._items[pos]

    def pop_front(self) -> Request:
        del self._keys[0]
        return self._items.pop(0)

    def pop_back(self) -> Request:
        self._keys.pop()
        return self._items.pop()

    def retain(self, keep: Callable[[Request], bool]) -> None:
        """Drop, in one pass, every request for which ``keep`` is false."""
        kept = [(k, r) for k, r in zip(self._keys, self._items) if keep(r)]
        self._keys = [k for k, _ in kept]
        self._items = [r for _, r in kept]

    def __getitem__(self, index: int) -> Request:
        return self._items[index]

    def after(self, index: int) -> list[Request]:
        """The requests behind position ``index``."""
        return self._items[index + 1 :]

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._items)
