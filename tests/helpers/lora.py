"""PEFT LoRA adapters on the tiny models, written by tests, and PEFT's own greedy tokens as the reference."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import peft
import torch

from helpers.tiny import make_tiny_model

# (name, PEFT config): ranks 2-8, different targets, alpha, rsLoRA
ADAPTERS: dict[str, dict[str, Any]] = {
    "attn": dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "mlp": dict(r=8, lora_alpha=4, target_modules=["gate_proj", "up_proj", "down_proj"], use_rslora=True),
    "sparse": dict(r=2, lora_alpha=16, target_modules=["v_proj", "up_proj"]),
}


def write_peft_adapter(base_dir: Path, kind: str, name: str, out: Path, seed: int, **cfg: Any) -> Path:
    """Write tiny model `kind` to `base_dir` and a random LoRA adapter of it to `out / name`."""
    hf = make_tiny_model(kind, base_dir)  # the same seed: the same base weights every call
    torch.manual_seed(seed)
    model = peft.get_peft_model(hf, peft.LoraConfig(init_lora_weights=False, **cfg), adapter_name=name)
    with torch.no_grad():  # PEFT's random B is small: widen it so that each adapter changes the tokens
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.3)
    model.save_pretrained(out / name)
    if (out / name / name).is_dir():  # PEFT keeps a non-default adapter in a subfolder
        for f in (out / name / name).iterdir():
            f.rename(out / name / f.name)
    return out / name


def peft_tokens(base: Path, adapter: Path | None, prompt: list[int], n: int = 10) -> list[int]:
    """Greedy tokens of PEFT's model (the base model without an adapter), float32."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(hf, adapter) if adapter is not None else hf
    ids = torch.tensor([prompt])
    with torch.no_grad():  # an explicit mask: without one, generate masks out every token equal to pad_token_id
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                             pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()
