"""How an embedding model turns hidden states into one vector: read from a sentence-transformers folder
(`modules.json` -> its Pooling module's `config.json`, a Normalize module, `sentence_bert_config.json`'s
`max_seq_length`), overridden by `--pooler-config`. Pure file reading: the API server uses it too."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rivulet.config import RivuletError
from rivulet.models.loader.source import ModelSource

POOLING_TYPES = ("LAST", "MEAN", "CLS")
_ST_MODES = {"pooling_mode_mean_tokens": "MEAN", "pooling_mode_cls_token": "CLS",
             "pooling_mode_lasttoken": "LAST"}


@dataclass(frozen=True)
class PoolerConfig:
    pooling_type: str  # LAST (the last token's hidden state), MEAN (over the sequence) or CLS (the first token)
    normalize: bool  # to unit length (a request may override)
    max_seq_length: int | None = None  # sentence-transformers' input length: the default max_model_len
    matryoshka: bool = False  # trained so that a prefix of the vector is an embedding: requests may ask `dimensions`


def read_pooler_config(src: ModelSource, is_encoder: bool, override: dict[str, Any] | None = None) -> PoolerConfig:
    pooling, normalize, max_len = ("CLS" if is_encoder else "LAST"), True, None
    matryoshka = False
    if not src.is_gguf:
        modules = src.read_json("modules.json")
        if isinstance(modules, list):
            kinds = {m.get("type", "").rsplit(".", 1)[-1]: m.get("path", "") for m in modules if isinstance(m, dict)}
            if "Pooling" in kinds:
                pooling = _st_pooling(src, kinds["Pooling"])
            normalize = "Normalize" in kinds
        st = src.read_json("sentence_bert_config.json") or {}
        max_len = st.get("max_seq_length")
        hf = src.read_json("config.json") or {}
        matryoshka = bool(hf.get("is_matryoshka") or hf.get("matryoshka_dimensions"))
    if override:
        unknown = sorted(set(override) - {"pooling_type", "normalize"})
        if unknown:
            raise RivuletError(f"--pooler-config: unknown key {unknown[0]!r} (known: pooling_type, normalize)")
        pooling = str(override.get("pooling_type", pooling)).upper()
        normalize = override.get("normalize", normalize)
        if not isinstance(normalize, bool):
            raise RivuletError(f"--pooler-config: normalize must be true or false, not {normalize!r}")
    if pooling not in POOLING_TYPES:
        raise RivuletError(f"pooling type {pooling!r} is not supported (supported: {', '.join(POOLING_TYPES)})")
    return PoolerConfig(pooling, normalize, max_len, matryoshka)


def _st_pooling(src: ModelSource, path: str) -> str:
    cfg = src.read_json(f"{path}/config.json") if path else None
    if not cfg:
        raise RivuletError(f"{src.path}: modules.json names a Pooling module without {path or '?'}/config.json")
    modes = [mode for key, mode in _ST_MODES.items() if cfg.get(key)]
    other = [k for k, v in cfg.items() if k.startswith("pooling_mode_") and v and k not in _ST_MODES]
    if len(modes) != 1 or other:
        on = [k for k, v in cfg.items() if k.startswith("pooling_mode_") and v]
        raise RivuletError(f"{src.path}: sentence-transformers pooling {on} is not supported (one of mean, cls, "
                           "lasttoken)")
    return modes[0]
