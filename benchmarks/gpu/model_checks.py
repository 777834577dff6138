"""Section "model" of the GPU check: a Llama-3-8B-shaped bf16 model on Rivulet and transformers.

One config.json (no weights) in a temporary folder. Rivulet builds it with `load_format="dummy"`
through `LLM`; transformers builds `LlamaForCausalLM` from the same config with its own random
initialisation on the GPU, and those weights are copied into Rivulet's model, so both systems
run the same weights. Then, each step guarded on its own:

- logits of one prompt, Rivulet vs transformers (the port is right at full size);
- batch-1 decode through the model runner, eager vs CUDA graphs (same greedy tokens?), tok/s
  against the bandwidth bound (bytes read per token / measured copy bandwidth, in the report);
- where a decode step's time goes at batch 1 and at the throughput run's batch: wall vs device ms
  per step (the difference is host time) and the kernels that take most device time;
- batch-1 `LLM.generate`, eager vs graphs, and graphs with the synchronous loop (what async scheduling
  gains); the throughput run also with the synchronous loop; offline throughput N x in/out; transformers' `generate`
  on the same prompts; a long run (e.g. 1000/1000) when the time budget allows;
- structured output (when xgrammar is importable): the same shape with a word-level tokenizer over the
  whole vocabulary, JSON-schema requests against free ones, asynchronous scheduling (the grammar mask
  filled while the step before runs) and synchronous (filled beside the forward, or before it); every
  constrained answer must parse and hold the schema's keys.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

from common import Deadline, PartWriter, error_text, free_memory, sync

LLAMA3_8B: dict[str, Any] = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, hidden_size=4096,
    intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
    max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False,
    hidden_act="silu", bos_token_id=128000, eos_token_id=128001)

TINY_LLAMA: dict[str, Any] = dict(
    LLAMA3_8B, vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=512, bos_token_id=1, eos_token_id=2)


# the structured step's schema: a record of a few typed fields
SCHEMA: dict[str, Any] = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24}, "count": {"type": "integer", "minimum": 0, "maximum": 999},
    "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 4}, "ok": {"type": "boolean"}},
    "required": ["name", "count", "tags", "ok"], "additionalProperties": False}


def write_word_tokenizer(folder: Path, vocab_size: int, bos: int, eos: int) -> None:
    """A word-level tokenizer with one token per id of the model's vocabulary (so every sampled id decodes):
    printable ASCII but the space, some JSON pieces, then filler words; `bos`/`eos` are its special tokens.
    No token holds whitespace, so a constrained answer cannot pad itself with blanks until max_tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    pieces = [chr(c) for c in range(33, 127)] + ['{"', '":', '","', '"}', 'true', 'false', 'null',
                                                  'red', 'green', 'blue', 'name', 'count', 'tags', 'ok', '<unk>']
    words = dict.fromkeys(pieces)
    filler = (f"w{i}" for i in range(vocab_size))
    vocab: dict[str, int] = {}
    for i in range(vocab_size):
        word = "<|begin|>" if i == bos else "<|end|>" if i == eos else next(iter(words), None)
        if word is None or word in vocab:
            word = next(w for w in filler if w not in vocab)
        words.pop(word, None)
        vocab[word] = i
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin|>", eos_token="<|end|>", unk_token="<unk>")
    fast.save_pretrained(str(folder))


def model_failures(data: dict[str, Any]) -> list[str]:
    """What in a model section's results must fail it: a step that errored, logits that do not match
    transformers, CUDA-graph tokens that differ from eager ones (skipped steps are not failures)."""
    bad = [f"{k}: {v.get('error', 'error')[:80]}" for k, v in data.items()
           if isinstance(v, dict) and v.get("status") == "error"]
    if data.get("logits_vs_hf", {}).get("passed") is False:
        bad.append(f"logits_vs_hf: min cosine {data['logits_vs_hf'].get('min_cosine')}")
    if data.get("decode_b1", {}).get("graph_tokens_equal_eager") is False:
        bad.append("decode_b1: CUDA-graph tokens differ from eager ones")
    done = [m.get("finished", 0) for r in ("async", "sync") for m in data.get("structured", {}).get(r, {}).values()
            if isinstance(m, dict) and "finished" in m]
    if done and not all(done):
        bad.append(f"structured: a mode where no constrained answer finished ({done})")
    if data.get("structured", {}).get("invalid"):
        bad.append(f"structured: finished constrained answers that do not parse: {data['structured']['invalid']}")
    return bad


def _step(out: PartWriter, name: str, deadline: Deadline, need_s: float, fn: Callable[[], dict[str, Any]]) -> bool:
    """Run one guarded step; its dict (or its error) goes to the results under `name`."""
    if not deadline.fits(need_s):
        reason = f"time budget: {deadline.left():.0f}s left, needs ~{need_s:.0f}s"
        out.set(name, {"status": "skipped", "reason": reason})
        return False
    t0 = time.time()
    try:
        result = fn()
        out.set(name, {"status": "ok", "elapsed_s": round(time.time() - t0, 2), **result})
        return True
    except Exception as e:  # noqa: BLE001 - one failing step must not lose the others
        out.set(name, {"status": "error", "elapsed_s": round(time.time() - t0, 2), "error": error_text(e)})
    # what the failed step built (an engine that ran out of memory half-way) is held by the traceback's frames,
    # a reference cycle: collected here, or the next steps run short of memory (the H100 run, 2026-12-05)
    free_memory(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    return False


def build_hf(cfg: dict[str, Any], device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """transformers' LlamaForCausalLM of `cfg`, randomly initialised directly on `device`."""
    import transformers

    hf_cfg = transformers.LlamaConfig(**cfg)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = transformers.LlamaForCausalLM(hf_cfg)
    finally:
        torch.set_default_dtype(old)
    model.generation_config.eos_token_id = None
    return model.eval()


def _runner(llm: Any) -> Any:
    """The in-process ModelRunner behind an `LLM` (single-rank executor)."""
    return llm.engine.core.executor.runner


def decode_with_runner(runner: Any, prompt: list[int], steps: int, device: torch.device) -> tuple[float, list[int]]:
    """Greedy batch-1 decode straight through the model runner: (tokens/s over `steps`, tokens)."""
    from rivulet.worker.batch import SeqChunk

    bs = runner.cache_config.block_size
    blocks = list(range(1, -(-(len(prompt) + steps + 1) // bs) + 1))
    tok = int(runner.forward([SeqChunk(prompt, 0, blocks)])[0].argmax())
    tokens = [tok]
    sync(device)
    t0 = time.perf_counter()
    for i in range(steps):
        tok = int(runner.forward([SeqChunk([tok], len(prompt) + i, blocks)])[0].argmax())
        tokens.append(tok)
    return steps / (time.perf_counter() - t0), tokens


def profile_decode(runner: Any, batch: int, context: int, steps: int, device: torch.device) -> dict[str, Any]:
    """Where a decode step of `batch` sequences at `context` tokens goes, through the model runner (graphs
    when captured): wall ms per step, the device's ms per step between events around each forward (the
    rest of the wall time is the host's: inputs, launches, the sync), and the kernels that take most
    device time (torch.profiler). The KV cache holds whatever is there: the cost, not the tokens, counts."""
    from torch.profiler import ProfilerActivity, profile

    from rivulet.worker.batch import SeqChunk

    bs = runner.cache_config.block_size
    nb = -(-(context + steps + 1) // bs)
    chunks = lambda i: [SeqChunk([100 + s], context + i, list(range(1 + s * nb, 1 + (s + 1) * nb)))  # noqa: E731
                        for s in range(batch)]
    for i in range(2):  # warm-up (a bucket's first replay, the allocator)
        runner.forward(chunks(i))
    sync(device)
    cuda = device.type == "cuda"
    device_s = 0.0
    t0 = time.perf_counter()
    for i in range(steps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        runner.forward(chunks(i)).argmax(-1).tolist()  # the sampled ids reach the host, as in a step
        if cuda:
            end.record()
            end.synchronize()
            device_s += start.elapsed_time(end) / 1e3
    wall_s = time.perf_counter() - t0
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        for i in range(min(steps, 8)):
            runner.forward(chunks(i)).argmax(-1).tolist()
    n = min(steps, 8)
    timed = [(e.key, (e.self_device_time_total if cuda else e.self_cpu_time_total) / 1e3 / n, e.count // n)
             for e in prof.key_averages()]
    timed = sorted((t for t in timed if t[1] > 0), key=lambda t: -t[1])
    busy = sum(t[1] for t in timed) if cuda else None
    return {"batch": batch, "context": context, "steps": steps, "graphs": runner.cuda_graphs is not None,
            "wall_ms_per_step": 1e3 * wall_s / steps, "device_ms_per_step": 1e3 * device_s / steps if cuda else None,
            "kernel_ms_per_step": busy, "top": [{"name": k[:120], "ms_per_step": ms, "calls_per_step": c}
                                                for k, ms, c in timed[:12]]}


def profile_generate(llm: Any, prompt: list[int], output_len: int, device: torch.device) -> dict[str, Any]:
    """The engine's own batch-1 decode (`LLM.generate`, async scheduling where it is on): wall ms per output
    token against the kernels' device ms per token (torch.profiler, the prompt's step included); the rest is
    the host's (scheduling, inputs, launches, waits), which async scheduling is there to hide."""
    from torch.profiler import ProfilerActivity, profile

    from rivulet import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    prompts = [{"prompt_token_ids": prompt}]
    llm.generate(prompts, sp, use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    llm.generate(prompts, sp, use_tqdm=False)
    wall = time.perf_counter() - t0
    cuda = device.type == "cuda"
    kernels = None
    if cuda:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            llm.generate(prompts, sp, use_tqdm=False)
        kernels = sum(e.self_device_time_total for e in prof.key_averages()) / 1e3 / output_len
    return {"output_len": output_len, "async_scheduling": llm.engine.core.async_scheduling,
            "wall_ms_per_token": 1e3 * wall / output_len, "kernel_ms_per_token": kernels}


def _without_async(llm: Any, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """`fn` run with the synchronous loop (each step's tokens on the host before the next is scheduled), to
    measure what async scheduling and its async outputs gain; the engine's mode is restored after."""
    core = llm.engine.core
    was = core.async_scheduling
    core.async_scheduling = False
    core.executor.use_async_outputs(False)
    try:
        return fn()
    finally:
        core.async_scheduling = was
        core.executor.use_async_outputs(was)


def _generate(llm: Any, prompts: list[list[int]], output_len: int) -> dict[str, Any]:
    from rivulet import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    n_in = sum(len(p) for p in prompts)
    return {"requests": len(prompts), "input_len": len(prompts[0]), "output_len": output_len, "elapsed_s": elapsed,
            "output_tokens": n_out, "output_tok_s": n_out / elapsed, "total_tok_s": (n_in + n_out) / elapsed}


def _hf_generate(hf: Any, prompts: list[list[int]], output_len: int, device: torch.device) -> dict[str, Any]:
    ids = torch.tensor(prompts, device=device)
    kw = dict(do_sample=False, pad_token_id=0, max_new_tokens=output_len, min_new_tokens=output_len)
    with torch.inference_mode():
        hf.generate(ids[:1, :8], attention_mask=torch.ones_like(ids[:1, :8]), **(kw | {"max_new_tokens": 2,
                                                                                        "min_new_tokens": 2}))
        sync(device)
        t0 = time.perf_counter()
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), **kw)
        sync(device)
    elapsed = time.perf_counter() - t0
    n_out = int((out.shape[1] - ids.shape[1]) * ids.shape[0])
    return {"requests": len(prompts), "input_len": len(prompts[0]), "output_len": output_len, "elapsed_s": elapsed,
            "output_tokens": n_out, "output_tok_s": n_out / elapsed,
            "total_tok_s": (n_out + ids.numel()) / elapsed}


def _holds(text: str) -> bool:
    """Whether a constrained answer parses as JSON with every key SCHEMA requires."""
    try:
        obj = json.loads(text)
    except ValueError:
        return False
    return isinstance(obj, dict) and set(SCHEMA["required"]) <= set(obj)


def run_model(out: PartWriter, cfg: dict[str, Any], args: Any, device: torch.device, dtype: torch.dtype,
              deadline: Deadline) -> None:
    from rivulet import LLM, SamplingParams

    folder = Path(tempfile.mkdtemp(prefix="rivulet_gpu_check_"))
    (folder / "config.json").write_text(json.dumps(cfg))
    out.set("config", {k: cfg[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                           "num_key_value_heads", "intermediate_size", "vocab_size")})
    gen = torch.Generator().manual_seed(0)

    def prompts(n: int, length: int) -> list[list[int]]:
        return torch.randint(100, cfg["vocab_size"] - 100, (n, length), generator=gen).tolist()

    state: dict[str, Any] = {}
    long_len = args.long_input_len + args.long_output_len if args.long_requests else 0
    max_len = max(args.input_len + args.output_len, long_len) + 16

    def hf_build() -> dict[str, Any]:
        state["hf"] = build_hf(cfg, device, dtype)
        return {"params": sum(p.numel() for p in state["hf"].parameters())}

    def rivulet_build() -> dict[str, Any]:
        kv = int(args.kv_cache_gib * (1 << 30))
        if device.type == "cuda":  # an 80 GB card: room left for transformers' batch, the graphs and, once
            # transformers' copy is gone, the structured and speculative sections' second engine (weights + 4 GiB KV)
            hf_bytes = sum(p.numel() * p.element_size() for p in state["hf"].parameters()) if "hf" in state else 0
            kv = max(min(kv, torch.cuda.mem_get_info()[0] - hf_bytes - (14 << 30)), 1 << 30)
        llm = state["llm"] = LLM(str(folder), dtype=str(dtype).removeprefix("torch."), load_format="dummy",
                                 max_model_len=max_len, max_num_seqs=max(args.num_prompts, args.long_requests),
                                 max_num_batched_tokens=args.max_batched_tokens,
                                 kv_cache_memory=kv, enable_prefix_caching=False)
        runner = _runner(llm)
        params = dict(runner.model.named_parameters())
        weight_bytes = sum(p.numel() * p.element_size() for p in params.values())
        embed = params.get("model.embed_tokens.weight")
        read_per_token = weight_bytes - (embed.numel() * embed.element_size() if embed is not None and
                                         not cfg.get("tie_word_embeddings") else 0)
        graphs = runner.cuda_graphs
        return {"weight_bytes": weight_bytes, "weight_bytes_read_per_token": read_per_token,
                "num_kv_blocks": llm.engine.core.num_blocks, "cuda_graphs": graphs is not None,
                "cuda_graph_error": getattr(runner, "cuda_graph_error", None),
                "graph_buckets": list(graphs.buckets) if graphs is not None else [],
                "graph_capture_s": graphs.capture_s if graphs is not None else None}

    def copy_weights() -> dict[str, Any]:
        loaded = _runner(state["llm"]).model.load_weights(state["hf"].state_dict().items())
        return {"loaded_tensors": len(loaded)}

    def logits_vs_hf() -> dict[str, Any]:
        from rivulet.worker.batch import SeqChunk

        runner, hf = _runner(state["llm"]), state["hf"]
        p = prompts(1, 32)[0]
        with torch.inference_mode():
            ours = runner.forward([SeqChunk(p, 0, [1, 2])], all_logits=True).float()
            theirs = hf(torch.tensor([p], device=device)).logits[0].float()
        cos = torch.nn.functional.cosine_similarity(ours, theirs, dim=-1)
        return {"max_abs_diff": float((ours - theirs).abs().max()), "max_abs_logit": float(theirs.abs().max()),
                "top1_agreement": float((ours.argmax(-1) == theirs.argmax(-1)).float().mean()),
                "min_cosine": float(cos.min()), "passed": bool(cos.min() > 0.99)}

    def decode_b1() -> dict[str, Any]:
        runner = _runner(state["llm"])
        prompt = prompts(1, args.input_len)[0]
        graphs = runner.cuda_graphs
        res: dict[str, Any] = {"prompt_len": args.input_len, "steps": args.decode_steps}
        runner.cuda_graphs = None
        try:
            res["eager_tok_s"], eager_tokens = decode_with_runner(runner, prompt, args.decode_steps, device)
        finally:
            runner.cuda_graphs = graphs
        if graphs is not None:
            res["graphs_tok_s"], graph_tokens = decode_with_runner(runner, prompt, args.decode_steps, device)
            res["graph_tokens_equal_eager"] = graph_tokens == eager_tokens
        state["b1"] = (prompt, eager_tokens)  # the compiled step decodes the same prompt
        kv_per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * cfg["head_dim"] * dtype.itemsize
        read = out.data.get("rivulet_build", {}).get("weight_bytes_read_per_token", 0)
        res["bytes_per_step"] = read + kv_per_token * (args.input_len + args.decode_steps // 2)
        return res

    def decode_profile() -> dict[str, Any]:
        runner = _runner(state["llm"])
        ctx, steps = args.input_len, max(args.decode_steps // 4, 4)
        free_blocks = state["llm"].engine.core.num_blocks - 1
        wide = min(args.num_prompts, free_blocks // -(-(ctx + steps + 1) // runner.cache_config.block_size))
        res: dict[str, Any] = {f"b{b}": profile_decode(runner, b, ctx, steps, device) for b in sorted({1, wide})
                               if b >= 1}
        res["engine_b1"] = profile_generate(state["llm"], prompts(1, ctx)[0], max(args.output_len // 2, 4), device)
        return res

    def generate_b1() -> dict[str, Any]:
        llm = state["llm"]
        runner = _runner(llm)
        p = prompts(1, args.input_len)
        _generate(llm, p, 4)  # warm-up
        graphs = runner.cuda_graphs
        runner.cuda_graphs = None
        try:
            eager = _generate(llm, p, args.output_len)
        finally:
            runner.cuda_graphs = graphs
        res = {"eager": eager}
        if graphs is not None:
            res["graphs"] = _generate(llm, p, args.output_len)
            res["graphs_sync"] = _without_async(llm, lambda: _generate(llm, p, args.output_len))
        return res

    def throughput() -> dict[str, Any]:
        state["short_prompts"] = prompts(args.num_prompts, args.input_len)
        _generate(state["llm"], state["short_prompts"][:2], 2)  # warm-up
        return _generate(state["llm"], state["short_prompts"], args.output_len)

    def throughput_sync() -> dict[str, Any]:
        return _without_async(state["llm"], lambda: _generate(state["llm"], state["short_prompts"], args.output_len))

    def hf_throughput() -> dict[str, Any]:
        hf = state["hf"]
        batch = _hf_generate(hf, state.get("short_prompts") or prompts(args.num_prompts, args.input_len),
                             args.output_len, device)
        single = _hf_generate(hf, prompts(1, args.input_len), args.output_len, device)
        return {"batch": batch, "b1": single}

    def structured() -> dict[str, Any]:
        import importlib.util

        if importlib.util.find_spec("xgrammar") is None:
            raise RuntimeError("xgrammar is not installed")
        from rivulet import LLM, SamplingParams
        from rivulet.sampling_params import StructuredOutputsParams

        sfolder = Path(tempfile.mkdtemp(prefix="rivulet_gpu_check_structured_"))
        (sfolder / "config.json").write_text(json.dumps(cfg))
        write_word_tokenizer(sfolder, cfg["vocab_size"], cfg["bos_token_id"], cfg["eos_token_id"])
        n = min(args.num_prompts, 64)
        ps = [{"prompt_token_ids": p} for p in prompts(n, args.input_len)]
        constrained = SamplingParams(temperature=0, max_tokens=max(args.output_len, 160),
                                     structured_outputs=StructuredOutputsParams(json=SCHEMA))
        free = SamplingParams(temperature=0, max_tokens=constrained.max_tokens, ignore_eos=True)
        res: dict[str, Any] = {"requests": n, "input_len": args.input_len, "max_tokens": constrained.max_tokens}
        for scheduling in ("async", "sync"):
            t0 = time.perf_counter()
            llm = LLM(str(sfolder), dtype=str(dtype).removeprefix("torch."), load_format="dummy",
                      max_model_len=args.input_len + constrained.max_tokens + 16, max_num_seqs=n,
                      kv_cache_memory=int(min(args.kv_cache_gib, 4) * (1 << 30)), enable_prefix_caching=False,
                      async_scheduling=scheduling == "async")
            core = llm.engine.core
            row: dict[str, Any] = {"build_s": round(time.perf_counter() - t0, 2),
                                   "overlap_grammar_default": core.overlap_grammar}
            llm.generate(ps[:2], constrained, use_tqdm=False)  # grammar compiled, graphs warm
            modes = ["constrained", "free"] if scheduling == "async" else ["overlap", "inline", "free"]
            for mode in modes:
                core.overlap_grammar = mode != "inline"
                t0 = time.perf_counter()
                outs = llm.generate(ps, free if mode == "free" else constrained, use_tqdm=False)
                elapsed = time.perf_counter() - t0
                lens = [len(o.outputs[0].token_ids) for o in outs]
                row[mode] = {"output_tokens": sum(lens), "steps": max(lens), "elapsed_s": round(elapsed, 3),
                             "ms_per_step": round(elapsed / max(lens) * 1000, 3)}  # a step per longest answer's token
                if mode != "free":  # an answer cut at max_tokens (whitespace is free in JSON) is not judged
                    done = [o.outputs[0] for o in outs if o.outputs[0].finish_reason == "stop"]
                    bad = [c.text[:80] for c in done if not _holds(c.text)]
                    row[mode].update(finished=len(done), valid=len(done) - len(bad))
                    if bad:
                        res.setdefault("invalid", {})[f"{scheduling}/{mode}"] = bad[:3]
                    row[mode]["example"] = outs[0].outputs[0].text[:160]
            res[scheduling] = row
            llm.shutdown()
            free_memory(device)
        return res

    def spec_decode() -> dict[str, Any]:
        """Plain decoding against speculative decoding on this shape, dummy weights: prompt lookup (ngram, k 4)
        and a draft model of the same family (this config with 1/8 of its layers, k 3), at one stream and at 64
        (where `disable_by_batch_size` 8 turns both off). Dummy weights make no language: what is accepted comes
        from the loops greedy decoding falls into, so the rows give the verify steps' cost and the speed at the
        acceptance they report, not what a trained pair would reach."""
        dfolder = Path(tempfile.mkdtemp(prefix="rivulet_gpu_check_draft_"))
        draft_layers = max(1, cfg["num_hidden_layers"] // 8)
        (dfolder / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": draft_layers}))
        specs: dict[str, dict[str, Any] | None] = {
            "plain": None,
            "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4,
                      "disable_by_batch_size": 8},
            "draft": {"method": "draft_model", "model": str(dfolder), "num_speculative_tokens": 3,
                      "disable_by_batch_size": 8}}
        one, many = prompts(1, args.input_len), prompts(min(64, args.num_prompts), args.input_len)
        res: dict[str, Any] = {"draft_layers": draft_layers, "streams": len(many)}
        tokens: dict[str, list[int]] = {}
        for name, spec in specs.items():
            t0 = time.perf_counter()
            llm = LLM(str(folder), dtype=str(dtype).removeprefix("torch."), load_format="dummy",
                      max_model_len=args.input_len + args.output_len + 16, max_num_seqs=len(many),
                      kv_cache_memory=int(min(args.kv_cache_gib, 4) * (1 << 30)), enable_prefix_caching=False,
                      speculative_config=spec)
            row: dict[str, Any] = {"build_s": round(time.perf_counter() - t0, 2)}
            graphs = _runner(llm).cuda_graphs
            row["graph_query_lens"] = sorted(graphs.sets) if graphs is not None else []
            _generate(llm, one, 4)  # warm-up
            stats = llm.engine.core.spec_stats
            before = (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens)
            sp = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
            t0 = time.perf_counter()
            out1 = llm.generate([{"prompt_token_ids": one[0]}], sp, use_tqdm=False)[0].outputs[0].token_ids
            row["b1"] = {"output_tok_s": len(out1) / (time.perf_counter() - t0), "output_tokens": len(out1)}
            drafts, proposed, accepted = (a - b for a, b in zip(
                (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens), before))
            row["b1"].update(drafts=drafts, acceptance_rate=accepted / proposed if proposed else None,
                             tokens_per_verify=1 + accepted / drafts if drafts else None)
            tokens[name] = list(out1)
            row["many"] = _generate(llm, many, args.output_len)
            res[name] = row
            llm.shutdown()
            free_memory(device)
        for name in ("ngram", "draft"):
            res[name]["speedup_b1"] = res[name]["b1"]["output_tok_s"] / res["plain"]["b1"]["output_tok_s"]
            res[name]["speedup_many"] = res[name]["many"]["output_tok_s"] / res["plain"]["many"]["output_tok_s"]
            res[name]["tokens_equal_plain"] = tokens[name] == tokens["plain"]
        return res

    def throughput_long() -> dict[str, Any]:
        p = prompts(args.long_requests, args.long_input_len)
        return _generate(state["llm"], p, args.long_output_len)

    def compiled() -> dict[str, Any]:
        """--compilation-level 2 on the same engine: compile both graphs (one token, more) at the warm-ups of a
        new CUDA-graph capture over the compiled forward (compiled pieces + CUDA graphs), then decode_b1's
        prompt and the throughput run again. Compare with decode_b1.graphs_tok_s and throughput."""
        from rivulet.compilation import CompiledForward

        llm = state["llm"]
        runner = _runner(llm)
        t0 = time.perf_counter()
        runner.forward_fn = fn = CompiledForward(runner.model, passes=("rope_kv_write",))
        if device.type == "cuda":
            runner.cuda_graphs = None  # the eager graphs' pool goes before the compiled ones are captured
            free_memory(device)
            runner._capture_cuda_graphs()
        else:  # the dry run: the compiled forward itself compiles at its first step
            prompt = state.get("b1", (prompts(1, 8)[0],))[0]
            decode_with_runner(runner, prompt, 2, device)
        res: dict[str, Any] = {"compile_and_capture_s": round(time.perf_counter() - t0, 2),
                               "compiled": sorted(fn.compiled), "loaded": sorted(fn.loaded), "fusions": fn.fusions,
                               "cuda_graphs": runner.cuda_graphs is not None,
                               "cuda_graph_error": runner.cuda_graph_error}
        if "b1" in state:
            prompt, eager_tokens = state["b1"]
            res["graphs_tok_s"], tokens = decode_with_runner(runner, prompt, args.decode_steps, device)
            res["tokens_equal_eager"] = tokens == eager_tokens  # bf16: inductor's glue may round differently
        if "short_prompts" in state:
            res["throughput"] = _generate(llm, state["short_prompts"], args.output_len)
        res["fallbacks"] = fn.fallbacks
        return res

    _step(out, "hf_build", deadline, 30, hf_build)
    if not _step(out, "rivulet_build", deadline, 60, rivulet_build):
        return
    if "hf" in state:
        _step(out, "copy_weights", deadline, 10, copy_weights)
        _step(out, "logits_vs_hf", deadline, 10, logits_vs_hf)
    _step(out, "decode_b1", deadline, 20, decode_b1)
    _step(out, "decode_profile", deadline, 20, decode_profile)
    _step(out, "generate_b1", deadline, 30, generate_b1)
    _step(out, "throughput", deadline, 30, throughput)
    if out.data.get("throughput", {}).get("status") == "ok":
        _step(out, "throughput_sync", deadline, 30, throughput_sync)
    if "hf" in state:
        _step(out, "hf_generate", deadline, 40, hf_throughput)
        del state["hf"]  # its memory goes to the long run's KV cache
        free_memory(device)
        if device.type == "cuda":  # the H100 run (2026-12-05) ran out of memory after this: was it freed?
            out.set("allocated_gib_after_hf", round(torch.cuda.memory_allocated() / 2**30, 2))
    _step(out, "structured", deadline, 60, structured)
    _step(out, "spec_decode", deadline, 90, spec_decode)
    if args.long_requests:
        short = out.data.get("throughput", {})
        est = 60.0
        if short.get("status") == "ok":  # scale by tokens, x2 for the longer contexts
            est = 2 * short["elapsed_s"] * (args.long_requests * (args.long_input_len + args.long_output_len)) / \
                (args.num_prompts * (args.input_len + args.output_len))
        _step(out, "throughput_long", deadline, est + 10, throughput_long)
    if "llm" in state:  # compiling on CUDA: last, its compile time is unknown
        _step(out, "compiled", deadline, 120, compiled)
    llm = state.pop("llm", None)
    if llm is not None:
        llm.shutdown()
