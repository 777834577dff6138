"""The cluster a plan is for: nodes of devices, their memory, bandwidth and compute, and the links between them.

A cluster file (YAML)::

    nodes: 2
    devices_per_node: 8
    device: h200            # a preset (h100, h200, a100, this-cpu) or {memory_gb, mem_bw_gbps, bf16_tflops, ...}
    intra_node: {gbps: 900, latency_us: 2}    # per device, GB/s (NVLink)
    inter_node: {gbps: 50, latency_us: 5}     # per device, GB/s (400 Gb/s InfiniBand)

Datasheet peaks are scaled by what kernels reach (`mem_efficiency`, `compute_efficiency`); `this-cpu` is
measured (`rivulet plan --probe`), so its efficiencies are 1.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from rivulet.config import RivuletError


@dataclass(frozen=True)
class Device:
    name: str
    memory_gb: float  # usable for weights, KV cache and activations
    mem_bw_gbps: float  # GB/s
    bf16_tflops: float
    fp8_tflops: float | None = None
    mem_efficiency: float = 0.8  # of the peak bandwidth a weight-streaming GEMM reaches
    compute_efficiency: float = 0.6  # of the peak FLOP rate a large GEMM reaches
    step_overhead_ms: float = 0.3  # host work per step that the device waits for
    layer_overhead_ms: float = 0.0  # per layer and step: op launches and small ops (CUDA graphs: ~0)
    seq_overhead_ms: float = 0.0  # per sequence and step: scheduling, sampling, outputs
    gemm_call_us: float = 0.0  # per GEMM call beyond its bytes and FLOPs (thread sync, prefetch ramp)
    gemm_tflops: dict[int, float] | None = None  # measured: the FLOP rate a GEMM of that many rows reaches
    gemm_call_us_rows: dict[int, float] | None = None  # measured: the call cost at that many rows (else gemm_call_us)
    stage_overhead_ms: float = 0.05  # per step and extra pipeline stage: the ranks' step messages, the hand-off
    tp_overhead_ms: float = 0.05  # per step of a tensor-parallel group: the other ranks' step messages and host work
    link_latency_us: float | None = None  # measured (this-cpu): one hop of a collective between this machine's ranks
    link_gbps: float | None = None  # measured (this-cpu): an all-reduce's payload GB/s between this machine's ranks
    # measured (this-cpu): the FLOP rate the attention kernels reach (else attention runs at the GEMMs' rate)
    attn_decode_tflops: float | None = None
    attn_prefill_tflops: float | None = None
    act_gbps: float | None = None  # measured: element-wise kernels on activations (else the memory bandwidth reached)
    expert_us: float = 0.0  # per routed expert hit and step beyond its GEMMs: its rows gathered, weighted, added back
    moe_layer_us: float = 0.0  # per MoE layer and step beyond a dense layer's and its experts': routing, counting
    ep_layer_us: float = 0.0  # per MoE layer and step under EP beyond its experts and collectives: rows grouped by rank
    ep_row_us: float = 0.0  # ... and per (token, expert) row the busiest rank computes
    # measured (this-cpu as slices of its cores): the kernel figures above (bandwidth, GEMM rates and call cost,
    # attention, element-wise, expert) while every slice runs at once, as the ranks of a TP group do: they share
    # the memory bus and the last-level cache (devices with memory of their own have no such entry)
    busy: dict[str, Any] | None = None

    def all_busy(self) -> Device:
        """This device as it runs while every device of its node runs too."""
        return replace(self, **self.busy, busy=None) if self.busy else self

    def flop_rate(self, rows: int, fp8: bool = False) -> float:
        """FLOP/s a step of `rows` tokens reaches: the measured curve (interpolated in log rows), else the peak
        times the compute efficiency."""
        if self.gemm_tflops and not fp8:
            return _by_rows(self.gemm_tflops, rows) * 1e12
        peak = self.fp8_tflops if fp8 and self.fp8_tflops else self.bf16_tflops
        return peak * 1e12 * self.compute_efficiency

    def call_s(self, rows: int) -> float:
        """Seconds a GEMM call of `rows` rows costs beyond its bytes and FLOPs (with two threads here: ~0 at one
        row, ~15-25 µs at 4-64, the threads' split and join of the work)."""
        return (_by_rows(self.gemm_call_us_rows, rows) if self.gemm_call_us_rows else self.gemm_call_us) * 1e-6


def _by_rows(curve: dict[int, float], rows: float) -> float:
    """A measured curve by rows, interpolated in log rows (flat beyond its ends)."""
    pts = sorted((int(r), v) for r, v in curve.items())
    if rows <= pts[0][0]:
        return pts[0][1]
    for (r0, v0), (r1, v1) in zip(pts, pts[1:]):
        if rows <= r1:
            f = (math.log(rows) - math.log(r0)) / (math.log(r1) - math.log(r0))
            return v0 + f * (v1 - v0)
    return pts[-1][1]


@dataclass(frozen=True)
class Link:
    gbps: float  # GB/s per device, each direction
    latency_us: float


PRESETS = {
    "h100": Device("h100", 80, 3350, 989, 1979),
    "h200": Device("h200", 141, 4800, 989, 1979),
    "a100": Device("a100", 80, 2039, 312),
}
NVLINK, INFINIBAND = Link(900, 2), Link(50, 5)


def probe_path() -> Path:
    """Where `rivulet plan --probe` writes this machine's figures ($RIVULET_THIS_CPU, else the cache folder)."""
    if os.environ.get("RIVULET_THIS_CPU"):
        return Path(os.environ["RIVULET_THIS_CPU"])
    return Path(os.environ.get("RIVULET_CACHE_DIR", Path.home() / ".cache" / "rivulet")) / "this-cpu.json"


def this_cpu() -> Device:
    path = probe_path()
    if not path.is_file():
        raise RivuletError(f"device 'this-cpu' is measured, not assumed: run `rivulet plan --probe` first ({path})")
    fields_ = json.loads(path.read_text())
    for figures in (fields_, fields_.get("busy") or {}):
        for curve in ("gemm_tflops", "gemm_call_us_rows"):
            if figures.get(curve):
                figures[curve] = {int(r): t for r, t in figures[curve].items()}
    return Device(**fields_)


@dataclass(frozen=True)
class Cluster:
    nodes: int
    devices_per_node: int
    device: Device
    intra_node: Link = NVLINK
    inter_node: Link = INFINIBAND

    @property
    def devices(self) -> int:
        return self.nodes * self.devices_per_node

    def link(self, group: int, stride: int = 1) -> Link:
        """The link a group of `group` devices, `stride` apart, talks over: intra-node if it fits in a node."""
        return self.intra_node if group * stride <= self.devices_per_node else self.inter_node

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Cluster:
        try:
            dev = d["device"]
            if isinstance(dev, str):
                device = this_cpu() if dev == "this-cpu" else PRESETS.get(dev)
                if device is None:
                    raise RivuletError(f"unknown device {dev!r}: a preset ({', '.join([*PRESETS, 'this-cpu'])}) "
                                       "or {memory_gb, mem_bw_gbps, bf16_tflops}")
            else:
                known = {f.name for f in fields(Device)}
                if bad := set(dev) - known:
                    raise RivuletError(f"unknown device fields {sorted(bad)} (known: {', '.join(sorted(known))})")
                device = Device(**{"name": "custom", **dev})
            links = {k: Link(**d[k]) for k in ("intra_node", "inter_node") if k in d}
            if device.link_latency_us is not None and device.link_gbps and "intra_node" not in links:
                links["intra_node"] = Link(device.link_gbps, device.link_latency_us)  # this machine's ranks, measured
            out = cls(int(d.get("nodes", 1)), int(d["devices_per_node"]), device, **links)
        except KeyError as e:
            raise RivuletError(f"the cluster lacks the field {e.args[0]!r}") from None
        except TypeError as e:
            raise RivuletError(f"bad cluster description: {e}") from None
        if out.nodes < 1 or out.devices_per_node < 1:
            raise RivuletError("nodes and devices_per_node must be at least 1")
        return out

    @classmethod
    def load(cls, path: str) -> Cluster:
        import yaml

        try:
            data = yaml.safe_load(Path(path).read_text())
        except (OSError, yaml.YAMLError) as e:
            raise RivuletError(f"cannot read the cluster file {path}: {e}") from None
        if not isinstance(data, dict):
            raise RivuletError(f"{path}: a cluster file is a mapping (nodes, devices_per_node, device, ...)")
        return cls.from_dict(data)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
