"""The KV tier's workload, side by side: documents that do not all fit in the device KV pool, questions on
random documents, time to first token per question; then a restart and the first question on each document.

8 documents of ~1,900 tokens (1,911 with the default model's tokenizer), 64 questions each on a random
document (seeded), asked one at a time (greedy, 16 tokens, streamed) of each system in turn, one server at a
time:

  rivulet          `rivulet serve` with a device pool of 1.7 documents (200 blocks of 16), no tier
  rivulet+tier     the same pool, plus --kv-offload-memory 1 GiB and --kv-tier-path DIR
  rivulet-restart  a new server on the same DIR: the first question on each document (disk tier hits)
  rivulet-cold     a new server without a tier: the same 8 first questions (every document prefilled)
  vllm             vLLM's CPU server with its own KV cache (1 GiB: all 8 documents fit), for reference
  vllm-small       vLLM with the same ~2-document pool (--num-gpu-blocks-override, 32-token blocks); its KV offloading
                   (--kv-offloading-size) needs CUDA or XPU tensors, so it has no tier on CPU

    python benchmarks/kv_tier.py --out benchmarks/results/kv_tier [--systems rivulet,rivulet+tier,...]

writes OUT/kv_tier.json: per system the questions' TTFTs and outputs, and the summary ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
PEERS = Path(os.environ.get("PEERS_DIR", Path.home() / ".cache/rivulet-peers"))
WORDS = ("river stone cloud light garden window silver morning engine market winter letter bridge music "
         "harbor lantern meadow copper signal orchard canyon thunder velvet compass ember glacier").split()


def documents(n: int, words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    docs = []
    for d in range(n):
        lines = [f"Line {i} of report {d}: " + " ".join(rng.choice(WORDS) for _ in range(12)) + "."
                 for i in range(words // 14)]
        docs.append(f"Report {d}.\n" + "\n".join(lines) + "\n")
    return docs


def questions(n_docs: int, n: int, seed: int) -> list[tuple[int, str]]:
    rng = random.Random(seed + 1)
    return [(rng.randrange(n_docs), f"Question {q}: what does line {rng.randrange(90)} say? Answer:")
            for q in range(n)]


def start(system: str, port: int, blocks: int, tier_dir: str, log: Path) -> subprocess.Popen:
    base = [str(ROOT / ".venv/bin/rivulet"), "serve", "--port", str(port), "--disable-uvicorn-access-log",
            "--max-model-len", "2048", "--num-kv-blocks", str(blocks)]
    env = dict(os.environ)
    if system in ("rivulet", "rivulet-cold"):
        cmd = base
    elif system in ("rivulet+tier", "rivulet-restart"):
        cmd = base + ["--kv-offload-memory", str(1 << 30), "--kv-tier-path", tier_dir]
    elif system in ("vllm", "vllm-small"):
        hf = PEERS / "smollm2-135m-instruct-hf"
        if not hf.is_dir():
            subprocess.run([str(ROOT / ".venv/bin/python"), str(ROOT / "benchmarks/peers/make_hf_model.py"), str(hf)],
                           check=True, stdout=subprocess.DEVNULL)
        tc = next((ln.split()[-1] for ln in subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
                   .splitlines() if "libtcmalloc_minimal.so.4 " in ln), "")
        iomp = next(iter(sorted((PEERS / "vllm/lib").rglob("libiomp5.so"))), "")
        env |= {"VLLM_CPU_OMP_THREADS_BIND": f"0-{os.cpu_count() - 1}", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
                "VLLM_USE_AOT_COMPILE": "0", "VLLM_CPU_KVCACHE_SPACE": "1", "LD_PRELOAD": f"{tc}:{iomp}"}
        cmd = [str(PEERS / "vllm/bin/vllm"), "serve", str(hf), "--served-model-name", "default", "--dtype",
               "bfloat16", "--port", str(port), "--max-model-len", "2048", "--no-enable-log-requests"]
        if system == "vllm-small":  # its CPU attention wants blocks of a multiple of 32 tokens: the same tokens
            cmd += ["--num-gpu-blocks-override", str(blocks // 2), "--block-size", "32"]
    else:
        raise SystemExit(f"unknown system {system!r}")
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, start_new_session=True)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{system} exited; see {log}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{system} did not become healthy; see {log}")


def stop(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def ask(client: httpx.Client, prompt: str, max_tokens: int) -> tuple[float, str]:
    """(TTFT in seconds, the completion's text)."""
    body = {"model": "default", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    t0, ttft, text = time.perf_counter(), None, []
    with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices"):
                if ttft is None:
                    ttft = time.perf_counter() - t0
                text.append(chunk["choices"][0].get("text", ""))
    assert ttft is not None
    return ttft, "".join(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="benchmarks/results/kv_tier")
    ap.add_argument("--systems", default="rivulet,rivulet+tier,rivulet-restart,rivulet-cold,vllm,vllm-small")
    ap.add_argument("--docs", type=int, default=8)
    ap.add_argument("--doc-words", type=int, default=1150, help="words of a document (1150: 1,911 tokens)")
    ap.add_argument("--questions", type=int, default=64)
    ap.add_argument("--device-blocks", type=int, default=200, help="the device pool in 16-token blocks")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--port", type=int, default=8041)
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    docs = documents(a.docs, a.doc_words, a.seed)
    qs = questions(a.docs, a.questions, a.seed)
    firsts = [next((q for q in qs if q[0] == d), (d, "Question: a summary? Answer:")) for d in range(a.docs)]
    tier_dir = tempfile.mkdtemp(prefix="rivulet-kv-tier-")
    results: dict = {"config": vars(a), "systems": {}}
    try:
        for system in a.systems.split(","):
            try:
                proc = start(system, a.port, a.device_blocks, tier_dir, out / f"{system}.log")
            except SystemExit as e:  # recorded; the other systems still run
                print(e, flush=True)
                results["systems"][system] = {"error": str(e)}
                continue
            try:
                with httpx.Client(base_url=f"http://127.0.0.1:{a.port}", timeout=600) as client:
                    n_tokens = client.post("/tokenize", json={"model": "default", "prompt": docs[0]}).json().get("count")
                    work = firsts if system in ("rivulet-restart", "rivulet-cold") else qs
                    runs = [ask(client, docs[d] + q, a.max_tokens) for d, q in work]
                    metrics = client.get("/metrics").text
            finally:
                stop(proc)
            ttfts = [t for t, _ in runs]
            results["systems"][system] = {
                "requests": len(runs), "doc_tokens": n_tokens, "mean_ttft_s": statistics.mean(ttfts),
                "median_ttft_s": statistics.median(ttfts), "ttft_s": ttfts, "outputs": [t for _, t in runs],
                "metrics": [ln for ln in metrics.splitlines() if ("kv_tier" in ln or "prefix_cache" in ln)
                            and not ln.startswith("#")]}
            print(f"{system:16s} mean TTFT {statistics.mean(ttfts) * 1e3:8.1f} ms over {len(runs)} requests",
                  flush=True)
    finally:
        shutil.rmtree(tier_dir, ignore_errors=True)
    s = {k: v for k, v in results["systems"].items() if "error" not in v}
    summary: dict = {}
    if "rivulet" in s and "rivulet+tier" in s:
        summary["tier_over_no_tier_mean_ttft"] = s["rivulet+tier"]["mean_ttft_s"] / s["rivulet"]["mean_ttft_s"]
        summary["same_outputs"] = sum(x == y for x, y in zip(s["rivulet"]["outputs"], s["rivulet+tier"]["outputs"]))
    if "rivulet-restart" in s and "rivulet-cold" in s:
        summary["restart_over_cold_mean_ttft"] = s["rivulet-restart"]["mean_ttft_s"] / s["rivulet-cold"]["mean_ttft_s"]
        summary["restart_same_outputs"] = sum(
            x == y for x, y in zip(s["rivulet-restart"]["outputs"], s["rivulet-cold"]["outputs"]))
    for peer in ("vllm", "vllm-small"):
        if peer in s and "rivulet+tier" in s:
            summary[f"tier_over_{peer}_mean_ttft"] = s["rivulet+tier"]["mean_ttft_s"] / s[peer]["mean_ttft_s"]
        if peer in s and "rivulet" in s:
            summary[f"no_tier_over_{peer}_mean_ttft"] = s["rivulet"]["mean_ttft_s"] / s[peer]["mean_ttft_s"]
    results["summary"] = summary
    (out / "kv_tier.json").write_text(json.dumps(results, indent=1))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    sys.exit(main())
