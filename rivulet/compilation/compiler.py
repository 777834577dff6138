"""`torch.compile` of a model's forward over one flat batch.

The model is plain PyTorch around kernels that are dispatcher ops with fake implementations
(`torch.ops.rivulet.*`, `rivulet/kernels/cpu/ops.py`), and its attention metadata is tensors only
(`AttentionMetadata`: the backend's plan is built before the forward), so Dynamo captures the whole
forward as one graph for any token count: each kernel is one opaque node, attention included, and
inductor compiles the PyTorch between them (views, splits, embedding, the glue ops of references).
What it removes is the interpreter: module calls, argument checks, per-op dispatch of the glue.

Levels (`--compilation-level`): 0 runs the model eagerly; 1 compiles it. Inductor's and
AOTAutograd's caches live under ~/.cache/rivulet/compile (or $RIVULET_CACHE_DIR/compile), so a
second start reuses the compiled code; Dynamo still traces the model at every start.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from rivulet.kernels.attention import AttentionMetadata

logger = logging.getLogger(__name__)

COMPILATION_LEVELS = {0: "eager", 1: "torch.compile (inductor), kernels and attention as opaque ops"}

ModelForward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


def compile_cache_dir() -> Path:
    root = os.environ.get("RIVULET_CACHE_DIR") or Path.home() / ".cache" / "rivulet"
    return Path(root) / "compile"


def _configure_caches() -> None:
    """Point inductor's persistent caches (generated code, FX graphs, AOTAutograd) at our cache folder."""
    root = compile_cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(root / "inductor"))
    import torch._inductor.config as inductor_config

    inductor_config.fx_graph_cache = True
    import torch._functorch.config as functorch_config

    functorch_config.enable_autograd_cache = True


class CompiledForward:
    """`model(input_ids, positions, meta)` through `torch.compile`: one graph for every token count
    (dynamic shapes), compiled at the first call of each kind of step (one token, or more: Dynamo
    specializes a size of 1); `compile_s` adds up the time those first calls took."""

    def __init__(self, model: nn.Module) -> None:
        _configure_caches()
        self.model = model
        self._fn = torch.compile(model, dynamic=True, fullgraph=True)
        self.compile_s = 0.0
        self._seen: set[bool] = set()

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        # the metadata only reaches opaque kernels: its sizes need no guards, so they are unbacked, which
        # keeps Dynamo from specializing (and recompiling mid-serving) on a size of 0 or 1, e.g. a step
        # without decodes or a block table one block wide
        for t in (meta.slot_mapping, meta.query_start_loc, meta.seq_lens, *meta.plan.values()):
            torch._dynamo.decorators.mark_unbacked(t, 0)
        torch._dynamo.decorators.mark_unbacked(meta.block_tables, 0)
        torch._dynamo.decorators.mark_unbacked(meta.block_tables, 1)
        kind = input_ids.shape[0] > 1
        if kind in self._seen:
            return self._fn(input_ids, positions, meta)
        start = time.perf_counter()
        out = self._fn(input_ids, positions, meta)
        took = time.perf_counter() - start
        self._seen.add(kind)
        self.compile_s += took
        logger.info("compiled the model for %s steps in %.1f s", _describe(kind), took)
        return out


def _describe(kind: bool) -> str:
    return "multi-token" if kind else "one-token"
