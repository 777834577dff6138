"""Ranks as Ray actors, so a deployment can span machines: rank 0 stays in the engine's process
(the scheduler runs once, there), ranks 1..N-1 are actors placed by a Ray placement group, and all
of them join one torch.distributed group at rank 0's address. Steps travel exactly as with
`MultiprocExecutor` (a broadcast from rank 0); Ray only starts, places and watches the workers.

Ray is optional (`pip install 'rivulet[ray]'`) and imported only when this executor is chosen
(`--distributed-executor-backend ray`). `ray.init()` joins the cluster named by `RAY_ADDRESS`, or
starts a local one; a caller may `ray.init(...)` first. The model path must exist on every node.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from rivulet.config import EngineConfig, RivuletError
from rivulet.distributed import ParallelState, set_parallel_state
from rivulet.executor.multiproc import MultiprocExecutor, _free_port, check_parallel
from rivulet.models.loader import ModelSource, load_arch_config
from rivulet.platforms import current_platform
from rivulet.worker.commands import Gather, Shutdown
from rivulet.worker.worker import Worker


class RayWorker:
    """The body of one Ray actor: a `Worker` that serves rank 0's broadcasts until told to stop."""

    def __init__(self, config_json: str, rank: int, world_size: int, init_method: str) -> None:
        self.args = (config_json, rank, world_size, init_method)

    def node_ip(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def serve(self) -> int:
        """Join the group, load this rank's shard, run until shutdown; returns the rank."""
        import torch.distributed as dist

        from rivulet.models.loader import resolve_model

        config_json, rank, world_size, init_method = self.args
        config = EngineConfig.from_json(config_json)
        worker = Worker(config, resolve_model(config.model.model), rank, world_size, init_method)
        try:
            worker.serve_forever()
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
        return rank


class RayExecutor(MultiprocExecutor):
    def __init__(self, config: EngineConfig, source: ModelSource) -> None:
        try:
            import ray
            from ray.util.placement_group import placement_group
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        except ImportError:
            raise RivuletError("--distributed-executor-backend ray needs Ray: pip install 'rivulet[ray]'") from None
        self.ray = ray
        self.world_size = config.parallel.world_size
        self._lock = threading.Lock()
        check_parallel(load_arch_config(source)[0], config)
        self.procs: list = []
        self.actors: list = []
        self.loops: dict = {}
        if not ray.is_initialized():
            ray.init(address=os.environ.get("RAY_ADDRESS"), log_to_driver=False)
        gpu = current_platform().name == "cuda"
        bundle = {"GPU": 1, "CPU": 1} if gpu else {"CPU": float(os.environ.get("RIVULET_RAY_CPUS_PER_WORKER", 1))}
        self.pg = None
        if self.world_size > 1:
            self.pg = placement_group([bundle] * (self.world_size - 1), strategy="PACK")
            ray.get(self.pg.ready(), timeout=float(os.environ.get("RIVULET_RAY_PLACEMENT_TIMEOUT", 120)))
        host = ray.util.get_node_ip_address()
        init_method = f"tcp://{host}:{_free_port()}"
        actor_cls = ray.remote(RayWorker)
        for rank in range(1, self.world_size):
            actor = actor_cls.options(
                num_cpus=bundle.get("CPU", 1), num_gpus=bundle.get("GPU", 0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=rank - 1),
            ).remote(config.to_json(), rank, self.world_size, init_method)
            self.actors.append(actor)
            self.loops[actor.serve.remote()] = rank
        try:
            self.worker = Worker(config, source, 0, self.world_size, init_method)
        except BaseException:
            self.shutdown()
            raise

    def _dead_ranks(self) -> list[str]:
        if not self.loops:
            return []
        done, _ = self.ray.wait(list(self.loops), num_returns=len(self.loops), timeout=0)
        return [str(self.loops[ref]) for ref in done]

    def shutdown(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            if not self._dead_ranks():  # with a rank gone the broadcast could wait out the gloo timeout;
                try:                    # the survivors stop once rank 0's sockets close
                    Worker.broadcast_command(Shutdown())
                except RuntimeError:
                    pass
            dist.destroy_process_group()
        set_parallel_state(ParallelState())
        if getattr(self, "worker", None) is not None:  # rank 0 ran in this process: give its threads and cores back
            self.worker.cores_before.restore()
        if self.loops:
            try:
                self.ray.wait(list(self.loops), num_returns=len(self.loops), timeout=10)
            except Exception:  # noqa: BLE001 - the actors are killed below anyway
                pass
        for actor in self.actors:
            self.ray.kill(actor)
        self.actors, self.loops = [], {}
        if self.pg is not None:
            self.ray.util.remove_placement_group(self.pg)
            self.pg = None

    def collect(self, name: str) -> list[Any]:
        return self._call(Gather(name))
