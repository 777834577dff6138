"""The router's workloads, side by side, one system at a time.

1. Prefix affinity: `rivulet bench serve --dataset shared-prefix --num-prefixes G` through a router over R
   `rivulet serve` replicas (each pinned to its own core when there are enough; otherwise unpinned), once per
   router and policy, on fresh replicas. The
   routers: `rivulet router` and the peer, sglang-router (benchmarks/peers/setup_sglang_router.sh). Each
   replica's KV pool holds about G/R prefixes plus room to run, so where the requests of a prefix go decides
   whether it is cached. Reported per policy: the replicas' prefix-cache hit rate (their own counters), mean
   TTFT, output throughput, errors.
2. Overhead: a stand-in worker whose first token comes 100 ms after the request and the next every `--fake-tpot-ms` (100) (an
   engine's own TTFT on 2 shared cores varies by seconds at concurrency 64, which would hide milliseconds),
   `rivulet bench serve` at concurrency 64 straight to it and through each router, in turn, `--rounds` rounds (5) in alternating order;
   the mean TTFT each router adds.
3. Overhead, interleaved (`--interleaved N`): the same stand-in worker and one router at a time, but one load of N
   requests at concurrency `--interleaved-concurrency` (64) where each request goes straight to the worker or through the router by a coin
   toss, so both kinds meet the same contention at the same moments; the difference of their mean TTFTs with a
   bootstrap 95% interval, and the router's CPU time per request (/proc).

    python benchmarks/router.py --out benchmarks/results/router [--routers rivulet,sglang] [--policies ...] [--skip-overhead]

writes OUT/router.json (and each bench run's JSON and each process's log next to it).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from rivulet.bench.serve import cache_summary, parse_cache_counters  # noqa: E402

RIVULET = str(ROOT / ".venv/bin/rivulet")
PEERS = Path(os.environ.get("PEERS_DIR", Path.home() / ".cache/rivulet-peers"))


def router_cmd(router: str, port: int, policy: str, urls: list[str]) -> list[str]:
    if router == "rivulet":
        return [RIVULET, "router", "--port", str(port), "--policy", policy, "--worker-urls", *urls]
    if router == "sglang":
        py = PEERS / "sglang-router/bin/python"
        if not py.exists():
            subprocess.run(["bash", str(ROOT / "benchmarks/peers/setup_sglang_router.sh")], check=True)
        return [str(py), "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port), "--policy",
                policy, "--worker-urls", *urls, "--log-level", "warn", "--prometheus-port", str(port + 1000)]
    raise SystemExit(f"unknown router {router!r}")


def spawn(cmd: list[str], log: Path, url: str, cores: str | None = None) -> subprocess.Popen:
    if cores is not None:
        cmd = ["taskset", "-c", cores, *cmd]
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, start_new_session=True)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{cmd[0]} exited; see {log}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{' '.join(cmd)} did not become healthy; see {log}")


def stop(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def replica(i: int, port: int, blocks: int | None, max_len: int, out: Path, cores: str | None) -> subprocess.Popen:
    cmd = [RIVULET, "serve", "--port", str(port), "--disable-uvicorn-access-log", "--max-model-len", str(max_len)]
    if blocks is not None:
        cmd += ["--num-kv-blocks", str(blocks)]
    return spawn(cmd, out / f"replica{i}.log", f"http://127.0.0.1:{port}", cores)


def bench(url: str, out_json: Path, args: list[str], log: Path) -> dict:
    cmd = [RIVULET, "bench", "serve", "--base-url", url, "--model", "default", "--tokenizer", "default",
           "--ignore-eos", "--disable-tqdm", "--result-json", str(out_json), *args]
    with log.open("w") as f:
        subprocess.run(cmd, check=True, stdout=f, stderr=subprocess.STDOUT)
    return json.loads(out_json.read_text())


def point(result: dict) -> dict:
    p = result["points"][0] if "points" in result else result
    return {k: p.get(k) for k in ("completed", "failed", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
                                  "output_throughput", "mean_tpot_ms", "duration_s")}


def cache_counters(urls: list[str]) -> dict[str, float]:
    total: dict[str, float] = {}
    for u in urls:
        for k, v in (parse_cache_counters(httpx.get(u + "/metrics", timeout=10).text) or {}).items():
            total[k] = total.get(k, 0.0) + v
    return total


def affinity(a: argparse.Namespace, out: Path) -> dict:
    cores = sorted(os.sched_getaffinity(0))
    results: dict = {}
    for router in a.routers.split(","):
        for policy in a.policies.split(","):
            name = policy if router == "rivulet" else f"{router}-{policy}"
            (out / name).mkdir(parents=True, exist_ok=True)
            urls = [f"http://127.0.0.1:{a.port + 1 + i}" for i in range(a.replicas)]
            procs = []
            try:
                for i in range(a.replicas):
                    pin = str(cores[i % len(cores)]) if a.replicas <= len(cores) else None
                    procs.append(replica(i, a.port + 1 + i, a.kv_blocks, a.max_model_len, out / name, pin))
                router_url = f"http://127.0.0.1:{a.port}"
                procs.append(spawn(router_cmd(router, a.port, policy, urls), out / name / "router.log", router_url))
                before = cache_counters(urls)
                res = bench(router_url, out / name / "bench.json",
                            ["--dataset", "shared-prefix", "--num-prefixes", str(a.prefixes), "--prefix-len",
                             str(a.prefix_len), "--input-len", str(a.prefix_len + a.suffix_len), "--output-len",
                             str(a.output_len), "--num-prompts", str(a.num_prompts), "--max-concurrency",
                             str(a.concurrency), "--num-warmups", "0", "--label", name], out / name / "bench.log")
                cache = cache_summary(before, cache_counters(urls))
                served = [int(cache_counters([u]).get("queries", 0)) for u in urls]  # prompt tokens per replica
            finally:
                for p in reversed(procs):
                    stop(p)
            results[name] = {**point(res), "prefix_cache": cache, "prompt_tokens_per_replica": served}
            print(name, json.dumps(results[name]), flush=True)
    return results


def fake_worker(port: int, tpot_s: float) -> None:
    """The stand-in worker of the overhead run (`--fake-worker PORT`): fixed delays, one word per token."""
    import asyncio

    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    async def generate(request):  # type: ignore[no-untyped-def]
        body = await request.json()
        n = int(body.get("max_tokens") or 16)

        async def events():  # type: ignore[no-untyped-def]
            for i in range(n):
                await asyncio.sleep(0.1 if i == 0 else tpot_s)
                chunk = {"id": "cmpl-fake", "object": "text_completion", "created": 0, "model": "default",
                         "choices": [{"index": 0, "text": " word", "token_ids": [i], "finish_reason":
                                      "length" if i == n - 1 else None}]}
                if i == 0:
                    chunk["choices"][0]["prompt_token_ids"] = [1, 2, 3]
                yield "data: " + json.dumps(chunk) + "\n\n"
            yield "data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")

    async def ok(request):  # type: ignore[no-untyped-def]
        return Response(status_code=200)

    async def models(request):  # type: ignore[no-untyped-def]
        return JSONResponse({"object": "list", "data": [{"id": "default", "object": "model"}]})

    app = Starlette(routes=[Route("/v1/completions", generate, methods=["POST"]), Route("/health", ok),
                            Route("/metrics", ok), Route("/v1/models", models)])
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


def overhead(a: argparse.Namespace, out: Path) -> dict:
    url = f"http://127.0.0.1:{a.port + 1}"
    routers = a.routers.split(",")
    runs: dict[str, list[dict]] = {"direct": [], **{r: [] for r in routers}}
    worker = spawn([sys.executable, __file__, "--fake-worker", str(a.port + 1), "--fake-tpot-ms", str(a.fake_tpot_ms)],
                   out / "overhead" / "worker.log", url)
    procs = []
    try:
        for i, r in enumerate(routers):
            port = a.port + 2 + i
            procs.append(spawn(router_cmd(r, port, "round_robin", [url]), out / "overhead" / f"{r}-router.log",
                               f"http://127.0.0.1:{port}"))
        targets = [("direct", url)] + [(r, f"http://127.0.0.1:{a.port + 2 + i}") for i, r in enumerate(routers)]
        for rnd in range(a.rounds):
            for name, target in (targets if rnd % 2 == 0 else targets[::-1]):  # alternate the order: drift cancels
                res = bench(target, out / "overhead" / f"{name}{rnd}.json",
                            ["--dataset", "random", "--input-len", "128", "--output-len", "16", "--num-prompts", "256",
                             "--max-concurrency", "64", "--label", name], out / "overhead" / f"{name}{rnd}.log")
                runs[name].append(point(res))
    finally:
        for p in procs:
            stop(p)
        stop(worker)
    mean = {k: sum(r["mean_ttft_ms"] for r in v) / len(v) for k, v in runs.items()}
    # per round, router minus direct (the two ran back to back): the median of those resists a noisy round
    added = {r: sorted(x["mean_ttft_ms"] - d["mean_ttft_ms"] for x, d in zip(runs[r], runs["direct"])) for r in routers}
    return {"runs": runs, "mean_ttft_ms": mean, "added_mean_ttft_ms": {r: mean[r] - mean["direct"] for r in routers},
            "added_per_round_ms": added, "added_median_ms": {r: v[len(v) // 2] for r, v in added.items()}}


def router_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of a process and its children so far."""
    total = 0.0
    for p in [pid, *(int(c) for c in subprocess.run(["pgrep", "-P", str(pid)], capture_output=True,
                                                   text=True).stdout.split())]:
        fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def interleaved(a: argparse.Namespace, out: Path) -> dict:
    """One load, each request direct or through the router at random: the TTFT the router adds, same moments."""
    import asyncio
    import random

    from rivulet.bench.datasets import SampleRequest
    from rivulet.bench.serve import ClientConfig, send_request

    url = f"http://127.0.0.1:{a.port + 1}"
    worker = spawn([sys.executable, __file__, "--fake-worker", str(a.port + 1), "--fake-tpot-ms", str(a.fake_tpot_ms)],
                   out / "overhead" / "worker.log", url)
    req = SampleRequest(" ".join(["word"] * 128), 128, 16)
    result: dict = {}

    async def load(targets: dict[str, ClientConfig], n: int, seed: int) -> dict[str, list[float]]:
        rng, ttft = random.Random(seed), {k: [] for k in targets}
        sem = asyncio.Semaphore(a.interleaved_concurrency)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(timeout=httpx.Timeout(600, connect=10.0), limits=limits) as client:
            t0 = time.perf_counter()

            async def one(kind: str) -> None:
                async with sem:
                    r = await send_request(client, targets[kind], req, t0)
                if not r.success:
                    raise RuntimeError(f"{kind}: {r.error}")
                ttft[kind].append(r.ttft * 1000)
            await asyncio.gather(*(one(rng.choice(list(targets))) for _ in range(n)))
        return ttft

    try:
        for i, r in enumerate(a.routers.split(",")):
            port = a.port + 2 + i
            proc = spawn(router_cmd(r, port, "round_robin", [url]), out / "overhead" / f"{r}-router-interleaved.log",
                         f"http://127.0.0.1:{port}")
            try:
                targets = {k: ClientConfig(u, "default", ignore_eos=True) for k, u in
                           (("direct", url), ("router", f"http://127.0.0.1:{port}"))}
                asyncio.run(load(targets, 128, 1))  # warm: connections, the router's first requests
                cpu0 = router_cpu_s(proc.pid)
                ttft = asyncio.run(load(targets, a.interleaved, 0))
                cpu = router_cpu_s(proc.pid) - cpu0
            finally:
                stop(proc)
            mean = {k: sum(v) / len(v) for k, v in ttft.items()}
            rng = random.Random(2)
            boot = sorted(sum(rng.choices(ttft["router"], k=len(ttft["router"]))) / len(ttft["router"]) -
                          sum(rng.choices(ttft["direct"], k=len(ttft["direct"]))) / len(ttft["direct"])
                          for _ in range(2000))
            result[r] = {"concurrency": a.interleaved_concurrency, "requests": {k: len(v) for k, v in ttft.items()}, "mean_ttft_ms": mean,
                         "added_ms": mean["router"] - mean["direct"], "added_ci95_ms": [boot[50], boot[1949]],
                         "router_cpu_ms_per_routed_request": 1000 * cpu / len(ttft["router"])}
            print(r, json.dumps(result[r]))
    finally:
        stop(worker)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="benchmarks/results/router")
    ap.add_argument("--routers", default="rivulet,sglang", help="rivulet and/or sglang (sglang-router, the peer)")
    ap.add_argument("--policies", default="round_robin,cache_aware")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--prefixes", type=int, default=8)
    ap.add_argument("--prefix-len", type=int, default=512)
    ap.add_argument("--suffix-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--num-prompts", type=int, default=96)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--kv-blocks", type=int, default=224, help="each replica's KV pool, 16-token blocks")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--port", type=int, default=8060)
    ap.add_argument("--skip-overhead", action="store_true")
    ap.add_argument("--rounds", type=int, default=5, help="overhead run: rounds of direct and each router")
    ap.add_argument("--skip-affinity", action="store_true")
    ap.add_argument("--interleaved", type=int, default=0, metavar="N",
                    help="also the interleaved overhead run with N requests (0: not run)")
    ap.add_argument("--interleaved-concurrency", type=int, default=64,
                    help="interleaved run: requests in flight, direct and routed together")
    ap.add_argument("--fake-worker", type=int, default=None, metavar="PORT", help=argparse.SUPPRESS)
    ap.add_argument("--fake-tpot-ms", type=float, default=100.0,
                    help="overhead run: the stand-in worker's time per output token")
    a = ap.parse_args()
    if a.fake_worker is not None:
        return fake_worker(a.fake_worker, a.fake_tpot_ms / 1000)
    out = Path(a.out)
    (out / "overhead").mkdir(parents=True, exist_ok=True)
    results: dict = {"config": vars(a), "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                                                 capture_output=True, text=True).stdout.strip()}
    results["affinity"] = {} if a.skip_affinity else affinity(a, out)
    if not a.skip_overhead:
        results["overhead"] = overhead(a, out)
    if a.interleaved:
        results["interleaved"] = interleaved(a, out)
    aff, summary = results["affinity"], {}
    for router in a.routers.split(","):
        rr, ca = (aff.get(p if router == "rivulet" else f"{router}-{p}") for p in ("round_robin", "cache_aware"))
        if rr and ca:
            summary[router] = {
                "hit_rate_ratio": ca["prefix_cache"]["hit_rate"] / rr["prefix_cache"]["hit_rate"]
                if rr["prefix_cache"]["hit_rate"] else None,
                "mean_ttft_ratio": ca["mean_ttft_ms"] / rr["mean_ttft_ms"],
                "throughput_ratio": ca["output_throughput"] / rr["output_throughput"]}
    if "cache_aware" in aff and "sglang-cache_aware" in aff:
        summary["rivulet_over_sglang_cache_aware_mean_ttft"] = \
            aff["cache_aware"]["mean_ttft_ms"] / aff["sglang-cache_aware"]["mean_ttft_ms"]
    results["summary"] = summary
    (out / "router.json").write_text(json.dumps(results, indent=1))
    print(json.dumps(results["summary"], indent=1), json.dumps(results.get("overhead", {}).get("added_median_ms")))


if __name__ == "__main__":
    main()
