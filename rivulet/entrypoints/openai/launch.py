"""``rivulet serve`` up to the web app: check the flags, bind the port, start the engine process,
and only then import the web framework and build the app (`api_server`), so that the engine's
model load (the longer part of a start) runs while this process imports FastAPI and loads the
tokenizer, on the other core:

    front end:  flags, bind | spawn | import fastapi, build app ... | wait ready | serve
    engine:                 | python, torch, model, KV cache ......| ready
    tokenizer thread:       | transformers, tokenizer files ....   |

This module imports neither FastAPI nor torch.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import socket
from pathlib import Path
from dataclasses import dataclass, field
from typing import Any

from rivulet.config import EngineConfig, RivuletError
from rivulet.engine.args import EngineArgs
from rivulet.entrypoints.openai.tools import TOOL_CALL_PARSERS

logger = logging.getLogger("rivulet.server")


@dataclass
class ServerSettings:
    """How the server behaves, from the command line."""

    served_model_names: list[str]
    model_root: str | None = None
    api_key: str | None = None
    max_queue: int | None = None  # None: no limit
    max_num_seqs: int = 128  # the engine's running capacity, part of the admission limit
    drain_timeout: float = 30.0
    retry_after_s: int = 1
    chat_template: str | None = None  # --chat-template: used in place of the model's
    tool_call_parser: str | None = None  # set with --enable-auto-tool-choice: tool_choice "auto" parses with it
    reasoning_parser: str | None = None  # --reasoning-parser: <think>...</think> goes to reasoning_content
    max_engine_restarts: int = 3  # within 10 minutes; one more ends the server with exit code 1
    engine_watchdog_s: float | None = 300.0  # kill an engine silent this long with work to do; None: no watchdog
    max_request_bytes: int = 32 << 20  # larger bodies get 413
    request_timeout: float | None = None  # seconds from arrival to the last byte; past it 408 (None: no limit)
    data_parallel_policy: str = "cache_aware"  # which replica takes a request (rivulet/router/policies.py)
    max_lora_rank: int | None = None  # --enable-lora: adapters up to this rank may be served; None: LoRA off
    lora_modules: dict[str, str] = field(default_factory=dict)  # --lora-modules: adapter name -> PEFT folder
    otlp_traces_endpoint: str | None = None  # OpenTelemetry traces to this OTLP/HTTP collector; None: none
    log_requests: bool = False  # one JSON line per finished engine request on stderr (logger rivulet.requests)
    log_request_text: bool = False  # ... with its prompt and output text

    @property
    def admission_limit(self) -> int | None:
        """Most unfinished requests at once: running capacity plus ``max_queue`` waiting; None: no limit."""
        return None if self.max_queue is None else self.max_num_seqs + self.max_queue


def engine_config_from_args(a: argparse.Namespace) -> EngineConfig:
    """The EngineConfig the command line asks for."""
    return EngineArgs.from_cli_args(a).create_engine_config()


def settings_from_args(a: argparse.Namespace) -> ServerSettings:
    """The ServerSettings the command line asks for."""
    if not 0 <= a.port <= 65535:
        raise RivuletError(f"--port must be in 0..65535, got {a.port}")
    if any(not name.strip() for name in a.served_model_name or ()):
        raise RivuletError("--served-model-name: a name cannot be empty")
    if a.max_queue is not None and a.max_queue < 0:
        raise RivuletError("--max-queue must be >= 0")
    if a.drain_timeout < 0:
        raise RivuletError("--drain-timeout must be >= 0")
    if a.max_engine_restarts < 0:
        raise RivuletError("--max-engine-restarts must be >= 0")
    if a.engine_watchdog_s is not None and a.engine_watchdog_s <= 0:
        raise RivuletError("--engine-watchdog-s must be > 0 (leave it out for the default, 300)")
    if a.max_request_bytes < 1:
        raise RivuletError("--max-request-bytes must be >= 1")
    if a.request_timeout is not None and a.request_timeout <= 0:
        raise RivuletError("--request-timeout must be > 0 (leave it out for no limit)")
    if a.data_parallel_size < 1:
        raise RivuletError("--data-parallel-size must be >= 1")
    if a.data_parallel_size > 1 and (a.kv_offload_memory or a.kv_tier_path):
        raise RivuletError("the KV tier (--kv-offload-memory, --kv-tier-path) serves one replica: drop it or "
                           "--data-parallel-size")
    if a.log_request_text and not a.log_requests:
        raise RivuletError("--log-request-text needs --log-requests")
    if a.enable_auto_tool_choice and a.tool_call_parser is None:
        raise RivuletError("--enable-auto-tool-choice needs --tool-call-parser "
                           f"({', '.join(TOOL_CALL_PARSERS)})")
    modules = parse_lora_modules(a.lora_modules or [], a.max_lora_rank if a.enable_lora else None)
    if clash := set(modules) & set(a.served_model_name or [a.model]):
        raise RivuletError(f"--lora-modules: {sorted(clash)[0]!r} is already the base model's name")
    template = a.chat_template
    if template is not None:
        path = Path(template).expanduser()
        if path.is_file():
            template = path.read_text()
        elif "{" not in template:  # neither a file nor a template
            raise RivuletError(f"--chat-template {a.chat_template!r}: no such file")
    return ServerSettings(served_model_names=a.served_model_name or [a.model], model_root=a.model,
                          api_key=a.api_key, max_queue=a.max_queue,
                          max_num_seqs=a.max_num_seqs * a.data_parallel_size,
                          drain_timeout=a.drain_timeout, chat_template=template,
                          tool_call_parser=a.tool_call_parser if a.enable_auto_tool_choice else None,
                          reasoning_parser=a.reasoning_parser, max_engine_restarts=a.max_engine_restarts,
                          engine_watchdog_s=a.engine_watchdog_s, max_request_bytes=a.max_request_bytes,
                          request_timeout=a.request_timeout,
                          data_parallel_policy=a.data_parallel_policy,
                          max_lora_rank=a.max_lora_rank if a.enable_lora else None, lora_modules=modules,
                          otlp_traces_endpoint=a.otlp_traces_endpoint, log_requests=a.log_requests,
                          log_request_text=a.log_request_text)


def parse_lora_modules(specs: list[str], max_rank: int | None) -> dict[str, str]:
    """--lora-modules entries (name=path, or vLLM's JSON form) -> {name: path}, each adapter checked."""
    from rivulet.models.loader.peft import read_adapter

    if specs and max_rank is None:
        raise RivuletError("--lora-modules needs --enable-lora")
    modules: dict[str, str] = {}
    for spec in specs:
        if spec.lstrip().startswith("{"):
            try:
                d = json.loads(spec)
                name, path = d["name"], d["path"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise RivuletError(f"--lora-modules: {spec!r} is not JSON with \"name\" and \"path\"") from None
        else:
            name, sep, path = spec.partition("=")
            if not sep or not name or not path:
                raise RivuletError(f"--lora-modules: {spec!r} is not name=path")
        if name in modules:
            raise RivuletError(f"--lora-modules: the name {name!r} is given twice")
        read_adapter(path, max_rank)  # RivuletError naming what is wrong with it
        modules[name] = str(Path(path).expanduser().resolve())
    return modules


def bind_socket(host: str, port: int) -> socket.socket:
    """A bound TCP socket (uvicorn listens on it); done before loading the model so a busy port fails fast."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except OSError as e:
        raise RivuletError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.set_inheritable(False)
    return sock


def run_server(a: argparse.Namespace) -> int:
    """``rivulet serve``: returns the exit code (0 after a signal-triggered shutdown)."""
    settings = settings_from_args(a)
    if a.config is not None:
        from rivulet.entrypoints.openai.deployment import DeploymentSpec

        check_no_engine_flags(a)
        target: Any = DeploymentSpec.load(a.config)
    else:
        target = engine_config_from_args(a)
    sock = bind_socket(a.host, a.port)
    try:
        return asyncio.run(_start_and_serve(target, settings, sock, a))
    finally:
        sock.close()


def check_no_engine_flags(a: argparse.Namespace) -> None:
    """With --config every model's engine arguments come from the file: a flag beside it would be ignored."""
    given = [f.name for f in dataclasses.fields(EngineArgs) if getattr(a, f.name, f.default) != f.default]
    for flag in ("served_model_name", "lora_modules"):
        if getattr(a, flag, None):
            given.append(flag)
    if given:
        raise RivuletError(f"--config gives every model's engine arguments (its 'args'); drop "
                           f"--{given[0].replace('_', '-')} or move it into the file")


def make_engine(config: EngineConfig, settings: ServerSettings) -> Any:
    """A supervised engine process for `config`, or its data-parallel replicas behind one client."""
    from rivulet.entrypoints.openai.supervisor import SupervisedEngine

    n = config.parallel.data_parallel_size
    logger.info("starting the engine for %s%s", config.model.model, f" ({n} replicas)" if n > 1 else "")
    if n == 1:
        return SupervisedEngine(config, settings.max_engine_restarts, watchdog_s=settings.engine_watchdog_s)
    from rivulet.entrypoints.openai.data_parallel import DataParallelEngine, replica_configs
    from rivulet.router.policies import POLICIES

    # mp: each replica pinned to its share of these cores; ray: placed by Ray, on whatever node
    cpus = sorted(os.sched_getaffinity(0)) if config.parallel.data_parallel_backend == "mp" else []
    return DataParallelEngine([SupervisedEngine(c, settings.max_engine_restarts, watchdog_s=settings.engine_watchdog_s)
                               for c in replica_configs(config, n, cpus)], POLICIES[settings.data_parallel_policy]())


async def _start_and_serve(target: Any, settings: ServerSettings, sock: socket.socket, a: argparse.Namespace) -> int:
    """Start the engine (`target` an EngineConfig) or every model's (a DeploymentSpec), then serve."""
    from rivulet.entrypoints.openai.deployment import Deployment

    if isinstance(target, EngineConfig):
        engine: Any = make_engine(target, settings)
    else:
        engine = Deployment(spawn=lambda config: make_engine(config, settings))
    try:
        if isinstance(engine, Deployment):
            engine.start(target)
        from rivulet.entrypoints.openai.api_server import serve  # FastAPI: imported while the models load

        return await serve(engine, settings, sock, a)
    finally:
        await engine.shutdown()
