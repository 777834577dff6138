import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # tests/helpers importable as `helpers`
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(max(1, os.cpu_count() or 1))
if os.environ.get("PYTEST_XDIST_WORKER") and torch.cuda.is_available():
    # workers share the GPU: each engine sizes its KV cache to its worker's share (CudaPlatform.kv_cache_budget),
    # and a share is left for the subprocesses some tests start
    torch.cuda.set_per_process_memory_fraction(0.9 / (int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) + 1))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """kind -> (folder with config.json + model.safetensors, transformers model) built once per session."""
    from helpers.tiny import make_tiny_model

    cache: dict = {}

    def get(kind: str):
        if kind not in cache:
            path = tmp_path_factory.mktemp(kind)
            cache[kind] = (path, make_tiny_model(kind, path))
        return cache[kind]

    return get
