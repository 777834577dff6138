"""Several models behind one server: ``rivulet serve --config deploy.yaml``, and models loaded and unloaded
while it runs (``POST /v1/models/load``, ``DELETE /v1/models/{name}``).

    models:
      - name: chat                 # the served name; `aliases: [...]` optional
        model: default             # "default", a HF folder or a .gguf file
        args: {dtype: bfloat16, max_num_seqs: 32}   # any engine argument, by its LLM(...) keyword
      - name: minilm
        model: path/to/sentence-transformers-folder
        task: embed                # generate (default) | embed

Each model runs in its own engine process (a ``SupervisedEngine``, or data-parallel replicas) with its own
``ServerContext`` and handlers; a request goes to the model its ``model`` field names (the first model when
it names none). This module imports neither FastAPI nor torch.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from rivulet.config import EngineConfig, RivuletError
from rivulet.engine.args import EngineArgs

logger = logging.getLogger("rivulet.server")

MODEL_KEYS = {"name", "model", "aliases", "task", "args"}
LOAD_OVERHEAD_BYTES = 512 << 20  # an engine process beyond its weights and KV cache: Python, torch, activations


@dataclass(frozen=True)
class ModelSpec:
    """One model of a deployment, as the file (or a load request) gives it."""

    name: str
    model: str = "default"
    aliases: tuple[str, ...] = ()
    task: str = "generate"
    args: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def parse(cls, d: Any, where: str) -> ModelSpec:
        if not isinstance(d, dict):
            raise RivuletError(f"{where}: a model is a mapping with name, model, aliases, task, args")
        unknown = sorted(set(d) - MODEL_KEYS)
        if unknown:
            raise RivuletError(f"{where}: unknown key {unknown[0]!r} (known: {', '.join(sorted(MODEL_KEYS))})")
        name = d.get("name")
        if not isinstance(name, str) or not name:
            raise RivuletError(f"{where}: 'name' must be a non-empty string")
        aliases = d.get("aliases") or []
        if not isinstance(aliases, list) or not all(isinstance(a, str) and a for a in aliases):
            raise RivuletError(f"{where} ({name}): 'aliases' must be a list of names")
        args = d.get("args") or {}
        if not isinstance(args, dict):
            raise RivuletError(f"{where} ({name}): 'args' must be a mapping of engine arguments")
        if clash := sorted({"model", "task"} & set(args)):
            raise RivuletError(f"{where} ({name}): give {clash[0]!r} as a key of the model, not in 'args'")
        model = d.get("model", "default")
        if not isinstance(model, str) or not model:
            raise RivuletError(f"{where} ({name}): 'model' must be 'default', a folder or a .gguf file")
        spec = cls(name, model, tuple(aliases), d.get("task", "generate"), dict(args))
        spec.engine_config()  # every argument checked now, before anything starts
        return spec

    @property
    def names(self) -> list[str]:
        return [self.name, *self.aliases]

    def engine_config(self) -> EngineConfig:
        try:
            return EngineArgs.from_kwargs(self.model, {**self.args, "task": self.task}).create_engine_config()
        except (RivuletError, TypeError, ValueError) as e:
            raise RivuletError(f"model {self.name!r}: {e}") from None


@dataclass(frozen=True)
class DeploymentSpec:
    models: list[ModelSpec]
    pipelines: list[Any] = field(default_factory=list)  # PipelineSpec (rivulet/entrypoints/pipelines/)

    @classmethod
    def parse(cls, d: Any, where: str = "the deployment") -> DeploymentSpec:
        if not isinstance(d, dict):
            raise RivuletError(f"{where}: expected a mapping with 'models'")
        unknown = sorted(set(d) - {"models", "pipelines"})
        if unknown:
            raise RivuletError(f"{where}: unknown key {unknown[0]!r} (known: models, pipelines)")
        models = d.get("models")
        if not isinstance(models, list) or not models:
            raise RivuletError(f"{where}: 'models' must be a non-empty list")
        specs = [ModelSpec.parse(m, f"{where}: models[{i}]") for i, m in enumerate(models)]
        pipelines = d.get("pipelines")
        pipelines = [] if pipelines is None else pipelines
        if not isinstance(pipelines, list):
            raise RivuletError(f"{where}: 'pipelines' must be a list")
        from rivulet.entrypoints.pipelines.pipeline import PipelineSpec

        try:
            pipes = [PipelineSpec.parse(p, f"{where}: pipelines[{i}]") for i, p in enumerate(pipelines)]
        except ValueError as e:
            raise RivuletError(str(e)) from None
        seen: set[str] = set()
        for n in [n for s in specs for n in s.names] + [p.name for p in pipes]:
            if n in seen:
                raise RivuletError(f"{where}: the model name {n!r} is used twice")
            seen.add(n)
        tasks = {n: s.task for s in specs for n in s.names}
        for p in pipes:
            check_pipeline_models(p, tasks, where)
        return cls(specs, pipes)

    @classmethod
    def load(cls, path: str) -> DeploymentSpec:
        import yaml

        p = Path(path).expanduser()
        try:
            data = yaml.load(p.read_text(), Loader=_yaml_loader())
        except OSError as e:
            raise RivuletError(f"--config {path}: {e.strerror or e}") from None
        except yaml.YAMLError as e:
            raise RivuletError(f"--config {path}: not valid YAML ({e})") from None
        return cls.parse(data, f"--config {path}")


def _yaml_loader() -> Any:
    """PyYAML's safe loader with YAML 1.2 booleans: only true/false, so a stage's `on:` key stays a string (YAML
    1.1 reads on/off/yes/no as booleans)."""
    import re

    import yaml

    class Loader(yaml.SafeLoader):
        pass

    bool_tag = "tag:yaml.org,2002:bool"
    Loader.yaml_implicit_resolvers = {k: [(tag, rx) for tag, rx in v if tag != bool_tag]
                                      for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()}
    Loader.add_implicit_resolver(bool_tag, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))
    return Loader


def check_pipeline_models(pipe: Any, tasks: dict[str, str], where: str) -> None:
    """Every model a pipeline's stages name is a model of the deployment, of the right task."""
    from rivulet.entrypoints.pipelines.stages import RetrieveStage

    for stage in pipe.stages:
        want = "embed" if isinstance(stage, RetrieveStage) else "generate"
        for m in stage.models():
            if m not in tasks:
                raise RivuletError(f"{where}: pipeline {pipe.name!r}: its {stage.kind} stage names the model {m!r}, "
                                   "which the deployment does not serve")
            if tasks[m] != want:
                raise RivuletError(f"{where}: pipeline {pipe.name!r}: its {stage.kind} stage needs a model of task "
                                   f"{want}, and {m!r} is {tasks[m]}")


def check_memory(spec: ModelSpec, config: EngineConfig) -> None:
    """Refuse a load that would not fit in the host's available memory: its weights in the engine's dtype, its
    KV cache when its size is given, and an engine process's overhead (an estimate: CPU engines keep all of it
    in host memory)."""
    from rivulet.models.loader import resolve_model
    from rivulet.models.loader.size import count_parameters

    itemsize = 4 if config.model.dtype == "float32" else 2
    need = count_parameters(resolve_model(config.model.model)) * itemsize + LOAD_OVERHEAD_BYTES
    need += config.cache.kv_cache_memory or 0
    available = available_memory_bytes()
    if available is not None and need > available:
        raise RivuletError(f"model {spec.name!r} needs about {need / 2**30:.2f} GiB (weights, KV cache, process) "
                           f"but {available / 2**30:.2f} GiB of memory is available")


def available_memory_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


@dataclass
class ServedModel:
    """One model of the running server: its engine, its context and handlers, where it is in its life."""

    spec: ModelSpec
    engine: Any  # SupervisedEngine, DataParallelEngine, or a test's fake
    ctx: Any  # ServerContext
    handlers: Any  # the app's handler set for this model
    state: str = "loading"  # loading | ready | unloading
    created: int = field(default_factory=lambda: int(time.time()))


class Deployment:
    """The models a server serves, by every name they answer to. ``spawn(config)`` starts an engine (None: the
    set is fixed); the app ``attach``es ``make_served(spec, engine)``, which builds a model's context and
    handlers (the app owns the web types)."""

    def __init__(self, spawn: Callable[[EngineConfig], Any] | None = None,
                 make_served: Callable[[ModelSpec, Any], ServedModel] | None = None) -> None:
        self.spawn = spawn
        self.make_served = make_served
        self.models: dict[str, ServedModel] = {}  # by primary name, in the order they were added
        self._starting: list[tuple[ModelSpec, Any]] = []  # engines started before the app attached
        self.pipeline_specs: list[Any] = []  # PipelineSpecs, run by the app as Pipelines
        self.pipelines: dict[str, Any] = {}
        self._lock = asyncio.Lock()
        self.on_fatal: Callable[[str], None] | None = None  # given to engines loaded at run time

    def start(self, deployment: DeploymentSpec) -> None:
        """Start every model's engine (they load at once, in their own processes); `ready()` waits for them."""
        assert self.spawn is not None
        self.pipeline_specs = list(deployment.pipelines)
        for spec in deployment.models:  # (a failure leaves the started ones to `shutdown`)
            logger.info("starting the engine of %s (%s)", spec.name, spec.model)
            self._starting.append((spec, self.spawn(spec.engine_config())))

    def attach(self, make_served: Callable[[ModelSpec, Any], ServedModel]) -> None:
        self.make_served = make_served
        for spec, engine in self._starting:
            self.add(spec, engine)
        self._starting = []

    @property
    def default(self) -> ServedModel:
        return next(iter(self.models.values()))

    def add(self, spec: ModelSpec, engine: Any, state: str = "loading") -> ServedModel:
        assert self.make_served is not None, "the app attaches make_served first"
        served = self.make_served(spec, engine)
        served.state = state
        self.models[spec.name] = served
        return served

    def names(self) -> set[str]:
        return {n for m in self.models.values() for n in [*m.spec.names, *m.ctx.adapters]} | set(self.pipelines)

    def find(self, requested: str | None) -> ServedModel | None:
        """The model answering to `requested` (a name, an alias or one of its LoRA adapters); None if unknown.
        No name: the first model."""
        if not requested:
            return self.default if self.models else None
        for m in self.models.values():
            if requested in m.spec.names or requested in m.ctx.adapters:
                return m
        return None

    async def ready(self) -> None:
        """Wait for every engine to load (the first failure raises), then ready the pipelines (their indexes)."""
        await asyncio.gather(*(m.engine.ready() for m in self.models.values()))
        for m in self.models.values():
            m.state = "ready"
        for p in self.pipelines.values():
            await p.prepare()

    async def load(self, spec: ModelSpec) -> ServedModel:
        """Start a model's engine and wait until it serves; RivuletError if its name is taken or it cannot be
        loaded (then nothing of it stays)."""
        if self.spawn is None:
            raise RivuletError("this server cannot load models")
        async with self._lock:
            if taken := sorted(set(spec.names) & self.names()):
                raise RivuletError(f"the model name {taken[0]!r} is already served")
            config = spec.engine_config()
            check_memory(spec, config)
            served = self.add(spec, self.spawn(config))
            if self.on_fatal is not None:
                served.engine.on_fatal = self.on_fatal
        logger.info("loading model %s (%s)", spec.name, spec.model)
        try:
            await served.engine.ready()
        except BaseException as e:
            self.models.pop(spec.name, None)
            await served.engine.shutdown()
            if isinstance(e, Exception):
                raise RivuletError(f"model {spec.name!r} failed to load: {e}") from None
            raise
        served.state = "ready"
        logger.info("model %s is ready", spec.name)
        return served

    async def unload(self, name: str, timeout: float) -> None:
        """Stop serving `name` (new requests get 404 at once), let its requests in flight finish for up to
        `timeout` seconds, then stop its engine. KeyError if no model has this name."""
        served = self.models.get(name)
        if served is None or served.state == "unloading":
            raise KeyError(name)
        if len(self.models) == 1:
            raise RivuletError(f"{name!r} is the last model of this server; it cannot be unloaded")
        if users := sorted(p.name for p in self.pipelines.values() if name in p.spec.models()):
            raise RivuletError(f"{name!r} serves the pipeline {users[0]!r}; it cannot be unloaded")
        served.state = "unloading"
        deadline = time.monotonic() + timeout
        while served.ctx.active > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self.models.pop(name, None)
        await served.engine.shutdown()
        logger.info("model %s unloaded", name)

    async def shutdown(self) -> None:
        engines = [m.engine for m in self.models.values()] + [e for _, e in self._starting]
        await asyncio.gather(*(e.shutdown() for e in engines), return_exceptions=True)


def model_settings(settings: Any, spec: ModelSpec, config: EngineConfig) -> Any:
    """The server settings as one model of a deployment sees them: its names and its capacity."""
    return dataclasses.replace(settings, served_model_names=spec.names, model_root=spec.model,
                               max_num_seqs=config.scheduler.max_num_seqs * config.parallel.data_parallel_size,
                               max_lora_rank=config.lora.max_lora_rank if config.lora else None, lora_modules={})
