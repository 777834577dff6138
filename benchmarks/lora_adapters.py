"""Random PEFT LoRA adapters for a model (all attention and MLP projections): what `benchmarks/lora.sh`
serves. Usage: python benchmarks/lora_adapters.py OUT_DIR [--model default] [--count 4] [--rank 16]"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from rivulet.models.loader import resolve_model
from rivulet.models.loader.build import load_arch_config


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--model", default="default")
    p.add_argument("--count", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    a = p.parse_args()
    c, _ = load_arch_config(resolve_model(a.model))
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    h, i = c.hidden_size, c.intermediate_size
    shapes = {"self_attn.q_proj": (h, q), "self_attn.k_proj": (h, kv), "self_attn.v_proj": (h, kv),
              "self_attn.o_proj": (q, h), "mlp.gate_proj": (h, i), "mlp.up_proj": (h, i), "mlp.down_proj": (i, h)}
    rng = np.random.default_rng(0)
    for n in range(a.count):
        folder = Path(a.out) / f"lora{n}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "r": a.rank, "lora_alpha": 2 * a.rank, "bias": "none",
            "target_modules": sorted({k.split(".")[1] for k in shapes})}))
        tensors = {}
        for layer in range(c.num_hidden_layers):
            for mod, (fan_in, fan_out) in shapes.items():
                key = f"base_model.model.model.layers.{layer}.{mod}"
                tensors[f"{key}.lora_A.weight"] = (rng.standard_normal((a.rank, fan_in)) / fan_in**0.5).astype(np.float32)
                tensors[f"{key}.lora_B.weight"] = (rng.standard_normal((fan_out, a.rank)) * 0.01).astype(np.float32)
        save_file(tensors, str(folder / "adapter_model.safetensors"))
        print(folder)


if __name__ == "__main__":
    main()
