"""One rank of a multi-rank deployment: joins the process group, builds its shard of the model,
and executes whatever rank 0 broadcasts.

Rank 0 lives in the engine's process (driven by `MultiprocExecutor`); ranks 1..N-1 run
`python -m rivulet.worker.worker RANK WORLD_SIZE INIT_METHOD` with the EngineConfig on stdin.
Every rank runs the same step on the same SchedulerOutput; the LM head's all-gather gives all
ranks identical logits and identically seeded samplers, so their persistent batches stay equal.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
import torch.distributed as dist

from rivulet.config import EngineConfig
from rivulet.distributed import init_distributed
from rivulet.models.loader import ModelSource, resolve_model
from rivulet.platforms import current_platform
from rivulet.worker.model_runner import ModelRunner


class Worker:
    def __init__(self, config: EngineConfig, source: ModelSource, rank: int, world_size: int, init_method: str) -> None:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        self.rank = rank
        init_distributed(rank, world_size, init_method, current_platform().dist_backend)
        self.runner = ModelRunner(config.model, config.cache, source)

    def call(self, method: str, args: tuple) -> Any:
        return getattr(self.runner, method)(*args)

    @staticmethod
    def broadcast_command(command: tuple | None) -> tuple:
        """Rank 0 passes the command; every rank returns it."""
        box = [command]
        dist.broadcast_object_list(box, src=0)
        return box[0]  # type: ignore[return-value]

    def serve_forever(self) -> None:
        """Ranks > 0: execute rank 0's commands until told to stop (or rank 0 disappears)."""
        while True:
            method, args = self.broadcast_command(None)
            if method == "shutdown":
                return
            self.call(method, args)


def main() -> None:
    rank, world_size, init_method = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    config = EngineConfig.from_json(sys.stdin.read())
    worker = Worker(config, resolve_model(config.model.model), rank, world_size, init_method)
    try:
        worker.serve_forever()
    except RuntimeError:  # rank 0 is gone: the collective failed
        sys.exit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
