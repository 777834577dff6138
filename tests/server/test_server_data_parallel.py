"""``rivulet serve --data-parallel-size 2``: two engine processes behind one API server. Requests spread over both;
one engine SIGKILLed under load of 64 concurrent requests (half streamed): every request completes exactly once
with the text the server gives at temperature 0 when healthy (those caught mid-way resume on the other replica),
and the dead replica is restarted."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from server_helpers import ServerProcess, wait_until

N, MAX_TOKENS = 64, 16


@pytest.fixture(scope="module")
def dp() -> Iterator[ServerProcess]:
    proc = ServerProcess("--data-parallel-size", "2", "--max-model-len", "256", "--max-num-seqs", "64")
    try:
        yield proc
    finally:
        proc.stop()


def engine_pids(server: ServerProcess) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == server.proc.pid and b"rivulet.engine.core_proc" in cmdline:
                pids.append(int(entry.name))
    return sorted(pids)


def body(i: int, stream: bool) -> dict[str, Any]:
    return {"prompt": f"Request {i}: the list of numbers from {i} to {i + 20} is", "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True, "stream": stream}


async def run_one(client: httpx.AsyncClient, url: str, i: int, seen: list[int]) -> str:
    if i % 2:
        r = await client.post(url, json=body(i, False))
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]
    text, done = "", 0
    async with client.stream("POST", url, json=body(i, True)) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                done += 1
            elif line.startswith("data: "):
                obj = json.loads(line[6:])
                assert "error" not in obj, obj
                text += obj["choices"][0]["text"]
                seen[0] += 1
    assert done == 1
    return text


def test_two_replicas_one_killed_under_load(dp: ServerProcess) -> None:
    pids = engine_pids(dp)
    assert len(pids) == 2
    url = dp.url + "/v1/completions"

    async def load(kill: bool) -> list[str]:
        seen = [0]
        async with httpx.AsyncClient(timeout=120) as client:
            tasks = [asyncio.create_task(run_one(client, url, i, seen)) for i in range(N)]
            if kill:
                while seen[0] < N // 2:
                    await asyncio.sleep(0.01)
                os.kill(pids[0], signal.SIGKILL)
            return await asyncio.gather(*tasks)

    texts = asyncio.run(asyncio.wait_for(load(True), 300))
    assert wait_until(lambda: len(engine_pids(dp)) == 2 and pids[0] not in engine_pids(dp), timeout=120)
    assert wait_until(lambda: httpx.get(dp.url + "/health").status_code == 200, timeout=60)
    want = asyncio.run(asyncio.wait_for(load(False), 300))  # the same requests on the healthy server
    assert texts == want
    assert "going on on another replica" in dp.log()  # some requests were caught mid-way and resumed


def ray_engine_pids() -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if b"EngineActor" in (entry / "cmdline").read_bytes():
                    pids.append(int(entry.name))
            except OSError:
                continue
    return sorted(pids)


@pytest.fixture
def ray_cluster(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A Ray cluster of three nodes on this machine (a head with no CPUs, two nodes of one CPU each: one engine
    fits a node), named to the server by RAY_ADDRESS as a real cluster would be."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, connect=False, head_node_args={"num_cpus": 0})
    try:
        for _ in range(2):
            cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        monkeypatch.setenv("RAY_ADDRESS", cluster.address)
        yield cluster.address
    finally:
        cluster.shutdown()


def placements(server: ServerProcess) -> list[str]:
    """The node ids the server logged its engine actors on, in order."""
    return [line.rsplit("(id ", 1)[1].rstrip(")") for line in server.log().splitlines()
            if "engine actor placed on node" in line]


def test_ray_backend_places_replicas_on_the_clusters_nodes_and_restarts_a_killed_one(dp: ServerProcess,
                                                                                     ray_cluster: str) -> None:
    """--data-parallel-backend ray on a 3-node cluster: the replicas are Ray actors on two different nodes,
    connected over TCP, they give the texts the process replicas give, and a SIGKILLed actor is restarted as a
    new one, on the node that freed its CPU."""
    async def gather(url: str) -> list[str]:
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(run_one(client, url + "/v1/completions", i, [0]) for i in range(1, 9, 2)))

    def texts(url: str, server: ServerProcess) -> list[str]:
        try:
            return asyncio.run(gather(url))
        except AssertionError as e:  # the server's log says why a request failed
            raise AssertionError(f"{e}\n--- server log ---\n{server.log()[-4000:]}") from None

    want = texts(dp.url, dp)
    proc = ServerProcess("--data-parallel-size", "2", "--data-parallel-backend", "ray", "--max-model-len", "256",
                         "--max-num-seqs", "64")
    try:
        actors = ray_engine_pids()
        assert len(actors) == 2, actors
        assert texts(proc.url, proc) == want
        assert wait_until(lambda: len(placements(proc)) == 2, timeout=30), proc.log()[-3000:]
        first = placements(proc)
        assert len(set(first)) == 2, first  # one engine per node
        os.kill(actors[0], signal.SIGKILL)
        assert wait_until(lambda: len(ray_engine_pids()) == 2 and actors[0] not in ray_engine_pids(), timeout=120)
        assert wait_until(lambda: httpx.get(proc.url + "/health").status_code == 200, timeout=60)
        assert texts(proc.url, proc) == want
        assert "restart" in proc.log()
        assert wait_until(lambda: len(placements(proc)) == 3, timeout=30)
        assert set(placements(proc)) == set(first)  # the new actor took the CPU the killed one gave back
    finally:
        proc.stop()
    assert wait_until(lambda: not ray_engine_pids(), timeout=60)
