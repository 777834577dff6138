"""One rank of a multi-rank deployment: joins the process group, builds its shard of the model,
and executes whatever rank 0 broadcasts.

Rank 0 lives in the engine's process (driven by `MultiprocExecutor`); ranks 1..N-1 run
`python -m rivulet.worker.worker RANK WORLD_SIZE INIT_METHOD` with the EngineConfig on stdin.
Rank 0 broadcasts each call as a typed command (`rivulet.worker.commands`, msgpack bytes).
Every rank runs the same step on the same SchedulerOutput; the LM head's all-gather gives all
ranks identical logits and identically seeded samplers, so their persistent batches stay equal.
With pipeline parallelism only the last stage samples: it broadcasts the step's output to every
rank, and the earlier stages append the sampled tokens to their own batches.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from rivulet.config import EngineConfig
from rivulet.core.kv_tier import FILE_SUFFIX
from rivulet.core.outputs import GrammarBitmask
from rivulet.distributed import broadcast_bytes, get_comm_stats, init_distributed, reset_comm_stats
from rivulet.models.loader import ModelSource, resolve_model
from rivulet.platforms import current_platform
from rivulet.worker.commands import (AllocateKVCache, Execute, Gather, SetEosTokenIds, Shutdown, WorkerCommand,
                                     decode_command, decode_runner_output, encode)
from rivulet.worker.async_output import resolve
from rivulet.worker.model_runner import ModelRunner
from rivulet.worker.outputs import ModelRunnerOutput


@dataclass(frozen=True)
class RankCores:
    """What `use_rank_threads` changed in the calling thread, to give back (`restore`)."""

    threads: int
    affinity: frozenset[int] | None  # None: not bound

    def restore(self) -> None:
        torch.set_num_threads(self.threads)
        if self.affinity is not None:
            os.sched_setaffinity(0, self.affinity)


def use_rank_threads(world_size: int, rank: int = 0) -> RankCores:
    """Give torch this rank's share of the cores the process may run on (taskset, cgroups): an engine sets its
    own, whatever an engine before it in this process left. With a core or more per rank, the calling thread
    (and the threads it starts) is bound to rank `rank`'s own share, so the ranks of one host do not take turns
    on a core while the others wait for them in a collective (vLLM binds its CPU ranks the same way)."""
    before = RankCores(torch.get_num_threads(), None)
    if not hasattr(os, "sched_getaffinity"):
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        return before
    cores = sorted(os.sched_getaffinity(0))
    per = max(1, len(cores) // world_size)
    torch.set_num_threads(per)
    if world_size == 1 or len(cores) < world_size:
        return before
    os.sched_setaffinity(0, cores[rank * per:(rank + 1) * per])
    return RankCores(before.threads, frozenset(cores))


class Worker:
    def __init__(self, config: EngineConfig, source: ModelSource, rank: int, world_size: int, init_method: str) -> None:
        self.cores_before = use_rank_threads(world_size, rank)
        self.rank = rank
        pc = config.parallel
        self.state = init_distributed(rank, world_size, init_method, current_platform().dist_backend,
                                      pipeline_parallel_size=pc.pipeline_parallel_size,
                                      sequence_parallel=pc.enable_sequence_parallel,
                                      expert_parallel=pc.enable_expert_parallel,
                                      replicated_experts=tuple(pc.replicated_experts or ()),
                                      pp_micro_batches=pc.pipeline_micro_batches)
        self.runner = ModelRunner(config.model, config.cache, source, config.speculative, config.lora)
        self.step_time_s, self.steps = 0.0, 0
        self.world_size = world_size
        self._tier_done: dict[str, int] = {}  # loads of the KV tier this rank has finished, until all have

    def run(self, command: WorkerCommand, grammar_bitmask: GrammarBitmask | None = None) -> Any:
        """Carry out one of rank 0's commands (every rank runs each one); `grammar_bitmask` is rank 0's
        source of an Execute's bitmask, broadcast to the others after the forward pass."""
        if isinstance(command, Execute):
            return self.execute(command.out, grammar_bitmask)
        if isinstance(command, Gather):
            return self.gather(command.name)
        if isinstance(command, SetEosTokenIds):
            return self.runner.set_eos_token_ids(set(command.ids))
        if isinstance(command, AllocateKVCache):
            disk_dir = self.tier_folder(command.disk_dir) if command.disk_dir is not None else None
            return self.runner.allocate_kv_cache(command.num_blocks, command.host_slots, disk_dir)
        raise TypeError(f"not a command a worker runs: {command!r}")

    def tier_folder(self, disk_dir: str) -> str:
        """This rank's folder of KV block files: rank 0's is the engine's (its index); rank r's, beside it,
        holds the same blocks' shards, pruned at start to the blocks rank 0 still has."""
        if self.rank == 0:
            return disk_dir
        mine = Path(f"{disk_dir}.rank{self.rank}")
        mine.mkdir(parents=True, exist_ok=True)
        index = {p.relative_to(disk_dir) for p in Path(disk_dir).glob(f"*/*{FILE_SUFFIX}")}
        for p in mine.glob(f"*/*{FILE_SUFFIX}"):
            if p.relative_to(mine) not in index:
                p.unlink(missing_ok=True)
        return str(mine)

    def _agree_on_tier(self, result: ModelRunnerOutput) -> None:
        """Every rank's KV tier report, combined the same way on every rank: a request's load is done once
        every rank has finished it (with the blocks all of them loaded), a key any rank dropped is dropped,
        and any rank's disk error is the error."""
        self._tier_done.update(result.kv_loaded)
        reports: list[Any] = [None] * self.world_size
        dist.all_gather_object(reports, (self._tier_done, result.kv_dropped, result.kv_disk_error))
        done = [r[0] for r in reports]
        ready = sorted(set(done[0]).intersection(*done[1:]))
        result.kv_loaded = {rid: min(d[rid] for d in done) for rid in ready}
        for rid in ready:
            del self._tier_done[rid]
        result.kv_dropped = sorted({key for r in reports for key in r[1]})
        result.kv_disk_error = next((r[2] for r in reports if r[2] is not None), None)

    def _bitmask_from_rank0(self, source: GrammarBitmask | None) -> bytes | None:
        """Rank 0's bitmask on every rank (one byte stands for none: a mask is whole int32 words)."""
        data = None
        if self.rank == 0:
            data = (source() if source is not None else None) or b"\0"
        data = broadcast_bytes(data, src=0)
        return data if len(data) > 1 else None

    def execute(self, out: Any, grammar_bitmask: GrammarBitmask | None = None) -> ModelRunnerOutput:
        start = time.perf_counter()
        mask = (lambda: self._bitmask_from_rank0(grammar_bitmask)) if out.grammar_follows else None
        result = resolve(self.runner.execute(out, mask))  # ranks send plain outputs (no async outputs here)
        if self.runner.kv_tier is not None and self.world_size > 1:
            self._agree_on_tier(result)
        st = self.state
        if st.pp_size > 1 and not out.is_empty:
            last = st.world_size - st.tp_size  # rank 0 of the last stage's tensor-parallel group
            data = broadcast_bytes(encode(result) if self.rank == last else None, src=last)
            if not st.is_last_stage:
                result = decode_runner_output(data)
                self.runner.append_sampled(result.sampled_token_ids)
        self.step_time_s += time.perf_counter() - start
        self.steps += 1
        return result

    def local_stats(self, name: str) -> Any:
        """This rank's statistics: "comm" (bytes per collective kind), "pipeline" (step and busy
        seconds), "experts" (per MoE layer: tokens per expert, rows per rank, packed or not), "compile" (the
        kinds of step whose graph this rank compiled or loaded, steps that fell back to the in-process compile;
        None when eager), "reset" (clear them)."""
        model = self.runner.model
        moes = [m for m in model.modules() if hasattr(m, "expert_counts")]
        if name == "comm":
            return get_comm_stats()
        if name == "pipeline":
            busy = self.runner.pipeline.busy_s if self.runner.pipeline is not None else 0.0
            return {"rank": self.rank, "pp_rank": self.state.pp_rank, "tp_rank": self.state.tp_rank,
                    "steps": self.steps, "step_s": self.step_time_s, "busy_s": busy}
        if name == "compile":
            fn = self.runner.forward_fn
            if fn is self.runner.model:
                return None
            return {"rank": self.rank, "compiled": sorted(fn.compiled), "loaded": sorted(fn.loaded),
                    "fallbacks": fn.fallbacks, "fusions": fn.fusions}
        if name == "experts":
            return [{"expert_counts": m.expert_counts.tolist(), "rank_load": m.rank_load.tolist(),
                     "cross_rows": int(m.cross_rows), "local_experts": list(m.local_experts),
                     "packed": m.packed is not None} for m in moes]
        if name == "reset":
            reset_comm_stats()
            self.step_time_s, self.steps = 0.0, 0
            if self.runner.pipeline is not None:
                self.runner.pipeline.busy_s = 0.0
            for m in moes:
                m.reset_load_stats()
            return None
        raise ValueError(f"unknown statistics {name!r}")

    def gather(self, name: str) -> list[Any]:
        """Every rank's `local_stats(name)`, in rank order (on every rank)."""
        out: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(out, self.local_stats(name))
        return out

    @staticmethod
    def broadcast_command(command: WorkerCommand | None) -> WorkerCommand:
        """Rank 0 passes the command; every rank returns it."""
        data = broadcast_bytes(encode(command) if command is not None else None, src=0)
        return command if command is not None else decode_command(data)

    def serve_forever(self) -> None:
        """Ranks > 0: execute rank 0's commands until told to stop (or rank 0 disappears)."""
        while True:
            command = self.broadcast_command(None)
            if isinstance(command, Shutdown):
                return
            self.run(command)


def main() -> None:
    rank, world_size, init_method = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    config = EngineConfig.from_json(sys.stdin.read())
    worker = Worker(config, resolve_model(config.model.model), rank, world_size, init_method)
    code = 0
    try:
        worker.serve_forever()
    except RuntimeError:  # rank 0 is gone: the collective failed
        code = 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    # as multiprocessing's children end: torch's static destructors at interpreter exit aborted the process now and
    # then ("terminate called without an active exception", SIGABRT) on a thread they found still running
    os._exit(code)


if __name__ == "__main__":
    main()
