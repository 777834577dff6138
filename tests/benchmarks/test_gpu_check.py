"""The one-shot GPU check script, on CPU: argument parsing, the summary table, the no-GPU exit,
the time budget, and a dry run (tiny sizes, float32, Triton in its interpreter) end to end."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
GPU = REPO / "benchmarks" / "gpu"
sys.path.insert(0, str(GPU))

import gpu_check  # noqa: E402
from report import render  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU behaviour of the GPU script")


def _run(*args: str, env_extra: dict[str, str] | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO), **(env_extra or {}))
    return subprocess.run([sys.executable, str(GPU / "gpu_check.py"), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_parse_args_defaults_and_dry_run_caps():
    a = gpu_check.parse_args([])
    assert a.section_list == ["ceilings", "kernels", "model", "pytest"]
    assert (a.num_prompts, a.input_len, a.output_len, a.long_input_len) == (256, 128, 128, 1000)
    d = gpu_check.parse_args(["--dry-run", "--sections", "model", "--kernels", "moe,fp8"])
    assert d.section_list == ["model"] and d.kernel_list == ["moe", "fp8"]
    assert d.num_prompts == 4 and d.long_input_len == 24 and d.kv_cache_gib == 1 / 16


@pytest.mark.parametrize("bad", [["--sections", "kernels,nope"], ["--kernels", "attention,nope"],
                                 ["--num-prompts", "0"]])
def test_parse_args_rejects(bad):
    with pytest.raises(SystemExit):
        gpu_check.parse_args(bad)


def test_report_renders_every_part():
    results = {
        "meta": {"device": "NVIDIA H200", "commit": "abc", "date": "2026-01-01", "budget_s": 440, "elapsed_s": 12.0,
                 "sections": ["ceilings", "kernels", "model", "pytest"]},
        "sections": {
            "ceilings": {"status": "ok", "copy_gbps": 4000.0, "copy_bytes": 2 << 30, "matmul_tflops": 700.0,
                         "matmul_n": 8192, "matmul_dtype": "bfloat16", "elapsed_s": 3.0},
            "kernels": {"status": "FAIL (1 of 3 cases failed or errored)", "rows": [
                {"kernel": "rms_norm", "shape": "4096x4096", "dtype": "bfloat16", "tol": 0.01, "rel_err": 0.002,
                 "passed": True, "ms": 0.05, "ref_ms": 0.2, "bytes": 67e6, "flops": 0},
                {"kernel": "fused_moe_T1", "shape": "T=1", "dtype": "bfloat16", "tol": 0.03, "rel_err": 0.5,
                 "passed": False, "ms": 0.3, "ref_ms": 1.0, "bytes": 7e8, "flops": 1e9},
                {"kernel": "attention", "error": "Traceback...\nRuntimeError: boom | bad"}]},
            "model": {"status": "ok", "config": {"hidden_size": 4096, "num_hidden_layers": 32},
                      "rivulet_build": {"status": "ok", "weight_bytes": 16e9, "cuda_graphs": True,
                                        "graph_buckets": [1, 2], "num_kv_blocks": 100},
                      "decode_b1": {"status": "ok", "eager_tok_s": 80.0, "graphs_tok_s": 200.0,
                                    "graph_tokens_equal_eager": True, "bytes_per_step": 15e9},
                      "decode_profile": {"status": "ok", "b1": {
                          "batch": 1, "context": 128, "graphs": True, "wall_ms_per_step": 6.0,
                          "device_ms_per_step": 4.5, "kernel_ms_per_step": 4.2,
                          "top": [{"name": "_attention_kernel", "ms_per_step": 0.25, "calls_per_step": 32}]},
                          "engine_b1": {"output_len": 64, "async_scheduling": True, "wall_ms_per_token": 5.0,
                                        "kernel_ms_per_token": 4.5}},
                      "throughput": {"status": "ok", "requests": 256, "input_len": 128, "output_len": 128,
                                     "elapsed_s": 5.0, "output_tok_s": 6000.0, "total_tok_s": 12000.0},
                      "throughput_sync": {"status": "ok", "requests": 256, "input_len": 128, "output_len": 128,
                                          "elapsed_s": 6.0, "output_tok_s": 5000.0, "total_tok_s": 10000.0},
                      "hf_generate": {"status": "error", "error": "CUDA out of memory"},
                      "spec_decode": {"status": "ok", "draft_layers": 4, "streams": 64, **{
                          name: {"b1": {"output_tok_s": tps, "acceptance_rate": acc, "tokens_per_verify": tpv},
                                 "many": {"output_tok_s": 9000.0}, "graph_query_lens": lens,
                                 "speedup_b1": up, "speedup_many": 1.0, "tokens_equal_plain": True}
                          for name, tps, acc, tpv, lens, up in (("plain", 200.0, None, None, [1], None),
                                                                ("ngram", 500.0, 0.8, 4.2, [1, 5], 2.5),
                                                                ("draft", 300.0, 0.5, 2.5, [1, 4], 1.5))}},
                      "throughput_long": {"status": "skipped", "reason": "time budget: 3s left"},
                      "compiled": {"status": "ok", "compiled": ["multi-token", "one-token"], "loaded": [],
                                   "cuda_graphs": True, "compile_and_capture_s": 40.0, "fusions": {"rope_kv_write": 64},
                                   "fallbacks": 0, "graphs_tok_s": 250.0, "tokens_equal_eager": True,
                                   "throughput": {"requests": 256, "input_len": 128, "output_len": 128,
                                                  "elapsed_s": 4.0, "output_tok_s": 7000.0, "total_tok_s": 14000.0}}},
            "pytest": {"status": "skipped", "reason": "pytest is not installed"},
        },
    }
    md = render(results)
    for want in ("HBM copy bandwidth", "4000.0 GB/s", "| rms_norm | 4096x4096 | bfloat16 |", "pass", "FAIL",
                 "ERROR: RuntimeError: boom / bad", "Bandwidth bound: 266.7 tok/s", "| graphs | 200.0 | 5.00 | 75.0 |",
                 "Greedy tokens with graphs identical to eager: yes", "256 x 128/128", "## Errors",
                 "| 1 | 128 | yes | 6.000 | 4.500 | 4.200 | 25% |", "`_attention_kernel` 0.250 x32",
                 "5.000 ms per token, of which kernels 4.500 ms: host share 10%",
                 "| Rivulet LLM.generate (sync loop) | 256 x 128/128 | 5000.0 |",
                 "CUDA out of memory", "skipped (time budget: 3s left)", "pytest is not installed",
                 "| ngram | 500.0 | 2.50 | 0.80 | 4.20 | 9000.0 | 1.00 | [1, 5] | yes |",
                 "| compiled -O2 + graphs | 250.0 | 4.00 | 93.8 |", "CUDA graphs captured in 40.0 s",
                 "| Rivulet LLM.generate (-O2 + graphs) | 256 x 128/128 | 7000.0 |"):
        assert want in md, want
    assert render({}).startswith("# Rivulet GPU check")  # nothing run: still a table


def test_no_gpu_fails_fast_with_a_clear_message(tmp_path):
    p = _run("--out", str(tmp_path))
    assert p.returncode == 2 and "no CUDA device" in p.stderr
    if shutil.which("bash"):
        p = subprocess.run(["bash", str(GPU / "run.sh")], cwd=REPO, capture_output=True, text=True, timeout=60,
                           env=dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable))
        assert p.returncode == 2 and "no CUDA device" in p.stderr


def test_budget_skips_sections_and_still_writes_the_table(tmp_path):
    p = _run("--dry-run", "--out", str(tmp_path), "--budget-s", "12", "--sections", "kernels,model")
    assert p.returncode == 0, p.stderr
    results = json.loads((tmp_path / "gpu_check.json").read_text())
    assert all(s["status"] == "skipped" for s in results["sections"].values())
    assert "time budget" in (tmp_path / "summary.md").read_text()


def test_dry_run_end_to_end(tmp_path):
    from rivulet.kernels.cpu import cache_dir

    # a fresh compile cache, the C++ kernels' build shared (a build of its own took two minutes)
    (tmp_path / "cache").mkdir()
    cache_dir().mkdir(parents=True, exist_ok=True)
    (tmp_path / "cache" / "cpu_ext").symlink_to(cache_dir(), target_is_directory=True)
    p = _run("--dry-run", "--out", str(tmp_path), "--sections", "ceilings,kernels,model",
             "--kernels", "rms_norm,write_kv,moe", env_extra={"RIVULET_CACHE_DIR": str(tmp_path / "cache")})
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    results = json.loads((tmp_path / "gpu_check.json").read_text())
    secs = results["sections"]
    assert secs["ceilings"]["status"] == "ok" and secs["ceilings"]["copy_gbps"] > 0
    rows = secs["kernels"]["rows"]
    assert secs["kernels"]["status"] == "ok" and {r["kernel"] for r in rows} >= {"rms_norm", "write_kv_cache",
                                                                                   "topk_routing", "fused_moe_T1"}
    assert all(r["passed"] for r in rows)
    model = secs["model"]
    assert model["status"] == "ok"
    for step in ("hf_build", "rivulet_build", "copy_weights", "logits_vs_hf", "decode_b1", "decode_profile",
                 "generate_b1", "throughput", "throughput_sync", "hf_generate", "spec_decode", "throughput_long",
                 "compiled"):
        assert model[step]["status"] == "ok", (step, model[step])
    compiled = model["compiled"]  # float32: the compiled forward decodes the eager tokens, every step a graph
    assert compiled["tokens_equal_eager"] and compiled["fallbacks"] == 0, compiled
    assert compiled["compiled"] == ["multi-token", "one-token"] and compiled["throughput"]["output_tok_s"] > 0
    prof = model["decode_profile"]  # batch 1 and the throughput run's batch, each with its busiest ops
    assert prof["b1"]["wall_ms_per_step"] > 0 and prof["b1"]["top"] and prof["b4"]["batch"] == 4
    assert prof["engine_b1"]["wall_ms_per_token"] > 0
    assert model["logits_vs_hf"]["passed"]
    spec = model["spec_decode"]  # float32: speculation gives plain decoding's greedy tokens
    assert spec["ngram"]["tokens_equal_plain"] and spec["draft"]["tokens_equal_plain"], spec
    assert spec["draft"]["b1"]["drafts"] > 0
    summary = (tmp_path / "summary.md").read_text()
    assert "Triton kernels vs PyTorch references" in summary and "Batch-1 decode" in summary
    assert "Where a decode step goes" in summary


def test_model_section_fails_on_wrong_tokens_or_logits():
    """Every check the model section records decides its status (test audit)."""
    from model_checks import model_failures

    ok = {"rivulet_build": {"status": "ok"}, "logits_vs_hf": {"status": "ok", "passed": True, "min_cosine": 0.999},
          "decode_b1": {"status": "ok", "graph_tokens_equal_eager": True}, "throughput": {"status": "skipped"}}
    assert model_failures(ok) == []
    assert model_failures({**ok, "decode_b1": {"status": "ok", "graph_tokens_equal_eager": False}}) == [
        "decode_b1: CUDA-graph tokens differ from eager ones"]
    assert model_failures({**ok, "logits_vs_hf": {"status": "ok", "passed": False, "min_cosine": 0.5}}) == [
        "logits_vs_hf: min cosine 0.5"]
    assert model_failures({**ok, "throughput": {"status": "error", "error": "CUDA out of memory"}}) == [
        "throughput: CUDA out of memory"]
