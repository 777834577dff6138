"""Hugging Face folders: `config.json` plus `*.safetensors` (single file or sharded with an index)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors import safe_open

from rivulet.config import RivuletError
from rivulet.models.loader.source import ModelSource


def hf_config(src: ModelSource) -> dict[str, Any]:
    cfg = src.read_json("config.json")
    if cfg is None:
        raise RivuletError(f"{src.path} has no config.json")
    return cfg


def safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [path / f for f in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise RivuletError(f"{path}: shards listed in the index are missing: {', '.join(missing)}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise RivuletError(f"{path} has no *.safetensors weights")
    return files


def hf_weights(src: ModelSource, dtype: torch.dtype, keep: tuple[str, ...] = ()) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs in the checkpoint's own names, cast to `dtype` (those whose names end with one of
    `keep`: as stored, for parameters the model holds in float32)."""
    for f in safetensors_files(src.path):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                t = st.get_tensor(name)
                yield name, t if name.endswith(keep) and keep else t.to(dtype)
