"""What an object keeps alive: a walk of the object graph from a root (an engine, a web app), used to show that
no per-request state outlives its request.

The walk follows instances, containers, bound methods, closures and weak dictionaries; it stops at modules,
classes, functions' globals, frames and coroutines (a background loop's locals hold its last message until the
next one: bounded, not per request), at event loops (shared by everything; count their tasks instead) and at
tensors (their storage holds no Python objects).
"""

from __future__ import annotations

import asyncio
import collections
import gc
import types
import weakref
from typing import Any, Callable, Iterator

import torch

_STOP = (type, types.ModuleType, types.CodeType, types.FrameType, types.CoroutineType, types.GeneratorType,
         types.AsyncGeneratorType, types.BuiltinFunctionType, types.MethodDescriptorType, types.WrapperDescriptorType,
         torch.Tensor, weakref.ref, asyncio.AbstractEventLoop)


def _referents(obj: Any) -> list[Any]:
    if isinstance(obj, types.FunctionType):  # its closure and defaults, not its module's globals
        cells = [c.cell_contents for c in obj.__closure__ or () if _cell_full(c)]
        return cells + list(obj.__defaults__ or ()) + list((obj.__kwdefaults__ or {}).values())
    if isinstance(obj, types.MethodType):
        return [obj.__self__, obj.__func__]
    if isinstance(obj, weakref.WeakKeyDictionary | weakref.WeakValueDictionary):
        return [obj.data]
    if type(obj) is dict or isinstance(obj, collections.OrderedDict | collections.defaultdict):
        return [*obj.keys(), *obj.values()]  # the garbage collector skips a dict's str keys
    return gc.get_referents(obj)


def _cell_full(cell: types.CellType) -> bool:
    try:
        cell.cell_contents
        return True
    except ValueError:
        return False


def walk(root: Any) -> Iterator[tuple[Any, str]]:
    """(object, a path from the root that reaches it) for every object the root keeps alive, each once."""
    seen = {id(root)}
    queue = collections.deque([(root, type(root).__name__)])
    while queue:
        obj, path = queue.popleft()
        yield obj, path
        if isinstance(obj, _STOP) or (isinstance(obj, types.FunctionType) and path.count("<fn>") > 3):
            continue
        for ref in _referents(obj):
            if id(ref) in seen or isinstance(ref, type):
                continue
            seen.add(id(ref))
            name = "<fn>" if isinstance(ref, types.FunctionType) else type(ref).__name__
            queue.append((ref, f"{path} > {name}"))


def find(root: Any, match: Callable[[Any], bool], limit: int = 10) -> list[str]:
    """Paths to the first `limit` objects the root keeps alive that `match`."""
    found = []
    for obj, path in walk(root):
        if match(obj):
            found.append(f"{path}: {obj!r:.120}")
            if len(found) >= limit:
                break
    return found


def census(root: Any) -> collections.Counter[str]:
    """How many objects of each type the root keeps alive, and the summed length of its containers by type.
    Scalars are left out: a metric's new value is a new float object, while the structures holding them
    keep their size."""
    counts: collections.Counter[str] = collections.Counter()
    for obj, _ in walk(root):
        if isinstance(obj, int | float | complex | str | bytes):
            continue
        name = f"{type(obj).__module__}.{type(obj).__qualname__}"
        counts[name] += 1
        if isinstance(obj, dict | list | set | tuple | collections.deque):
            counts[name + " items"] += len(obj)
    return counts
