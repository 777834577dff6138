"""`rivulet plan --probe`: measure this machine as a planning device (`this-cpu`), in a few seconds.

What a step runs is what is timed: Rivulet's own bf16 linear kernel (the packed weights it serves with) on a
decode-shaped input, whose weight streaming gives the bandwidth a decode step sees, and on a prefill-shaped
input, which gives the FLOP rate; plus the fixed time of one engine step of a tiny model (host work,
sampling), which is what a step costs beyond its arithmetic. The efficiencies are 1: these are reached,
not peak, figures.
"""

from __future__ import annotations

import json
import time
from typing import Callable

from rivulet.plan.cluster import Device, probe_path


def _best(fn: Callable[[], object], repeat: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def probe(write: bool = True) -> Device:
    import torch

    from rivulet.kernels.ops import get_op
    from rivulet.platforms import current_platform

    torch.manual_seed(0)
    dtype = torch.bfloat16
    k, n = 4096, 16384  # a 128 MiB bf16 weight: well past the caches
    weight = torch.randn(n, k, dtype=dtype) * 0.02
    packed = get_op("pack_linear_weight")(weight)
    linear = get_op("packed_linear")

    def mm(x: torch.Tensor) -> Callable[[], object]:
        return (lambda: linear(x, packed, None)) if packed is not None else (lambda: torch.nn.functional.linear(x, weight))

    with torch.inference_mode():
        decode = _best(mm(torch.randn(1, k, dtype=dtype)), 20)
        prefill = _best(mm(torch.randn(512, k, dtype=dtype)), 5)
    bandwidth = weight.numel() * weight.element_size() / decode / 1e9
    tflops = 2 * 512 * k * n / prefill / 1e12
    overhead = _step_overhead_ms()
    memory = current_platform().free_memory_bytes() / 1e9
    dev = Device("this-cpu", round(memory, 2), round(bandwidth, 2), round(tflops, 4), None, 1.0, 1.0, round(overhead, 3))
    if write:
        path = probe_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(dev.__dict__, indent=2) + "\n")
    return dev


def _step_overhead_ms() -> float:
    """A one-token decode step of a 1-layer, 64-wide model: nearly all host work (inputs, sampling, outputs)."""
    import tempfile

    from rivulet.engine.llm import LLM
    from rivulet.sampling_params import SamplingParams

    with tempfile.TemporaryDirectory() as d:
        _tiny_checkpoint(d)
        llm = LLM(d, dtype="bfloat16", max_model_len=64, num_kv_blocks=16)
        params = SamplingParams(temperature=0, max_tokens=33, ignore_eos=True)
        llm.generate([{"prompt_token_ids": [1, 2, 3]}], params, use_tqdm=False)
        t = time.perf_counter()
        llm.generate([{"prompt_token_ids": [1, 2, 3]}], params, use_tqdm=False)
        elapsed = time.perf_counter() - t
        llm.shutdown()
    return elapsed / 33 * 1e3


def _tiny_checkpoint(path: str) -> None:
    import torch
    from safetensors.torch import save_file

    h, v = 64, 256
    cfg = {"architectures": ["LlamaForCausalLM"], "vocab_size": v, "hidden_size": h, "intermediate_size": 128,
           "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 4, "rms_norm_eps": 1e-5,
           "max_position_embeddings": 64, "eos_token_id": 0}
    g = torch.Generator().manual_seed(0)
    w = {"model.embed_tokens.weight": (v, h), "lm_head.weight": (v, h), "model.norm.weight": (h,),
         "model.layers.0.input_layernorm.weight": (h,), "model.layers.0.post_attention_layernorm.weight": (h,),
         **{f"model.layers.0.self_attn.{p}_proj.weight": (h, h) for p in "qkvo"},
         "model.layers.0.mlp.gate_proj.weight": (128, h), "model.layers.0.mlp.up_proj.weight": (128, h),
         "model.layers.0.mlp.down_proj.weight": (h, 128)}
    save_file({name: torch.randn(shape, generator=g) * 0.1 for name, shape in w.items()}, f"{path}/model.safetensors")
    with open(f"{path}/config.json", "w") as f:
        json.dump(cfg, f)
