"""An HF folder (safetensors, bf16) of the default model, made from its GGUF file, for peers that load HF folders.

    .venv/bin/python benchmarks/peers/make_hf_model.py OUT_DIR

transformers dequantizes the Q4_1 tensors on load; it refuses `save_pretrained` on a GGUF-loaded model while
its gguf quantizer and `quantization_config` are attached, so both are removed first. The weights are then the
same dequantized values Rivulet's bf16 path computes with.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rivulet.models.loader.source import resolve_model


def main() -> int:
    out = Path(sys.argv[1])
    gguf = Path(resolve_model("default").gguf_path)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tok.save_pretrained(out)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
