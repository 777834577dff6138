"""Several ranks on one machine: rank 0 in this process, ranks 1..N-1 as child processes, joined by
torch.distributed (gloo on CPU, NCCL on GPU); N = tensor_parallel_size x pipeline_parallel_size.
The scheduler runs once, here; each call (the step's SchedulerOutput) is broadcast to every rank."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
from typing import Any

import torch.distributed as dist

from rivulet.config import EngineConfig, RivuletError
from rivulet.core.outputs import GrammarBitmask, SchedulerOutput
from rivulet.distributed import ParallelState, set_parallel_state
from rivulet.models.arch_config import ArchConfig
from rivulet.models.loader import ModelSource, load_arch_config
from rivulet.worker.commands import AllocateKVCache, Execute, Gather, SetEosTokenIds, Shutdown, WorkerCommand
from rivulet.worker.outputs import ModelRunnerOutput
from rivulet.worker.worker import Worker


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_tensor_parallel(arch: ArchConfig, tp: int, expert_parallel: bool = False) -> None:
    """Fail early, in one line, when the model's shapes cannot be split over `tp` ranks."""
    def divisors(n: int) -> str:
        return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)

    checks = [("attention heads", arch.num_attention_heads), ("MLP width", arch.intermediate_size)]
    if arch.is_moe and expert_parallel:
        if arch.num_experts % tp:
            raise RivuletError(f"expert parallelism over {tp} ranks does not divide the model's "
                               f"{arch.num_experts} experts; choose one of: {divisors(arch.num_experts)}")
    elif arch.is_moe:
        checks.append(("expert MLP width", arch.moe_intermediate_size))
    for what, n in checks:
        if n and n % tp:
            raise RivuletError(f"tensor_parallel_size {tp} does not divide the model's {n} {what}; "
                               f"choose one of: {divisors(arch.num_attention_heads)}")
    kv = arch.num_key_value_heads
    if kv % tp and tp % kv:
        raise RivuletError(f"tensor_parallel_size {tp} and the model's {kv} key/value heads: one must divide the other")


def check_parallel(arch: ArchConfig, config: EngineConfig) -> None:
    """All the one-line checks of a parallel configuration against the model."""
    pc = config.parallel
    check_tensor_parallel(arch, pc.tensor_parallel_size, pc.enable_expert_parallel)
    if pc.pipeline_parallel_size > arch.num_hidden_layers:
        raise RivuletError(f"pipeline_parallel_size {pc.pipeline_parallel_size} exceeds the model's "
                           f"{arch.num_hidden_layers} layers")
    if pc.pipeline_parallel_size > 1 and arch.is_encoder:  # (checked here too: before any rank starts)
        raise RivuletError("encoder models run without pipeline parallelism")
    if pc.enable_expert_parallel and not arch.is_moe:
        raise RivuletError("--enable-expert-parallel needs a mixture-of-experts model")
    for e in pc.replicated_experts or ():
        if not 0 <= e < arch.num_experts:
            raise RivuletError(f"replicated expert {e} is not one of the model's {arch.num_experts} experts")


class MultiprocExecutor:
    def __init__(self, config: EngineConfig, source: ModelSource) -> None:
        self.world_size = config.parallel.world_size
        self._lock = threading.Lock()
        check_parallel(load_arch_config(source)[0], config)
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

    def _dead_ranks(self) -> list[str]:
        return [p.args[3] for p in self.procs if p.poll() is not None]

    def check_health(self) -> None:
        """Raise RivuletError if a worker rank has exited (the engine checks while idle, so a dead rank
        is reported at once, not at the next request)."""
        dead = self._dead_ranks()
        if dead:
            raise RivuletError(f"worker rank(s) {', '.join(dead)} exited; the engine cannot continue")

    def _call(self, command: WorkerCommand, grammar_bitmask: GrammarBitmask | None = None) -> Any:
        """Every rank runs `command`. One call at a time: the engine's step thread and a caller's
        `collect` must not interleave their collectives."""
        with self._lock:
            self.check_health()
            Worker.broadcast_command(command)
            return self.worker.run(command, grammar_bitmask)

    @property
    def arch_config(self) -> ArchConfig:
        return self.worker.runner.arch

    def set_eos_token_ids(self, ids: set[int]) -> None:
        self._call(SetEosTokenIds(sorted(ids)))

    def determine_num_blocks(self) -> int:
        return self.worker.runner.num_blocks_for_budget()  # ranks are symmetric: rank 0 decides

    def kv_bytes_per_block(self) -> int:
        return self.worker.runner.kv_bytes_per_block()

    def initialize_cache(self, num_blocks: int, host_slots: int = 0, disk_dir: str | None = None) -> None:
        self._call(AllocateKVCache(num_blocks, host_slots, disk_dir))

    def use_async_outputs(self, on: bool) -> None:
        """Outputs cross process boundaries as plain data: each rank's step ends with its tokens on the host."""

    def execute(self, out: SchedulerOutput, grammar_bitmask: GrammarBitmask | None = None) -> ModelRunnerOutput:
        return self._call(Execute(out), grammar_bitmask)

    def collect(self, name: str) -> list[Any]:
        """Every rank's statistics `name` (see `Worker.local_stats`), in rank order."""
        return self._call(Gather(name))

    def shutdown(self) -> None:
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
        for p in self.procs:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()
