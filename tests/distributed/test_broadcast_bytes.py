"""`broadcast_bytes` carries rank 0's typed commands (and the last pipeline stage's outputs) to every
rank: two real gloo ranks, a message from a rank other than 0, a large one, and the refusal of an
empty message at the source."""

from __future__ import annotations

import socket

import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, results) -> None:  # type: ignore[no-untyped-def]
    import torch.distributed as dist

    from rivulet.core.outputs import NewRequestData, SchedulerOutput
    from rivulet.distributed import broadcast_bytes
    from rivulet.worker.commands import Execute, decode_command, encode

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        big = SchedulerOutput({"a": 300_000}, 300_000, [NewRequestData("a", list(range(300_000)), 300_000, [1, 2], 0)])
        small = Execute(SchedulerOutput({"b": 1}, 1, sampling_request_ids={"b"}))
        ok = []
        for src, cmd in ((1, Execute(big)), (0, small)):
            got = broadcast_bytes(encode(cmd) if rank == src else None, src=src)
            ok.append(decode_command(got) == cmd)
        if rank == 0:  # refused at the source before any collective (so rank 1 takes no part)
            try:
                broadcast_bytes(b"", src=0)
                ok.append(False)
            except ValueError:
                ok.append(True)
        results.put((rank, ok))
    finally:
        dist.destroy_process_group()


def test_broadcast_bytes_between_two_gloo_ranks() -> None:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, 2, port, results)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        got = dict(results.get(timeout=60) for _ in procs)
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    assert got == {0: [True, True, True], 1: [True, True]}
