"""The op registry and the platforms' backend choices."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from rivulet.kernels import fused_add_rms_norm_ref, get_op, rms_norm_ref
from rivulet.kernels.attention import get_attention_backend
from rivulet.kernels.ops import op_names, register_op
from rivulet.platforms import CpuPlatform, CudaPlatform

HAS_TRITON = importlib.util.find_spec("triton") is not None


def test_cpu_uses_the_references():
    assert CpuPlatform().kernel_backend() == "torch"
    assert CpuPlatform().attention_backend() == "cpu"
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
    for name in op_names():
        if name.startswith("test_only"):
            continue
        impl = get_op(name, "triton")
        assert impl.__module__.startswith("rivulet.kernels.triton."), name


def test_importing_rivulet_does_not_import_triton():
    code = "import sys, rivulet, rivulet.models.llama, rivulet.worker.model_runner; print('triton' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
