"""Shared fixtures for the sampling tests: the default model's tokenizer, loaded once."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tokenizer():
    """The SmolLM2 tokenizer read from the GGUF file (a byte-level BPE, vocab 49152) by transformers. A missing
    model package is an error here, as in every other test of the default model, not a skip."""
    import transformers

    from rivulet.models.loader import resolve_model

    gguf = Path(resolve_model("default").gguf_path)
    return transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
