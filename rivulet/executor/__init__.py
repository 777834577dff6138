from rivulet.config import EngineConfig
from rivulet.executor.multiproc import MultiprocExecutor
from rivulet.executor.uniproc import UniProcExecutor
from rivulet.models.loader import ModelSource

Executor = UniProcExecutor | MultiprocExecutor


def make_executor(config: EngineConfig, source: ModelSource) -> Executor:
    """One rank in this process, or one process (or Ray actor) per rank of tp x pp."""
    if config.parallel.distributed_executor_backend == "ray":
        from rivulet.executor.ray_executor import RayExecutor  # Ray is optional: imported only when asked for

        return RayExecutor(config, source)  # type: ignore[return-value]
    if config.parallel.world_size > 1:
        return MultiprocExecutor(config, source)
    return UniProcExecutor(config, source)


__all__ = ["Executor", "MultiprocExecutor", "UniProcExecutor", "make_executor"]
