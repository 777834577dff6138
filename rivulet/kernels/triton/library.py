"""The Triton wrappers as dispatcher ops for `torch.compile`: `torch.ops.rivulet_triton.<name>`.

A compiled model records each kernel as one opaque node, as it does the C++ CPU ops
(`torch.ops.rivulet.*`): Dynamo cannot trace a wrapper that launches a kernel on fake tensors, and
inductor has nothing to gain inside one. Eager calls skip the dispatcher: `graph_op` returns a function
that calls the wrapper directly unless Dynamo is tracing, when it calls the op (whose fake
implementation gives the output's shape and dtype). So eager steps and CUDA-graph captures of eager
steps pay nothing for the op, and a compiled graph captured into a CUDA graph launches the same kernels.

The ops have the same names as the CPU ops where both exist, so the fusion passes match either namespace.
"""

from __future__ import annotations

import functools
from typing import Callable, TypeVar

import torch

NAMESPACE = "rivulet_triton"

F = TypeVar("F", bound=Callable)


def graph_op(name: str, fake: Callable, mutates_args: tuple[str, ...] = ()) -> Callable[[F], F]:
    """Register `fn` as the op `rivulet_triton::<name>` with its fake implementation; return `fn` itself
    for eager calls and the op while Dynamo traces. `fn` must return fresh tensors (none aliasing an
    input) and mutate only `mutates_args`."""

    def wrap(fn: F) -> F:
        torch.library.custom_op(f"{NAMESPACE}::{name}", fn, mutates_args=mutates_args).register_fake(fake)
        op = getattr(getattr(torch.ops, NAMESPACE), name).default

        @functools.wraps(fn)
        def call(*args, **kwargs):
            if torch.compiler.is_compiling():
                return op(*args, **kwargs)
            return fn(*args, **kwargs)

        call.op = op  # type: ignore[attr-defined]
        return call  # type: ignore[return-value]

    return wrap
