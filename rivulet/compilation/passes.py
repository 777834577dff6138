"""Rivulet's own graph passes, run by inductor on the graph Dynamo captured (`pre_grad_custom_pass`),
before AOTAutograd functionalizes it: the kernels are still plain `torch.ops.rivulet.*` calls (or
`torch.ops.rivulet_triton.*` on GPUs) and the KV-cache write is still a call that mutates the cache,
so a fusion is a local rewrite of a few nodes.

The model calls fused kernels where its own code can (residual add + RMSNorm, SiLU-and-mul); the passes
fuse what crosses module boundaries. `--compilation-level 2` runs every pass in `PASSES`, or those
`--compilation-passes` names (a comma list; '' for none). Each pass is a function `graph -> number of
rewrites`; `FusionPasses` runs the chosen ones, counts their rewrites per pass (`applied`), and gives
inductor the `uuid` its caches key on (the passes' names and source). Importing this module imports
no inductor (nor the Triton it brings): `inductor_pass` wraps the passes when a compile starts.

- `rope_kv_write`: `apply_rotary(q, k)` whose rotated keys only go (through views) to
  `write_kv_cache(keys, values, cache, slots)` becomes one `rotary_write_kv_cache(q, k, values, ...)`
  that returns the rotated queries and writes the rotated keys straight into their cache slots.
"""

from __future__ import annotations

import hashlib
import inspect
import operator
from typing import Callable, Iterable

import torch
from torch import fx

from rivulet.config import RivuletError

GraphPass = Callable[[fx.Graph], int]

_VIEWS = {"view", "reshape", torch.reshape, torch.Tensor.view, torch.Tensor.reshape}


def _is_view(node: fx.Node) -> bool:
    return node.op in ("call_method", "call_function") and node.target in _VIEWS


def _only_user(node: fx.Node) -> fx.Node | None:
    return next(iter(node.users)) if len(node.users) == 1 else None


def _move_after(anchor: fx.Node, start: fx.Node, dependents_of: fx.Node) -> bool:
    """Move the nodes between `start` and `anchor` that depend on `dependents_of` to just after `anchor`
    (in their order), so `anchor` may produce what they read. False (nothing moved) when one of them has
    a side effect, or when `anchor` depends on one of them."""
    moved, seen, node = [], {dependents_of}, start.next
    while node is not anchor:
        if any(a in seen for a in node.all_input_nodes):
            if node.is_impure():
                return False
            seen.add(node)
            moved.append(node)
        node = node.next
    if any(a in seen for a in anchor.all_input_nodes):
        return False
    last = anchor
    for n in moved:
        last.append(n)
        last = n
    return True


# the kernel backends whose ops the passes match: the C++ CPU ops and the Triton ops (same names)
_NAMESPACES = ("rivulet", "rivulet_triton")


def fuse_rope_kv_write(graph: fx.Graph) -> int:
    """apply_rotary -> getitem(1) -> views -> write_kv_cache(key=...) into rotary_write_kv_cache, for the ops of
    each kernel backend (none are there when the model's kernels are the references)."""
    count = 0
    for namespace in _NAMESPACES:
        ops = getattr(torch.ops, namespace)
        if all(hasattr(ops, name) for name in ("apply_rotary", "write_kv_cache", "rotary_write_kv_cache")):
            count += _fuse_rope_kv_write(graph, ops.apply_rotary.default, ops.write_kv_cache.default,
                                         ops.rotary_write_kv_cache.default)
    return count


def _fuse_rope_kv_write(graph: fx.Graph, rotary: object, write: object, fused: object) -> int:
    count = 0
    for rot in [n for n in graph.nodes if n.op == "call_function" and n.target is rotary]:
        outs = {u.args[1]: u for u in rot.users if u.target is operator.getitem}
        if len(outs) != len(rot.users) or 1 not in outs or rot.kwargs or len(rot.args) != 5:
            continue
        key = outs[1]
        while (user := _only_user(key)) is not None and _is_view(user) and user.args[0] is key:
            key = user
        w = _only_user(key)
        if w is None or w.target is not write or w.kwargs or len(w.args) != 4 or w.args[0] is not key:
            continue
        positions, q, k, cos_sin, interleaved = rot.args
        _, value, kv_cache, slots = w.args
        if 0 in outs and not _move_after(w, rot, outs[0]):
            continue
        with graph.inserting_before(w):
            node = graph.call_function(fused, (positions, q, k, value, cos_sin, interleaved, kv_cache, slots))
        if 0 in outs:  # the queries' readers (moved after the write above) read the fused op's output
            node.meta.update(outs[0].meta)
            outs[0].replace_all_uses_with(node)
        dead, chain = [w], key
        while chain is not rot:
            dead.append(chain)
            chain = chain.args[0]
        dead += [*outs.values(), rot]
        for n in dict.fromkeys(dead):
            graph.erase_node(n)
        count += 1
    return count


PASSES: dict[str, GraphPass] = {"rope_kv_write": fuse_rope_kv_write}


def parse_passes(spec: str | None) -> tuple[str, ...]:
    """`--compilation-passes`: None -> every pass; 'a,b' -> those; '' -> none. Unknown names are an error."""
    if spec is None:
        return tuple(PASSES)
    names = tuple(dict.fromkeys(n.strip() for n in spec.split(",") if n.strip()))
    unknown = [n for n in names if n not in PASSES]
    if unknown:
        raise RivuletError(f"unknown compilation pass(es) {', '.join(unknown)}; known: {', '.join(PASSES)}")
    return names


class FusionPasses:
    """The chosen passes as one inductor pre-grad pass; `applied` counts each pass's rewrites over every
    graph compiled in this process (a graph loaded from disk was rewritten when it was compiled)."""

    def __init__(self, names: Iterable[str]) -> None:
        self.names = tuple(names)
        self.applied = dict.fromkeys(self.names, 0)

    def __call__(self, graph: fx.Graph) -> None:
        for name in self.names:
            self.applied[name] += PASSES[name](graph)
        graph.lint()

    def uuid(self) -> str:
        h = hashlib.sha256(inspect.getsource(inspect.getmodule(FusionPasses)).encode())  # type: ignore[arg-type]
        h.update(",".join(self.names).encode())
        return h.hexdigest()


def inductor_pass(passes: FusionPasses) -> object:
    """`passes` as inductor's `CustomGraphPass` (the type its caches accept), for `pre_grad_custom_pass`."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class _Pass(CustomGraphPass):
        def __call__(self, graph: fx.Graph) -> None:
            passes(graph)

        def uuid(self) -> str:
            return passes.uuid()

    return _Pass()
