"""`rivulet bench serve` against a real `rivulet serve --model default`: exact prompt lengths as the server
counts them, a sweep with one JSON of all points and a PNG, and `rivulet bench plot` of two systems."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "server"))

from server_helpers import ServerProcess  # noqa: E402


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    proc = ServerProcess("--max-model-len", "256", "--max-num-seqs", "16")
    try:
        yield proc
    finally:
        proc.stop()


def _bench(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "rivulet.entrypoints.cli", "bench", *args], capture_output=True,
                       text=True, timeout=300, env=env)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    return r


def test_bench_serve_8_prompts(server, tmp_path):
    out = tmp_path / "rivulet.json"
    r = _bench("serve", "--base-url", server.url, "--num-prompts", "8", "--input-len", "32", "--output-len", "12",
               "--max-concurrency", "8", "--ignore-eos", "--slo", "ttft=60000,tpot=60000", "--result-json", str(out),
               "--disable-tqdm")
    assert "Successful requests:" in r.stdout
    data = json.loads(out.read_text())
    assert data["model"] == "default" and data["label"] == "default"
    (p,) = data["points"]
    assert p["completed"] == 8 and p["failed"] == 0 and p["errors"] == []
    assert p["total_input_tokens"] == 8 * 32  # the server's usage.prompt_tokens: prompts are exact
    assert p["total_output_tokens"] == 8 * 12  # ignore_eos honoured
    assert 0 < p["median_ttft_ms"] < p["median_e2el_ms"] and p["median_tpot_ms"] > 0 and p["median_itl_ms"] > 0
    assert p["good_requests"] == 8 and p["output_throughput"] > 0


def test_sweep_writes_all_points_and_plots(server, tmp_path):
    out, png = tmp_path / "sweep.json", tmp_path / "sweep.png"
    _bench("serve", "--base-url", f"{server.base_url}/", "--num-prompts", "4", "--input-len", "16", "--output-len",
           "6", "--prompt-format", "ids", "--sweep", "1,4", "--ignore-eos", "--result-json", str(out), "--plot",
           str(png), "--label", "rivulet", "--disable-tqdm")
    data = json.loads(out.read_text())
    assert [p["max_concurrency"] for p in data["points"]] == [1, 4] and data["sweep_over"] == "concurrency"
    assert all(p["completed"] == 4 and p["total_input_tokens"] == 4 * 16 for p in data["points"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    both = tmp_path / "both.png"
    _bench("plot", str(out), str(out), "-o", str(both), "--label", "rivulet", "--label", "peer")
    assert both.stat().st_size > 10_000
