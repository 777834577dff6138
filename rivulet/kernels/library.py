"""Kernels as dispatcher ops for `torch.compile`: `graph_op(namespace, name, fake)`.

A compiled model records such a kernel as one opaque node: Dynamo cannot trace a Triton launch on fake
tensors, nor a reference whose loop depends on the data (the MoE reference loops over the experts that
have tokens), and inductor has nothing to gain inside one. Eager calls skip the dispatcher: the function
returned calls the kernel directly unless Dynamo is tracing, when it calls the op (whose fake
implementation gives the output's shape and dtype). So eager steps, and CUDA-graph captures of eager
steps, pay nothing for the op.
"""

from __future__ import annotations

import functools
from typing import Callable, TypeVar

import torch

F = TypeVar("F", bound=Callable)


def graph_op(namespace: str, name: str, fake: Callable, mutates_args: tuple[str, ...] = ()) -> Callable[[F], F]:
    """Register `fn` as the op `<namespace>::<name>` with its fake implementation; return `fn` itself for
    eager calls and the op while Dynamo traces. `fn` must be annotated (the op's schema comes from its
    annotations), return fresh tensors (none aliasing an input) and mutate only `mutates_args`."""

    def wrap(fn: F) -> F:
        torch.library.custom_op(f"{namespace}::{name}", fn, mutates_args=mutates_args).register_fake(fake)
        op = getattr(getattr(torch.ops, namespace), name).default

        @functools.wraps(fn)
        def call(*args, **kwargs):
            if torch.compiler.is_compiling():
                return op(*args, **kwargs)
            return fn(*args, **kwargs)

        call.op = op  # type: ignore[attr-defined]
        return call  # type: ignore[return-value]

    return wrap
