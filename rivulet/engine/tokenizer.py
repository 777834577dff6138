"""Tokenizer and generation defaults of a model, from its HF folder or its GGUF metadata.

Building a tokenizer from GGUF metadata takes seconds, so the converted tokenizer is saved once
under the cache folder (``$RIVULET_CACHE_DIR``, default ``~/.cache/rivulet``) and reloaded from there.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rivulet.config import RivuletError
from rivulet.models.loader import ModelSource

if TYPE_CHECKING:  # transformers takes ~1 s to import: the engine process needs only `eos_token_ids`
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)


def cache_dir() -> Path:
    return Path(os.environ.get("RIVULET_CACHE_DIR", Path.home() / ".cache" / "rivulet"))


def _gguf_cache_key(path: Path) -> str:
    st = path.stat()
    return hashlib.sha256(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


_LOAD_LOCK = threading.Lock()  # transformers' lazy imports are not safe from two threads at once


def load_tokenizer(src: ModelSource, tokenizer: str | None = None) -> PreTrainedTokenizerBase | None:
    """The model's tokenizer (or the one at `tokenizer`, a folder), with its chat template;
    None for a Hugging Face folder that ships no tokenizer files. One load at a time in a process
    (data-parallel replicas load theirs from parallel threads)."""
    with _LOAD_LOCK:
        return _load_tokenizer(src, tokenizer)


def _load_tokenizer(src: ModelSource, tokenizer: str | None) -> PreTrainedTokenizerBase | None:
    try:
        if tokenizer is not None:
            return _auto(tokenizer)
        if not src.is_gguf:
            if not any((src.path / f).is_file() for f in _TOKENIZER_FILES):
                return None  # a weights-only folder: token-id prompts only
            return _auto(str(src.path))
        cached = cache_dir() / "tokenizers" / _gguf_cache_key(src.gguf_path)
        if (cached / "tokenizer_config.json").is_file():
            return _load_saved(cached)
        try:
            tok = _auto(str(src.path), gguf_file=src.gguf_file)
        except ValueError as e:
            if "is not supported yet" not in str(e):
                raise
            raise RivuletError(f"cannot read the tokenizer in {src.gguf_file} ({e}); pass --tokenizer with the "
                               f"model's Hugging Face tokenizer folder") from None
        try:
            tok.save_pretrained(str(cached))
        except OSError as e:  # a read-only home is fine: convert again next time
            logger.warning("could not cache the tokenizer in %s: %s", cached, e)
        return tok
    except RivuletError:
        raise
    except (OSError, ValueError) as e:
        raise RivuletError(f"cannot load a tokenizer for {tokenizer or src.path}: {e}") from None


def _load_saved(folder: Path) -> PreTrainedTokenizerBase:
    """A tokenizer this module saved from a GGUF file. Its config names `TokenizersBackend` (the fast
    tokenizer class of transformers 5), which is what `AutoTokenizer` would pick for a folder with no
    model config; loading that class directly skips `AutoTokenizer`'s import of torch (~1.5 s)."""
    config = json.loads((folder / "tokenizer_config.json").read_text())
    if config.get("tokenizer_class") == "TokenizersBackend":
        from transformers import TokenizersBackend

        return TokenizersBackend.from_pretrained(str(folder))
    return _auto(str(folder))


def _auto(path: str, **kwargs: Any) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer  # imports torch

    return AutoTokenizer.from_pretrained(path, **kwargs)


def eos_token_ids(src: ModelSource, config_eos: list[int], tok: PreTrainedTokenizerBase | None) -> set[int]:
    """End-of-sequence ids from the model config, generation_config.json and the tokenizer."""
    ids = set(config_eos)
    gen = src.read_json("generation_config.json") or {}
    eos = gen.get("eos_token_id")
    ids |= {eos} if isinstance(eos, int) else set(eos or [])
    if tok is not None and tok.eos_token_id is not None:
        ids.add(tok.eos_token_id)
    return ids
