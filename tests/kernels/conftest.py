"""Triton kernels run on the GPU when there is one, else in Triton's CPU interpreter.

The interpreter is chosen by TRITON_INTERPRET at the time a kernel is decorated, so it is set
here, before any test imports `rivulet.kernels.triton`. The interpreter computes bfloat16
wrongly: on CPU the Triton tests run in float32 only.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
