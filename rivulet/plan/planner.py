"""`rivulet plan`: every parallel layout of a model on a cluster, predicted, then ranked.

Per stage, a step's time is the roofline of its GEMMs (FLOPs against the weights' bytes) plus the roofline
of its attention (FLOPs against the KV bytes), which run one after the other, plus its
collectives (ring all-reduce / all-gather, pairwise all-to-all, one send to the next stage: latency per
hop plus wire bytes over the link's bandwidth), each layer's launch overhead and the host's per-step
overhead (measured on this-cpu, ~0 on GPUs with CUDA graphs). Pipeline stages run
micro-batches: a step takes (M + pp - 1) / M slowest-stage times. At the workload (input and output
lengths, concurrency or an arrival rate) a replica decodes min(its share of the concurrency, what its
KV cache holds) sequences: TPOT is that decode step, TTFT the prefill of one prompt plus one decode
step, throughput the output tokens of that batch over its prefills and decodes. Layouts meeting the
SLO rank by throughput per device. docs/planning.md has the assumptions and the validation.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from rivulet.config import RivuletError
from rivulet.models.arch_config import ArchConfig
from rivulet.plan.cluster import Cluster
from rivulet.plan.cost import Layout, ModelCost, check_layout

MEMORY_FRACTION = 0.9  # of device memory for weights + KV cache (the rest: activations, buffers)


@dataclass(frozen=True)
class Workload:
    input_len: int = 1024
    output_len: int = 256
    concurrency: int | None = 64
    rate: float | None = None  # requests/s; sets the concurrency by Little's law

    @classmethod
    def parse(cls, text: str | None) -> Workload:
        """`in=1024,out=256,concurrency=64` or `...,rate=5`."""
        if not text:
            return cls()
        names = {"in": "input_len", "out": "output_len", "concurrency": "concurrency", "rate": "rate"}
        kw: dict[str, Any] = {}
        for part in text.split(","):
            key, _, value = part.partition("=")
            if key.strip() not in names or not value:
                raise RivuletError(f"bad --workload item {part!r}: use in=N,out=N,concurrency=N or rate=R")
            kw[names[key.strip()]] = float(value) if key.strip() == "rate" else int(value)
        if "rate" in kw:
            kw.setdefault("concurrency", None)
        return cls(**kw)


@dataclass(frozen=True)
class SLO:
    ttft_ms: float | None = None
    tpot_ms: float | None = None

    @classmethod
    def parse(cls, text: str | None) -> SLO:
        if not text:
            return cls()
        kw = {}
        for part in text.split(","):
            key, _, value = part.partition("=")
            if key.strip() not in ("ttft", "tpot") or not value:
                raise RivuletError(f"bad --slo item {part!r}: use ttft=MS,tpot=MS")
            kw[f"{key.strip()}_ms"] = float(value)
        return cls(**kw)


class Predictor:
    def __init__(self, arch: ArchConfig, cluster: Cluster, dtype: str = "bfloat16", micro_batches: int = 1) -> None:
        if dtype not in ("bfloat16", "fp8"):
            raise RivuletError(f"--dtype {dtype!r}: bfloat16 or fp8")
        if dtype == "fp8" and cluster.device.fp8_tflops is None:
            raise RivuletError(f"{cluster.device.name} has no fp8 compute")
        self.arch, self.cluster, self.dtype, self.micro_batches = arch, cluster, dtype, micro_batches
        self.weight_bytes = 1 if dtype == "fp8" else 2

    def layouts(self) -> list[Layout]:
        """Every layout Rivulet can run that fits the cluster's device count, using as many replicas as fit."""
        out = []
        n = self.cluster.devices
        for tp in _divisors(n):
            for pp in _divisors(n // tp):
                for ep in (False, True):
                    lay = Layout(tp, pp, ep, n // (tp * pp))
                    if check_layout(self.arch, lay) is None:
                        out.append(lay)
        return out

    # ---- time of one step ----

    def together(self, lay: Layout) -> bool:
        """Whether the devices run at the same moment in a step: the ranks of a TP group, replicas, and pipeline
        stages once micro-batches overlap them (one batch through the stages keeps one stage busy at a time)."""
        return lay.tp > 1 or lay.dp > 1 or (lay.pp > 1 and self.micro_batches > 1)

    def _stage_time(self, cost: ModelCost, stage: int, tokens: int, sampled: int, context: float) -> dict[str, float]:
        c, lay = self.cluster, cost.lay
        d = c.device.all_busy() if self.together(lay) else c.device  # slices of one CPU share its memory bus
        s = cost.step(stage, tokens, sampled, context, self.weight_bytes)
        # the GEMMs over the weights and the attention over the KV cache run one after the other: a roofline each
        bw = d.mem_bw_gbps * 1e9 * d.mem_efficiency
        fp8 = self.dtype == "fp8"
        gemm_compute = ((s["flops"] - s["expert_flops"]) / d.flop_rate(tokens, fp8)
                        + s["expert_flops"] / d.flop_rate(round(s["expert_rows"]), fp8))
        gemm_memory = s["weight_bytes"] / bw
        measured = d.attn_decode_tflops if tokens == sampled else d.attn_prefill_tflops
        attn_rate = measured * 1e12 if measured else d.flop_rate(tokens)
        attn_compute, attn_memory = s["attn_flops"] / attn_rate, s["kv_bytes"] / bw
        compute = max(gemm_compute, gemm_memory) if gemm_compute >= gemm_memory else 0.0
        compute += attn_compute if attn_compute >= attn_memory else 0.0
        memory = (gemm_memory if gemm_memory > gemm_compute else 0.0) + (attn_memory if attn_memory > attn_compute else 0.0)
        memory += s["act_bytes"] / (d.act_gbps * 1e9 if d.act_gbps else bw)  # the element-wise kernels
        expert_calls = 2 * s["experts_hit"]  # at their own rows; the rest at the step's
        launches = (len(cost.stage_layers(stage)) * d.layer_overhead_ms * 1e-3
                    + max(0.0, s["gemm_calls"] - expert_calls) * d.call_s(tokens) + expert_calls * d.call_s(s["expert_rows"])
                    + s["experts_hit"] * d.expert_us * 1e-6 + s["moe_layers"] * (d.moe_layer_us + lay.ep * d.ep_layer_us) * 1e-6
                    + s["ep_rows"] * d.ep_row_us * 1e-6)
        comm = 0.0
        tp_link = c.link(lay.tp)
        for kind, payload in s.items():
            if kind in ("all_reduce", "all_gather", "all_to_all") and lay.tp > 1:
                calls = _calls(kind, cost, stage)
                hops = {"all_reduce": 2 * (lay.tp - 1), "all_gather": lay.tp - 1, "all_to_all": lay.tp - 1}[kind]
                share = {"all_reduce": 2 * (lay.tp - 1) / lay.tp, "all_gather": (lay.tp - 1) / lay.tp,
                         "all_to_all": 1.0}[kind]
                comm += calls * hops * tp_link.latency_us * 1e-6 + payload * share / (tp_link.gbps * 1e9)
            elif kind == "send":
                link = c.link(2, stride=lay.tp)
                comm += self.micro_batches * link.latency_us * 1e-6 + payload / (link.gbps * 1e9)
        return {"compute": compute, "memory": memory, "comm": comm, "launches": launches,
                "time": compute + memory + comm + launches,
                "comm_bytes": sum(v for k, v in s.items() if k in ("all_reduce", "all_gather", "all_to_all", "send"))}

    def step_time(self, lay: Layout, tokens: int, sampled: int, context: float) -> dict[str, float]:
        """Seconds of one step of a replica, with what each part took on its slowest stage."""
        cost = ModelCost(self.arch, lay)
        stages = [self._stage_time(cost, s, tokens, sampled, context) for s in range(lay.pp)]
        slowest = max(stages, key=lambda x: x["time"])
        m = max(1, min(self.micro_batches, sampled))
        pipeline = (m + lay.pp - 1) / m
        d = self.cluster.device
        host = (d.step_overhead_ms + d.seq_overhead_ms * sampled + (lay.pp - 1) * d.stage_overhead_ms
                + (lay.tp > 1) * d.tp_overhead_ms) * 1e-3
        overhead = host + slowest["launches"]
        return {**slowest, "time": slowest["time"] * pipeline + host,
                "bubble": (lay.pp - 1) / (m + lay.pp - 1), "pipeline_extra": slowest["time"] * (pipeline - 1),
                "overhead": overhead}

    # ---- at the workload ----

    def predict(self, lay: Layout, w: Workload) -> dict[str, Any]:
        cost = ModelCost(self.arch, lay)
        d = self.cluster.device
        weights = max(cost.weights(s) for s in range(lay.pp)) * self.weight_bytes
        usable = d.memory_gb * 1e9 * MEMORY_FRACTION
        kv_bytes_token = max(cost.kv_per_token(s) for s in range(lay.pp)) * 2
        kv_tokens = int(max(0.0, usable - weights) // kv_bytes_token)
        seq_len = w.input_len + w.output_len
        fits = weights < usable and kv_tokens >= seq_len
        out: dict[str, Any] = {**asdict(lay), "devices": lay.devices, "layout": str(lay),
                               "weight_gb_per_device": round(weights / 1e9, 3), "kv_tokens_per_device": kv_tokens,
                               "fits": fits}
        if not fits:
            return {**out, "ttft_ms": None, "tpot_ms": None, "throughput_tok_s": 0.0,
                    "throughput_per_device": 0.0, "binding": "memory capacity", "batch": 0}
        prefill = self.step_time(lay, w.input_len, 1, w.input_len / 2)
        concurrency = w.concurrency or 1
        for _ in range(4 if w.rate else 1):  # Little's law: in flight = rate x time in the system
            batch = max(1, min(math.ceil(concurrency / lay.dp), kv_tokens // seq_len))
            decode = self.step_time(lay, batch, batch, w.input_len + w.output_len / 2)
            if w.rate:
                latency = prefill["time"] + w.output_len * decode["time"]
                concurrency = max(1, math.ceil(w.rate * latency))
        cycle = batch * prefill["time"] + w.output_len * decode["time"]
        throughput = lay.dp * batch * w.output_len / cycle
        parts = {"compute": decode["compute"], "memory bandwidth": decode["memory"], "communication": decode["comm"], "pipeline bubble": decode["pipeline_extra"],
                 "host and launch overhead": decode["overhead"]}
        binding = max(parts, key=parts.__getitem__)
        if batch < math.ceil(concurrency / lay.dp):
            binding = "memory capacity"  # the KV cache holds fewer sequences than the workload has
        return {**out, "batch": batch, "ttft_ms": round((prefill["time"] + decode["time"]) * 1e3, 3),
                "tpot_ms": round(decode["time"] * 1e3, 3), "throughput_tok_s": round(throughput, 2),
                "throughput_per_device": round(throughput / lay.devices, 2), "binding": binding,
                "decode_step": {k: round(v * 1e3, 4) if k not in ("comm_bytes", "bubble") else v
                                for k, v in decode.items()}}

    def plan(self, w: Workload, slo: SLO = SLO()) -> list[dict[str, Any]]:
        """Every valid layout's prediction, best first: those that fit and meet the SLO, by throughput per device."""
        preds = [self.predict(lay, w) for lay in self.layouts()]
        for p in preds:
            p["meets_slo"] = p["fits"] and (slo.ttft_ms is None or p["ttft_ms"] <= slo.ttft_ms) and (
                slo.tpot_ms is None or p["tpot_ms"] <= slo.tpot_ms)
        return sorted(preds, key=lambda p: (not p["meets_slo"], -p["throughput_per_device"], p["devices"]))


def explain(best: dict[str, Any], workload: Workload) -> str:
    """A few lines on the top layout: what it predicts and what binds it."""
    if not best["fits"]:
        return "No layout fits: the weights and one sequence's KV cache need more memory than the cluster has."
    d = best["decode_step"]
    lines = [f"Best: {best['layout']} ({best['devices']} devices): {best['throughput_tok_s']:.0f} output tok/s "
             f"({best['throughput_per_device']:.1f} per device), TTFT {best['ttft_ms']:.1f} ms, "
             f"TPOT {best['tpot_ms']:.2f} ms at a decode batch of {best['batch']} per replica.",
             f"Each device holds {best['weight_gb_per_device']:.1f} GB of weights and KV for "
             f"{best['kv_tokens_per_device']} tokens ({best['kv_tokens_per_device'] // (workload.input_len + workload.output_len)}"
             f" sequences of {workload.input_len}+{workload.output_len}).",
             f"A decode step: compute {d['compute']:.3f} ms, memory {d['memory']:.3f} ms, communication "
             f"{d['comm']:.3f} ms, pipeline {d['pipeline_extra']:.3f} ms, host and launches {d['overhead']:.3f} ms; "
             f"bound by "
             f"{best['binding']}."]
    if not best.get("meets_slo", True):
        lines.append("No layout meets the SLO; this is the fastest one that fits.")
    return "\n".join(lines)


def _calls(kind: str, cost: ModelCost, stage: int) -> int:
    layers = len(cost.stage_layers(stage))
    moe = sum(cost.a.is_sparse_layer(i) for i in cost.stage_layers(stage))
    if kind == "all_reduce":  # the embedding's, after attention, after every MLP (EP: the dense ones only)
        return (stage == 0) + 2 * layers - (moe if cost.lay.ep else 0)
    if kind == "all_to_all":
        return 2 * moe
    return (stage == cost.lay.pp - 1) + (moe if cost.lay.ep else 0)  # the LM head's; EP's per MoE layer


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
