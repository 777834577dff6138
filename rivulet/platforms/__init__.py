"""Platform layer: which device we run on and what it supports.

A new accelerator is one new `Platform` subclass: declared by its own package as a `rivulet.platforms`
entry point (`rivulet/plugins.py`), which is probed before the built-in ones, or added to `_PLATFORMS`.
"""

from __future__ import annotations

from functools import cache

from rivulet.plugins import platform_plugins
from rivulet.platforms.interface import Platform
from rivulet.platforms.cpu import CpuPlatform
from rivulet.platforms.cuda import CudaPlatform

_PLATFORMS: list[type[Platform]] = [CudaPlatform, CpuPlatform]  # probed in order


@cache
def current_platform() -> Platform:
    """The first platform whose device is present (CPU always is): plugins' platforms first."""
    for cls in (*platform_plugins(), *_PLATFORMS):
        if cls.is_available():
            return cls()
    raise RuntimeError("no platform available")


__all__ = ["Platform", "CpuPlatform", "CudaPlatform", "current_platform"]
