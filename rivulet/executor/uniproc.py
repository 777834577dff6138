"""The single-rank executor: the model runner lives in the engine's own process."""

from __future__ import annotations

from rivulet.config import EngineConfig
from rivulet.distributed import ParallelState, set_parallel_state
from rivulet.core.outputs import GrammarBitmask, SchedulerOutput
from rivulet.models.arch_config import ArchConfig
from rivulet.models.loader import ModelSource
from rivulet.worker.async_output import AsyncModelRunnerOutput
from rivulet.worker.model_runner import ModelRunner
from rivulet.worker.outputs import ModelRunnerOutput
from rivulet.worker.worker import use_rank_threads


class UniProcExecutor:
    def __init__(self, config: EngineConfig, source: ModelSource) -> None:
        set_parallel_state(ParallelState())  # one rank, whatever another engine in this process uses
        use_rank_threads(1)  # all the process's cores, whatever a multi-rank engine before left
        self.runner = ModelRunner(config.model, config.cache, source, config.speculative, config.lora)

    @property
    def arch_config(self) -> ArchConfig:
        return self.runner.arch

    def set_eos_token_ids(self, ids: set[int]) -> None:
        self.runner.set_eos_token_ids(ids)

    def determine_num_blocks(self) -> int:
        return self.runner.num_blocks_for_budget()

    def kv_bytes_per_block(self) -> int:
        return self.runner.kv_bytes_per_block()

    def initialize_cache(self, num_blocks: int, host_slots: int = 0, disk_dir: str | None = None) -> None:
        self.runner.allocate_kv_cache(num_blocks, host_slots, disk_dir)

    def use_async_outputs(self, on: bool) -> None:
        """With async scheduling `execute` may return before the step's tokens reach the host (`resolve` its
        result in the engine)."""
        self.runner.use_async_outputs(on)

    def execute(self, out: SchedulerOutput, grammar_bitmask: GrammarBitmask | None = None
                ) -> ModelRunnerOutput | AsyncModelRunnerOutput:
        return self.runner.execute(out, grammar_bitmask)

    def check_health(self) -> None:
        """One rank, in this process: healthy while this runs."""

    def collect(self, name: str) -> list:
        """This one rank's statistics `name` (see `Worker.local_stats`), as a one-element list."""
        from types import SimpleNamespace

        from rivulet.worker.worker import Worker

        if not hasattr(self, "_stats"):
            self._stats = SimpleNamespace(runner=self.runner, state=ParallelState(), rank=0, steps=0, step_time_s=0.0)
        return [Worker.local_stats(self._stats, name)]  # type: ignore[arg-type]

    def shutdown(self) -> None:
        self.runner.shutdown()
