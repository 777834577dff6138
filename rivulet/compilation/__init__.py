"""Compiled model forwards: `torch.compile` (Dynamo + inductor) over the kernels' dispatcher ops."""

from rivulet.compilation.compiler import COMPILATION_LEVELS, CompiledForward, compile_cache_dir

__all__ = ["COMPILATION_LEVELS", "CompiledForward", "compile_cache_dir"]
