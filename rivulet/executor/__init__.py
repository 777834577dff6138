from rivulet.config import EngineConfig
from rivulet.executor.multiproc import MultiprocExecutor
from rivulet.executor.uniproc import UniProcExecutor
from rivulet.models.loader import ModelSource

Executor = UniProcExecutor | MultiprocExecutor


def make_executor(config: EngineConfig, source: ModelSource) -> Executor:
    """One rank in this process, or one per tensor-parallel rank."""
    if config.parallel.tensor_parallel_size > 1:
        return MultiprocExecutor(config, source)
    return UniProcExecutor(config, source)


__all__ = ["Executor", "MultiprocExecutor", "UniProcExecutor", "make_executor"]
