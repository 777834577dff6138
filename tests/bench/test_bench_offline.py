"""`rivulet bench latency` and `rivulet bench throughput` (with the transformers peer) on a tiny HF model, and
once on the default model, with tiny sizes."""

from __future__ import annotations

import json
import time

from rivulet.entrypoints.cli import main


def _timed(argv: list[str]) -> float:
    """main(argv) must succeed; its wall time, an outer bound on every duration the bench reports."""
    t0 = time.perf_counter()
    assert main(argv) == 0
    return time.perf_counter() - t0


def _check_latency(r: dict, wall: float) -> None:
    """Durations measured apart must add up: first token plus n - 1 gaps is the request's end (to within
    the last token's processing), and the timed requests fit in the command's own wall time."""
    n = r["output_len"]
    to_last = r["prefill_s_mean"] + (n - 1) * r["decode_token_s_mean"]
    assert 0.7 * r["e2e_s_mean"] <= to_last <= 1.01 * r["e2e_s_mean"], (to_last, r["e2e_s_mean"])
    assert r["iterations"] * r["e2e_s_mean"] < wall
    assert abs(r["prefill_tok_s"] * r["prefill_s_mean"] - r["input_len"]) < 1e-6 * r["input_len"]


def test_latency_reports_prefill_and_decode_and_writes_a_trace(tmp_path, capsys, tiny_model_dir):
    path, _ = tiny_model_dir("llama")
    out, prof = tmp_path / "lat.json", tmp_path / "prof"
    wall = _timed(["bench", "latency", "--model", str(path), "--input-len", "16", "--output-len", "4", "--num-iters",
                   "2", "--dtype", "float32", "--profile", str(prof), "--result-json", str(out)])
    r = json.loads(out.read_text())
    assert r["iterations"] == 2 and r["input_len"] == 16 and r["output_len"] == 4
    assert 0 < r["prefill_s_p50"] and 0 < r["decode_token_s_p50"] < r["e2e_s_mean"]
    _check_latency(r, wall)
    trace = json.loads((prof / "trace.json").read_text())
    assert trace["traceEvents"]


def test_throughput_runs_rivulet_and_transformers_in_one_command(tmp_path, capsys, tiny_model_dir):
    path, _ = tiny_model_dir("llama")  # a tiny HF folder (vocab 256): the same code path, seconds not minutes
    out = tmp_path / "tp.json"
    wall = _timed(["bench", "throughput", "--model", str(path), "--backend", "rivulet,transformers", "--dtype",
                   "float32", "--num-prompts", "3", "--input-len", "8", "--output-len", "4", "--result-json", str(out)])
    r = json.loads(out.read_text())
    assert [x["system"] for x in r["runs"]] == ["rivulet", "transformers"]
    assert all(x["output_tokens"] == 12 for x in r["runs"])
    # both runs timed inside the command: each rate at least its tokens over the whole command's time
    assert sum(x["elapsed_s"] for x in r["runs"]) < wall
    assert all(x["output_tok_s"] > 12 / wall for x in r["runs"])


def test_latency_and_throughput_on_the_default_model(tmp_path):
    """The GGUF default model behind the offline rows of RESULTS.md, once, at small sizes."""
    lat, tp = tmp_path / "lat.json", tmp_path / "tp.json"
    wall = _timed(["bench", "latency", "--input-len", "32", "--output-len", "8", "--num-iters", "1",
                   "--result-json", str(lat)])
    r = json.loads(lat.read_text())
    assert r["input_len"] == 32 and r["output_len"] == 8 and 0 < r["prefill_s_p50"] < r["e2e_s_mean"]
    assert 0 < r["decode_token_s_p50"] < r["e2e_s_mean"]
    _check_latency(r, wall)
    wall = _timed(["bench", "throughput", "--backend", "rivulet", "--num-prompts", "4", "--input-len", "16",
                   "--output-len", "8", "--result-json", str(tp)])
    runs = json.loads(tp.read_text())["runs"]
    assert [x["system"] for x in runs] == ["rivulet"] and runs[0]["output_tokens"] == 32
    assert runs[0]["elapsed_s"] < wall and runs[0]["output_tok_s"] > 32 / wall
