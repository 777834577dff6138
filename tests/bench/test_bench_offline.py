"""`rivulet bench latency` and `rivulet bench throughput` (with the transformers peer) on a tiny HF model, and
once on the default model, with tiny sizes."""

from __future__ import annotations

import json

from rivulet.entrypoints.cli import main


def test_latency_reports_prefill_and_decode_and_writes_a_trace(tmp_path, capsys, tiny_model_dir):
    path, _ = tiny_model_dir("llama")
    out, prof = tmp_path / "lat.json", tmp_path / "prof"
    assert main(["bench", "latency", "--model", str(path), "--input-len", "16", "--output-len", "4", "--num-iters", "2", "--dtype",
                 "float32", "--profile", str(prof), "--result-json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["iterations"] == 2 and r["input_len"] == 16 and r["output_len"] == 4
    assert 0 < r["prefill_s_p50"] and 0 < r["decode_token_s_p50"] < r["e2e_s_mean"]
    assert r["prefill_tok_s"] == 16 / r["prefill_s_mean"] and r["decode_tok_s"] == 1 / r["decode_token_s_mean"]
    trace = json.loads((prof / "trace.json").read_text())
    assert trace["traceEvents"]


def test_throughput_runs_rivulet_and_transformers_in_one_command(tmp_path, capsys, tiny_model_dir):
    path, _ = tiny_model_dir("llama")  # a tiny HF folder (vocab 256): the same code path, seconds not minutes
    out = tmp_path / "tp.json"
    assert main(["bench", "throughput", "--model", str(path), "--backend", "rivulet,transformers", "--dtype", "float32", "--num-prompts",
                 "3", "--input-len", "8", "--output-len", "4", "--result-json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert [x["system"] for x in r["runs"]] == ["rivulet", "transformers"]
    assert all(x["output_tokens"] == 12 and x["output_tok_s"] > 0 for x in r["runs"])


def test_latency_and_throughput_on_the_default_model(tmp_path):
    """The GGUF default model behind the offline rows of RESULTS.md, once, at small sizes."""
    lat, tp = tmp_path / "lat.json", tmp_path / "tp.json"
    assert main(["bench", "latency", "--input-len", "32", "--output-len", "8", "--num-iters", "1",
                 "--result-json", str(lat)]) == 0
    r = json.loads(lat.read_text())
    assert r["input_len"] == 32 and r["output_len"] == 8 and 0 < r["prefill_s_p50"] < r["e2e_s_mean"]
    assert 0 < r["decode_token_s_p50"] < r["e2e_s_mean"]
    assert main(["bench", "throughput", "--backend", "rivulet", "--num-prompts", "4", "--input-len", "16",
                 "--output-len", "8", "--result-json", str(tp)]) == 0
    runs = json.loads(tp.read_text())["runs"]
    assert [x["system"] for x in runs] == ["rivulet"] and runs[0]["output_tokens"] == 32
    assert runs[0]["output_tok_s"] > 0
