"""Platform layer: which device we run on and what it supports.

A new accelerator is one new `Platform` subclass registered in `_PLATFORMS`.
"""

from __future__ import annotations

from functools import cache

from rivulet.platforms.interface import Platform
from rivulet.platforms.cpu import CpuPlatform
from rivulet.platforms.cuda import CudaPlatform

_PLATFORMS: list[type[Platform]] = [CudaPlatform, CpuPlatform]  # probed in order


@cache
def current_platform() -> Platform:
    """The first platform whose device is present (CPU always is)."""
    for cls in _PLATFORMS:
        if cls.is_available():
            return cls()
    raise RuntimeError("no platform available")


__all__ = ["Platform", "CpuPlatform", "CudaPlatform", "current_platform"]
