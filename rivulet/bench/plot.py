"""Plots of `rivulet bench serve` results: output-token throughput against median and p90 TPOT (left) and
TTFT (right), one line per system (result file), each point labelled with its concurrency or rate.
matplotlib is an optional extra (`pip install 'rivulet[bench]'`), imported only here, only when plotting."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from rivulet.config import RivuletError


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise RivuletError("plotting needs matplotlib: pip install 'rivulet[bench]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def load_result(path: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise RivuletError(f"cannot read result JSON {path}: {e}") from None
    if not isinstance(data, dict) or not isinstance(data.get("points"), list) or not data["points"]:
        raise RivuletError(f"{path} is not a `rivulet bench serve` result (no 'points')")
    return data


def _point_label(p: dict[str, Any]) -> str:
    if p.get("max_concurrency") is not None and p.get("request_rate") is None:
        return f"c={p['max_concurrency']}"
    if p.get("request_rate") is not None:
        return f"r={p['request_rate']:g}"
    return "c=inf"


def plot_results(results: Sequence[dict[str, Any]], labels: Sequence[str], out: str) -> None:
    """One PNG: throughput vs TPOT and vs TTFT (solid: median, dashed: p90) for each result."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (res, label) in enumerate(zip(results, labels)):
        pts = res["points"]
        color = colors[i % len(colors)]
        y = [p["output_throughput"] for p in pts]
        for ax, metric in zip(axes, ("tpot", "ttft")):
            ax.plot([p[f"median_{metric}_ms"] for p in pts], y, "o-", color=color, label=f"{label} (median)")
            ax.plot([p[f"p90_{metric}_ms"] for p in pts], y, "s--", color=color, alpha=0.6, label=f"{label} (p90)")
            for p, yy in zip(pts, y):
                ax.annotate(_point_label(p), (p[f"median_{metric}_ms"], yy), textcoords="offset points",
                            xytext=(4, 4), fontsize=7, color=color)
    axes[1].set_xscale("log")  # TTFT spans milliseconds (idle) to minutes (queued)
    for ax, name in zip(axes, ("TPOT", "TTFT")):
        ax.set_xlabel(f"{name} (ms{', log scale' if name == 'TTFT' else ''})")
        ax.set_ylabel("output tokens/s")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    first = results[0]
    fig.suptitle(f"{first.get('dataset', '')} {first.get('input_len', '')} in / {first.get('output_len', '')} out"
                 f" ({first.get('endpoint', 'completions')})", fontsize=10)
    fig.tight_layout()
    try:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, dpi=110)
    except OSError as e:
        raise RivuletError(f"cannot write the plot {out}: {e}") from None
    finally:
        plt.close(fig)


def plot_files(paths: Sequence[str], out: str, labels: Sequence[str] | None = None) -> None:
    results = [load_result(p) for p in paths]
    labels = list(labels or [])
    if labels and len(labels) != len(paths):
        raise RivuletError(f"{len(paths)} result files but {len(labels)} --label values")
    if not labels:
        labels = [r.get("label") or Path(p).stem for r, p in zip(results, paths)]
    plot_results(results, labels, out)
