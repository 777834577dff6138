"""The shared-memory collectives of a tensor-parallel group on one host (`rivulet.distributed.shm`), on real
processes: three ranks (which the engine puts on the segment only with a core each) with a small slot so that
every op also runs in pieces, the results equal to the sums and concatenations computed from every rank's known
input, bit-identical on every rank; uneven and empty all-to-all rows; the engine's collectives use the segment
when `init_distributed` made one (and not when switched off); a rank that dies mid-collective makes the others
raise instead of wait."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _inputs(rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(100 + rank)).to(dtype)


def _collectives(rank: int, world: int, port: int, results) -> None:  # type: ignore[no-untyped-def]
    import torch.distributed as dist

    from rivulet.distributed.shm import ShmGroup, usable

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        group = dist.group.WORLD
        out: dict[str, object] = {"usable": usable(group)}  # not with fewer cores than ranks: they would spin
        shm = ShmGroup.create(group, slot_bytes=4096)  # 4 KiB slots: most ops below take several rounds
        for dtype in (torch.float32, torch.bfloat16):
            for n in (5, 3000):  # one piece; 12 kB = several
                x = _inputs(rank, n, dtype)
                shm.all_reduce(x)
                expect = _inputs(0, n, dtype).clone()
                for r in range(1, world):
                    expect += _inputs(r, n, dtype)
                out[f"reduce {dtype} {n}"] = (torch.equal(x, expect), x.view(torch.uint8).sum().item())
        mine = torch.arange(1500, dtype=torch.float32).view(500, 3) + 1000 * rank
        got = shm.all_gather(mine)
        out["gather"] = [torch.equal(g, torch.arange(1500, dtype=torch.float32).view(500, 3) + 1000 * r)
                         for r, g in enumerate(got)]
        # all-to-all: rank r sends (r + d) * 100 rows to rank d (rank 0 sends none to itself), rows tagged by
        # (sender, receiver, index); uneven, some larger than a slot
        counts = [(rank + d) * 100 for d in range(world)]
        rows = torch.cat([torch.stack([torch.full((c,), float(rank)), torch.full((c,), float(d)),
                                       torch.arange(c, dtype=torch.float32)], 1) for d, c in enumerate(counts)])
        recv = [(r + rank) * 100 for r in range(world)]
        back = shm.all_to_all(rows, counts, recv)
        expect = torch.cat([torch.stack([torch.full((c,), float(r)), torch.full((c,), float(rank)),
                                         torch.arange(c, dtype=torch.float32)], 1) for r, c in enumerate(recv)])
        out["to_all"] = torch.equal(back, expect)
        try:
            shm.all_to_all(rows, counts, [c + 1 for c in recv])
            out["mismatch"] = False
        except RuntimeError:
            out["mismatch"] = True
        results.put((rank, out))
    finally:
        dist.destroy_process_group()


def _spawn(target, world: int, *args, replies: int | None = None):  # type: ignore[no-untyped-def]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=target, args=(r, world, port, results, *args)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        return dict(results.get(timeout=120) for _ in range(world if replies is None else replies))
    finally:
        for p in procs:
            p.join(20)
            if p.is_alive():
                p.kill()


@pytest.mark.skipif(os.uname().machine not in ("x86_64", "AMD64"), reason="the segment is used on x86-64 only")
def test_shared_memory_collectives_of_three_ranks() -> None:
    got = _spawn(_collectives, 3)
    for rank, out in got.items():
        assert out.pop("usable") == (len(os.sched_getaffinity(0)) >= 3)
        for name, value in out.items():
            if name.startswith("reduce"):
                assert value[0], (rank, name)
            elif name == "gather":
                assert value == [True, True, True], rank
            else:
                assert value is True, (rank, name)
    for name in got[0]:  # the same bits on every rank
        if name.startswith("reduce"):
            assert len({out[name][1] for out in got.values()}) == 1, name


def _engine_collectives(rank: int, world: int, port: int, results, env: str) -> None:  # type: ignore[no-untyped-def]
    import torch.distributed as dist

    from rivulet.distributed import (get_comm_stats, init_distributed, tensor_parallel_all_gather,
                                     tensor_parallel_all_reduce)

    os.environ["RIVULET_SHM_COLLECTIVES"] = env
    state = init_distributed(rank, world, f"tcp://127.0.0.1:{port}", "gloo")
    try:
        x = torch.full((4, 6), float(rank + 1))[:, ::2]  # not contiguous: summed all the same
        y = tensor_parallel_all_reduce(x, state)
        g = tensor_parallel_all_gather(torch.full((2, 3), float(rank)), state, dim=-1)
        results.put((rank, (state.shm is not None, torch.equal(y, torch.full((4, 3), 3.0)),
                            torch.equal(g, torch.tensor([[0.0] * 3 + [1.0] * 3] * 2)), get_comm_stats())))
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(os.uname().machine not in ("x86_64", "AMD64"), reason="the segment is used on x86-64 only")
@pytest.mark.parametrize("env", ["1", "0"])
def test_the_engine_collectives_use_the_segment_unless_switched_off(env: str) -> None:
    got = _spawn(_engine_collectives, 2, env)
    for rank in (0, 1):
        used, reduced, gathered, stats = got[rank]
        assert used is (env == "1")
        assert reduced and gathered
        assert stats["all_reduce"]["payload_bytes"] == 4 * 3 * 4 and stats["all_gather"]["payload_bytes"] == 2 * 2 * 3 * 4


def _dies(rank: int, world: int, port: int, results) -> None:  # type: ignore[no-untyped-def]
    import time

    import torch.distributed as dist

    from rivulet.distributed.shm import ShmGroup

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    shm = ShmGroup.create(dist.group.WORLD)
    x = torch.ones(8)
    shm.all_reduce(x)
    if rank == 1:
        os._exit(3)  # gone without a word, mid-run
    t = time.perf_counter()
    try:
        shm.all_reduce(x)
        results.put((rank, "returned"))
    except RuntimeError as e:
        results.put((rank, (str(e), time.perf_counter() - t)))


@pytest.mark.skipif(os.uname().machine not in ("x86_64", "AMD64"), reason="the segment is used on x86-64 only")
def test_a_rank_that_dies_mid_collective_makes_the_others_raise() -> None:
    got = _spawn(_dies, 2, replies=1)  # rank 0's: rank 1 is gone
    message, waited = got[0]
    assert "rank 1" in message and "exited" in message
    assert waited < 10
