"""Model architectures and their registry. The exports are imported on first use (they need torch),
so that importing a light submodule such as `rivulet.models.loader.source` stays light."""

from __future__ import annotations

from typing import Any

__all__ = ["ArchConfig", "MODEL_REGISTRY", "get_model_class"]


def __getattr__(name: str) -> Any:
    if name == "ArchConfig":
        from rivulet.models.arch_config import ArchConfig

        return ArchConfig
    if name in ("MODEL_REGISTRY", "get_model_class"):
        from rivulet.models import registry

        return getattr(registry, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
