"""Model sources and loading. `ModelSource`/`resolve_model` (which file or folder a name means) import
no torch, so the API server process can resolve a model without it; the builders (`load_model`,
`load_arch_config`, in `build.py`) are imported on first use."""

from __future__ import annotations

from typing import Any

from rivulet.models.loader.source import ModelSource, resolve_model

__all__ = ["ModelSource", "load_arch_config", "load_model", "resolve_model"]


def __getattr__(name: str) -> Any:
    if name in ("load_arch_config", "load_model"):
        from rivulet.models.loader import build

        return getattr(build, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
