"""`rivulet plan`'s cost model against hand-computed and measured facts: parameters per device (every family,
against transformers' own models), KV bytes per token (against the model runner's cache), collective
payloads (hand formulas here; the measured bytes of real TP and PP runs in tests/distributed), the
pipeline bubble, every returned layout valid, and the command's output and errors."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from helpers.runner import make_runner
from helpers.tiny import TINY_CONFIGS
from rivulet.config import RivuletError
from rivulet.models.arch_config import ArchConfig
from rivulet.plan.cluster import Cluster, Device, Link
from rivulet.plan.cost import Layout, ModelCost, check_layout
from rivulet.plan.planner import Predictor, SLO, Workload

LLAMA = dict(architectures=["LlamaForCausalLM"], vocab_size=256, hidden_size=64, intermediate_size=96,
             num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5)
CLUSTER = Cluster(1, 4, Device("test", memory_gb=1.0, mem_bw_gbps=100, bf16_tflops=1.0, mem_efficiency=1.0,
                               compute_efficiency=1.0, step_overhead_ms=0.0))


@pytest.mark.parametrize("kind", sorted(TINY_CONFIGS))
def test_parameters_per_device_equal_the_models_own(kind, tiny_model_dir):
    """One rank holds every parameter of transformers' model but the norms (vectors the cost model leaves out)."""
    path, hf = tiny_model_dir(kind)
    arch = ArchConfig.from_hf(json.loads((path / "config.json").read_text()))
    want = sum(p.numel() for n, p in hf.named_parameters() if "norm" not in n)
    assert ModelCost(arch, Layout()).weights(0) == want


def test_parameters_per_rank_by_hand():
    """tp 2, pp 2 of a 4-layer Llama (4 heads of 16, 2 KV heads, MLP 96, vocab 256, untied)."""
    arch = ArchConfig.from_hf(LLAMA)
    c = ModelCost(arch, Layout(tp=2, pp=2))
    layer = (2 * 64 * 64 + 2 * 64 * 32) / 2 + 3 * 64 * 96 / 2  # q, o, k, v split; gate, up, down split
    assert c.weights(0) == 2 * layer + 256 * 64 / 2  # two layers and half the embedding
    assert c.weights(1) == 2 * layer + 256 * 64 / 2  # ... and half the LM head
    assert c.kv_per_token(0) == 2 * 2 * 1 * 16  # two layers: a key and a value of one KV head per rank
    assert ModelCost(arch, Layout(tp=4)).kv_per_token(0) == 4 * 2 * 1 * 16  # 2 KV heads over 4 ranks: replicated


@pytest.mark.parametrize("kind", ["llama", "qwen3-moe", "deepseek-v3"])
def test_kv_bytes_per_token_equal_the_runners_cache(kind, tiny_model_dir):
    path, _ = tiny_model_dir(kind)
    arch = ArchConfig.from_hf(json.loads((path / "config.json").read_text()))
    r = make_runner(path, block_size=4)
    assert ModelCost(arch, Layout()).kv_per_token(0) * 4 == r.kv_bytes_per_block() // 4  # float32


def test_collective_payloads_by_hand():
    """T tokens, S sampled: TP all-reduces (1 + 2L) x T x H on the first stage (2L on the others), the last
    stage all-gathers S x V logits, a stage sends hidden + residual (2 x T x H) on; 2 bytes each."""
    arch = ArchConfig.from_hf(LLAMA)
    c = ModelCost(arch, Layout(tp=2, pp=2))
    assert c.comm(0, 10, 3, 0) == {"all_reduce": (1 + 2 * 2) * 10 * 64 * 2, "send": 2 * 10 * 64 * 2}
    assert c.comm(1, 10, 3, 0) == {"all_reduce": 2 * 2 * 10 * 64 * 2, "all_gather": 3 * 256 * 2}
    assert ModelCost(arch, Layout()).comm(0, 10, 3, 0) == {}


def test_pipeline_bubble_and_step_parts():
    arch = ArchConfig.from_hf(LLAMA)
    p = Predictor(arch, CLUSTER, micro_batches=2)
    one, two = Predictor(arch, CLUSTER).step_time(Layout(pp=2), 8, 8, 100), p.step_time(Layout(pp=2), 8, 8, 100)
    assert one["bubble"] == pytest.approx(1 / 2) and two["bubble"] == pytest.approx(1 / 3)
    single = Predictor(arch, CLUSTER).step_time(Layout(), 8, 8, 100)
    assert single["bubble"] == 0 and single["comm"] == 0
    # each stage beyond the first adds the device's per-stage step overhead, once per step
    slow = dataclasses.replace(CLUSTER, device=dataclasses.replace(CLUSTER.device, stage_overhead_ms=2.0))
    for pp in (1, 2, 4):
        diff = Predictor(arch, slow).step_time(Layout(pp=pp), 8, 8, 100)["time"] - \
            Predictor(arch, CLUSTER).step_time(Layout(pp=pp), 8, 8, 100)["time"]
        assert diff == pytest.approx((pp - 1) * (2.0 - CLUSTER.device.stage_overhead_ms) * 1e-3)
    # a tensor-parallel group adds the device's per-step tp overhead once, whatever its size
    slow = dataclasses.replace(CLUSTER, device=dataclasses.replace(CLUSTER.device, tp_overhead_ms=3.0))
    for tp in (1, 2, 4):
        diff = Predictor(arch, slow).step_time(Layout(tp=tp), 8, 8, 100)["time"] - \
            Predictor(arch, CLUSTER).step_time(Layout(tp=tp), 8, 8, 100)["time"]
        assert diff == pytest.approx((tp > 1) * (3.0 - CLUSTER.device.tp_overhead_ms) * 1e-3)
    # a measured attention rate replaces the GEMMs' for the attention's FLOPs (decode and prefill steps apart)
    s = ModelCost(arch, Layout()).step(0, 8, 8, 100, 2)
    for field, tokens, sampled in (("attn_decode_tflops", 8, 8), ("attn_prefill_tflops", 64, 1)):
        slow_attn = dataclasses.replace(CLUSTER, device=dataclasses.replace(CLUSTER.device, **{field: 1e-6}))
        flops = ModelCost(arch, Layout()).step(0, tokens, sampled, 100, 2)["attn_flops"]
        got = Predictor(arch, slow_attn).step_time(Layout(), tokens, sampled, 100)["time"]
        base = Predictor(arch, CLUSTER).step_time(Layout(), tokens, sampled, 100)["time"]
        assert got == pytest.approx(base + flops / 1e6, rel=0.05)
    # memory-bound decode: the weights and KV read, and the element-wise kernels' activations, at 100 GB/s
    s = ModelCost(arch, Layout()).step(0, 8, 8, 100, 2)
    assert single["memory"] == pytest.approx((s["weight_bytes"] + s["kv_bytes"] + s["act_bytes"]) / 100e9)
    assert s["kv_bytes"] == 8 * 100 * 4 * 2 * 2 * 16 * 2  # tokens x context x layers x (K, V) x 2 heads x 16 x 2 B
    # per token and layer 8H (two add + norms) + 2 x 64 (RoPE on q) + 3 x 64 (k, v: RoPE, cache write) + 3 x 96
    # (SiLU-and-mul), 2 B each; the logits 2 B + a float32 copy written and read per vocabulary entry
    assert s["act_bytes"] == 8 * 4 * (8 * 64 + 2 * 64 + 3 * 64 + 3 * 96) * 2 + 8 * 256 * (2 + 8)
    fast_act = dataclasses.replace(CLUSTER, device=dataclasses.replace(CLUSTER.device, act_gbps=1e9))
    assert Predictor(arch, fast_act).step_time(Layout(), 8, 8, 100)["memory"] == pytest.approx(
        (s["weight_bytes"] + s["kv_bytes"]) / 100e9, rel=1e-6)


def test_devices_running_together_use_their_busy_figures():
    """A device measured as a slice of a CPU carries its figures with every slice busy (`busy`): a TP group's
    ranks, replicas and overlapping pipeline micro-batches run on them; one batch through pipeline stages (one
    stage busy at a time) and a lone device keep the figures measured alone."""
    arch = ArchConfig.from_hf(LLAMA)
    shared = dataclasses.replace(CLUSTER, device=dataclasses.replace(CLUSTER.device, busy={"mem_bw_gbps": 25}))
    assert shared.device.all_busy().mem_bw_gbps == 25 and shared.device.all_busy().busy is None
    assert CLUSTER.device.all_busy() is CLUSTER.device  # nothing measured busy: the same device
    for lay, micro, together in ((Layout(tp=2), 1, True), (Layout(dp=2), 1, True), (Layout(pp=2), 2, True),
                                 (Layout(pp=2), 1, False), (Layout(), 1, False)):
        alone = Predictor(arch, CLUSTER, micro_batches=micro).step_time(lay, 8, 8, 100)
        got = Predictor(arch, shared, micro_batches=micro)
        assert got.together(lay) == together
        step = got.step_time(lay, 8, 8, 100)
        # memory-bound decode: the memory term at 25 GB/s rather than 100
        assert step["memory"] == pytest.approx(alone["memory"] * (4 if together else 1))
        assert step["compute"] == alone["compute"] == 0


MIXTRAL = dict(architectures=["MixtralForCausalLM"], vocab_size=256, hidden_size=64, intermediate_size=96,
               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
               num_experts_per_tok=2, rms_norm_eps=1e-5)


def test_moe_step_parts():
    """Routed experts' GEMMs run at the FLOP rate of their own rows (tokens x k / experts hit), each expert hit
    costs the device's `expert_us`, and under EP the MoE layers' all-reduces give way to all-to-alls and
    all-gathers, each paying its hops' latency."""
    arch = ArchConfig.from_hf(MIXTRAL)
    curve = dataclasses.replace(CLUSTER.device, gemm_tflops={1: 0.01, 1024: 1.0}, mem_bw_gbps=1e9)
    cost = ModelCost(arch, Layout())
    s = cost.step(0, 64, 64, 100, 2)
    hit = 4 * (1 - (1 - 2 / 4) ** 64)
    assert s["experts_hit"] == pytest.approx(2 * hit) and s["expert_rows"] == pytest.approx(64 * 2 / hit)
    assert s["expert_flops"] == pytest.approx(2 * 2 * 64 * 2 * 3 * 64 * 96)  # layers x 2 x rows x params
    dev = Predictor(arch, Cluster(1, 1, curve))
    step = dev.step_time(Layout(), 64, 64, 100)
    want = (s["flops"] - s["expert_flops"]) / curve.flop_rate(64) + s["expert_flops"] / curve.flop_rate(32)
    attn = s["attn_flops"] / curve.flop_rate(64)
    assert step["compute"] == pytest.approx(want + attn)
    per_hit = Predictor(arch, Cluster(1, 1, dataclasses.replace(curve, expert_us=100.0))).step_time(Layout(), 64, 64, 100)
    assert per_hit["time"] - step["time"] == pytest.approx(s["experts_hit"] * 100e-6)
    per_layer = Predictor(arch, Cluster(1, 1, dataclasses.replace(curve, moe_layer_us=100.0, ep_layer_us=1e6,
                                                                  ep_row_us=1e6))).step_time(Layout(), 64, 64, 100)
    assert per_layer["time"] - step["time"] == pytest.approx(2 * 100e-6)  # 2 MoE layers; no EP terms without EP
    # under EP: per layer, and per row on the busiest rank (64 x 2 / 2 rows, times the imbalance, per layer)
    ep_dev = Cluster(1, 2, dataclasses.replace(curve, ep_layer_us=100.0, ep_row_us=1.0))
    base = Predictor(arch, Cluster(1, 2, curve)).step_time(Layout(tp=2, ep=True), 64, 64, 100)
    got = Predictor(arch, ep_dev).step_time(Layout(tp=2, ep=True), 64, 64, 100)
    rows = 64 * 2 / 2 * ModelCost(arch, Layout(tp=2, ep=True)).imbalance(64)
    assert got["time"] - base["time"] == pytest.approx(2 * (100e-6 + rows * 1e-6))
    # tp2 with and without EP over a link of 1 ms a hop and endless bandwidth: the hops, counted by hand
    link = Cluster(1, 2, CLUSTER.device, intra_node=Link(1e12, 1000.0))
    plain = Predictor(arch, link).step_time(Layout(tp=2), 8, 8, 100)["comm"]
    ep = Predictor(arch, link).step_time(Layout(tp=2, ep=True), 8, 8, 100)["comm"]
    # all-reduces of 2 hops: the embedding, after attention x 2 layers, after the MLP x 2 (not under EP);
    # all-gathers of 1 hop: the LM head, and under EP one per MoE layer; all-to-alls (EP): 2 per MoE layer
    assert plain == pytest.approx(((1 + 2 + 2) * 2 + 1) * 1e-3, rel=1e-6)
    assert ep == pytest.approx(((1 + 2) * 2 + (1 + 2) + 2 * 2) * 1e-3, rel=1e-6)


def test_gemm_calls_cost_by_their_rows():
    """A measured call cost by rows (interpolated in log rows, flat beyond the ends) replaces the single figure:
    the step's GEMMs pay it at the step's rows, a routed expert's two at that expert's rows."""
    dev = dataclasses.replace(CLUSTER.device, gemm_call_us=5.0, gemm_call_us_rows={1: 0.0, 16: 20.0, 256: 40.0})
    assert dev.call_s(1) == 0 and dev.call_s(16) == pytest.approx(20e-6) and dev.call_s(4) == pytest.approx(10e-6)
    assert dev.call_s(1024) == pytest.approx(40e-6) and dev.call_s(64) == pytest.approx(30e-6)
    assert CLUSTER.device.call_s(16) == CLUSTER.device.gemm_call_us * 1e-6  # nothing by rows: the single figure
    for cfg, tokens in ((LLAMA, 16), (MIXTRAL, 64)):
        arch = ArchConfig.from_hf(cfg)
        s = ModelCost(arch, Layout()).step(0, tokens, tokens, 100, 2)
        base = Predictor(arch, CLUSTER).step_time(Layout(), tokens, tokens, 100)["time"]
        got = Predictor(arch, dataclasses.replace(CLUSTER, device=dev)).step_time(Layout(), tokens, tokens, 100)["time"]
        experts = 2 * s["experts_hit"]
        want = (s["gemm_calls"] - experts) * dev.call_s(tokens) + experts * dev.call_s(s["expert_rows"])
        assert got - base == pytest.approx(want - s["gemm_calls"] * CLUSTER.device.gemm_call_us * 1e-6)
        assert s["gemm_calls"] == (4 * 4 + 1 if cfg is LLAMA else 2 * (2 + 1 + 2 * s["experts_hit"] / 2) + 1)


@pytest.mark.parametrize("kind", ["llama", "qwen3-moe", "deepseek-v3", "gemma2"])
def test_every_layout_is_valid_and_fits_what_it_says(kind, tiny_model_dir):
    path, _ = tiny_model_dir(kind)
    arch = ArchConfig.from_hf(json.loads((path / "config.json").read_text()))
    cluster = Cluster(2, 4, Device("small", 0.002, 100, 1.0))  # 2 MB devices: some layouts do not fit
    preds = Predictor(arch, cluster).plan(Workload(16, 8, 4))
    assert preds and all(check_layout(arch, Layout(p["tp"], p["pp"], p["ep"], p["dp"])) is None for p in preds)
    assert all(p["devices"] == 8 for p in preds)
    for p in preds:
        assert p["fits"] == (p["weight_gb_per_device"] < 0.002 * 0.9 and p["kv_tokens_per_device"] >= 24)
    fitting = [p for p in preds if p["fits"]]
    assert fitting and preds[:len(fitting)] == fitting  # fitting ones first, by throughput per device
    assert [p["throughput_per_device"] for p in fitting] == sorted((p["throughput_per_device"] for p in fitting),
                                                                    reverse=True)
    assert any(p["ep"] for p in preds) == arch.is_moe


def test_slo_and_workload_parsing():
    assert Workload.parse("in=100,out=20,concurrency=8") == Workload(100, 20, 8)
    assert Workload.parse("in=100,out=20,rate=2.5") == Workload(100, 20, None, 2.5)
    with pytest.raises(RivuletError, match="bad --workload item"):
        Workload.parse("input=3")
    assert SLO.parse("ttft=200,tpot=50") == SLO(200, 50)
    arch = ArchConfig.from_hf(LLAMA)
    tight = Predictor(arch, CLUSTER).plan(Workload(64, 16, 4), SLO(tpot_ms=1e-6))
    assert not any(p["meets_slo"] for p in tight)
    with pytest.raises(RivuletError, match="not valid for this model: tp 3"):
        ModelCost(arch, Layout(tp=3))


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rivulet.entrypoints.cli", "plan", *args], capture_output=True,
                          text=True, timeout=120)


def test_plan_command_json_and_errors(tmp_path):
    (tmp_path / "c.yaml").write_text("nodes: 2\ndevices_per_node: 8\ndevice: h200\n")
    (tmp_path / "m.json").write_text(json.dumps({**LLAMA, "vocab_size": 128256, "hidden_size": 4096,
                                                 "intermediate_size": 14336, "num_hidden_layers": 32,
                                                 "num_attention_heads": 32, "num_key_value_heads": 8}))
    out = _run("--model", str(tmp_path / "m.json"), "--cluster", str(tmp_path / "c.yaml"), "--workload",
               "in=512,out=128,concurrency=32", "--slo", "tpot=50", "--json", str(tmp_path / "p.json"))
    assert out.returncode == 0, out.stderr
    assert "Best: tp" in out.stdout and "bound by" in out.stdout
    layouts = json.loads((tmp_path / "p.json").read_text())["layouts"]
    need = {"tp", "pp", "ep", "dp", "devices", "weight_gb_per_device", "kv_tokens_per_device", "fits", "ttft_ms",
            "tpot_ms", "throughput_tok_s", "binding"}
    assert layouts and all(need <= set(p) for p in layouts) and layouts[0]["meets_slo"]
    assert {p["tp"] for p in layouts} == {1, 2, 4, 8, 16}  # 8 KV heads: tp 16 replicates them
    (tmp_path / "bad.yaml").write_text("nodes: 1\ndevice: tpu9\ndevices_per_node: 4\n")
    bad = _run("--model", str(tmp_path / "m.json"), "--cluster", str(tmp_path / "bad.yaml"))
    assert bad.returncode == 2 and "unknown device 'tpu9'" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
    missing = _run("--model", str(tmp_path / "m.json"), "--cluster", str(tmp_path / "none.yaml"))
    assert missing.returncode == 2 and "cannot read the cluster file" in missing.stderr
    for args, message in ((("--probe", "--probe-cores", "0"), "--probe-cores 0: this process may use"),
                          (("--probe-cores", "1", "--model", "m", "--cluster", "c"), "--probe-cores goes with --probe")):
        bad = _run(*args)
        assert bad.returncode == 2 and message in bad.stderr and len(bad.stderr.strip().splitlines()) == 1


def test_probe_measures_this_cpu_and_the_cluster_uses_it(tmp_path, monkeypatch):
    monkeypatch.setenv("RIVULET_THIS_CPU", str(tmp_path / "this-cpu.json"))  # not the cache folder: the C++ build lives there
    (tmp_path / "c.yaml").write_text("devices_per_node: 2\ndevice: this-cpu\n")
    with pytest.raises(RivuletError, match="run `rivulet plan --probe` first"):
        Cluster.load(str(tmp_path / "c.yaml"))
    from rivulet.plan.probe import probe

    dev = probe()
    assert dev.mem_bw_gbps > 0.5 and dev.bf16_tflops > 0.005 and 0 < dev.step_overhead_ms < 1000
    assert 0 < dev.stage_overhead_ms < 1000  # two pipeline stages cost something per step beyond one
    assert 0 <= dev.tp_overhead_ms < 1000 and 0 < dev.link_latency_us < 1e5  # so do two tensor-parallel ranks
    assert 0.001 < dev.link_gbps < 1000
    assert 0 < dev.attn_decode_tflops < dev.bf16_tflops * 10 and 0 < dev.attn_prefill_tflops < dev.bf16_tflops * 10
    assert 0.1 < dev.act_gbps < 10_000  # element-wise kernels on activations
    assert all(0 <= x < 10_000 for x in (dev.expert_us, dev.moe_layer_us, dev.ep_layer_us, dev.ep_row_us))
    cluster = Cluster.load(str(tmp_path / "c.yaml"))
    assert cluster.device == dev and cluster.intra_node == Link(dev.link_gbps, dev.link_latency_us)  # measured
    assert dev.busy is None  # a device of every core: nothing else runs beside it


def test_a_slice_of_the_cores_is_also_measured_with_every_slice_busy():
    """Each core a device: its kernel figures again while the other cores' slices run the same timings in step
    (processes bound as Rivulet binds its ranks). Every figure is there and plausible; the calling thread gets
    its cores and threads back."""
    import os

    import torch

    from rivulet.plan.probe import _all_busy

    cores, threads = os.sched_getaffinity(0), torch.get_num_threads()
    if len(cores) < 2:
        pytest.skip("one core: no slices to keep busy")
    assert _all_busy(len(cores)) is None  # one slice: the whole machine
    busy = _all_busy(1)
    assert os.sched_getaffinity(0) == cores and torch.get_num_threads() == threads
    assert set(busy) == {"mem_bw_gbps", "gemm_call_us", "gemm_call_us_rows", "gemm_tflops", "attn_decode_tflops",
                         "attn_prefill_tflops", "act_gbps", "expert_us"}
    assert sorted(busy["gemm_call_us_rows"]) == [1, 4, 16, 64, 256] and all(0 <= c < 10_000 for c in busy["gemm_call_us_rows"].values())
    assert 0.5 < busy["mem_bw_gbps"] < 10_000 and 0.1 < busy["act_gbps"] < 10_000
    assert all(0 < t < 100 for t in busy["gemm_tflops"].values()) and sorted(busy["gemm_tflops"]) == [1, 4, 16, 64, 256]
    assert 0 < busy["attn_decode_tflops"] < 100 and 0 < busy["attn_prefill_tflops"] < 100
