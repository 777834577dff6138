"""How many weights a model has, from its files' headers alone (no torch, no tensor data read): what the
server's memory check before loading a model needs."""

from __future__ import annotations

import json
import math
import struct

from rivulet.config import RivuletError
from rivulet.models.loader.source import ModelSource


def count_parameters(src: ModelSource) -> int:
    """Elements of every weight tensor: from the safetensors headers of a folder, or a GGUF file's tensor table."""
    if src.is_gguf:
        from rivulet.models.loader.gguf_file import GGUFFile

        return sum(math.prod(t.shape) for t in GGUFFile(str(src.gguf_path)).tensors)
    files = sorted(src.path.glob("*.safetensors"))
    if not files:
        raise RivuletError(f"{src.path} has no .safetensors files")
    total = 0
    for f in files:
        with f.open("rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        total += sum(math.prod(t["shape"]) for name, t in header.items() if name != "__metadata__")
    return total
