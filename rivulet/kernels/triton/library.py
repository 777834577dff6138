"""The Triton wrappers as dispatcher ops for `torch.compile`: `torch.ops.rivulet_triton.<name>`
(`rivulet.kernels.library.graph_op`).

A compiled model records each kernel as one opaque node, as it does the C++ CPU ops
(`torch.ops.rivulet.*`), and a compiled graph captured into a CUDA graph launches the same kernels as
an eager step. The ops have the same names as the CPU ops where both exist, so the fusion passes match
either namespace.
"""

from __future__ import annotations

import functools

from rivulet.kernels import library

NAMESPACE = "rivulet_triton"

graph_op = functools.partial(library.graph_op, NAMESPACE)
