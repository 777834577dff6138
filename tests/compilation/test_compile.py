"""`--compilation-level 1`: the model compiled by torch.compile gives the eager model's greedy tokens
(float32) on a mixed workload (prefill chunks, batched decodes, one-token steps); every C++ kernel is a
dispatcher op whose fake implementation agrees with the kernel (torch.library.opcheck)."""

from __future__ import annotations

import random

import pytest
import torch

from rivulet import LLM, SamplingParams
from rivulet.config import RivuletError
from rivulet.kernels.cpu import load_cpu_ext

ext = load_cpu_ext()
needs_ext = pytest.mark.skipif(ext is None, reason="no C++ compiler: the kernels are PyTorch references")


def _workload(vocab: int, n: int, seed: int = 0) -> tuple[list[dict], list[SamplingParams]]:
    rng = random.Random(seed)
    prompts = [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 40))]} for _ in range(n)]
    params = [SamplingParams(temperature=0, max_tokens=rng.randrange(1, 16), ignore_eos=True) for _ in range(n)]
    return prompts, params


def _tokens(llm: LLM, prompts, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def _eager_and_compiled(tiny_model_dir, kind: str, stat: str, **parallel) -> dict:
    """Over several ranks (`parallel`), at -O 0 and -O 2: (greedy tokens of three prompts, `collect(stat)`,
    `collect("compile")`, rank 0's forward) per level. (The default cache folder: rank 1's process would build
    the C++ kernels again in a new one.)"""
    path, _ = tiny_model_dir(kind)
    g = torch.Generator().manual_seed(5)
    prompts = [{"prompt_token_ids": torch.randint(3, 256, (n,), generator=g).tolist()} for n in (5, 23, 40)]
    params = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)] * 3
    runs = {}
    for level in (0, 2):
        llm = LLM(str(path), dtype="float32", max_model_len=128, max_num_batched_tokens=128, block_size=4,
                  compilation_level=level, **parallel)
        ex = llm.engine.core.executor
        ex.collect("reset")
        runs[level] = (_tokens(llm, prompts, params), ex.collect(stat), ex.collect("compile"), ex.worker.runner.forward_fn)
        llm.shutdown()
    return runs


def test_compiled_model_gives_the_eager_tokens(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("RIVULET_CACHE_DIR", str(tmp_path))
    path, _ = tiny_model_dir("llama")
    kw = dict(dtype="float32", max_model_len=128, max_num_batched_tokens=32, block_size=4)
    prompts, params = _workload(256, 8)
    eager = LLM(str(path), **kw)
    want = _tokens(eager, prompts, params)
    one = _tokens(eager, prompts[:1], params[:1])
    eager.shutdown()
    kinds = {"one-token", "multi-token"}
    for start, num_kv_blocks in (("compiles and saves", None), ("loads", 300)):  # a KV cache of another size
        llm = LLM(str(path), compilation_level=1, num_kv_blocks=num_kv_blocks, **kw)
        compiled = llm.engine.core.executor.runner.forward_fn
        assert _tokens(llm, prompts, params) == want, start
        assert _tokens(llm, prompts[:1], params[:1]) == one, start  # a lone request: one-token steps
        # every step ran a graph compiled ahead of time (none fell back to the in-process torch.compile),
        # compiled by the first engine, read from disk by the second
        assert compiled.fallbacks == 0, start
        assert (compiled.compiled, compiled.loaded) == ((kinds, set()) if start == "compiles and saves" else (set(), kinds))
        llm.shutdown()
    assert len(list((tmp_path / "compile" / "aot").glob(f"{compiled.fingerprint}-*.bin"))) == 2


@pytest.mark.parametrize("kind, dtype", [("mixtral", "float32"), ("qwen3-moe", "bfloat16")])
def test_moe_models_compile_with_their_experts_as_one_op(kind, dtype, tiny_model_dir, tmp_path, monkeypatch):
    """MoE models compile: the experts, a loop over those that have tokens (which Dynamo cannot trace), are one
    op on stacked weights (float32) or on weights packed one by one (bf16); the bf16 router, whose 6 rows our
    kernels do not pack, keeps a plain weight (oneDNN's opaque layout cannot enter a graph). The compiled
    forward gives the eager logits over prefill chunks and decodes."""
    from helpers.runner import make_runner, teacher_forced_logits
    from rivulet.layers.moe import FusedMoE

    monkeypatch.setenv("RIVULET_CACHE_DIR", str(tmp_path))
    path, _ = tiny_model_dir(kind)
    ids = torch.randint(3, 256, (13,), generator=torch.Generator().manual_seed(5)).tolist()
    blocks = [3, 9, 1, 20]
    want = teacher_forced_logits(make_runner(path, dtype=dtype, num_blocks=32), ids, [6, 5], blocks)
    r = make_runner(path, dtype=dtype, num_blocks=32, compilation_level=1)
    r.decode_program = None
    moe = [m for m in r.model.modules() if isinstance(m, FusedMoE)]
    # packed one by one where our bf16 kernel has a layout (panels; AMX CPUs pack these tiny experts only in
    # oneDNN's opaque layout, which a compiled model leaves out: they stay stacked there)
    from rivulet.kernels.cpu import ops as cpu_ops
    assert moe and all((m.packed is not None) == (dtype == "bfloat16" and cpu_ops.PANEL_BF16) for m in moe)
    assert not any(p.is_mkldnn for p in r.model.parameters())
    assert not any(w.is_mkldnn for m in moe if m.packed is not None for w in m.packed[0] + m.packed[1])
    got = teacher_forced_logits(r, ids, [6, 5], blocks)
    tol = 1e-4 if dtype == "float32" else 3e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    compiled = r.forward_fn
    assert compiled.compiled == {"one-token", "multi-token"} and compiled.fallbacks == 0


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
def test_compiled_tensor_parallel_gives_the_eager_tokens(sp, tiny_model_dir):
    """-O2 over two tensor-parallel ranks (with sequence parallelism: reduce-scatters and all-gathers of token
    shards): each rank compiles its graph with the collectives as opaque ops (`torch.ops.rivulet_dist.*`), and
    the greedy tokens, and every collective's calls and bytes (counted as the ops run), equal the eager engine's.
    Every step has 3 tokens or more (the prompts, then 3 decodes), so each rank compiles one graph."""
    runs = _eager_and_compiled(tiny_model_dir, "llama", "comm", tensor_parallel_size=2, enable_sequence_parallel=sp)
    stats, compiled = runs[2][2:]
    assert runs[2][:2] == runs[0][:2]
    assert compiled.compiled == {"multi-token-over-2" if sp else "multi-token"} and compiled.fallbacks == 0
    assert [(s["compiled"], s["fallbacks"]) for s in stats] == [(sorted(compiled.compiled), 0)] * 2  # rank 1 too
    assert compiled.fusions["rope_kv_write"] > (0 if ext is not None else -1)  # the pass matches the C++ ops
    kinds = set().union(*runs[0][1])
    assert kinds == ({"reduce_scatter", "all_gather"} if sp else {"all_reduce", "all_gather"})
    assert compiled.cache_dir is None  # ranks compile in-process and save nothing


@pytest.mark.parametrize("sp", [False, True], ids=["pp2", "pp2-tp2-sp"])
def test_compiled_pipeline_parallel_gives_the_eager_tokens(sp, tiny_model_dir):
    """-O2 over two pipeline stages in two micro-batches (with SP: two stages of two tensor-parallel ranks each,
    stages passing token shards): each stage compiles its forward on one micro-batch (the first from token ids,
    the second from the [2, rows, hidden] it receives; the runner sends and receives around it,
    `worker/pipeline.py`), and the greedy tokens equal the eager engine's. Every rank got a graph for each kind
    of step, with no fallback; busy time is counted."""
    parallel = dict(tensor_parallel_size=2, enable_sequence_parallel=True) if sp else {}
    runs = _eager_and_compiled(tiny_model_dir, "llama", "pipeline", pipeline_parallel_size=2, pipeline_micro_batches=2,
                               **parallel)
    busy, stats, compiled = [s["busy_s"] for s in runs[2][1]], *runs[2][2:]  # (the first stage's forward)
    assert runs[2][0] == runs[0][0]
    assert compiled.cache_dir is None and all(b > 0 for b in busy)
    # every rank: a graph for each kind of step, none fell back (the second stage's takes what it receives: a
    # graph traced without it would fail its guards and fall back)
    kinds = ["2-2-token", "multi-token-over-2", "one-token"] if sp else ["multi-token", "one-token"]
    assert [(s["compiled"], s["fallbacks"]) for s in stats] == [(kinds, 0)] * len(stats)


def test_step_kinds_split_where_a_graph_would_be_specialized():
    """Sequence parallelism over n ranks: steps of 2..n tokens (a one-row shard) get their own graph."""
    from types import SimpleNamespace

    from rivulet.compilation.compiler import step_kinds

    model = torch.nn.Module()
    model.layer = torch.nn.Linear(64, 1000)
    top = (2**31 - 1) // 1000  # every [tokens, width] activation under 2**31 elements (inductor's 32-bit indexing)
    assert [tuple(k) for k in step_kinds(model)] == [("one-token", 1, 1), ("multi-token", 2, top)]
    model.layer.parallel = SimpleNamespace(sp=False, tp_size=4)
    assert len(step_kinds(model)) == 2
    model.layer.parallel = SimpleNamespace(sp=True, tp_size=4)
    assert [tuple(k) for k in step_kinds(model)] == [("one-token", 1, 1), ("2-4-token", 2, 4),
                                                      ("multi-token-over-4", 5, top)]


def test_steps_past_the_last_kinds_range_run_eager(tiny_model_dir, tmp_path, monkeypatch):
    """A step longer than the compiled range (`max_step_tokens`: on GPUs inductor guards 32-bit indexing, so the
    range is bounded) runs the eager model, with the eager logits; steps inside it run their graphs."""
    from helpers.runner import make_runner, teacher_forced_logits

    monkeypatch.setenv("RIVULET_CACHE_DIR", str(tmp_path))
    path, _ = tiny_model_dir("llama")
    ids = torch.randint(3, 256, (15,), generator=torch.Generator().manual_seed(7)).tolist()
    blocks = [3, 9, 1, 20]
    want = teacher_forced_logits(make_runner(path, num_blocks=32), ids, [10, 3], blocks)
    r = make_runner(path, num_blocks=32, compilation_level=1)
    r.decode_program = None
    compiled = r.forward_fn
    compiled.kinds = [k._replace(hi=8) if k.hi > 8 else k for k in compiled.kinds]
    calls = []
    monkeypatch.setattr(compiled, "_compile", lambda kind, *a: calls.append(kind.name) or None)  # jit below
    got = teacher_forced_logits(r, ids, [10, 3], blocks)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert calls == ["multi-token", "one-token"]  # the 10-token chunk compiled nothing


@pytest.mark.parametrize("kind, backend, write", [("deepseek-v3", None, "write_latent_cache"),
                                                  ("llama", "torch", "write_kv_cache")])
def test_compiled_kv_writes_are_ops_that_write_the_cache_in_place(kind, backend, write, tiny_model_dir, tmp_path,
                                                                  monkeypatch):
    """KV-cache writes no kernel backend owns are one op per layer in a compiled graph, so the graph writes the
    cache in place: DeepSeek's latent attention, and the reference write (a CPU without a compiler; here the
    "torch" kernel backend). Traced, a write became a copy of the whole cache per step (a Llama decode step over
    a 200k-block cache: 359 ms against 0.29 eager, `benchmarks/compiled_kv_write.py`). The compiled forward gives
    the eager logits over prefill chunks and decodes."""
    from helpers.runner import make_runner, teacher_forced_logits
    from rivulet.layers.attention import Attention
    from rivulet.platforms import current_platform
    from rivulet.worker.batch import SeqChunk

    monkeypatch.setenv("RIVULET_CACHE_DIR", str(tmp_path))
    if backend is not None:
        monkeypatch.setattr(current_platform(), "kernel_backend", lambda: backend)
    path, _ = tiny_model_dir(kind)
    ids = torch.randint(3, 256, (13,), generator=torch.Generator().manual_seed(5)).tolist()
    blocks = [3, 9, 1, 20]
    want = teacher_forced_logits(make_runner(path, num_blocks=32), ids, [6, 5], blocks)
    r = make_runner(path, num_blocks=32, compilation_level=1)
    got = teacher_forced_logits(r, ids, [6, 5], blocks)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert r.forward_fn.compiled == {"one-token", "multi-token"} and r.forward_fn.fallbacks == 0
    with torch.profiler.profile() as prof:
        r.forward([SeqChunk(ids[-1:], len(ids) - 1, blocks)])
    writes = sum(e.name == f"rivulet_ref::{write}" for e in prof.events())
    assert writes == sum(isinstance(m, Attention) for m in r.model.modules()) > 0


@pytest.mark.parametrize("sp", [False, True], ids=["ep2", "ep2-sp"])
def test_compiled_expert_parallel_gives_the_eager_tokens(sp, tiny_model_dir):
    """-O2 with expert parallelism over two ranks: each rank's expert-parallel layers are one op in its graph
    (`rivulet_ep::expert_parallel_moe`: the all-to-alls' split sizes are read on the host), and the greedy
    tokens and the routing statistics equal the eager engine's; every rank compiled, none fell back."""
    runs = _eager_and_compiled(tiny_model_dir, "mixtral", "experts", tensor_parallel_size=2,
                               enable_expert_parallel=True, enable_sequence_parallel=sp)
    stats = runs[2][2]
    assert runs[2][:2] == runs[0][:2]
    assert all(layer["rank_load"] and sum(layer["rank_load"]) for rank in runs[2][1] for layer in rank)
    assert [s["fallbacks"] for s in stats] == [0, 0] and all(s["compiled"] for s in stats)


@needs_ext
def test_weight_only_models_get_a_graph_per_side_of_the_row_test(tiny_model_dir, tmp_path, monkeypatch):
    """int4 linears read their compact copies up to R rows and the original weights beyond: the multi-token
    steps get two graphs, 2..R tokens and more, each compiled (then loaded) once, with no fallback to an
    in-process compile when steps cross R (one graph would have been specialized on the first side).
    `enforce_eager` keeps the decode program out, so every step runs a graph."""
    from rivulet.layers.quantization import small_step_rows

    monkeypatch.setenv("RIVULET_CACHE_DIR", str(tmp_path))
    path, _ = tiny_model_dir("llama")
    r = small_step_rows()  # 32 (8 on AMX CPUs)
    kw = dict(dtype="float32", max_model_len=128, max_num_batched_tokens=2 * r, block_size=4, quantization="int4",
              enforce_eager=True)
    rng = random.Random(3)
    alone = [{"prompt_token_ids": [rng.randrange(3, 256) for _ in range(r // 2 + 1)]}]  # 2..R tokens, then 1
    many = [{"prompt_token_ids": [rng.randrange(3, 256) for _ in range(n)]} for n in (r // 2 + 1, r // 2 + 3, r + 1)]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)  # `many` decodes 3 rows at a time
    eager = LLM(str(path), **kw)
    want = _tokens(eager, alone, [params]) + _tokens(eager, many, [params] * 3)
    eager.shutdown()
    kinds = {"one-token", f"2-{r}-token", f"multi-token-over-{r}"}
    for start in ("compiles", "loads"):
        llm = LLM(str(path), compilation_level=1, **kw)
        compiled = llm.engine.core.executor.runner.forward_fn
        assert {k.name for k in compiled.kinds} == kinds
        assert _tokens(llm, alone, [params]) + _tokens(llm, many, [params] * 3) == want, start
        assert compiled.fallbacks == 0, start
        assert (compiled.compiled if start == "compiles" else compiled.loaded) == kinds, start
        llm.shutdown()


def test_a_saved_graph_reads_the_weights_of_the_model_that_loads_it(tiny_model_dir, tmp_path, monkeypatch):
    """Weights are inputs of the saved graph, not constants: a model with the same shapes and other
    values (same fingerprint) loads the file and computes with its own weights."""
    monkeypatch.setenv("RIVULET_CACHE_DIR", str(tmp_path))
    path, _ = tiny_model_dir("llama")
    kw = dict(dtype="float32", max_model_len=128, max_num_batched_tokens=32, block_size=4)
    prompts, params = _workload(256, 4, seed=1)

    def run(level: int, scale: float) -> tuple[list[list[int]], object]:
        llm = LLM(str(path), compilation_level=level, **kw)
        runner = llm.engine.core.executor.runner
        with torch.no_grad():
            for layer in runner.model.model.layers:
                layer.mlp.down_proj.weight.mul_(scale)  # other values, same shape and dtype
        tokens = _tokens(llm, prompts, params)
        llm.shutdown()
        return tokens, runner.forward_fn

    first, compiled = run(1, 1.0)
    assert compiled.compiled == {"one-token", "multi-token"}
    scaled_eager, _ = run(0, 4.0)
    scaled, loaded = run(1, 4.0)
    assert loaded.loaded == {"one-token", "multi-token"} and loaded.fallbacks == 0
    assert loaded.fingerprint == compiled.fingerprint
    assert scaled == scaled_eager
    assert scaled != first  # the scaling matters, so the equality above says something


def test_fingerprint_follows_what_the_trace_depends_on(tiny_model_dir):
    from rivulet.compilation.compiler import model_fingerprint

    path, _ = tiny_model_dir("llama")
    llm = LLM(str(path), dtype="float32", max_model_len=64)
    model = llm.engine.core.executor.runner.model
    before = model_fingerprint(model)
    assert model_fingerprint(model) == before
    norm = model.model.norm
    norm.eps *= 2  # a constant the trace bakes in
    assert model_fingerprint(model) != before
    norm.eps /= 2
    norm.weight.data = norm.weight.data.to(torch.bfloat16)  # a weight's dtype
    assert model_fingerprint(model) != before
    llm.shutdown()


def test_unknown_compilation_level_is_a_clear_error():
    with pytest.raises(RivuletError, match="compilation_level"):
        LLM("default", compilation_level=3)


def _rand(*shape, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(0)).to(dtype)


@needs_ext
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_ops_have_faithful_fake_implementations(dtype):
    import rivulet.kernels.cpu.ops  # noqa: F401 - registers the fake implementations

    ops = torch.ops.rivulet
    t, hq, hk, d, bs, nb = 5, 4, 2, 16, 4, 6
    x, w = _rand(t, 32, dtype=dtype), _rand(32, dtype=dtype)
    cache = _rand(2, nb, bs, hk, d, dtype=dtype)
    q, k = _rand(t, hq, d, dtype=dtype), _rand(t, hk, d, dtype=dtype)
    cases = [
        (ops.rms_norm.default, (x, w, 1e-6)),
        (ops.fused_add_rms_norm.default, (x, x.clone(), w, 1e-6)),
        (ops.silu_and_mul.default, (x,)),
        (ops.apply_rotary.default, (torch.arange(t), q, k, _rand(64, d), False)),
        (ops.write_kv_cache.default, (k, k.clone(), cache, torch.tensor([0, 5, 9, 2, 23]))),
        (ops.rotary_write_kv_cache.default, (torch.arange(t), q, k, k.clone(), _rand(64, d), False, cache,
                                             torch.tensor([0, 5, -1, 2, 23]))),
        (ops.decode_attention.default, (q, cache, torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
                                        torch.tensor([5, 8], dtype=torch.int32), torch.tensor([0, 4]),
                                        torch.tensor([0, 1]), torch.zeros_like(q), 0.25, 0)),
    ]
    e, inter = 3, 16  # MoE: 3 experts, 2 of them chosen by each token (expert 2 by none)
    w13, w2 = _rand(e, 2 * inter, 32, dtype=dtype), _rand(e, 32, inter, dtype=dtype)
    topk = (_rand(t, 2).softmax(-1), torch.tensor([[0, 1], [1, 0], [0, 1], [1, 0], [0, 1]]))
    cases += [(torch.ops.rivulet_ref.fused_moe.default, (x, w13, w2, *topk)),
              (torch.ops.rivulet_cpu.packed_fused_moe.default, (x, list(w13), list(w2), *topk)),
              (torch.ops.rivulet_ref.write_latent_cache.default, (x[:, :24], _rand(1, nb, bs, 1, 24, dtype=dtype),
                                                                 torch.tensor([0, 5, 9, 2, 23]))),
              (torch.ops.rivulet_ref.varlen_attention.default, (q, k, k.clone(), torch.tensor([0, 2, 5]), 0.25, 1.25))]
    if dtype == torch.bfloat16 and hasattr(ext, "bf16_linear") and ext.bf16_linear_available():
        cases.append((ops.bf16_linear.default, (x, ext.bf16_pack_weight(_rand(48, 32, dtype=dtype)), None)))
        cases.append((torch.ops.rivulet_cpu.packed_fused_moe.default,
                      (x, [ext.bf16_pack_weight(w) for w in w13], [ext.bf16_pack_weight(w) for w in w2], *topk)))
    for op, args in cases:
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))
