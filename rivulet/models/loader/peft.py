"""PEFT LoRA adapters: a folder with `adapter_config.json` and `adapter_model.safetensors` (or `.bin`-free
PEFT's only other format is not read). `read_adapter` checks the adapter without loading its weights (the
front end does this before accepting it); `adapter_weights` yields its (A, B) pairs per target module,
with B scaled by alpha / r (alpha / sqrt(r) for rsLoRA)."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from rivulet.config import RivuletError

# the projections an adapter may adapt: attention and MLP (the fused Phi-3 ones too)
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj", "gate_up_proj",
           "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa")  # the last three: DeepSeek's MLA projections
# read per head in MLA's absorbed form, never as one linear: an adapter there cannot be added to its output
_NOT_ADAPTABLE = {"kv_b_proj": "DeepSeek's kv_b_proj is applied per head in the absorbed attention (adapt "
                               "kv_a_proj_with_mqa, q_a_proj / q_b_proj / q_proj and o_proj instead)"}
_PREFIX = "base_model.model."


@dataclass(frozen=True)
class AdapterInfo:
    path: Path
    rank: int
    scaling: float  # alpha / r, or alpha / sqrt(r) with rsLoRA
    modules: tuple[str, ...]  # the checkpoint module names it adapts, e.g. model.layers.0.self_attn.q_proj


def read_adapter(path: str | Path, max_rank: int | None = None) -> AdapterInfo:
    """The adapter's config and tensor names, checked: a LoRA of supported targets and features, rank
    <= `max_rank`, every target with an A and a B of that rank."""
    from safetensors import safe_open

    folder = Path(path).expanduser()
    cfg_file, weights = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    if not cfg_file.is_file() or not weights.is_file():
        raise RivuletError(f"LoRA adapter {path}: need adapter_config.json and adapter_model.safetensors there")
    try:
        cfg = json.loads(cfg_file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise RivuletError(f"LoRA adapter {path}: adapter_config.json is not readable JSON ({e})") from None
    if cfg.get("peft_type", "LORA") != "LORA":
        raise RivuletError(f"LoRA adapter {path}: peft_type {cfg.get('peft_type')!r} is not LORA")
    unsupported = [k for k in ("use_dora", "modules_to_save", "fan_in_fan_out",
                               "lora_bias", "layer_replication", "trainable_token_indices", "use_qalora")
                   if cfg.get(k)]
    if cfg.get("bias", "none") != "none":
        unsupported.append(f"bias={cfg['bias']}")
    if unsupported:
        raise RivuletError(f"LoRA adapter {path}: unsupported settings {', '.join(unsupported)}")
    r, alpha = cfg.get("r"), cfg.get("lora_alpha")
    if not isinstance(r, int) or r < 1 or not isinstance(alpha, (int, float)):
        raise RivuletError(f"LoRA adapter {path}: needs an integer r >= 1 and a lora_alpha, got {r!r}, {alpha!r}")
    if max_rank is not None and r > max_rank:
        raise RivuletError(f"LoRA adapter {path} has rank {r}, more than --max-lora-rank {max_rank}")
    try:
        with safe_open(str(weights), "np") as f:  # the header only: no torch needed
            shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except Exception as e:  # noqa: BLE001 - a corrupt file: any error of the reader
        raise RivuletError(f"LoRA adapter {path}: cannot read adapter_model.safetensors ({e})") from None
    modules: dict[str, dict[str, tuple[int, ...]]] = {}
    for key, shape in shapes.items():
        name = key.removeprefix(_PREFIX)
        for part in ("lora_A", "lora_B"):
            suffix = f".{part}.weight"
            if name.endswith(suffix):
                modules.setdefault(name.removesuffix(suffix), {})[part] = shape
                break
        else:
            raise RivuletError(f"LoRA adapter {path}: unexpected tensor {key!r} (only lora_A/lora_B weights)")
    for module, parts in modules.items():
        leaf = module.rsplit(".", 1)[-1]
        if leaf in _NOT_ADAPTABLE:
            raise RivuletError(f"LoRA adapter {path}: target {module!r} is not supported: {_NOT_ADAPTABLE[leaf]}")
        if leaf not in TARGETS:
            raise RivuletError(f"LoRA adapter {path}: target {module!r} is not supported "
                               f"(supported: {', '.join(TARGETS)})")
        a, b = parts.get("lora_A"), parts.get("lora_B")
        if a is None or b is None or len(a) != 2 or len(b) != 2 or a[0] != r or b[1] != r:
            raise RivuletError(f"LoRA adapter {path}: {module} needs lora_A [r, in] and lora_B [out, r] of rank {r}")
    if not modules:
        raise RivuletError(f"LoRA adapter {path} has no LoRA weights")
    # per-module ranks or alphas are not supported; patterns that match none of the adapter's modules (PEFT
    # writes some for the fused expert parameters of transformers' MoE models) change nothing
    for key in ("rank_pattern", "alpha_pattern"):
        hit = [p for p in cfg.get(key) or {} if any(re.fullmatch(rf"(.*\.)?{p}", m) for m in modules)]
        if hit:
            raise RivuletError(f"LoRA adapter {path}: unsupported settings {key} ({', '.join(hit)})")
    scaling = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    return AdapterInfo(folder, r, float(scaling), tuple(sorted(modules)))


def adapter_weights(info: AdapterInfo) -> Iterator[tuple[str, "object", "object"]]:
    """(module name, A [r, in], B [out, r] * scaling) of each target, float32 tensors."""
    from safetensors.torch import load_file

    tensors = load_file(str(info.path / "adapter_model.safetensors"))
    for module in info.modules:
        a = tensors[f"{_PREFIX}{module}.lora_A.weight"].float()
        b = tensors[f"{_PREFIX}{module}.lora_B.weight"].float() * info.scaling
        yield module, a, b
