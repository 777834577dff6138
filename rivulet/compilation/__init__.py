"""Compiled model forwards: `torch.compile` (Dynamo + inductor) over the kernels' dispatcher ops."""

from rivulet.compilation.compiler import COMPILATION_LEVELS, CompiledForward, compile_cache_dir
from rivulet.compilation.passes import PASSES, FusionPasses, parse_passes

__all__ = ["COMPILATION_LEVELS", "PASSES", "CompiledForward", "FusionPasses", "compile_cache_dir", "parse_passes"]
