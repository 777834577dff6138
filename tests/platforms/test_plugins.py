"""Out-of-tree platforms, kernels and models (`rivulet/plugins.py`): an installed package that declares a
`rivulet.platforms` and a `rivulet.kernels` entry point is probed first and its kernels are used (the
others fall back to the references); a `rivulet.models` entry point serves its architecture;
`RIVULET_PLUGINS` selects; a broken plugin is a clear error. Each case runs in a fresh interpreter
(the platform is chosen once per process)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

PLUGIN = '''
from rivulet.kernels.norm import rms_norm_ref
from rivulet.models.llama import LlamaForCausalLM
from rivulet.platforms.cpu import CpuPlatform

CALLS = {"rms_norm": 0, "attention": 0, "models": 0}


class FakeLlama(LlamaForCausalLM):
    """A new architecture name served by the Llama code (counting the models built)."""

    def __init__(self, *args, **kwargs):
        CALLS["models"] += 1
        super().__init__(*args, **kwargs)


class FakePlatform(CpuPlatform):
    """The CPU under another name, with its own kernel and attention backends."""

    name = "fake"

    def kernel_backend(self) -> str:
        return "fake"

    def attention_backend(self) -> str:
        return "fake"


def _rms_norm(x, weight, eps):
    CALLS["rms_norm"] += 1
    return rms_norm_ref(x, weight, eps)


def _attention(*args):
    from rivulet.kernels.attention import paged_attention_ref

    CALLS["attention"] += 1
    return paged_attention_ref(*args)


def register():
    from rivulet.kernels.attention import register_attention_backend
    from rivulet.kernels.ops import register_op

    register_op("rms_norm", "fake", _rms_norm)
    register_attention_backend("fake", _attention)
'''

RUN = '''
import json, sys
from rivulet import LLM, SamplingParams
from rivulet.kernels.ops import get_op
from rivulet.kernels.norm import fused_add_rms_norm_ref
from rivulet.platforms import current_platform
from rivulet.plugins import load_kernel_plugins
llm = LLM(sys.argv[1], dtype="float32", max_model_len=64)
out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
calls = sys.modules["fakeplug"].CALLS if "fakeplug" in sys.modules else None
print(json.dumps({"platform": current_platform().name, "plugins": list(load_kernel_plugins()), "calls": calls,
                  "reference_fallback": get_op("fused_add_rms_norm") is fused_add_rms_norm_ref,
                  "tokens": out[0].outputs[0].token_ids}))
'''


def _package(root: Path, entry_points: str) -> None:
    """An installed distribution `fakeplug` on `root` (what pip leaves: the module and its dist-info)."""
    (root / "fakeplug").mkdir()
    (root / "fakeplug" / "__init__.py").write_text(PLUGIN)
    info = root / "fakeplug-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fakeplug\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(textwrap.dedent(entry_points))


def _run(root: Path, code: str, *args: str, plugins: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "RIVULET_PLUGINS"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(root)])
    if plugins is not None:
        env["RIVULET_PLUGINS"] = plugins
    return subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture
def installed(tmp_path):
    _package(tmp_path, """
        [rivulet.platforms]
        fake = fakeplug:FakePlatform
        [rivulet.kernels]
        fake = fakeplug:register
        [rivulet.models]
        FakeLlamaForCausalLM = fakeplug:FakeLlama
        """)
    return tmp_path


def test_a_plugin_platform_is_chosen_and_runs_its_kernels(installed, tiny_model_dir):
    path, _ = tiny_model_dir("llama")
    p = _run(installed, RUN, str(path))
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["platform"] == "fake" and got["plugins"] == ["fake"]
    assert got["calls"]["rms_norm"] > 0 and got["calls"]["attention"] > 0  # its kernels ran the model
    assert got["reference_fallback"]  # an op it does not register: the PyTorch reference
    assert len(got["tokens"]) == 5


def test_rivulet_plugins_selects_which_load(installed, tiny_model_dir):
    path, _ = tiny_model_dir("llama")
    p = _run(installed, RUN, str(path), plugins="")
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["platform"] == "cpu" and got["plugins"] == [] and got["calls"] is None


def test_a_plugin_model_serves_its_architecture(installed, tiny_model_dir, tmp_path):
    path, _ = tiny_model_dir("llama")
    renamed = tmp_path / "renamed"
    shutil.copytree(path, renamed)
    cfg = json.loads((renamed / "config.json").read_text())
    cfg["architectures"] = ["FakeLlamaForCausalLM"]
    (renamed / "config.json").write_text(json.dumps(cfg))
    outs = {}
    for name, folder, plugins in (("plugin", renamed, "FakeLlamaForCausalLM"), ("built-in", path, "")):
        p = _run(installed, RUN, str(folder), plugins=plugins)
        assert p.returncode == 0, p.stderr[-3000:]
        outs[name] = json.loads(p.stdout.strip().splitlines()[-1])
    assert outs["plugin"]["platform"] == "cpu" and outs["plugin"]["calls"]["models"] == 1
    assert outs["plugin"]["tokens"] == outs["built-in"]["tokens"]  # the same weights through the same code
    p = _run(installed, RUN, str(renamed), plugins="")
    assert p.returncode != 0 and "unsupported architecture 'FakeLlamaForCausalLM'" in p.stderr


def test_a_broken_plugin_is_a_clear_error(tmp_path):
    _package(tmp_path, """
        [rivulet.platforms]
        nope = fakeplug:Missing
        notaplatform = fakeplug:register
        """)
    code = "from rivulet.platforms import current_platform; current_platform()"
    p = _run(tmp_path, code, plugins="nope")
    assert p.returncode != 0
    assert "plugin rivulet.platforms:nope (fakeplug:Missing, package fakeplug) failed to load: AttributeError" in p.stderr
    p = _run(tmp_path, code, plugins="notaplatform")
    assert "plugin rivulet.platforms:notaplatform (fakeplug:register) is not a rivulet Platform subclass" in p.stderr
