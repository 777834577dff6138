"""Soak: a mixed load against one OpenAI-compatible server for a bounded time, the resident memory of every
process in the server's tree sampled as it runs, and the slope after warm-up reported with its noise.

The load (16 client loops by default, loopback only): random prompts of 5-300 words through
/v1/completions and /v1/chat/completions, max_tokens 1-64, temperature 0 or 0.8, half of them streamed,
1% of the streams closed by the client after the first chunk, a few with logprobs or n=2.

    python benchmarks/soak.py --pid SERVER_PID --url http://127.0.0.1:8000 --duration 1800 --out DIR

writes DIR/soak.json (samples, per-process slopes, request counts) and DIR/soak.png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import time
from pathlib import Path

import httpx
import numpy as np

WORDS = ("the of and to in is was for on that with as by at from his her it an were are which this be or "
         "river stone cloud light garden window silver morning engine market winter letter bridge music").split()


def process_tree(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                ppid = int(open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            children.setdefault(ppid, []).append(int(d))
    tree, todo = [], [root]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo.extend(children.get(p, []))
    return tree


def memory(pid: int) -> tuple[str, float, float] | None:
    """(command, RSS MiB, PSS MiB) of one process, None when it is gone."""
    try:
        cmd = open(f"/proc/{pid}/cmdline").read().replace("\0", " ").strip()
        rss = pss = 0
        for line in open(f"/proc/{pid}/smaps_rollup"):
            if line.startswith("Rss:"):
                rss = int(line.split()[1])
            elif line.startswith("Pss:"):
                pss = int(line.split()[1])
        return cmd, rss / 1024, pss / 1024
    except OSError:
        return None


def label(cmd: str) -> str:
    if "core_proc" in cmd:
        return "engine"
    if "rivulet.worker.worker" in cmd:
        return "worker"
    if "resource_tracker" in cmd or "semaphore" in cmd:
        return "tracker"
    if "spawn_main" in cmd or "multiprocessing" in cmd:
        return "child"
    return "api" if "serve" in cmd else cmd.split()[0].rsplit("/", 1)[-1]


class Load:
    def __init__(self, url: str, model: str, seed: int):
        self.url, self.model, self.rng = url, model, random.Random(seed)
        self.counts = {"ok": 0, "errors": 0, "closed_early": 0}
        self.error_samples: list[str] = []

    def _body(self) -> tuple[str, dict]:
        r = self.rng
        text = " ".join(r.choice(WORDS) for _ in range(r.randint(5, 300)))
        body = {"model": self.model, "max_tokens": r.randint(1, 64), "temperature": r.choice([0.0, 0.8])}
        if r.random() < 0.5:
            body["stream"] = True
        if r.random() < 0.1:
            body["n"] = 2
        if r.random() < 0.5:
            if r.random() < 0.1:
                body["logprobs"] = 2
            return "/v1/completions", {**body, "prompt": text}
        if r.random() < 0.1:
            body["logprobs"], body["top_logprobs"] = True, 2
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": text}]}

    async def _one(self, client: httpx.AsyncClient) -> None:
        path, body = self._body()
        try:
            if body.get("stream"):
                close_early = self.rng.random() < 0.01
                async with client.stream("POST", self.url + path, json=body) as resp:
                    if resp.status_code != 200:
                        raise RuntimeError(f"{resp.status_code} {(await resp.aread())[:200]!r}")
                    done = False
                    async for line in resp.aiter_lines():
                        if close_early and line.startswith("data:"):
                            self.counts["closed_early"] += 1
                            return
                        done = done or line == "data: [DONE]"
                    if not done:
                        raise RuntimeError("stream ended without [DONE]")
            else:
                resp = await client.post(self.url + path, json=body)
                if resp.status_code != 200:
                    raise RuntimeError(f"{resp.status_code} {resp.text[:200]}")
            self.counts["ok"] += 1
        except Exception as e:  # counted and reported, the soak goes on
            self.counts["errors"] += 1
            if len(self.error_samples) < 10:
                self.error_samples.append(f"{type(e).__name__}: {e}")

    async def run(self, clients: int, until: float) -> None:
        async def loop() -> None:
            async with httpx.AsyncClient(timeout=300) as client:
                while time.monotonic() < until:
                    await self._one(client)
        await asyncio.gather(*(loop() for _ in range(clients)))


def slope(t: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Least-squares slope (per minute) and its standard error."""
    if len(t) < 3:
        return float("nan"), float("nan")
    tm = t / 60.0
    a, b = np.polyfit(tm, y, 1)
    resid = y - (a * tm + b)
    se = float(np.sqrt(resid.var(ddof=2) / ((tm - tm.mean()) ** 2).sum()))
    return float(a), se


async def soak(args: argparse.Namespace) -> dict:
    samples: list[dict] = []
    t0 = time.monotonic()
    until = t0 + args.duration
    load = Load(args.url.rstrip("/"), args.model, args.seed)

    async def sampler() -> None:
        while True:
            now = time.monotonic()
            procs = {}
            for pid in process_tree(args.pid):
                m = memory(pid)
                if m:
                    procs[f"{label(m[0])}:{pid}"] = {"rss_mib": m[1], "pss_mib": m[2]}
            samples.append({"t": now - t0, "requests": dict(load.counts), "processes": procs})
            if now >= until:
                return
            await asyncio.sleep(min(args.interval, max(0.0, until - now)))

    await asyncio.gather(sampler(), load.run(args.clients, until))
    names = sorted({n for s in samples for n in s["processes"]})
    t = np.array([s["t"] for s in samples])
    warm = t >= args.warmup_fraction * args.duration
    per_process = {}
    for n in names:
        y = np.array([s["processes"].get(n, {}).get("rss_mib", np.nan) for s in samples])
        ok = warm & ~np.isnan(y)
        a, se = slope(t[ok], y[ok])
        per_process[n] = {"rss_start_mib": float(y[~np.isnan(y)][0]), "rss_end_mib": float(y[~np.isnan(y)][-1]),
                          "rss_after_warmup_mib": float(y[ok][0]) if ok.any() else float("nan"),
                          "slope_mib_per_min": a, "slope_stderr": se}
    return {"url": args.url, "duration_s": args.duration, "clients": args.clients,
            "warmup_s": args.warmup_fraction * args.duration, "requests": load.counts,
            "error_samples": load.error_samples, "processes": per_process, "samples": samples}


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 4.5))
    t = [s["t"] / 60 for s in result["samples"]]
    for name, p in result["processes"].items():
        y = [s["processes"].get(name, {}).get("rss_mib", float("nan")) for s in result["samples"]]
        ax.plot(t, y, label=f"{name} ({p['slope_mib_per_min']:+.2f} MiB/min)")
    ax.axvline(result["warmup_s"] / 60, color="grey", ls=":", lw=1)
    ax.set_xlabel("minutes")
    ax.set_ylabel("RSS (MiB)")
    ax.set_title(f"soak: {sum(result['requests'].values())} requests, {result['requests']['errors']} errors")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pid", type=int, required=True, help="the server's process id (its tree is sampled)")
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default="default")
    ap.add_argument("--duration", type=float, default=1800.0, help="seconds")
    ap.add_argument("--interval", type=float, default=10.0, help="seconds between memory samples")
    ap.add_argument("--warmup-fraction", type=float, default=1 / 3)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    result = asyncio.run(soak(args))
    (args.out / "soak.json").write_text(json.dumps(result, indent=1))
    plot(result, args.out / "soak.png")
    print(json.dumps({k: v for k, v in result.items() if k != "samples"}, indent=1))


if __name__ == "__main__":
    main()
