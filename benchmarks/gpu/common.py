"""Shared by the GPU check's sections: timing, result files and time limits."""

from __future__ import annotations

import gc
import json
import os
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_call(fn: Callable[[], object], device: torch.device, target_s: float = 0.2, max_iters: int = 200,
              min_iters: int = 3) -> float:
    """Seconds per call of `fn` (after a warm-up call), repeated to fill about `target_s`."""
    fn()
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    once = max(time.perf_counter() - t0, 1e-6)
    iters = int(min(max(target_s / once, min_iters), max_iters))
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3 / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters


def free_memory(device: torch.device) -> None:
    """Return freed memory to the device: first the objects only a reference cycle keeps (a transformers model
    is one; on an 80 GB card its 16 GB outlived `del` and the next engine ran out of memory)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def error_text(e: BaseException) -> str:
    """The exception and the last frames of its traceback, short enough for a JSON field."""
    tb = traceback.format_exception(type(e), e, e.__traceback__)
    return ("".join(tb[-3:]))[-1500:]


class PartWriter:
    """One section's results, rewritten to its JSON file after every update, so a section that
    is killed at its time limit still leaves what it measured."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.data: dict[str, Any] = {"status": "running"}
        self.flush()

    def set(self, key: str, value: Any) -> None:
        self.data[key] = value
        self.flush()

    def append(self, key: str, value: Any) -> None:
        self.data.setdefault(key, []).append(value)
        self.flush()

    def flush(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=2, default=str))
        os.replace(tmp, self.path)


class Deadline:
    """An absolute time limit: steps ask whether they still fit."""

    def __init__(self, at: float) -> None:
        self.at = at

    def left(self) -> float:
        return self.at - time.time()

    def fits(self, seconds: float) -> bool:
        return self.left() > seconds
