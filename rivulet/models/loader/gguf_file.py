"""GGUF metadata and tensor descriptors, read with `struct` from one memory map.

The `gguf` package's `GGUFReader` builds numpy views for every part of every field: 2.8 s for the
default model's file, most of it the tokenizer's ~98k strings. Here values are plain Python (strings,
numbers, lists) and tensor data are numpy views into the map, shaped as `GGUFReader` shapes them
(slowest dimension first; quantized types as rows of bytes), so `gguf.quants.dequantize` takes them.
Little-endian files (the format's default), versions 2 and 3.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quant_shape_to_byte_shape

_MAGIC = 0x46554747  # "GGUF"
_STRING, _ARRAY = 8, 9
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_PLAIN = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
          GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
          GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32, GGMLQuantizationType.I64: np.int64}


@dataclass
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # fastest dimension first, as the file lists them
    data: np.ndarray


class GGUFFile:
    def __init__(self, path: str) -> None:
        try:
            self._read(path)
        except struct.error:
            raise ValueError("truncated GGUF file") from None

    def _read(self, path: str) -> None:
        self._map = np.memmap(path, mode="r")
        self._buf = memoryview(self._map)  # type: ignore[arg-type]
        magic, version = struct.unpack_from("<II", self._buf, 0)
        if magic != _MAGIC:
            raise ValueError("not a GGUF file (bad magic)")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not supported (2 and 3 are; big-endian files are not)")
        n_tensors, n_kv = struct.unpack_from("<QQ", self._buf, 8)
        self._off = 24
        self.fields: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._string()
            self.fields[key] = self._value(self._unpack("<I")[0])
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            (n_dims,) = self._unpack("<I")
            dims = self._unpack(f"<{n_dims}Q")
            ttype, offset = self._unpack("<I")[0], self._unpack("<Q")[0]
            infos.append((name, GGMLQuantizationType(ttype), tuple(int(d) for d in dims), offset))
        align = int(self.fields.get("general.alignment", 32))
        start = self._off + (-self._off % align)
        self.tensors: list[GGUFTensor] = []
        names: set[str] = set()
        for name, ttype, dims, offset in infos:
            if name in names:
                raise ValueError(f"duplicated tensor {name}")
            names.add(name)
            n_elems = int(np.prod(dims))
            np_dims = tuple(reversed(dims))
            block, type_size = GGML_QUANT_SIZES[ttype]
            if ttype in _PLAIN:
                dtype, count = _PLAIN[ttype], n_elems
            else:
                dtype, count, np_dims = np.uint8, n_elems * type_size // block, quant_shape_to_byte_shape(np_dims, ttype)
            data = np.frombuffer(self._map, dtype=dtype, count=count, offset=start + offset).reshape(np_dims)
            self.tensors.append(GGUFTensor(name, ttype, dims, data))

    def _unpack(self, fmt: str) -> tuple[Any, ...]:
        values = struct.unpack_from(fmt, self._buf, self._off)
        self._off += struct.calcsize(fmt)
        return values

    def _string(self) -> str:
        (n,) = self._unpack("<Q")
        s = bytes(self._buf[self._off:self._off + n]).decode("utf-8")
        self._off += n
        return s

    def _value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self._string()
        if vtype == _ARRAY:
            etype, count = self._unpack("<I")[0], self._unpack("<Q")[0]
            if etype == _STRING:  # the tokenizer's vocabulary and merges: ~150k strings, one tight loop
                buf, off, out, length = self._buf, self._off, [], struct.Struct("<Q").unpack_from
                for _ in range(count):
                    (n,) = length(buf, off)
                    out.append(str(buf[off + 8:off + 8 + n], "utf-8"))
                    off += 8 + n
                self._off = off
                return out
            if etype == _ARRAY:
                return [self._value(etype) for _ in range(count)]
            fmt = _SCALARS[etype]
            values = list(struct.unpack_from(f"<{count}{fmt}", self._buf, self._off))
            self._off += count * struct.calcsize(fmt)
            return values
        if vtype not in _SCALARS:
            raise ValueError(f"unknown GGUF value type {vtype}")
        return self._unpack("<" + _SCALARS[vtype])[0]
