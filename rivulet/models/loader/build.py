"""Build a model from any source: Hugging Face folder, GGUF file, or dummy weights."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from rivulet.config import ModelConfig, RivuletError
from rivulet.layers.quantization import prepack_model, quantize_model
from rivulet.models.arch_config import ArchConfig
from rivulet.models.loader.dummy import init_dummy_weights
from rivulet.models.loader.gguf import GGUFCheckpoint
from rivulet.models.loader.hf import hf_config, hf_weights
from rivulet.models.loader.source import ModelSource
from rivulet.models.registry import get_model_class
from rivulet.models.weights import check_all_loaded

def load_arch_config(src: ModelSource) -> tuple[ArchConfig, dict[str, Any]]:
    raw = GGUFCheckpoint(src).hf_config if src.is_gguf else hf_config(src)
    return ArchConfig.from_hf(raw), raw


def load_model(cfg: ModelConfig, src: ModelSource, dtype: torch.dtype, device: torch.device) -> tuple[nn.Module, ArchConfig]:
    """Instantiate the architecture's class and fill its weights; returns (model in eval mode, config)."""
    ckpt = GGUFCheckpoint(src) if src.is_gguf else None
    raw = ckpt.hf_config if ckpt else hf_config(src)
    cls = get_model_class((raw.get("architectures") or ["(none)"])[0])
    arch = ArchConfig.from_hf(raw)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = cls(arch)
    finally:
        torch.set_default_dtype(old)
    if cfg.load_format == "dummy":
        init_dummy_weights(model, cfg.seed)
    else:
        weights = ckpt.weights(dtype) if ckpt else hf_weights(src, dtype, getattr(cls, "float32_weights", ()))
        try:
            loaded = model.load_weights(weights)  # type: ignore[operator]
        except RivuletError:
            raise
        except ValueError as e:
            raise RivuletError(f"cannot load weights from {src.path}: {e}") from None
        check_all_loaded(model, loaded)
    quantize_model(model, cfg.quantization)
    prepack_model(model, opaque=cfg.compilation_level == 0)
    return model.eval(), arch
