"""The default model's tokenizer: converted from the GGUF file once, then reloaded from the cache
without transformers' AutoTokenizer (and so without importing torch), with the same behaviour."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from rivulet.engine.tokenizer import cache_dir, load_tokenizer
from rivulet.models.loader import resolve_model

TEXTS = ["The capital of France is", "def fibonacci(n):\n    return n", "  spaces\tand ünïcödé 🙂", ""]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi"},
        {"role": "assistant", "content": "Hi!"}, {"role": "user", "content": "Again"}]


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RIVULET_CACHE_DIR", str(tmp_path))
    return tmp_path


def test_cached_tokenizer_behaves_as_the_converted_one(fresh_cache):
    src = resolve_model("default")
    converted = load_tokenizer(src)  # converts the GGUF tokenizer and saves it
    assert list((cache_dir() / "tokenizers").iterdir()), "the conversion was not cached"
    cached = load_tokenizer(src)
    assert type(cached).__name__ == "TokenizersBackend"
    for text in TEXTS:
        ids = converted(text).input_ids
        assert cached(text).input_ids == ids, text
        assert cached.decode(ids) == converted.decode(ids)
    for kwargs in ({"add_generation_prompt": True}, {"add_generation_prompt": False}):
        assert (cached.apply_chat_template(CHAT, tokenize=False, **kwargs)
                == converted.apply_chat_template(CHAT, tokenize=False, **kwargs))
    assert (cached.eos_token_id, cached.bos_token_id, cached.pad_token_id) == (
        converted.eos_token_id, converted.bos_token_id, converted.pad_token_id)
    assert len(cached) == len(converted)


def test_cached_tokenizer_loads_without_torch(fresh_cache):
    load_tokenizer(resolve_model("default"))  # fill the cache
    code = ("import sys; from rivulet.engine.tokenizer import load_tokenizer; "
            "from rivulet.models.loader import resolve_model; "
            "t = load_tokenizer(resolve_model('default')); assert t('hi').input_ids; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "RIVULET_CACHE_DIR": str(fresh_cache)})
    assert out.stdout.strip() == "False", out.stderr
