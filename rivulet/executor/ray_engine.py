"""A whole engine (one data-parallel replica) as a Ray actor: ``--data-parallel-backend ray``.

The front end (`AsyncLLM`) binds its two ZeroMQ sockets on TCP at its node's address; the actor, placed by
Ray wherever ``num_cpus`` fit (``RIVULET_RAY_CPUS_PER_ENGINE``, default 1), runs the engine process's loop
(`run_engine_core`) connected to them. `RayEngineProcess` gives the front end the few things it asks of a
`subprocess.Popen` (poll, kill, wait): the actor's running call is the process. When the front end exits,
Ray ends the actors it owns. The model path must exist on every node.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from rivulet.config import EngineConfig, RivuletError

logger = logging.getLogger("rivulet.ray")


class EngineActor:
    """The body of the actor: one engine, serving its front end until told to stop."""

    def run(self, config_json: str, input_addr: str, output_addr: str) -> int:
        from rivulet.engine.core_proc import run_engine_core

        run_engine_core(EngineConfig.from_json(config_json), input_addr, output_addr)
        return 0

    def where(self) -> tuple[str, str]:
        """(node address, node id) of the node Ray placed this actor on."""
        import ray

        return ray.util.get_node_ip_address(), ray.get_runtime_context().get_node_id()


def node_address() -> str:
    """This node's address in the Ray cluster (joined, or a local one started, on first use)."""
    ray = _ray()
    return ray.util.get_node_ip_address()


class RayEngineProcess:
    """An engine actor, seen as a process: ``poll()`` is None while its loop runs, then its exit code."""

    pid = None

    def __init__(self, config: EngineConfig, input_addr: str, output_addr: str) -> None:
        ray = self.ray = _ray()
        cpus = float(os.environ.get("RIVULET_RAY_CPUS_PER_ENGINE", 1))
        self.actor = ray.remote(EngineActor).options(num_cpus=cpus).remote()
        self._where = self.actor.where.remote()  # answered once Ray has placed it (ahead of `run`)
        self.ref = self.actor.run.remote(config.to_json(), input_addr, output_addr)
        self.returncode: int | None = None
        self.node: tuple[str, str] | None = None

    def poll(self) -> int | None:
        if self.node is None and self.ray.wait([self._where], timeout=0)[0]:
            try:
                self.node = self.ray.get(self._where)
                logger.info("engine actor placed on node %s (id %s)", *self.node)
            except Exception:  # the actor died before it answered: `run` below says so
                self.node = ("?", "?")
        if self.returncode is None:
            done, _ = self.ray.wait([self.ref], timeout=0)
            if done:
                try:
                    self.returncode = int(self.ray.get(self.ref))
                except Exception:  # the actor died (killed, or its node went away) or the loop raised
                    self.returncode = 1
                self.ray.kill(self.actor, no_restart=True)  # its loop is over: give its CPUs back
        return self.returncode

    def kill(self) -> None:
        self.ray.kill(self.actor, no_restart=True)

    def wait(self, timeout: float | None = None) -> int:
        done, _ = self.ray.wait([self.ref], timeout=timeout)
        if not done:
            import subprocess

            raise subprocess.TimeoutExpired("ray engine actor", timeout or 0)
        code = self.poll()
        assert code is not None
        return code


def _ray() -> Any:
    try:
        import ray
    except ImportError:
        raise RivuletError("--data-parallel-backend ray needs Ray: pip install 'rivulet[ray]'") from None
    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS"), log_to_driver=False)
    return ray
