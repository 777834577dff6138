"""`rivulet plan`'s predictions against measured steps on this machine, one layout at a time.

For each layout the machine can run on the default model (one device = the whole CPU; two devices =
one core each, as Rivulet pins its ranks), the device is probed first (`rivulet.plan.probe`, with that
many threads), then the engine runs: decode steps of a batch (the median step once every prompt is in)
and the prefill of one prompt; the planner predicts the same steps. Writes a markdown table and JSON.

    .venv/bin/python benchmarks/plan_validation.py [--out benchmarks/results/plan_validation.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

from rivulet import LLM, SamplingParams
from rivulet.bench.offline import machine_info
from rivulet.models.arch_config import ArchConfig
from rivulet.plan.cli import model_config
from rivulet.plan.cluster import Cluster, Link
from rivulet.plan.cost import Layout
from rivulet.plan.planner import Predictor
from rivulet.plan.probe import probe

IN, OUT = 128, 48
GLOO = Link(gbps=5, latency_us=50)  # ranks on one machine: gloo over loopback (an assumption, not probed)


def measure(kwargs: dict[str, Any], batch: int) -> tuple[float, float]:
    """(median decode step s at `batch`, prefill s of one IN-token prompt)."""
    g = torch.Generator().manual_seed(batch)
    prompts = [{"prompt_token_ids": torch.randint(100, 20000, (IN,), generator=g).tolist()} for _ in range(batch + 1)]
    llm = LLM("default", dtype="bfloat16", max_model_len=IN + OUT + 16, max_num_seqs=batch,
              max_num_batched_tokens=max(batch * IN, 2048), enable_prefix_caching=False, **kwargs)
    try:
        engine = llm.engine
        llm.generate(prompts[:2], SamplingParams(max_tokens=4), use_tqdm=False)  # warm up
        params = SamplingParams(temperature=0, max_tokens=OUT, ignore_eos=True)
        t0 = time.perf_counter()
        engine.add_request(None, prompts[-1], SamplingParams(temperature=0, max_tokens=1))
        while engine.has_unfinished_requests():
            engine.step()
        prefill = time.perf_counter() - t0
        for p in prompts[:batch]:
            engine.add_request(None, p, params)
        steps = []
        while engine.has_unfinished_requests():
            t = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - t)
        decode = statistics.median(steps[3:-2])  # past the prefill steps and the overlap's edges
    finally:
        llm.shutdown()
    return decode, prefill


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/plan_validation.json")
    ap.add_argument("--batches", default="1,16,64")
    a = ap.parse_args()
    arch = ArchConfig.from_hf(model_config("default"))
    cores = torch.get_num_threads()
    runs = [("one device (all cores)", Layout(), {}, 1, cores),
            ("pp2 (a core per stage)", Layout(pp=2), {"pipeline_parallel_size": 2}, 2, max(1, cores // 2))]
    rows = []
    for name, layout, kwargs, devices, threads in runs:
        torch.set_num_threads(threads)
        device = probe(write=False)
        torch.set_num_threads(cores)
        predictor = Predictor(arch, Cluster(1, devices, device, intra_node=GLOO))
        for batch in [int(b) for b in a.batches.split(",")]:
            decode, prefill = measure(kwargs, batch)
            want_decode = predictor.step_time(layout, batch, batch, IN + OUT / 2)["time"]
            rows.append({"layout": name, "what": f"decode step, batch {batch}", "predicted_ms": want_decode * 1e3,
                         "measured_ms": decode * 1e3})
            if batch == 1:
                want_prefill = predictor.step_time(layout, IN, 1, IN / 2)["time"]
                rows.append({"layout": name, "what": f"prefill of {IN} tokens", "predicted_ms": want_prefill * 1e3,
                             "measured_ms": prefill * 1e3})
        rows.append({"layout": name, "what": "device", **device.__dict__})
    print("| layout | step | predicted ms | measured ms | error |")
    print("|---|---|---:|---:|---:|")
    for r in rows:
        if "predicted_ms" in r:
            r["error"] = r["predicted_ms"] / r["measured_ms"] - 1
            print(f"| {r['layout']} | {r['what']} | {r['predicted_ms']:.1f} | {r['measured_ms']:.1f} | {r['error']:+.0%} |")
    with open(a.out, "w") as f:
        json.dump({"benchmark": "plan_validation", "input_len": IN, "output_len": OUT, **machine_info(), "rows": rows},
                  f, indent=1)


if __name__ == "__main__":
    main()
