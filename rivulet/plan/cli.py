"""`rivulet plan`: flags and the command (argparse only at import, so building the CLI stays cheap)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from rivulet.config import RivuletError


def add_plan_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="a HF model folder, its config.json, a .gguf file, or 'default'")
    p.add_argument("--cluster", default=None, help="the cluster YAML (nodes, devices_per_node, device, links)")
    p.add_argument("--workload", default=None, help="in=N,out=N,concurrency=N or in=N,out=N,rate=R (default "
                                                    "in=1024,out=256,concurrency=64)")
    p.add_argument("--slo", default=None, help="ttft=MS,tpot=MS: layouts that miss it rank last")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "fp8"], help="the weights' type")
    p.add_argument("--pipeline-micro-batches", type=int, default=1)
    p.add_argument("--top", type=int, default=5, help="layouts to print")
    p.add_argument("--json", default=None, metavar="PATH", help="write {\"layouts\": [...]}, best first")
    p.add_argument("--probe", action="store_true", help="measure this machine as the device 'this-cpu' and exit")
    p.add_argument("--probe-cores", type=int, default=None, metavar="N",
                   help="with --probe: a device is N of this machine's cores (a cluster of its cores as devices: "
                        "devices_per_node = cores / N); default all of them, one device")


def model_config(model: str) -> dict[str, Any]:
    """The HF config dict of a folder, a config.json, a .gguf file or 'default' (no weights are read)."""
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".json":
        try:
            return json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise RivuletError(f"cannot read {path}: {e}") from None
    from rivulet.models.loader.source import resolve_model

    src = resolve_model(model)
    if src.is_gguf:
        from rivulet.models.loader.gguf import GGUFCheckpoint

        return GGUFCheckpoint(src).hf_config
    from rivulet.models.loader.hf import hf_config

    return hf_config(src)


def cmd_plan(a: argparse.Namespace) -> int:
    from rivulet.models.arch_config import ArchConfig
    from rivulet.plan.cluster import Cluster
    from rivulet.plan.planner import SLO, Predictor, Workload, explain

    if a.probe:
        from rivulet.plan.probe import probe
        from rivulet.plan.cluster import probe_path

        import os

        import torch

        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        n = cores if a.probe_cores is None else a.probe_cores
        if not 1 <= n <= cores:
            raise RivuletError(f"--probe-cores {n}: this process may use {cores} core(s)")
        torch.set_num_threads(n)
        dev = probe()
        print(json.dumps(dev.__dict__))
        print(f"written to {probe_path()} (device: this-cpu)")
        return 0
    if a.probe_cores is not None:
        raise RivuletError("--probe-cores goes with --probe")
    if a.model is None or a.cluster is None:
        raise RivuletError("rivulet plan needs --model and --cluster (or --probe)")
    arch = ArchConfig.from_hf(model_config(a.model))
    workload, slo = Workload.parse(a.workload), SLO.parse(a.slo)
    layouts = Predictor(arch, Cluster.load(a.cluster), a.dtype, a.pipeline_micro_batches).plan(workload, slo)
    if a.json:
        Path(a.json).write_text(json.dumps({"model": arch.architecture, "workload": workload.__dict__,
                                            "layouts": layouts}, indent=1) + "\n")
    print(f"{'layout':<18}{'fits':>5}{'slo':>5}{'weights GB':>12}{'KV tokens':>12}{'TTFT ms':>10}{'TPOT ms':>10}"
          f"{'tok/s':>10}{'per dev':>9}  binding")
    for p in layouts[:a.top]:
        ttft = f"{p['ttft_ms']:.1f}" if p["ttft_ms"] is not None else "-"
        tpot = f"{p['tpot_ms']:.2f}" if p["tpot_ms"] is not None else "-"
        print(f"{p['layout']:<18}{'yes' if p['fits'] else 'no':>5}{'yes' if p.get('meets_slo') else 'no':>5}"
              f"{p['weight_gb_per_device']:>12.2f}{p['kv_tokens_per_device']:>12}{ttft:>10}{tpot:>10}"
              f"{p['throughput_tok_s']:>10.0f}{p['throughput_per_device']:>9.1f}  {p['binding']}")
    print()
    print(explain(layouts[0], workload))
    return 0
