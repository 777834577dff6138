"""`torch.compile` of a model's forward over one flat batch, saved to disk and loaded at the next start.

The model is plain PyTorch around kernels that are dispatcher ops with fake implementations
(`torch.ops.rivulet.*`, `rivulet/kernels/cpu/ops.py`; on GPUs `torch.ops.rivulet_triton.*`,
`rivulet/kernels/triton/library.py`), and its attention metadata is tensors only
(`AttentionMetadata`: the backend's plan is built before the forward), so Dynamo captures the whole
forward as one graph for any token count: each kernel is one opaque node, attention included, and
inductor compiles the PyTorch between them (views, splits, embedding, the glue ops of references).
What it removes is the interpreter: module calls, argument checks, per-op dispatch of the glue.

Two graphs per model: steps of one token, and steps of more (any count: the token dimension is
dynamic, the weights static, the metadata sizes unbacked). A model with weight-only int8/int4 linears,
which read their compact copies up to R rows and the original weights beyond, gets three: one token,
2 to R, and more than R, each token range declared to Dynamo, so that the row test is decided once per
graph (one multi-token graph would be specialized on the first step's side of it and recompiled, tens of
seconds in the middle of serving, at the first step on the other side). Sequence parallelism over n ranks
splits at n the same way (a rank's token shard is one row up to n tokens). Each is compiled ahead of time
(`torch.compile(...).aot_compile`) at the first step of its kind and saved, Dynamo's guards and
inductor's code together, under ~/.cache/rivulet/compile/aot (or $RIVULET_CACHE_DIR/compile/aot),
named by a fingerprint of everything the trace depends on (torch, the Rivulet sources, the CPU, the
model's structure, weight shapes and dtypes). A start that finds the files loads them in a background
thread while the engine finishes starting (seconds, instead of tens of seconds of tracing and
compiling). Whatever fails on that path (a graph that will not
serialize, a step the saved guards reject) is logged and falls back to the in-process `torch.compile`,
which gives the same results.

On CUDA the runner's CUDA graphs capture this forward (compiled pieces + CUDA graphs): the warm-up run
before each capture compiles or loads the graphs.

Levels (`--compilation-level`): 0 runs the model eagerly; 1 compiles it; 2 compiles it with Rivulet's
fusion passes (`passes.py`), which inductor runs on the captured graph; the passes are part of the
saved graphs' fingerprint.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import io
import logging
import os
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple

import torch
from torch import nn

from rivulet.compilation.passes import FusionPasses, inductor_pass
from rivulet.kernels.attention import AttentionMetadata
from rivulet.layers.quantization import WeightOnly
from rivulet.platforms import current_platform

logger = logging.getLogger(__name__)

COMPILATION_LEVELS = {0: "eager", 1: "torch.compile (inductor), kernels and attention as opaque ops",
                      2: "level 1 and Rivulet's fusion passes"}

ModelForward = Callable[..., torch.Tensor]  # (input_ids, positions, meta[, received])
_GUARD_FAILED = "GuardManager check failed"  # torch's message when a saved graph's guards reject a call


def compile_cache_dir() -> Path:
    root = os.environ.get("RIVULET_CACHE_DIR") or Path.home() / ".cache" / "rivulet"
    return Path(root) / "compile"


def _configure_caches() -> None:
    """Point inductor's persistent caches (generated code, FX graphs, AOTAutograd; all on by default) at
    our cache folder. Only an environment variable: importing inductor costs a second, off the start."""
    root = compile_cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(root / "inductor"))


def _trust_reported_isa() -> None:
    """Inductor checks each vector ISA the CPU reports by building and loading a test library (about a
    second, at every start). Where no AMX is reported, the flags are trustworthy on the machines we run
    on (AMX may be reported and unusable in VMs: then the checks stay)."""
    import torch._inductor.config as inductor_config

    if inductor_config.cpp.vec_isa_ok is None and "amx" not in _cpu_flags():
        inductor_config.cpp.vec_isa_ok = True


@lru_cache(maxsize=1)
def _cpu_flags() -> str:
    try:
        return next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")), "")
    except OSError:
        return ""


def _package_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "-"


@lru_cache(maxsize=1)
def _environment_digest() -> str:
    """torch, Python, the CPU's flags, the GPU (inductor's code for it is built for its architecture) and every
    Rivulet source file: what a saved graph was made with."""
    h = hashlib.sha256(f"{torch.__version__}|{sys.version}".encode())
    h.update(_cpu_flags().encode())
    if current_platform().name == "cuda":  # inductor's and the ops' Triton code is built for this GPU
        h.update(f"{torch.cuda.get_device_name()}|{torch.cuda.get_device_capability()}".encode())
        h.update(_package_version("triton").encode())
    package = Path(__file__).resolve().parents[1]
    for f in sorted(package.rglob("*")):
        if f.suffix in (".py", ".cpp", ".h"):
            h.update(str(f.relative_to(package)).encode())
            h.update(f.read_bytes())
    return h.hexdigest()


def _describe_value(v: Any) -> str | None:
    """What of a module attribute the trace may depend on; None for what it cannot (dicts, objects)."""
    if isinstance(v, (bool, int, float, str, type(None), torch.dtype, torch.device)):
        return repr(v)
    if isinstance(v, torch.Tensor):
        return f"tensor{tuple(v.shape)}{tuple(v.stride())}{v.dtype}{v.device}"
    if isinstance(v, (tuple, list)):
        parts = [_describe_value(x) for x in v]
        return None if any(p is None for p in parts) else f"({','.join(parts)})"  # type: ignore[arg-type]
    if callable(v):
        return str(v) if isinstance(v, torch._ops.OpOverload) else getattr(v, "__qualname__", type(v).__qualname__)
    return None


class StepKind(NamedTuple):
    """Steps of `lo` to `hi` tokens, one compiled graph; `name` names its file."""

    name: str
    lo: int
    hi: int

    def takes(self, tokens: int) -> bool:
        return self.lo <= tokens <= self.hi


def max_step_tokens(model: nn.Module) -> int:
    """The most tokens a compiled step takes: every activation of the step ([tokens, width], width at most
    the widest weight dimension) keeps under 2**31 elements. Inductor's GPU kernels index in 32 bits where
    a buffer fits and guard that it does; a token range reaching past that fails at compile time (Dynamo's
    constraint violation). Longer steps, far beyond any step budget, run eager."""
    width = max((max(p.shape) for p in model.parameters() if p.dim() >= 2), default=1)
    return (2**31 - 1) // width


def step_kinds(model: nn.Module) -> list[StepKind]:
    """One token, and more; more is split where a graph would otherwise be specialized on one side: at R with
    weight-only linears (compact copies up to R rows), and at the tensor-parallel size n with sequence
    parallelism (up to n tokens a rank's shard is one row)."""
    bounds = {1}
    rows = min((m.quant.max_rows for m in model.modules() if isinstance(getattr(m, "quant", None), WeightOnly)),
               default=None)
    if rows is not None and rows >= 2:
        bounds.add(rows)
    sp = max((m.parallel.tp_size for m in model.modules() if getattr(getattr(m, "parallel", None), "sp", False)),
             default=1)
    if sp >= 2:
        bounds.add(sp)
    ends = sorted(bounds)
    kinds = [StepKind("one-token", 1, 1)]
    kinds += [StepKind(f"{lo + 1}-{hi}-token", lo + 1, hi) for lo, hi in zip(ends, ends[1:])]
    last = ends[-1]
    name = "multi-token" if last == 1 else f"multi-token-over-{last}"
    kinds.append(StepKind(name, last + 1, max_step_tokens(model)))
    return kinds


def model_fingerprint(model: nn.Module, passes: tuple[str, ...] = ()) -> str:
    """A digest of the model as a trace sees it: module types, their plain attributes (sizes, eps, flags,
    the kernel each one calls), every weight's shape, strides and dtype, the environment, and the fusion
    passes that rewrite the graph."""
    h = hashlib.sha256(_environment_digest().encode())
    h.update(f"passes={','.join(passes)}".encode())
    for name, mod in model.named_modules():
        h.update(f"{name}:{type(mod).__module__}.{type(mod).__qualname__}".encode())
        for key, value in vars(mod).items():
            described = _describe_value(value)
            if described is not None:
                h.update(f"{key}={described}".encode())
        for key, t in (*mod.named_parameters(recurse=False), *mod.named_buffers(recurse=False)):
            h.update(f"{key}={_describe_value(t)}".encode())
    return h.hexdigest()[:24]


class CompiledForward:
    """`model(input_ids, positions, meta)` through a compiled graph for each kind of step (one token, or
    more). Graphs a start before saved are loaded in a background thread from construction on (the
    engine reports ready meanwhile; a step that needs a graph still loading waits for it); a graph
    not on disk is compiled at the first step of its kind and saved. `compile_s` adds up load and
    compile time, `loaded` and `compiled` name the kinds that came from disk or were compiled,
    `fallbacks` counts steps that went to the in-process `torch.compile` (see the module docstring).
    `kinds` are the token ranges with a graph each (`step_kinds`).
    `passes` names the fusion passes to run (level 2); `fusions` counts their rewrites in the graphs
    this process compiled."""

    def __init__(self, model: nn.Module, cache: bool = True, passes: tuple[str, ...] = ()) -> None:
        _configure_caches()
        self.model = model
        self.cache_dir = compile_cache_dir() / "aot" if cache else None
        self.passes = FusionPasses(passes)
        self.fingerprint = model_fingerprint(model, self.passes.names)
        self.compile_s = 0.0
        self.loaded: set[str] = set()
        self.compiled: set[str] = set()
        self.fallbacks = 0
        self.kinds = step_kinds(model)
        self._graphs: dict[StepKind, Any] = {}  # kind -> AOTCompiledFunction, called as fn(model, ids, positions, meta)
        self._jit: ModelForward | None = None  # torch.compile(model) where the saved graph cannot serve
        self._loading: dict[StepKind, Future] = {}
        saved = [kind for kind in self.kinds if (p := self._path(kind)) is not None and p.is_file()]
        if saved:
            pool = ThreadPoolExecutor(1, thread_name_prefix="rivulet-compile-load")
            self._loading = {kind: pool.submit(self._load, kind) for kind in saved}
            pool.shutdown(wait=False)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 received: torch.Tensor | None = None) -> torch.Tensor:
        """`received`: a pipeline stage's input from the stage before (`worker/pipeline.py`); passed on only
        where given, so a model without pipeline stages (an encoder) keeps its three-argument forward."""
        kind = next((k for k in self.kinds if k.takes(input_ids.shape[0])), None)
        if kind is None:  # past max_step_tokens
            return self.model(*_args(input_ids, positions, meta, received))
        if kind not in self._graphs:
            loading = self._loading.pop(kind, None)
            graph = loading.result() if loading is not None else None
            if graph is None:
                with _marked(kind, input_ids, positions, meta, self._kv_caches(), received):
                    graph = self._compile(kind, input_ids, positions, meta, received)
            self._graphs[kind] = graph
        graph = self._graphs[kind]
        if graph is not None:
            try:
                return graph(self.model, *_args(input_ids, positions, meta, received))
            except RuntimeError as e:
                if not str(e).startswith(_GUARD_FAILED):
                    raise
                why = " ".join(str(e).split())  # torch lists every guard part: the first few say enough
                logger.warning("the saved %s graph does not fit this step (%s); using torch.compile",
                               kind.name, why if len(why) <= 600 else why[:600] + " ...")
                self._graphs[kind] = None
        self.fallbacks += 1
        with _marked(kind, input_ids, positions, meta, self._kv_caches(), received):
            return self._jit_forward(input_ids, positions, meta, received)

    @property
    def fusions(self) -> dict[str, int]:
        return dict(self.passes.applied)

    def _inductor_options(self) -> dict[str, Any]:
        return {"pre_grad_custom_pass": inductor_pass(self.passes)} if self.passes.names else {}

    def _kv_caches(self) -> list[torch.Tensor]:
        return [c for m in self.model.modules() if isinstance(c := getattr(m, "kv_cache", None), torch.Tensor)]

    def _path(self, kind: StepKind) -> Path | None:
        return None if self.cache_dir is None else self.cache_dir / f"{self.fingerprint}-{kind.name}.bin"

    def _load(self, step: StepKind) -> Any:
        kind, path, start = step.name, self._path(step), time.perf_counter()
        assert path is not None
        _trust_reported_isa()
        try:
            # in inference mode, as steps run: the saved guards rebuild their example tensors as this
            # mode makes them (else they expect a normal tensor's dispatch keys and reject every step)
            with torch.inference_mode():
                graph = torch.compiler.load_compiled_function(io.BytesIO(path.read_bytes()))
        except Exception as e:  # noqa: BLE001 - a stale or truncated file: compile again
            logger.warning("could not load the saved %s graph %s (%s: %s); compiling it", kind, path,
                           type(e).__name__, e)
            return None
        took = time.perf_counter() - start
        self.compile_s += took
        self.loaded.add(kind)
        logger.info("loaded the compiled model for %s steps in %.1f s (%s)", kind, took, path)
        return graph

    def _compile(self, step: StepKind, input_ids: torch.Tensor, positions: torch.Tensor,
                 meta: AttentionMetadata, received: torch.Tensor | None) -> Any:
        kind, path, start = step.name, self._path(step), time.perf_counter()
        _trust_reported_isa()
        try:
            # float attributes (eps) as constants: dynamo's restart to specialize them has no place in AOT
            with torch._dynamo.config.patch(specialize_float=True), \
                    torch._inductor.config.patch(self._inductor_options()):
                fn = torch.compile(type(self.model).forward, fullgraph=True)
                graph = fn.aot_compile(((self.model, *_args(input_ids, positions, meta, received)), {}))
        except Exception as e:  # noqa: BLE001 - the in-process compile still works
            logger.warning("ahead-of-time compile of the %s graph failed (%s: %s); using torch.compile", kind,
                           type(e).__name__, e)
            return None
        took = time.perf_counter() - start
        self.compile_s += took
        self.compiled.add(kind)
        logger.info("compiled the model for %s steps in %.1f s%s", kind, took,
                    f" (fusion passes, rewrites so far: {self.fusions})" if self.passes.names else "")
        if path is not None:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                graph.save_compiled_function(str(path))
            except Exception as e:  # noqa: BLE001 - only the next start's time is lost
                logger.warning("could not save the compiled %s graph (%s: %s)", kind, type(e).__name__, e)
        return graph

    def _jit_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                     received: torch.Tensor | None) -> torch.Tensor:
        if self._jit is None:
            self._jit = torch.compile(self.model, fullgraph=True, options=self._inductor_options() or None)
        return self._jit(*_args(input_ids, positions, meta, received))


def _args(input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
          received: torch.Tensor | None) -> tuple:
    return (input_ids, positions, meta) if received is None else (input_ids, positions, meta, received)


_MARKS = ("_dynamo_dynamic_indices", "_dynamo_dynamic_range", "_dynamo_hint_overrides", "_specialize_on",
          "_dynamo_unbacked_indices", "_dynamo_shape_ids", "_dynamo_unbacked_bounds", "_has_dynamo_dim_marking")


@contextmanager
def _marked(kind: StepKind, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
            kv_caches: list[torch.Tensor], received: torch.Tensor | None = None) -> Iterator[None]:
    """Dynamo's size annotations on a step's inputs while it traces them, taken off afterwards: a saved
    graph guards that a tensor it saw unmarked comes unmarked, and some metadata tensors live on.

    The token dimension is dynamic for steps of more than one token, within the kind's range (a count of 1
    is its own kind);
    the metadata and the KV caches only reach opaque kernels, so their sizes are unbacked: no guards,
    and no specialization on a size of 0 or 1 (a step without decodes, a block table one block wide)."""
    marked = [meta.slot_mapping, meta.query_start_loc, meta.seq_lens, *meta.plan.values(), meta.block_tables]
    for t in marked[:-1]:
        torch._dynamo.decorators.mark_unbacked(t, 0)
    torch._dynamo.decorators.mark_unbacked(meta.block_tables, 0)
    torch._dynamo.decorators.mark_unbacked(meta.block_tables, 1)
    for cache in kv_caches:  # [2, num_blocks, ...]: a saved graph serves any KV cache size
        torch._dynamo.decorators.mark_unbacked(cache, 1)
        marked.append(cache)
    if kind.hi != 1:
        hi = kind.hi
        torch._dynamo.mark_dynamic(input_ids, 0, min=kind.lo, max=hi)
        torch._dynamo.mark_dynamic(positions, 0, min=kind.lo, max=hi)
        marked += [input_ids, positions]
        if received is not None and received.shape[1] > 1:  # a pipeline stage's input: [2, rows, hidden], rows =
            # tokens, or with SP over n ranks this rank's shard of the padded tokens (one row up to n tokens)
            torch._dynamo.mark_dynamic(received, 1, min=2 if received.shape[1] != input_ids.shape[0] else kind.lo,
                                       max=hi)
            marked.append(received)
    try:
        yield
    finally:
        for t in marked:
            for attr in _MARKS:
                if hasattr(t, attr):
                    delattr(t, attr)

