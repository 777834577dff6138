"""deploy/: the Grafana dashboard and the Prometheus alert rules name only metrics the server exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from rivulet.entrypoints.openai.metrics import ServerMetrics

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
SUFFIXES = ("_bucket", "_count", "_sum", "_total")


def exported_families() -> set[str]:
    m = ServerMetrics("x")
    names = set()
    for family in m.registry.collect():
        names.add(family.name)
        names.update(s.name for s in family.samples)
    return names


def named_metrics(exprs: list[str]) -> set[str]:
    return {n for e in exprs for n in re.findall(r"rivulet:[a-z0-9_]+", e)}


def is_exported(name: str, exported: set[str]) -> bool:
    """A sample name the server exports, or a family's with its suffix (a labelled family has no sample yet)."""
    return name in exported or any(name.endswith(s) and name[: -len(s)] in exported for s in SUFFIXES)


def test_the_dashboard_and_alerts_name_exported_metrics() -> None:
    dash = json.loads((DEPLOY / "grafana" / "rivulet-dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    rules = yaml.safe_load((DEPLOY / "prometheus" / "rivulet-alerts.yaml").read_text())
    exprs += [r["expr"] for g in rules["groups"] for r in g["rules"]]
    exported = exported_families()
    used = named_metrics(exprs)
    assert len(used) >= 12
    missing = sorted(n for n in used if not is_exported(n, exported))
    assert not missing, f"not exported by the server: {missing}"
    assert {p["id"] for p in dash["panels"]} == set(range(1, len(dash["panels"]) + 1))
    assert all(r["alert"] and r["annotations"]["summary"] for g in rules["groups"] for r in g["rules"])
