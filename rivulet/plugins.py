"""Out-of-tree extensions, found through the entry points of installed packages (as vLLM's plugins are).

- `rivulet.platforms`: each entry point names a `Platform` subclass. `current_platform()` probes them,
  in entry-point name order, before the built-in CUDA and CPU platforms: a new accelerator is a package
  that declares its platform, not a change here.
- `rivulet.models`: each entry point is named after a Hugging Face `architectures` entry and names the model
  class that serves it (built from `ArchConfig`, like the built-in ones); it takes precedence over a
  built-in class of the same name.
- `rivulet.kernels`: each entry point names a function called once, with no arguments, before the first
  op or attention backend is looked up. It registers its backend's implementations with
  `rivulet.kernels.ops.register_op(name, backend, impl)` and
  `rivulet.kernels.attention.register_attention_backend(name, fn)`; ops it does not register fall
  back to the PyTorch references.

`RIVULET_PLUGINS` (a comma list of entry-point names) loads only those; set and empty, none. A plugin
that fails to import, or a platform entry point that is not a `Platform` subclass, is a `RivuletError`
naming the entry point and its package.
"""

from __future__ import annotations

import importlib.metadata
import os
from functools import cache

from rivulet.config import RivuletError

PLATFORM_GROUP = "rivulet.platforms"
MODEL_GROUP = "rivulet.models"
KERNEL_GROUP = "rivulet.kernels"


def _selected(group: str) -> list[importlib.metadata.EntryPoint]:
    wanted = os.environ.get("RIVULET_PLUGINS")
    names = None if wanted is None else {n.strip() for n in wanted.split(",") if n.strip()}
    found = importlib.metadata.entry_points(group=group)
    return sorted((ep for ep in found if names is None or ep.name in names), key=lambda ep: ep.name)


def _load(ep: importlib.metadata.EntryPoint) -> object:
    try:
        return ep.load()
    except Exception as e:  # noqa: BLE001 - whatever the plugin raises: name it
        dist = ep.dist.name if ep.dist is not None else "?"
        raise RivuletError(f"plugin {ep.group}:{ep.name} ({ep.value}, package {dist}) failed to load: "
                           f"{type(e).__name__}: {e}") from e


@cache
def platform_plugins() -> tuple[type, ...]:
    """The `Platform` subclasses that installed packages declare."""
    from rivulet.platforms.interface import Platform

    classes = []
    for ep in _selected(PLATFORM_GROUP):
        cls = _load(ep)
        if not (isinstance(cls, type) and issubclass(cls, Platform)):
            raise RivuletError(f"plugin {ep.group}:{ep.name} ({ep.value}) is not a rivulet Platform subclass")
        classes.append(cls)
    return tuple(classes)


@cache
def model_plugins() -> dict[str, type]:
    """Architecture name -> the model class an installed package declares for it."""
    import torch

    models = {}
    for ep in _selected(MODEL_GROUP):
        cls = _load(ep)
        if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module)):
            raise RivuletError(f"plugin {ep.group}:{ep.name} ({ep.value}) is not a torch.nn.Module subclass")
        models[ep.name] = cls
    return models


_kernel_plugins: list[str] | None = None  # the names called, once loading has begun


def load_kernel_plugins() -> tuple[str, ...]:
    """Call each `rivulet.kernels` plugin's registration function once per process (a registration that
    looks ops up itself does not start the loading again); returns the names called."""
    global _kernel_plugins
    if _kernel_plugins is None:
        _kernel_plugins = []
        for ep in _selected(KERNEL_GROUP):
            register = _load(ep)
            if not callable(register):
                raise RivuletError(f"plugin {ep.group}:{ep.name} ({ep.value}) is not a function")
            register()
            _kernel_plugins.append(ep.name)
    return tuple(_kernel_plugins)
