"""Fixtures for the `rivulet bench` tests: the fake OpenAI server, a tiny HF tokenizer, the default model's
tokenizer."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Iterator

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from fake_openai import FakeServer  # noqa: E402


@pytest.fixture(scope="package")
def fake_server() -> Iterator[FakeServer]:
    srv = FakeServer()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def fake(fake_server: FakeServer) -> FakeServer:
    fake_server.state.reset()
    return fake_server


@pytest.fixture(scope="package")
def default_tokenizer() -> Any:
    from rivulet.bench.datasets import load_bench_tokenizer

    return load_bench_tokenizer("default")


@pytest.fixture(scope="package")
def tiny_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A byte-level BPE tokenizer (vocab ~300) trained on a few sentences, saved as a HF tokenizer folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["the quick brown fox jumps over the lazy dog", "rivers run to the sea and the sea is never full",
              "streams of tokens flow through the engine", "benchmarks measure latency and throughput"] * 20
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    path = tmp_path_factory.mktemp("tiny_tokenizer")
    fast.save_pretrained(str(path))
    return path
