"""`rivulet plan`'s predictions against measured steps on this machine, one layout at a time.

For each layout the machine can run (one device = the whole CPU; two devices = one core each, as Rivulet
pins its ranks): the default model on one device and over two pipeline stages; random-weight models written
here whose shapes split in two, a Llama (8 heads) on one device and over two tensor-parallel ranks, and a
Mixtral-shaped MoE (8 experts, top 2) on one device, tp2 and tp2 with expert parallelism. TP x PP needs four
ranks: more than this machine's two cores. The device is probed first (`rivulet.plan.probe`, with that many
threads, again before each model), then the engine runs: TPOT = the median decode step of a batch once every prompt is in, TTFT = the
median prefill of one prompt to its first token (of 5); with two ranks also the bytes rank 0 puts into collectives per decode
step. The planner predicts the same. Everything (probes and runs) is done `--passes` times (3) and each row is the
median of its passes, its measured values beside it. Writes a markdown table and JSON.

    .venv/bin/python benchmarks/plan_validation.py [--out benchmarks/results/plan_validation.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from rivulet import LLM, SamplingParams
from rivulet.bench.offline import machine_info
from rivulet.models.arch_config import ArchConfig
from rivulet.plan.cli import model_config
from rivulet.plan.cluster import Cluster, Device, Link
from rivulet.plan.cost import Layout, ModelCost
from rivulet.plan.planner import Predictor
from rivulet.plan.probe import probe

IN, OUT = 128, 48
PREFILLS = 5  # TTFT: the median of this many prefills of one prompt
VOCAB = 16384
SHAPES: dict[str, tuple[str, dict[str, Any]]] = {  # random-weight models whose heads and experts split in two
    "llama-8h": ("LlamaConfig", dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=12,
                                     num_attention_heads=8, num_key_value_heads=4)),
    "mixtral-8e": ("MixtralConfig", dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=8,
                                         num_attention_heads=8, num_key_value_heads=4, num_local_experts=8,
                                         num_experts_per_tok=2)),
}
TP2 = {"tensor_parallel_size": 2}
RUNS: list[tuple[str, str, Layout, dict[str, Any]]] = [  # model, layout name, layout, engine arguments
    ("default", "one device (all cores)", Layout(), {}),
    ("default", "pp2 (a core per stage)", Layout(pp=2), {"pipeline_parallel_size": 2}),
    ("llama-8h", "one device (all cores)", Layout(), {}),
    ("llama-8h", "tp2 (a core per rank)", Layout(tp=2), TP2),
    ("mixtral-8e", "one device (all cores)", Layout(), {}),
    ("mixtral-8e", "tp2 (a core per rank)", Layout(tp=2), TP2),
    ("mixtral-8e", "tp2 ep (a core per rank)", Layout(tp=2, ep=True), {**TP2, "enable_expert_parallel": True}),
]


def write_model(kind: str, folder: Path) -> None:
    """A random-weight bf16 checkpoint of SHAPES[kind] in `folder`."""
    import transformers

    cls, kw = SHAPES[kind]
    cfg = getattr(transformers, cls)(vocab_size=VOCAB, max_position_embeddings=1024, tie_word_embeddings=False,
                                     bos_token_id=1, eos_token_id=2, **kw)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(folder)


def measure(model: str, kwargs: dict[str, Any], batch: int) -> dict[str, float]:
    """Median decode step s at `batch` (TPOT), the median prefill of one IN-token prompt to its first token (TTFT), and
    with several ranks rank 0's collective payload bytes per decode step."""
    g = torch.Generator().manual_seed(batch)
    prompts = [{"prompt_token_ids": torch.randint(100, VOCAB, (IN,), generator=g).tolist()}
               for _ in range(batch + PREFILLS)]
    llm = LLM(model, dtype="bfloat16", max_model_len=IN + OUT + 16, max_num_seqs=batch,
              max_num_batched_tokens=max(batch * IN, 2048), enable_prefix_caching=False, **kwargs)
    try:
        engine = llm.engine
        llm.generate(prompts[:2], SamplingParams(max_tokens=4), use_tqdm=False)  # warm up
        params = SamplingParams(temperature=0, max_tokens=OUT, ignore_eos=True)
        prefills = []
        for p in prompts[batch:]:  # one prompt at a time, the typical of a few (a two-rank step varies 2x here)
            t0 = time.perf_counter()
            engine.add_request(None, p, SamplingParams(temperature=0, max_tokens=1))
            while engine.has_unfinished_requests():
                engine.step()
            prefills.append(time.perf_counter() - t0)
        for p in prompts[:batch]:
            engine.add_request(None, p, params)
        steps, comm = [], []
        while engine.has_unfinished_requests():
            several = bool(kwargs)
            if several:
                engine.core.executor.collect("reset")
            t = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - t)
            if several:
                stats = engine.core.executor.collect("comm")[0]
                comm.append(sum(v.get("payload_bytes", 0) for v in stats.values()))
        out = {"decode": statistics.median(steps[3:-2]), "prefill": statistics.median(prefills)}  # past the prefill steps and the edges
        if comm:
            out["comm_bytes"] = statistics.median(comm[3:-2])
    finally:
        llm.shutdown()
    return out


def one_pass(models: list[str], batches: list[int], tmp: str) -> list[dict[str, Any]]:
    """Probe the device (per model and thread count, just before its rows) and measure every row once."""
    cores = torch.get_num_threads()
    probes: dict[tuple[str, int], Device] = {}  # probed again for each model: the VM's speed drifts over minutes
    rows: list[dict[str, Any]] = []
    for model, name, layout, kwargs in RUNS:
        if model not in models:
            continue
        path = model
        if model in SHAPES:
            path = str(Path(tmp) / model)
            if not Path(path).exists():
                write_model(model, Path(path))
        devices = layout.devices
        threads = max(1, cores // devices)
        if (model, threads) not in probes:
            torch.set_num_threads(threads)
            probes[model, threads] = probe(write=False)
            torch.set_num_threads(cores)
            rows.append({"layout": f"{threads} thread(s)", "what": "device", "before": model,
                         **probes[model, threads].__dict__})
        device = probes[model, threads]
        link = Link(device.link_gbps or 1.0, device.link_latency_us if device.link_latency_us is not None else 500.0)
        predictor = Predictor(ArchConfig.from_hf(model_config(path)), Cluster(1, devices, device, intra_node=link))
        for batch in batches:
            got = measure(path, kwargs, batch)
            step = predictor.step_time(layout, batch, batch, IN + OUT / 2)
            row = {"model": model, "layout": name, "what": f"TPOT (decode step), batch {batch}",
                   "predicted_ms": step["time"] * 1e3, "measured_ms": got["decode"] * 1e3}
            if "comm_bytes" in got:  # rank 0's: the first stage's payloads
                rank0 = ModelCost(predictor.arch, layout).step(0, batch, batch, IN + OUT / 2, 2)
                predicted = sum(v for k, v in rank0.items() if k in ("all_reduce", "all_gather", "all_to_all", "send"))
                row |= {"predicted_comm_bytes": predicted, "measured_comm_bytes": got["comm_bytes"]}
            rows.append(row)
            if batch == 1:
                first = predictor.step_time(layout, IN, 1, IN / 2)["time"]
                rows.append({"model": model, "layout": name, "what": f"TTFT (prefill of {IN} tokens)",
                             "predicted_ms": first * 1e3, "measured_ms": got["prefill"] * 1e3})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/plan_validation.json")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--models", default="default,llama-8h,mixtral-8e")
    ap.add_argument("--passes", type=int, default=3,
                    help="probe and measure everything this many times; a row is the median of its passes "
                         "(this VM's speed moves 10-40%% for seconds at a time)")
    a = ap.parse_args()
    passes = []
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(a.passes):
            passes.append(one_pass(a.models.split(","), [int(b) for b in a.batches.split(",")], tmp))
    rows = [r for r in passes[0] if r["what"] == "device"] + [r for p in passes[1:] for r in p if r["what"] == "device"]
    print("| model | layout | measure | predicted ms | measured ms (passes) | error | comm bytes/step predicted / measured |")
    print("|---|---|---|---:|---:|---:|---|")
    for i, r in enumerate(passes[0]):
        if r["what"] == "device":
            continue
        same = [p[i] for p in passes]
        r = {**r, "predicted_ms": statistics.median(x["predicted_ms"] for x in same),
             "measured_ms": statistics.median(x["measured_ms"] for x in same),
             "passes": [{"predicted_ms": x["predicted_ms"], "measured_ms": x["measured_ms"]} for x in same]}
        r["error"] = r["predicted_ms"] / r["measured_ms"] - 1
        rows.append(r)
        comm = (f"{r['predicted_comm_bytes']:.0f} / {r['measured_comm_bytes']:.0f}" if "measured_comm_bytes" in r else "-")
        spread = "/".join(f"{x['measured_ms']:.1f}" for x in same)
        print(f"| {r['model']} | {r['layout']} | {r['what']} | {r['predicted_ms']:.1f} | {r['measured_ms']:.1f} ({spread}) | "
              f"{r['error']:+.0%} | {comm} |")
    inside = sum(abs(r["error"]) <= 0.25 for r in rows if "error" in r)
    print(f"{inside} of {sum('error' in r for r in rows)} rows within 25%")
    choices = choice_rows(rows)
    for c in choices:
        print(f"{c['model']}, {c['what']}: predicted best {c['predicted_best']}, measured best {c['measured_best']} "
              f"(the predicted choice measures {c['penalty']:+.0%})")
    with open(a.out, "w") as f:
        json.dump({"benchmark": "plan_validation", "input_len": IN, "output_len": OUT, "passes": a.passes,
                   **machine_info(), "rows": rows, "choices": choices}, f, indent=1)


def choice_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per model and measure, the layout the planner would choose (the fastest predicted step) against the
    fastest measured one, and how much slower the chosen one measured."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        if "error" in r:
            groups.setdefault((r["model"], r["what"]), []).append(r)
    out = []
    for (model, what), rs in groups.items():
        if len(rs) < 2:
            continue
        chosen = min(rs, key=lambda r: r["predicted_ms"])
        best = min(rs, key=lambda r: r["measured_ms"])
        out.append({"model": model, "what": what, "predicted_best": chosen["layout"], "measured_best": best["layout"],
                    "penalty": chosen["measured_ms"] / best["measured_ms"] - 1})
    return out


if __name__ == "__main__":
    main()
