"""The CPU decode program (small steps of a plain Llama decoder with int8/int4 or packed bf16 weights as one
native call) computes exactly the layer-by-layer path's numbers on decode steps, gives each token of a
multi-token step what it would get decoded alone, takes only the steps it describes, and refuses
other models with a reason."""

from __future__ import annotations

import pytest
import torch

from helpers.runner import make_runner, teacher_forced_logits
from rivulet import LLM, SamplingParams
from rivulet.kernels.cpu import load_cpu_ext
from rivulet.kernels.cpu import ops as cpu_ops
from rivulet.layers.quantization import small_step_rows
from rivulet.worker.batch import SeqChunk

pytestmark = pytest.mark.skipif(not hasattr(load_cpu_ext(), "DecodeProgram"),
                                reason="the decode program is built for AVX512-VNNI CPUs only")
# bf16 linears packed in a layout the program reads: AMX tiles, or panels (AVX512-BF16 CPUs without AMX)
_BF16_PACKED = cpu_ops.AMX_BF16 or (cpu_ops.PANEL_BF16 and getattr(load_cpu_ext(), "DECODE_PROGRAM_PANELS", False))


def _counting(runner) -> list[int]:
    """Wrap the runner's program so that each step it takes appends its token count (negated for a step
    where some sequence has several tokens)."""
    calls: list[int] = []
    program = runner.decode_program
    run = program.run

    def counted(input_ids, positions, meta, layout):
        out = run(input_ids, positions, meta, layout)
        if out is not None:
            calls.append(input_ids.shape[0] if layout.num_seqs == input_ids.shape[0] else -input_ids.shape[0])
        return out

    program.run = counted
    return calls


# Llama (GQA 2), Qwen2 (QKV bias), Llama 3 rope scaling with a tied head and 4 heads per KV head,
# Phi-3 (LongRoPE, fused checkpoint projections), Qwen3 (q/k norms)
@pytest.mark.parametrize("kind", ["llama", "qwen2", "llama3-rope-tied", "phi3", "qwen3-hd16"])
@pytest.mark.parametrize("method", ["int4", "int8"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_one_sequence_decodes_bitwise_as_layer_by_layer(kind, method, dtype, tiny_model_dir):
    path, _ = tiny_model_dir(kind)
    ids = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    r = make_runner(path, dtype=dtype, quantization=method)
    calls = _counting(r)
    got = teacher_forced_logits(r, ids, chunks=[16], blocks=list(range(12)))
    assert calls == [1] * 24  # every one-token step, not the 16-token prefill
    r.decode_program = None
    ref = teacher_forced_logits(r, ids, chunks=[16], blocks=list(range(12)))
    assert torch.equal(got, ref)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_batched_decode_steps_match_and_other_steps_run_layer_by_layer(dtype, tiny_model_dir):
    path, _ = tiny_model_dir("qwen2")
    g = torch.Generator().manual_seed(5)
    rows = small_step_rows()  # the most rows the compact weights serve
    lengths = torch.randint(2, 31, (rows + 1,), generator=g).tolist()
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]
    tables = [list(range(i * 10, i * 10 + 10)) for i in range(len(prompts))]  # 10 blocks of 4: 40 tokens each

    def run(r, n_seqs: int) -> list[torch.Tensor]:
        out = [r.forward([SeqChunk(p, 0, t) for p, t in zip(prompts[:n_seqs], tables)])]  # a mixed-length prefill
        toks = [int(x) for x in out[0].argmax(-1)]
        lens = [len(p) for p in prompts[:n_seqs]]
        for _ in range(4):
            logits = r.forward([SeqChunk([tok], n, t) for tok, n, t in zip(toks, lens, tables)])
            out.append(logits)
            toks, lens = [int(x) for x in logits.argmax(-1)], [n + 1 for n in lens]
        return out

    r = make_runner(path, dtype=dtype, num_blocks=10 * len(prompts), quantization="int4")
    calls = _counting(r)
    # bf16 original weights packed (panels on AVX512-BF16 CPUs without AMX, AMX tiles): a second program takes
    # what the compact copies do not, up to 64 rows; float32 originals: those steps run layer by layer
    panels = dtype == "bfloat16" and _BF16_PACKED
    assert [n for n, _ in r.decode_program.natives] == ([rows, 64] if panels else [rows])
    got = run(r, 3) + run(r, 9) + run(r, rows + 1)
    # (steps of 9 fit the compact copies where they serve 9 rows or more: 32 rows here, 8 on AMX CPUs)
    assert calls == [3] * 4 + ([9] * 4 if 9 <= rows or panels else []) + ([rows + 1] * 4 if panels else [])
    r.decode_program = None
    for a, b in zip(got, run(r, 3) + run(r, 9) + run(r, rows + 1)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kind,why", [
    ("mistral-window", "sliding-window layers"),
    ("qwen3", "refused the model: decode program: head layout"),  # head dim 24: no attention kernel for it
    ("qwen3-moe", "not the plain Llama decoder"),
    ("gemma2", "sandwich norms"),
])
def test_models_it_does_not_describe_run_layer_by_layer(kind, why, tiny_model_dir):
    r = make_runner(tiny_model_dir(kind)[0], quantization="int4")
    assert r.decode_program is None and why in r.decode_program_skipped


@pytest.mark.skipif(not _BF16_PACKED, reason="packed bf16 linears: AMX or AVX512-BF16 CPUs")
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_packed_bf16_weights_decode_bitwise_and_batch_up_to_64(kind, tiny_model_dir):
    """Without quantization, bf16 weights packed (AMX tiles or panels): decode steps of 1, of 9 sequences (more
    than the int4 program's 8) and of 20 (more than one AMX tile of rows) are taken and equal the layer-by-layer
    path; a step with a 12-token sequence is not."""
    path, _ = tiny_model_dir(kind)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in torch.randint(2, 31, (20,), generator=g)]
    tables = [list(range(i * 10, i * 10 + 10)) for i in range(len(prompts))]

    def run(r) -> list[torch.Tensor]:
        out = [r.forward([SeqChunk(p, 0, t) for p, t in zip(prompts, tables)])]
        toks, lens = [int(x) for x in out[0].argmax(-1)], [len(p) for p in prompts]
        for n in (20, 20, 9, 9, 1):  # 20 sequences: 2 x 2 tile blocks on AMX; 9 and 1: 16-row tiles
            logits = r.forward([SeqChunk([tok], k, t) for tok, k, t in zip(toks[:n], lens[:n], tables)])
            out.append(logits)
            toks[:n], lens[:n] = [int(x) for x in logits.argmax(-1)], [k + 1 for k in lens[:n]]
        out.append(r.forward([SeqChunk(list(range(12)), 0, list(range(200, 206)))], all_logits=True))  # 12 > MAX_QUERY
        return out

    r = make_runner(path, dtype="bfloat16", num_blocks=206)
    assert r.decode_program is not None and r.decode_program.max_rows == 64
    calls = _counting(r)
    got = run(r)
    assert calls == [20, 20, 9, 9, 1]  # not the prefill, nor one sequence's 12-token chunk
    r.decode_program = None
    for a, b in zip(got, run(r)):
        assert torch.equal(a, b)


def test_dense_weights_and_enforce_eager_have_no_program(tiny_model_dir):
    from rivulet.config import CacheConfig, ModelConfig
    from rivulet.models.loader import resolve_model
    from rivulet.worker.model_runner import ModelRunner as Runner

    path, _ = tiny_model_dir("llama")
    r = make_runner(path)
    assert r.decode_program is None and "weight-only int8/int4" in r.decode_program_skipped
    eager = Runner(ModelConfig(model=str(path), dtype="float32", quantization="int4", enforce_eager=True),
                   CacheConfig(block_size=4), resolve_model(str(path)))
    eager.allocate_kv_cache(16)
    assert eager.decode_program is None and eager.decode_program_skipped is None


@pytest.mark.parametrize("quantization", ["int4", None])  # None: bf16 weights (panels on CPUs that have them)
def test_default_model_greedy_tokens_match_enforce_eager(quantization):
    # prompts of more than 8 tokens: their prefill runs layer by layer either way (a short prompt's would run in
    # the program, whose attention sums in another order than the prefill kernel's: a near-tie may then flip)
    prompts = ["The capital of France is a city known for many things, such as",
               "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
               "Water boils at a temperature that depends on the pressure of the air around it, and"]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = {}
    for eager in (False, True):
        llm = LLM("default", quantization=quantization, max_model_len=256, kv_cache_memory=32 << 20,
                  enforce_eager=eager)
        try:
            runner = llm.engine.core.executor.runner
            if quantization is None and runner.decode_program_skipped:  # AMX CPUs: bf16 runs on AMX tiles
                pytest.skip(runner.decode_program_skipped)
            assert (runner.decode_program is None) == eager
            calls = _counting(runner) if not eager else []
            outs[eager] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        finally:
            llm.shutdown()
        assert eager or len(calls) >= 23  # every decode step (the first token comes from the prefill)
    assert outs[False] == outs[True]
    assert all(len(t) == 24 for t in outs[False])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_multi_token_step_gives_each_token_its_one_token_numbers(dtype, tiny_model_dir):
    """Short prefill chunks and k-token steps (two sequences in one step): each token's logits equal
    decoding it alone through the program, bitwise, and are close to the layer-by-layer path's, whose prefill
    kernel sums attention in another order: in float32 equal but where that last-bit difference flips an int8
    activation rounding (measured: 1 token of 23, by 0.04), in bf16 within its rounding (<= 0.16 measured).
    A wrong position, mask or row would move most tokens by ~1 (logits span ~+-5)."""
    path, _ = tiny_model_dir("llama3-rope-tied")
    g = torch.Generator().manual_seed(7)
    a, b = torch.randint(0, 256, (14,), generator=g).tolist(), torch.randint(0, 256, (9,), generator=g).tolist()
    ta, tb = list(range(0, 5)), list(range(5, 10))

    def chunked(r):  # a: 6, then 8 tokens in two steps; b: 3 + 3 + 3 beside them
        out = [r.forward([SeqChunk(a[:6], 0, ta), SeqChunk(b[:2], 0, tb)], all_logits=True)]
        out.append(r.forward([SeqChunk(a[6:10], 6, ta), SeqChunk(b[2:6], 2, tb)], all_logits=True))
        out.append(r.forward([SeqChunk(a[10:], 10, ta), SeqChunk(b[6:], 6, tb)], all_logits=True))
        return torch.cat(out)

    r = make_runner(path, dtype=dtype, quantization="int4")
    calls = _counting(r)
    got = chunked(r)
    assert calls == [-8, -8, -7]
    alone = [r.forward([SeqChunk([t], i, ta)]) for i, t in enumerate(a)]
    alone_b = [r.forward([SeqChunk([t], i, tb)]) for i, t in enumerate(b)]
    order = [alone[:6], alone_b[:2], alone[6:10], alone_b[2:6], alone[10:], alone_b[6:]]
    assert torch.equal(got, torch.cat([x for part in order for x in part]))
    r.decode_program = None
    ref = chunked(r)
    diff = (got.float() - ref.float()).abs().amax(-1)  # per token
    if dtype == "float32":
        assert int((diff > 1e-4).sum()) <= 2 and diff.max() < 0.1, diff
    else:
        assert diff.max() < 0.3 and int((got.argmax(-1) != ref.argmax(-1)).sum()) <= 2, diff


def test_int4_ngram_speculation_keeps_the_greedy_tokens_and_verifies_in_the_program():
    """One sequence at a time, so every verify step (1 + 3 tokens) fits the program: each of its tokens gets
    its one-token numbers, so even in bf16 the greedy tokens are those of plain decoding. (Bigger verify
    steps run layer by layer on the dense weights, as any step of more than 8 rows does.)"""
    rng = torch.Generator().manual_seed(2)
    prompts = []
    for _ in range(4):
        a = torch.randint(100, 30000, (12,), generator=rng).tolist()
        prompts.append({"prompt_token_ids": a + a[:3]})
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    outs, calls = {}, []
    for cfg in (None, spec):
        llm = LLM("default", quantization="int4", max_model_len=256, kv_cache_memory=32 << 20, max_num_seqs=1,
                  speculative_config=cfg)
        try:
            runner = llm.engine.core.executor.runner
            if cfg is not None:
                calls = _counting(runner)
            outs[cfg is None] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        finally:
            llm.shutdown()
    assert outs[True] == outs[False]
    assert any(c < 0 for c in calls)  # verify steps of 1 + k tokens ran in the program


def test_the_native_call_checks_its_step(tiny_model_dir):
    r = make_runner(tiny_model_dir("llama")[0], quantization="int4")
    native = r.decode_program.native
    pos, slots, tables = torch.tensor([3]), torch.tensor([3]), torch.zeros(1, 4, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="token id out of range"):
        native.run(torch.tensor([256]), pos, slots, tables)
    with pytest.raises(RuntimeError, match="position beyond the rotary table"):
        native.run(torch.tensor([5]), torch.tensor([10_000]), slots, tables)
    rows = r.decode_program.max_rows
    over = torch.arange(rows + 1)
    with pytest.raises(RuntimeError, match=f"1 to {rows} tokens, got {rows + 1}"):
        native.run(over, over, over, torch.zeros(rows + 1, 4, dtype=torch.int32))
    assert native.run(torch.tensor([5]), pos, slots, tables).shape == (1, 64)
