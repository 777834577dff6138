from rivulet.executor.uniproc import UniProcExecutor

__all__ = ["UniProcExecutor"]
