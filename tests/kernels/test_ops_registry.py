"""The op registry and the platforms' backend choices."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from rivulet.kernels import fused_add_rms_norm_ref, get_op, rms_norm_ref
from rivulet.kernels.attention import get_attention_backend
from rivulet.kernels.moe import topk_routing_ref
from rivulet.kernels.ops import op_names, register_op
from rivulet.platforms import CpuPlatform, CudaPlatform

HAS_TRITON = importlib.util.find_spec("triton") is not None


def test_cpu_uses_its_kernels_and_falls_back_to_the_references():
    assert CpuPlatform().kernel_backend() == "cpu"
    assert CpuPlatform().attention_backend() == "cpu"
    assert get_op("topk_routing", "cpu") is topk_routing_ref  # no CPU kernel: the reference
    assert get_op("rms_norm", "torch") is rms_norm_ref
    assert get_op("fused_add_rms_norm", "no-such-backend") is fused_add_rms_norm_ref  # falls back


def test_cuda_platform_selects_triton():
    want = "triton" if HAS_TRITON else "torch"
    assert CudaPlatform().kernel_backend() == want and CudaPlatform().attention_backend() == want


def test_unknown_op_and_backend():
    with pytest.raises(ValueError, match="unknown op"):
        get_op("no_such_op")
    with pytest.raises(ValueError, match="triton"):  # the error lists the lazy backends too
        get_attention_backend("no-such-backend")


def test_register_op():
    def fake(x):  # type: ignore[no-untyped-def]
        return x

    register_op("test_only_identity", "torch", fake)
    assert get_op("test_only_identity") is fake


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
def test_every_op_has_a_triton_version():
    # the VNNI weight-only path (GPUs use fp8), packed weights (GPU matmuls read the plain weight), GGUF
    # dequantization (the loader's, on the host, before the weights reach a device), and greedy sampling's
    # argmax (torch's CUDA kernel is the GPU's; on CPU torch's took 3 ms of a 64-row step), and the top-k / top-p
    # mask (GPUs run the reference's sort, a segmented sort on the device; on CPU it took 145 ms for 64 rows)
    cpu_only = {"int8_linear", "int4_linear", "quantize_int8_weight", "quantize_int4_weight", "pack_linear_weight",
                "packed_linear", "packed_linear_silu_mul", "packed_fused_moe", "dequantize_gguf_blocks", "argmax_rows",
                "top_k_top_p"}
    for name in op_names():
        if name.startswith("test_only") or name in cpu_only:
            continue
        impl = get_op(name, "triton")
        assert impl.__module__.startswith("rivulet.kernels.triton."), name


def test_importing_rivulet_does_not_import_triton():
    code = ("import sys, rivulet, rivulet.models.llama, rivulet.worker.model_runner, rivulet.compilation; "
            "print('triton' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_every_cpu_kernel_is_registered():
    from rivulet.kernels.cpu import ops as cpu_ops

    for name in ("rms_norm", "fused_add_rms_norm", "apply_rotary", "write_kv_cache", "int8_linear",
                 "int4_linear", "quantize_int4_weight", "dequantize_gguf_blocks", "argmax_rows", "top_k_top_p"):
        assert get_op(name, "cpu") is getattr(cpu_ops, name), name


def test_without_the_cpu_extension_the_references_run():
    """No compiler (or RIVULET_DISABLE_CPU_EXT=1): the "cpu" backend hands out the references and a
    quantized model still runs, through the reference arithmetic of the same kernels."""
    code = (
        "import torch\n"
        "from rivulet.kernels import get_op, rms_norm_ref\n"
        "from rivulet.kernels.cpu import ops\n"
        "from rivulet.kernels.quant import int4_linear_ref, quantize_int4_weight\n"
        "from rivulet.layers.quantization import WeightOnly\n"
        "assert not ops.AVAILABLE and get_op('rms_norm', 'cpu') is rms_norm_ref\n"
        "assert get_op('int4_linear', 'cpu') is int4_linear_ref\n"
        "w = torch.randn(8, 64); x = torch.randn(2, 64)\n"
        "y = WeightOnly('int4', w, 8)(x, w, None)\n"
        "assert torch.allclose(y, int4_linear_ref(x, quantize_int4_weight(w), 8)), y\n"
        "print('ok')\n"
    )
    env = {**os.environ, "RIVULET_DISABLE_CPU_EXT": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
