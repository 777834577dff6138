"""`rivulet plan`'s single-device predictions for the Llama-3-8B shape against the H200 run of the GPU
check (benchmarks/results/gpu/gpu_check.json): the preset (datasheet peaks x efficiencies) and the same
device calibrated by that run's own ceilings (copy bandwidth and matmul rate, efficiencies 1). No device
is needed: it reads the measured figures.

    .venv/bin/python benchmarks/plan_gpu.py [--gpu benchmarks/results/gpu/gpu_check.json] [--out benchmarks/results/plan_gpu.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent / "gpu"))

from model_checks import LLAMA3_8B  # noqa: E402

from rivulet.models.arch_config import ArchConfig  # noqa: E402
from rivulet.plan.cluster import PRESETS, Cluster  # noqa: E402
from rivulet.plan.cost import Layout  # noqa: E402
from rivulet.plan.planner import Predictor, Workload  # noqa: E402


def rows(gpu: dict[str, Any], predictor: Predictor) -> list[dict[str, Any]]:
    """(what, predicted, measured) in output tok/s for each figure of the run the planner can predict."""
    args, model = gpu["meta"]["args"], gpu["sections"]["model"]
    one = Layout()
    out = []
    decode = model["decode_b1"]
    step = predictor.step_time(one, 1, 1, decode["prompt_len"] + decode["steps"] / 2)["time"]
    out.append(("batch-1 decode step (model runner, CUDA graphs)", 1 / step, decode["graphs_tok_s"]))
    for what, key, w in [
        ("1 x {i}/{o} (LLM.generate, graphs)", ("generate_b1", "graphs"), Workload(args["input_len"], args["output_len"], 1)),
        ("{n} x {i}/{o}", ("throughput",), Workload(args["input_len"], args["output_len"], args["num_prompts"])),
        ("{n} x {i}/{o} (long)", ("throughput_long",),
         Workload(args["long_input_len"], args["long_output_len"], args["long_requests"])),
    ]:
        measured = model
        for k in key:
            measured = measured.get(k, {})
        if "output_tok_s" not in measured:
            continue
        pred = predictor.predict(one, w)
        label = what.format(n=w.concurrency, i=w.input_len, o=w.output_len)
        out.append((label, pred["throughput_tok_s"], measured["output_tok_s"]))
    return [{"what": w, "predicted_tok_s": round(p, 1), "measured_tok_s": round(m, 1), "error": round(p / m - 1, 3)}
            for w, p, m in out]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpu", type=Path, default=Path("benchmarks/results/gpu/gpu_check.json"))
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    gpu = json.loads(a.gpu.read_text())
    arch = ArchConfig.from_hf(LLAMA3_8B)
    ceil = gpu["sections"]["ceilings"]
    preset = PRESETS["h200"]
    calibrated = dataclasses.replace(preset, name="h200 (this run's ceilings)", mem_bw_gbps=ceil["copy_gbps"],
                                     bf16_tflops=ceil["matmul_tflops"], mem_efficiency=1.0, compute_efficiency=1.0)
    result: dict[str, Any] = {"benchmark": "plan_gpu", "gpu_run": {k: gpu["meta"][k] for k in ("date", "commit", "device")},
                              "devices": {}}
    for device in (preset, calibrated):
        table = rows(gpu, Predictor(arch, Cluster(1, 1, device)))
        result["devices"][device.name] = {"device": dataclasses.asdict(device), "rows": table}
        print(f"\n{device.name}\n| figure | predicted tok/s | measured tok/s | error |\n|---|---:|---:|---:|")
        for r in table:
            print(f"| {r['what']} | {r['predicted_tok_s']} | {r['measured_tok_s']} | {r['error']:+.0%} |")
    if a.out:
        a.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
