"""Multi-LoRA: adapters written by PEFT on tiny random models; Rivulet's greedy tokens against PEFT's own
model on the same adapter (float32), with adapters and the base model mixed in one batch."""

from __future__ import annotations

import json

import pytest
import torch

from helpers.lora import ADAPTERS, peft_tokens as _peft_tokens, write_peft_adapter as _write_adapter
from helpers.tiny import make_tiny_model
from rivulet import LLM, LoRARequest, RivuletError, SamplingParams
from rivulet.kernels.cpu import load_cpu_ext
from rivulet.kernels.lora import LoRAPlan, add_lora_batched, add_lora_ref

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llama_adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    make_tiny_model("llama", root / "base")
    for seed, (name, cfg) in enumerate(ADAPTERS.items(), start=1):
        _write_adapter(root / "base", "llama", name, root, seed, **cfg)
    return root


def _tokens(llm: LLM, prompts, loras) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False, lora_request=loras)
    return [o.outputs[0].token_ids for o in outs]


def test_adapters_and_base_mixed_in_one_batch_match_peft(llama_adapters):
    root = llama_adapters
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (7, 30, 19, 12)]
    names = [*ADAPTERS, None]
    want = [_peft_tokens(root / "base", root / n if n else None, p) for n, p in zip(names, prompts)]
    assert len({tuple(w) for w in want}) == 4
    loras = [LoRARequest(n, i + 1, str(root / n)) if n else None for i, n in enumerate(names)]
    # small steps: prefill chunks of different adapters' requests share steps with decodes
    llm = LLM(str(root / "base"), dtype="float32", enable_lora=True, max_loras=3, max_num_batched_tokens=16,
              block_size=4)
    try:
        assert _tokens(llm, prompts, loras) == want
        # the same prompt under each adapter and the base: no request reads another's cached blocks
        same = [prompts[1]] * 4
        assert _tokens(llm, same, loras) == [_peft_tokens(root / "base", root / n if n else None, prompts[1])
                                             for n in names]
        # while the same adapter's request does reuse them
        again = llm.generate({"prompt_token_ids": prompts[1]}, GREEDY, use_tqdm=False, lora_request=loras[1])[0]
        assert again.num_cached_tokens >= 24 and again.outputs[0].token_ids == want[1]
    finally:
        llm.shutdown()


def test_compiled_model_keeps_each_adapters_tokens(llama_adapters, tmp_path, monkeypatch):
    """--compilation-level 1 with adapters: each adapted linear's deltas are one op in the graph (the step's plan
    read when it runs), so adapters and the base mixed in one batch, then the base alone, give PEFT's tokens
    from the same two graphs (one token, more), and nothing is traced again. The graphs are not saved: they
    name this engine's slots."""
    monkeypatch.setenv("RIVULET_CACHE_DIR", str(tmp_path))
    root = llama_adapters
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (9, 21, 14)]
    names = [*ADAPTERS][:2] + [None]
    want = [_peft_tokens(root / "base", root / n if n else None, p) for n, p in zip(names, prompts)]
    loras = [LoRARequest(n, i + 1, str(root / n)) if n else None for i, n in enumerate(names)]
    llm = LLM(str(root / "base"), dtype="float32", enable_lora=True, max_loras=2, max_num_batched_tokens=16,
              block_size=4, compilation_level=1)
    try:
        compiled = llm.engine.core.executor.runner.forward_fn
        assert _tokens(llm, prompts, loras) == want
        assert _tokens(llm, prompts[2:], [None]) == want[2:]
        assert compiled.compiled == {"one-token", "multi-token"} and compiled.fallbacks == 0
        assert compiled.cache_dir is None  # not saved: the graphs name this engine's slots
    finally:
        llm.shutdown()


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculative_decoding_keeps_each_adapters_tokens(llama_adapters, method):
    """Drafts verified under each request's adapter: n-gram lookups, or the base model as the draft model
    (its guesses are the base's, so adapters' requests reject some): PEFT's greedy tokens either way. (LoRA
    with speculative decoding was refused before.)"""
    root = llama_adapters
    g = torch.Generator().manual_seed(3)
    motif = torch.randint(0, 256, (5,), generator=g).tolist()
    prompts = [motif * 4 + torch.randint(0, 256, (n,), generator=g).tolist() for n in (3, 9, 1, 6)]
    names = [*ADAPTERS, None]
    loras = [LoRARequest(n, i + 1, str(root / n)) if n else None for i, n in enumerate(names)]
    spec = {"method": method, "num_speculative_tokens": 3, **({"prompt_lookup_min": 1, "prompt_lookup_max": 3}
                                                             if method == "ngram" else {"model": str(root / "base")})}
    llm = LLM(str(root / "base"), dtype="float32", enable_lora=True, max_loras=4, speculative_config=spec)
    try:
        got = _tokens(llm, prompts, loras)
        stats = llm.engine.core.spec_stats
    finally:
        llm.shutdown()
    assert got == [_peft_tokens(root / "base", root / n if n else None, p) for n, p in zip(names, prompts)]
    assert stats.num_draft_tokens > 0, stats  # drafts were verified
    if method == "draft_model":  # the base request takes its draft's guesses, the adapters' do not all
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats


@pytest.mark.skipif(not hasattr(load_cpu_ext(), "DecodeProgram"), reason="the decode program needs AVX512-VNNI")
def test_steps_without_adapters_run_the_decode_program(llama_adapters):
    """On a LoRA server, steps in which no row has an adapter take the CPU decode program (a LoRA server once
    ran every step layer by layer); steps with an adapter do not, and every output is what an engine without
    the program gives (int4 weights: the program's path)."""
    root = llama_adapters
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, 256, (n,), generator=g).tolist() for n in (9, 14)]
    kw = dict(dtype="float32", quantization="int4", block_size=4)

    def run(llm: LLM, loras) -> tuple[list[list[int]], list[int]]:
        runner = llm.engine.core.executor.runner
        calls: list[int] = []
        if runner.decode_program is not None:
            program_run = runner.decode_program.run

            def counted(input_ids, *args):
                out = program_run(input_ids, *args)
                calls.append(0 if out is None else input_ids.shape[0])
                return out

            runner.decode_program.run = counted
        return _tokens(llm, prompts, loras), calls

    lora = LoRARequest("attn", 1, str(root / "attn"))
    llm = LLM(str(root / "base"), enable_lora=True, **kw)
    base, base_calls = run(llm, [None, None])
    mixed, mixed_calls = run(llm, [None, lora])
    llm.shutdown()
    assert sum(c > 0 for c in base_calls) == GREEDY.max_tokens - 1  # every decode step of the base requests
    assert not any(mixed_calls)  # an adapter in every step: never the program
    plain = LLM(str(root / "base"), **kw)
    assert run(plain, [None, None])[0] == base
    plain.shutdown()
    eager = LLM(str(root / "base"), enable_lora=True, enforce_eager=True, **kw)
    assert run(eager, [None, lora])[0] == mixed
    eager.shutdown()


def test_more_adapters_than_slots_take_turns(llama_adapters):
    """One slot, three adapters and the base in one call: requests wait for the slot, adapters are
    evicted and reloaded, and every output is still its adapter's."""
    root = llama_adapters
    prompt = list(range(40, 60))
    names = [*ADAPTERS, None, "attn"]
    loras = [LoRARequest(n, list(ADAPTERS).index(n) + 1, str(root / n)) if n else None for n in names]
    llm = LLM(str(root / "base"), dtype="float32", enable_lora=True, max_loras=1)
    try:
        got = _tokens(llm, [prompt] * len(names), loras)
    finally:
        llm.shutdown()
    assert got == [_peft_tokens(root / "base", root / n if n else None, prompt) for n in names]


def test_tensor_parallel_adapter_equals_peft(llama_adapters):
    """Two ranks: column-parallel layers hold rows of B, row-parallel layers columns of A."""
    root = llama_adapters
    prompt = list(range(3, 23))
    loras = [LoRARequest(n, i + 1, str(root / n)) for i, n in enumerate(ADAPTERS)]
    llm = LLM(str(root / "base"), dtype="float32", enable_lora=True, max_loras=3, tensor_parallel_size=2)
    try:
        got = _tokens(llm, [prompt] * 3, loras)
    finally:
        llm.shutdown()
    assert got == [_peft_tokens(root / "base", root / n, prompt) for n in ADAPTERS]


def test_phi3_adapter_on_fused_projections(tmp_path):
    """A Phi-3 adapter targets the checkpoint's fused qkv_proj and gate_up_proj themselves."""
    _write_adapter(tmp_path / "base", "phi3", "fused", tmp_path, 7, r=4, lora_alpha=8,
                   target_modules=["qkv_proj", "gate_up_proj", "o_proj"])
    prompt = list(range(60, 85))
    llm = LLM(str(tmp_path / "base"), dtype="float32", enable_lora=True)
    try:
        got = _tokens(llm, [prompt, prompt], [LoRARequest("fused", 1, str(tmp_path / "fused")), None])
    finally:
        llm.shutdown()
    assert got == [_peft_tokens(tmp_path / "base", tmp_path / "fused", prompt),
                   _peft_tokens(tmp_path / "base", None, prompt)]


def test_bad_adapters_are_clear_errors(llama_adapters, tmp_path):
    root = llama_adapters
    base = LLM(str(root / "base"), dtype="float32")
    with pytest.raises(RivuletError, match="LoRA is off: start with --enable-lora"):
        base.generate([1, 2, 3], GREEDY, lora_request=LoRARequest("attn", 1, str(root / "attn")))
    base.shutdown()
    llm = LLM(str(root / "base"), dtype="float32", enable_lora=True, max_lora_rank=4)
    try:
        with pytest.raises(RivuletError, match="rank 8, more than --max-lora-rank 4"):
            llm.generate([1, 2, 3], GREEDY, lora_request=LoRARequest("mlp", 2, str(root / "mlp")))
        with pytest.raises(RivuletError, match="need adapter_config.json and adapter_model.safetensors"):
            llm.generate([1, 2, 3], GREEDY, lora_request=LoRARequest("none", 5, str(tmp_path)))
        dora = tmp_path / "dora"
        dora.mkdir()
        cfg = json.loads((root / "attn" / "adapter_config.json").read_text()) | {"use_dora": True}
        (dora / "adapter_config.json").write_text(json.dumps(cfg))
        (dora / "adapter_model.safetensors").write_bytes((root / "attn" / "adapter_model.safetensors").read_bytes())
        with pytest.raises(RivuletError, match="unsupported settings use_dora"):
            llm.generate([1, 2, 3], GREEDY, lora_request=LoRARequest("dora", 6, str(dora)))
        (dora / "adapter_config.json").write_text(json.dumps(cfg | {"use_dora": False,
                                                                    "rank_pattern": {"v_proj": 2, "gate_up_proj": 2}}))
        with pytest.raises(RivuletError, match=r"unsupported settings rank_pattern \(v_proj\)$"):
            llm.generate([1, 2, 3], GREEDY, lora_request=LoRARequest("ranks", 7, str(dora)))
        assert not llm.engine.has_unfinished_requests()  # nothing half-registered
    finally:
        llm.shutdown()


def _cpu_kernel():
    from rivulet.kernels.cpu.ops import AVAILABLE, add_lora

    if not AVAILABLE:
        pytest.skip("the C++ CPU kernels are not built on this machine")
    return add_lora


@pytest.mark.parametrize("fn", ["batched", "cpu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_ops_equal_the_reference(fn, dtype):
    """Three adapters (slots 2, 0, 3 of 4: gathered weights) with 4, 2 and 1 tokens (padding masked), base
    tokens between them; and one adapter taking the whole step. The reference is checked against a
    per-token loop first."""
    fn = add_lora_batched if fn == "batched" else _cpu_kernel()
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(4, 6, 40, generator=g).to(dtype), torch.randn(4, 6, 300, generator=g).to(dtype)  # b: B^T
    x, y = torch.randn(9, 40, generator=g).to(dtype), torch.randn(9, 300, generator=g).to(dtype)
    slots = [2, -1, 0, 2, 2, -1, 0, 3, 2]
    gather = torch.tensor([2, 6, 0, 0, 0, 3, 4, 8, 7, 0, 0, 0])  # slot 0's tokens, then 2's, then 3's, padded
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]], dtype=dtype)[..., None]
    plan = LoRAPlan(torch.tensor(slots), [0, 2, 3], torch.tensor([0, 2, 3]), gather, mask, 4)
    loop = y.float().clone()
    for i, s in enumerate(slots):
        if s >= 0:
            loop[i] += (a[s, :5].float() @ x[i].float()) @ b[s, :5].float()
    ref = add_lora_ref(y.clone(), x, a, b, plan, 5)
    tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=0.25)  # two bf16 roundings vs one
    torch.testing.assert_close(ref.float(), loop, **tol)
    torch.testing.assert_close(fn(y.clone(), x, a, b, plan, 5).float(), ref.float(), **tol)
    # a fused layer: 3 projections of 100 columns, rank 2 each, B^T block-diagonal; the layout lets a
    # kernel skip the zero blocks, and must not change the result (slot 3's rank 0: one whole projection)
    fused = b.clone()
    for i in range(3):
        fused[:3, 2 * i:2 * i + 2, :100 * i] = 0
        fused[:3, 2 * i:2 * i + 2, 100 * (i + 1):] = 0
    layout = ([0, 100, 200, 300], [2, 2, 2, 0])
    torch.testing.assert_close(fn(y.clone(), x, a, fused, plan, 6, layout).float(),
                               add_lora_ref(y.clone(), x, a, fused, plan, 6).float(), **tol)
    whole = LoRAPlan(torch.full((9,), 1), [1], torch.tensor([1]), None, None, 9)
    want = add_lora_ref(y.clone(), x, a, b, whole, 6)
    torch.testing.assert_close(want.float(), y.float() + (x.float() @ a[1].float().t()) @ b[1].float(), **tol)
    torch.testing.assert_close(fn(y.clone(), x, a, b, whole, 6).float(), want.float(), **tol)



@pytest.mark.parametrize("kind,targets", [
    ("deepseek-v2", ["q_proj", "kv_a_proj_with_mqa", "o_proj"]),
    ("deepseek-v3", ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj"]),
])
def test_deepseek_adapter_on_mla_projections(kind, targets, tmp_path):
    """DeepSeek adapters on MLA's input projections (the latent's and the query's, with or without the
    query bottleneck) and o_proj, mixed with the base in one batch; kv_b_proj, which the absorbed attention
    reads per head, is a clear error. (MLP targets would make PEFT adapt transformers' fused experts too,
    which Rivulet does not.)"""
    _write_adapter(tmp_path / "base", kind, "mla", tmp_path, 5, r=4, lora_alpha=8, target_modules=targets)
    _write_adapter(tmp_path / "base", kind, "kvb", tmp_path, 6, r=4, lora_alpha=8, target_modules=["kv_b_proj"])
    prompt = list(range(30, 55))
    llm = LLM(str(tmp_path / "base"), dtype="float32", enable_lora=True)
    try:
        got = _tokens(llm, [prompt, prompt], [LoRARequest("mla", 1, str(tmp_path / "mla")), None])
        with pytest.raises(RivuletError, match="kv_b_proj is applied per head in the absorbed attention"):
            llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False,
                         lora_request=LoRARequest("kvb", 2, str(tmp_path / "kvb")))
    finally:
        llm.shutdown()
    want = [_peft_tokens(tmp_path / "base", tmp_path / "mla", prompt), _peft_tokens(tmp_path / "base", None, prompt)]
    assert got == want and want[0] != want[1]
