"""An approximate prefix tree over request text, shared by all workers ("tenants").

The router cannot see the workers' KV caches, so it remembers which worker it sent which text to:
a radix tree over characters whose nodes carry, per tenant, when that tenant last used them. The
longest match of a new request names the worker most likely to hold its prefix in cache. Each
tenant's share is bounded (``max_chars``): its least recently used leaves are evicted first, as
its engine's LRU would evict the blocks. This is the sglang-router approach, in plain Python.
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field


@dataclass(eq=False)
class _Node:
    edge: str
    parent: _Node | None
    children: dict[str, _Node] = field(default_factory=dict)  # first character of the child's edge -> child
    tenants: dict[str, float] = field(default_factory=dict)  # tenant -> last use (monotonic clock)


class PrefixTree:
    """Which tenant saw the longest prefix of a text; insert, match, evict, remove a tenant."""

    def __init__(self) -> None:
        self.root = _Node("", None)
        self.chars: dict[str, int] = {}  # tenant -> characters of text it holds

    def insert(self, text: str, tenant: str, now: float | None = None) -> None:
        """Record that `tenant` saw `text` (every prefix of it) at `now`."""
        now = time.monotonic() if now is None else now
        node, i = self.root, 0
        node.tenants[tenant] = now
        self.chars.setdefault(tenant, 0)
        while i < len(text):
            child = node.children.get(text[i])
            if child is None:
                child = _Node(text[i:], node)
                node.children[text[i]] = child
            else:
                n = _common(child.edge, text, i)
                if n < len(child.edge):
                    child = self._split(child, n)
            if tenant not in child.tenants:
                self.chars[tenant] += len(child.edge)
            child.tenants[tenant] = now
            node, i = child, i + len(child.edge)

    def match(self, text: str) -> tuple[int, str | None]:
        """(characters matched, the tenant that used that prefix last); (0, None) when nothing matches."""
        node, i, best = self.root, 0, None
        while i < len(text):
            child = node.children.get(text[i])
            if child is None or not child.tenants:
                break
            n = _common(child.edge, text, i)
            i += n
            best = child
            if n < len(child.edge):
                break
            node = child
        if best is None:
            return 0, None
        return i, max(best.tenants, key=best.tenants.__getitem__)

    def evict(self, tenant: str, max_chars: int) -> int:
        """Drop `tenant`'s least recently used leaves until it holds at most `max_chars`; returns chars dropped."""
        if self.chars.get(tenant, 0) <= max_chars:
            return 0
        heap = [(n.tenants[tenant], id(n), n) for n in self._nodes() if tenant in n.tenants and n is not self.root
                and not any(tenant in c.tenants for c in n.children.values())]
        heapq.heapify(heap)
        dropped = 0
        while heap and self.chars[tenant] > max_chars:
            _, _, node = heapq.heappop(heap)
            dropped += self._drop(node, tenant)
            parent = node.parent
            if parent is not None and parent is not self.root and tenant in parent.tenants and \
                    not any(tenant in c.tenants for c in parent.children.values()):
                heapq.heappush(heap, (parent.tenants[tenant], id(parent), parent))
        return dropped

    def remove_tenant(self, tenant: str) -> None:
        """Forget everything `tenant` saw (a worker removed from the pool)."""
        for node in list(self._nodes()):
            if tenant in node.tenants and node is not self.root:
                self._drop(node, tenant)
        self.root.tenants.pop(tenant, None)
        self.chars.pop(tenant, None)

    # ---- internals ----

    def _split(self, child: _Node, n: int) -> _Node:
        """Split `child`'s edge after `n` characters; returns the new upper node."""
        parent = child.parent
        assert parent is not None
        upper = _Node(child.edge[:n], parent, tenants=dict(child.tenants))
        parent.children[upper.edge[0]] = upper
        child.edge, child.parent = child.edge[n:], upper
        upper.children[child.edge[0]] = child
        return upper

    def _drop(self, node: _Node, tenant: str) -> int:
        """Take `tenant` off `node`, pruning nodes no tenant uses; returns the characters it gave up."""
        del node.tenants[tenant]
        size = len(node.edge)
        self.chars[tenant] -= size
        while node is not self.root and not node.tenants and not node.children and node.parent is not None:
            del node.parent.children[node.edge[0]]
            node = node.parent
        return size

    def _nodes(self) -> list[_Node]:
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out


def _common(edge: str, text: str, start: int) -> int:
    """Length of the common prefix of `edge` and `text[start:]` (slice compares: C speed on long texts)."""
    n = min(len(edge), len(text) - start)
    if text.startswith(edge[:n], start):
        return n
    lo, hi = 0, n  # edge[:lo] matches, edge[:hi] does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if text.startswith(edge[:mid], start):
            lo = mid
        else:
            hi = mid
    return lo
