"""Route checkpoint tensors to parameters through their `weight_loader`s."""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from rivulet.config import RivuletError


def load_named_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    stacked: list[tuple[str, str, Any]],
    skip: tuple[str, ...] = (),
) -> set[str]:
    """Load Hugging Face-named tensors; `stacked` maps a checkpoint fragment to the fused parameter
    that holds it and the shard id its loader takes (e.g. q_proj -> qkv_proj, "q")."""
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()
    for name, tensor in weights:
        if any(name.endswith(s) for s in skip):
            continue
        for frag, fused, shard in stacked:
            if f".{frag}." in name:
                target = name.replace(f".{frag}.", f".{fused}.")
                _param(params, target, name).weight_loader(_param(params, target, name), tensor, shard)
                break
        else:
            param = _param(params, name, name)
            getattr(param, "weight_loader", _copy)(param, tensor)
            target = name
        loaded.add(target)
    return loaded


def _param(params: dict[str, nn.Parameter], target: str, source: str) -> nn.Parameter:
    try:
        return params[target]
    except KeyError:
        raise RivuletError(f"checkpoint tensor {source!r} does not belong to this model") from None


def _copy(param: torch.Tensor, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise RivuletError(f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint {tuple(loaded.shape)}")
    param.data.copy_(loaded)


def check_all_loaded(model: nn.Module, loaded: set[str]) -> None:
    """Every parameter (tied ones counted once) must have come from the checkpoint."""
    missing = [n for n, _ in model.named_parameters() if n not in loaded]
    if missing:
        more = f" (+{len(missing) - 5} more)" if len(missing) > 5 else ""
        raise RivuletError(f"checkpoint is missing weights: {', '.join(missing[:5])}{more}")
