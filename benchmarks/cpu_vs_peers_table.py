"""Summarize benchmarks/cpu_vs_peers.sh's JSON files: summary.json, table.md and table.png in the same folder."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROWS = {1: "8 x 128/128 at 1: tok/s (TPOT ms)", 2: "32 x 128/128 at 16: tok/s", 3: "128 x 128/128 at 64: tok/s (TPOT ms)",
        4: "16 x 1024/16 at 8: mean TTFT s", 5: "start to healthy, s",
        6: "memory after the rows: PSS MiB (RSS)"}


def _load(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.exists() else None


def _point(d: dict | None) -> dict | None:
    if d is None:
        return None
    r = d["points"][0] if "points" in d else d  # rivulet bench serve: {"points": [...]}; vLLM's client: flat
    return {"output_tok_s": r.get("output_throughput"), "tpot_ms": r.get("mean_tpot_ms"),
            "ttft_ms": r.get("mean_ttft_ms"), "completed": r.get("completed")}


def main() -> int:
    out = Path(sys.argv[1])
    systems = sorted({p.name.split("_row")[0] for p in out.glob("*_row*.json")} |
                     {p.name.removesuffix("_start.json") for p in out.glob("*_start.json")})
    summary: dict = {}
    for s in systems:
        summary[s] = {}
        for row in (1, 2, 3, 4):
            summary[s][f"row{row}"] = {"rivulet_client": _point(_load(out / f"{s}_row{row}.json")),
                                       "vllm_client": _point(_load(out / f"{s}_row{row}_vllmclient.json"))}
        start = _load(out / f"{s}_start.json")
        summary[s]["row5"] = start["start_s"] if start else None
        summary[s]["row6"] = _load(out / f"{s}_mem.json")
    (out / "summary.json").write_text(json.dumps(summary, indent=2))

    def cell(s: str, row: int, client: str) -> str:
        if row == 5:
            v = summary[s]["row5"]
            return f"{v:.1f}" if v is not None else "-"
        if row == 6:
            m = summary[s].get("row6")
            return f"{m['pss_mib']:.0f} ({m['rss_mib']:.0f})" if m else "-"
        p = summary[s][f"row{row}"][client]
        if not p or p["output_tok_s"] is None:
            return "-"
        if row == 4:
            return f"{p['ttft_ms'] / 1000:.2f}"
        extra = f" ({p['tpot_ms']:.1f})" if row in (1, 3) and p["tpot_ms"] is not None else ""
        return f"{p['output_tok_s']:.1f}{extra}"

    lines = ["| workload | " + " | ".join(systems) + " |", "|---|" + "---|" * len(systems)]
    for row, name in ROWS.items():
        lines.append(f"| {name} | " + " | ".join(cell(s, row, "rivulet_client") for s in systems) + " |")
    lines += ["", "vLLM's client (`vllm bench serve`), same points:", "",
              "| workload | " + " | ".join(systems) + " |", "|---|" + "---|" * len(systems)]
    for row in (1, 2, 3, 4):
        lines.append(f"| {ROWS[row]} | " + " | ".join(cell(s, row, "vllm_client") for s in systems) + " |")
    (out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return 0
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.6))
    for ax, row in zip(axes, (1, 2, 3, 4)):
        vals = []
        for s in systems:
            p = summary[s][f"row{row}"]["rivulet_client"]
            vals.append((p["ttft_ms"] / 1000 if row == 4 else p["output_tok_s"]) if p else 0)
        ax.bar(systems, vals, color=["#1f77b4" if s.startswith("rivulet") else "#999999" for s in systems])
        ax.set_title(ROWS[row].split(":")[0] + (" (mean TTFT s, lower is better)" if row == 4 else " (output tok/s)"),
                     fontsize=8)
        ax.tick_params(axis="x", labelsize=7, rotation=20)
    fig.tight_layout()
    fig.savefig(out / "table.png", dpi=110)
    return 0


if __name__ == "__main__":
    sys.exit(main())
