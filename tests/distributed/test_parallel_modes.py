"""Pipeline, sequence and expert parallelism over gloo on CPU: each mode gives exactly the
single-rank greedy tokens (float32), and the collectives move the bytes the formulas say."""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch

from helpers.constrained import JSON_PROMPT, constrained_params
from rivulet import LLM, RivuletError, SamplingParams
from rivulet.models.arch_config import ArchConfig
from rivulet.plan.cost import Layout, ModelCost

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
LENS = (5, 23, 40)
H, B = 64, 4  # tiny models' hidden size, float32 bytes


def _tokens(llm: LLM, prompts) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def _prompts():
    g = torch.Generator().manual_seed(5)
    return [{"prompt_token_ids": torch.randint(0, 256, (n,), generator=g).tolist()} for n in LENS]


_REFERENCE: dict[str, list[list[int]]] = {}


def _reference(path) -> list[list[int]]:
    if str(path) not in _REFERENCE:
        _REFERENCE[str(path)] = _tokens(LLM(str(path), dtype="float32", max_model_len=128), _prompts())
    return _REFERENCE[str(path)]


def _pad(n: int, tp: int) -> int:
    return -(-n // tp) * tp


# tokens computed over the run: the three prompts in one prefill step, then MAX_TOKENS - 1 decode steps of 3
T_STEPS = [sum(LENS)] + [len(LENS)] * (MAX_TOKENS - 1)
SAMPLED = len(LENS) * MAX_TOKENS


def _sum(stats: list[dict], kind: str, field: str = "payload_bytes") -> int:
    return sum(s.get(kind, {}).get(field, 0) for s in stats)


@pytest.mark.parametrize("kind,kw", [
    ("llama", dict(pipeline_parallel_size=2)),  # one batch at a time (the default)
    ("llama", dict(pipeline_parallel_size=2, pipeline_micro_batches=2)),  # 2 micro-batches in flight per step
    ("llama3-rope-tied", dict(pipeline_parallel_size=2)),  # tied LM head on the last stage, from the embedding
    ("qwen3-moe", dict(pipeline_parallel_size=2)),         # experts on stage 0, a dense MLP (mlp_only_layers) on 1
    ("llama", dict(tensor_parallel_size=2, enable_sequence_parallel=True)),
    ("qwen3-moe", dict(tensor_parallel_size=2, enable_sequence_parallel=True)),
    ("mixtral", dict(tensor_parallel_size=2, enable_expert_parallel=True)),
    ("qwen3-moe", dict(tensor_parallel_size=2, enable_expert_parallel=True)),
    ("deepseek-v3", dict(tensor_parallel_size=2, enable_expert_parallel=True)),  # grouped routing, shared experts
    ("qwen3-moe", dict(tensor_parallel_size=2, enable_expert_parallel=True, enable_sequence_parallel=True)),
], ids=lambda v: v if isinstance(v, str) else ",".join(f"{k}={x}" for k, x in v.items()))
def test_mode_equals_single_rank_and_comm_formula(kind, kw, tiny_model_dir):
    path, hf = tiny_model_dir(kind)
    want = _reference(path)
    llm = LLM(str(path), dtype="float32", max_model_len=128, **kw)
    try:
        ex = llm.engine.core.executor
        ex.collect("reset")
        assert _tokens(llm, _prompts()) == want
        comm = ex.collect("comm")
        layers = hf.config.num_hidden_layers
        tp = kw.get("tensor_parallel_size", 1)
        if kw.get("pipeline_parallel_size", 1) == 2:  # hidden + residual of every token over the one boundary
            assert _sum(comm, "send") == sum(2 * t * H * B for t in T_STEPS)
            cost = ModelCost(ArchConfig.from_hf(json.loads((path / "config.json").read_text())),
                             Layout(pp=2))
            assert _sum(comm, "send") == sum(cost.comm(0, t, len(LENS), 0, B)["send"] for t in T_STEPS)
            assert _sum(comm, "recv") == _sum(comm, "send")
            assert set().union(*comm) == {"send", "recv"}
        elif kw.get("enable_expert_parallel"):
            experts = ex.collect("experts")[0]
            cross = sum(m["cross_rows"] for m in experts)  # (token, expert) rows computed on another rank
            assert _sum(comm, "all_to_all") == 2 * cross * H * B  # there and back
            assert 0 < cross < sum(T_STEPS) * len(experts) * hf.config.num_experts_per_tok
        if kw.get("enable_sequence_parallel"):
            # every all-reduce of TP (embedding + 2 per layer) becomes a reduce-scatter of the padded tokens
            t_pad = sum(_pad(t, tp) for t in T_STEPS)
            dense_layers = layers if not kw.get("enable_expert_parallel") else layers - len(ex.collect("experts")[0])
            rs = (1 + layers + dense_layers) * t_pad * H * B
            assert _sum(comm, "reduce_scatter") == tp * rs
            assert "all_reduce" not in set().union(*comm)
            # ... and the same wire bytes as the ring all-reduce it replaces, with all-gathers of the shards
            assert _sum(comm, "reduce_scatter", "wire_bytes") == tp * rs * (tp - 1) // tp
    finally:
        llm.shutdown()


def test_tp_all_reduce_bytes_match_formula(tiny_model_dir):
    """Plain TP=2: one all-reduce of T x hidden for the embedding and two per layer; the LM head
    all-gathers the vocabulary shards of the sampled rows."""
    path, hf = tiny_model_dir("llama")
    want = _reference(path)
    llm = LLM(str(path), dtype="float32", max_model_len=128, tensor_parallel_size=2)
    try:
        ex = llm.engine.core.executor
        ex.collect("reset")
        assert _tokens(llm, _prompts()) == want
        comm = ex.collect("comm")
        layers, vocab = hf.config.num_hidden_layers, hf.config.vocab_size
        assert _sum(comm, "all_reduce") == 2 * (1 + 2 * layers) * sum(T_STEPS) * H * B
        assert _sum(comm, "all_reduce", "calls") == 2 * (1 + 2 * layers) * len(T_STEPS)
        assert _sum(comm, "all_gather") == 2 * SAMPLED * vocab * B
        # rivulet plan's cost model predicts these bytes exactly
        cost = ModelCost(ArchConfig.from_hf(json.loads((path / "config.json").read_text())), Layout(tp=2))
        predicted = [cost.comm(0, t, len(LENS), 0, B) for t in T_STEPS]
        for kind in ("all_reduce", "all_gather"):
            assert _sum(comm, kind) == 2 * sum(p[kind] for p in predicted)
    finally:
        llm.shutdown()


def test_tp2_pp2_four_ranks(tiny_model_dir):
    path, _ = tiny_model_dir("llama")
    llm = LLM(str(path), dtype="float32", max_model_len=128, tensor_parallel_size=2, pipeline_parallel_size=2,
              pipeline_micro_batches=2)
    try:
        assert _tokens(llm, _prompts()) == _reference(path)
        timing = llm.engine.core.executor.collect("pipeline")
        assert [(t["pp_rank"], t["tp_rank"]) for t in timing] == [(0, 0), (0, 1), (1, 0), (1, 1)]
        assert all(0 < t["busy_s"] < t["step_s"] for t in timing)
    finally:
        llm.shutdown()


def test_bf16_expert_parallel_runs_the_packed_experts(tiny_model_dir):
    """In bf16 on CPU every rank's experts are packed for the CPU's linear kernel (`FusedMoE.pack_experts`);
    expert parallelism then computes the rows it receives with them: the next-token distribution of each
    prompt stays the float32 single rank's (bf16 tolerance)."""
    path, _ = tiny_model_dir("mixtral")
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=5)

    def first(llm: LLM) -> list[dict[int, float]]:
        try:
            outs = llm.generate(_prompts(), params, use_tqdm=False)
            return [{t: lp.logprob for t, lp in o.outputs[0].logprobs[0].items()} for o in outs]
        finally:
            llm.shutdown()

    want = first(LLM(str(path), dtype="float32", max_model_len=128))
    ep = LLM(str(path), dtype="bfloat16", max_model_len=128, tensor_parallel_size=2, enable_expert_parallel=True)
    assert all(layer["packed"] for rank in ep.engine.core.executor.collect("experts") for layer in rank)
    got = first(ep)
    for g, w in zip(got, want):
        top = max(w, key=w.get)
        assert top in g and abs(g[top] - w[top]) < 0.1, (g, w)


def test_expert_load_stats_and_hot_expert_replication(tiny_model_dir):
    """A skewed routing workload (prompts of one repeated token, whose tokens mostly go to experts 2
    and 3, both on rank 1): the per-expert counts show the hot expert; replicating it on every rank
    lowers the busiest rank's share of the (token, expert) rows, and the tokens stay the same."""
    path, _ = tiny_model_dir("mixtral")
    prompts = [{"prompt_token_ids": [tok] * 30} for tok in (1, 0, 28)]
    want = _tokens(LLM(str(path), dtype="float32", max_model_len=128), prompts)
    imbalance, replicate = {}, None
    for run in ("before", "after"):
        llm = LLM(str(path), dtype="float32", max_model_len=128, tensor_parallel_size=2,
                  enable_expert_parallel=True, replicated_experts=replicate)
        try:
            assert _tokens(llm, prompts) == want
            stats = llm.engine.core.executor.collect("experts")[0]
        finally:
            llm.shutdown()
        counts = torch.tensor([m["expert_counts"] for m in stats]).sum(0)
        load = torch.tensor([m["rank_load"] for m in stats]).sum(0)
        rows = (90 + 3 * (MAX_TOKENS - 1)) * len(stats) * 2  # tokens x layers x top-2
        assert counts.sum() == load.sum() == rows  # every (token, expert) row computed once
        imbalance[run] = (load.max() / load.float().mean()).item()
        replicate = [int(counts.argmax())]
    assert replicate == [2] and imbalance["before"] > 1.5
    assert imbalance["after"] < imbalance["before"] - 0.2


def test_default_model_pp2_and_dead_worker(default_reference):
    ref = default_reference
    llm = LLM(dtype="float32", max_model_len=256, pipeline_parallel_size=2, pipeline_micro_batches=2)
    try:
        greedy16 = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        got = [o.outputs[0].token_ids for o in llm.generate(ref.prompts, greedy16, use_tqdm=False)]
        assert got == ref.tokens  # 30 layers: 15 per stage, tied LM head on stage 1
        # the grammar bitmask, filled on rank 0 (stage 0) during the forward, reaches the sampling stage
        out = llm.generate(JSON_PROMPT, constrained_params(), use_tqdm=False)[0].outputs[0]
        assert out.token_ids == ref.constrained and json.loads(out.text)
        os.kill(llm.engine.core.executor.procs[0].pid, signal.SIGKILL)
        llm.engine.core.executor.procs[0].wait()
        with pytest.raises((RivuletError, RuntimeError), match="exited|closed|Connection"):
            llm.generate(ref.prompts[0], GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()


def test_clear_errors(tiny_model_dir):
    """The executor's checks, without starting ranks (the CLI prints these on one line)."""
    from helpers.minilm import minilm_dir
    from rivulet.config import EngineConfig, ParallelConfig
    from rivulet.executor.multiproc import check_parallel
    from rivulet.models.loader import load_arch_config, resolve_model

    default = load_arch_config(resolve_model("default"))[0]
    mixtral = load_arch_config(resolve_model(str(tiny_model_dir("mixtral")[0])))[0]

    def check(arch, **kw):
        check_parallel(arch, EngineConfig(parallel=ParallelConfig(**kw)))

    with pytest.raises(RivuletError, match="pipeline_parallel_size 31 exceeds the model's 30 layers"):
        check(default, pipeline_parallel_size=31)
    with pytest.raises(RivuletError, match="needs a mixture-of-experts model"):
        check(default, tensor_parallel_size=3, enable_expert_parallel=True)
    with pytest.raises(RivuletError, match="expert parallelism over 3 ranks does not divide the model's 4 experts"):
        check(mixtral, tensor_parallel_size=3, enable_expert_parallel=True)
    with pytest.raises(RivuletError, match="replicated expert 7 is not one of the model's 4 experts"):
        check(mixtral, tensor_parallel_size=2, enable_expert_parallel=True, replicated_experts=[7])
    minilm = load_arch_config(resolve_model(str(minilm_dir())))[0]
    with pytest.raises(RivuletError, match="encoder models run without pipeline parallelism"):
        check(minilm, pipeline_parallel_size=2)  # (once raised by rank 1, its traceback printed)
    check(default, tensor_parallel_size=3, pipeline_parallel_size=2)  # fine: 9 heads / 3, 30 layers / 2


def test_an_engine_after_a_multi_rank_one_has_all_the_cores(tiny_model_dir):
    """Rank 0 of a two-rank engine runs in this process with half the cores, its thread bound to the first half
    (rank 1's process to the second: `/proc` shows its affinity); after it, the process has its threads and cores
    back, and a single-rank engine takes every core it may run on (it once ran on the one thread left)."""
    path, _ = tiny_model_dir("llama")
    mask = sorted(os.sched_getaffinity(0))
    cores = len(mask)
    before = torch.get_num_threads()
    llm = LLM(str(path), dtype="float32", max_model_len=128, tensor_parallel_size=2)
    assert torch.get_num_threads() == max(1, cores // 2)
    if cores >= 2:
        half = cores // 2
        assert sorted(os.sched_getaffinity(0)) == mask[:half]
        rank1 = llm.engine.core.executor.procs[0].pid
        assert sorted(os.sched_getaffinity(rank1)) == mask[half:2 * half]
    llm.shutdown()
    assert torch.get_num_threads() == before and sorted(os.sched_getaffinity(0)) == mask
    torch.set_num_threads(1)  # as a caller (or an engine killed before its shutdown) may leave it
    try:
        single = LLM(str(path), dtype="float32", max_model_len=128)
        assert torch.get_num_threads() == cores
        single.shutdown()
    finally:
        torch.set_num_threads(before)
