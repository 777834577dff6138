"""Tensor parallelism on one machine: rank 0 in this process, ranks 1..N-1 as child processes,
joined by torch.distributed (gloo on CPU, NCCL on GPU). Each call is broadcast to every rank."""

from __future__ import annotations

import socket
import subprocess
import sys
from typing import Any

import torch.distributed as dist

from rivulet.config import EngineConfig, RivuletError
from rivulet.core.outputs import SchedulerOutput
from rivulet.distributed import ParallelState, set_parallel_state
from rivulet.models.arch_config import ArchConfig
from rivulet.models.loader import ModelSource, load_arch_config
from rivulet.worker.outputs import ModelRunnerOutput
from rivulet.worker.worker import Worker


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_tensor_parallel(arch: ArchConfig, tp: int) -> None:
    """Fail early, in one line, when the model's shapes cannot be split over `tp` ranks."""
    def divisors(n: int) -> str:
        return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)

    checks = [("attention heads", arch.num_attention_heads), ("MLP width", arch.intermediate_size)]
    if arch.is_moe:
        checks.append(("expert MLP width", arch.moe_intermediate_size))
    for what, n in checks:
        if n and n % tp:
            raise RivuletError(f"tensor_parallel_size {tp} does not divide the model's {n} {what}; "
                               f"choose one of: {divisors(arch.num_attention_heads)}")
    kv = arch.num_key_value_heads
    if kv % tp and tp % kv:
        raise RivuletError(f"tensor_parallel_size {tp} and the model's {kv} key/value heads: one must divide the other")


class MultiprocExecutor:
    def __init__(self, config: EngineConfig, source: ModelSource) -> None:
        self.world_size = config.parallel.tensor_parallel_size
        check_tensor_parallel(load_arch_config(source)[0], self.world_size)
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        self.procs = []
        for rank in range(1, self.world_size):
            p = subprocess.Popen([sys.executable, "-m", "rivulet.worker.worker", str(rank), str(self.world_size),
                                  init_method], stdin=subprocess.PIPE, text=True)
            p.stdin.write(config.to_json())  # type: ignore[union-attr]
            p.stdin.close()  # type: ignore[union-attr]
            self.procs.append(p)
        try:
            self.worker = Worker(config, source, 0, self.world_size, init_method)
        except BaseException:
            self.shutdown()
            raise

    def _call(self, method: str, *args: Any) -> Any:
        dead = [p.args[3] for p in self.procs if p.poll() is not None]
        if dead:
            raise RivuletError(f"tensor-parallel worker rank(s) {', '.join(dead)} exited; the engine cannot continue")
        Worker.broadcast_command((method, args))
        return self.worker.call(method, args)

    @property
    def arch_config(self) -> ArchConfig:
        return self.worker.runner.arch

    def set_eos_token_ids(self, ids: set[int]) -> None:
        self._call("set_eos_token_ids", set(ids))

    def determine_num_blocks(self) -> int:
        return self.worker.runner.num_blocks_for_budget()  # ranks are symmetric: rank 0 decides

    def kv_bytes_per_block(self) -> int:
        return self.worker.runner.kv_bytes_per_block()

    def initialize_cache(self, num_blocks: int) -> None:
        self._call("allocate_kv_cache", num_blocks)

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        return self._call("execute", out)

    def shutdown(self) -> None:
        if dist.is_initialized():
            try:
                Worker.broadcast_command(("shutdown", ()))
            except RuntimeError:
                pass
            dist.destroy_process_group()
        set_parallel_state(ParallelState())
        for p in self.procs:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()
