"""Triton kernels for NVIDIA GPUs, one op per module, each a thin Python wrapper around a kernel.

Each wrapper takes and returns what its PyTorch reference in `rivulet.kernels` does and is tested
against it (on CPU under ``TRITON_INTERPRET=1``, in float32: the interpreter computes bfloat16
wrongly). Nothing here is imported unless the platform asks for the "triton" backend (see
`rivulet.kernels.ops`). The model's ops are also dispatcher ops for `torch.compile` (`library.py`).
"""

from __future__ import annotations

import os


def _fix_interpreter_index() -> None:
    """Triton 3.6's CPU interpreter turns a scalar tensor into a Python int (e.g. a `range` bound
    inside a kernel) with `int(array)`; its scalars are shape-(1,) arrays, which NumPy >= 2.4
    refuses to convert that way. Convert with indexing instead. Interpreter only: compiled
    kernels never take this path."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_rivulet_fixed", False):
        return

    def patched(tensor, scope):  # type: ignore[no-untyped-def]
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._rivulet_fixed = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patched


if os.environ.get("TRITON_INTERPRET") == "1":
    _fix_interpreter_index()
