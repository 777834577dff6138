"""Every Triton kernel variant compiles for sm_90 (H100/H200), checked without a GPU.

Runs tests/kernels/sm90_compile.py in a subprocess: the compiler must not see TRITON_INTERPRET,
which the other kernel tests set. Compiled kernels are cached by Triton, so reruns are fast.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
pytest.importorskip("triton.backends.nvidia")

REPO = Path(__file__).resolve().parents[2]


def test_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    p = subprocess.run([sys.executable, str(REPO / "tests/kernels/sm90_compile.py")], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    assert "kernel variants compile for sm_90" in p.stdout
