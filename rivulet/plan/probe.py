"""`rivulet plan --probe`: measure this machine as a planning device (`this-cpu`), in a few seconds.

What a step runs is what is timed: Rivulet's own bf16 linear kernel (the packed weights it serves with) on a
decode-shaped input, whose weight streaming gives the bandwidth a decode step sees (and 48 layer-sized weights
one after another, what each GEMM call costs beyond its bytes; the same at more rows up to a prefill
chunk, the FLOP rate reached at each batch size, `gemm_tflops`); plus the fixed time of
engine steps of tiny models of 1 and 9 layers, which is what a step, and each layer, cost beyond their
arithmetic (host work, sampling, op launches and small ops), and what two pipeline stages or two
tensor-parallel ranks add to them (per step, and per hop of a collective: `link_latency_us`), and the
bandwidth of an all-reduce between two processes (`link_gbps`); and the FLOP rate the attention kernels
reach on a decode batch and on a prefill chunk (`attn_decode_tflops`, `attn_prefill_tflops`); the bandwidth of the
element-wise kernels on activations (`act_gbps`) and what a MoE layer spends per expert it routes to beyond the
expert's GEMMs (`expert_us`). The efficiencies are 1: these are reached, not peak, figures.

This file times the kernels; `probe_engine.py` the engine steps and the two-rank figures; `timing.py` holds
the timing loop both use.
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable

from rivulet.plan.cluster import Device, probe_path
from rivulet.plan.probe_engine import _moe_layer_ms, _stage_overhead_ms, _step_overhead_ms, _tp_overheads, _two_ranks
from rivulet.plan.timing import BUSY_WAIT_S, Lockstep, typical

GEMM_ROWS = (1, 4, 16, 64, 256)  # rows of the timed GEMMs: decode batches to prefill chunks


def probe(write: bool = True) -> Device:
    """Measure this machine as a device of `torch.get_num_threads()` cores (all it may use, or a slice of them when a
    cluster counts its cores as several devices) and, when that is a slice, also with every slice busy at once."""
    import torch

    from rivulet.platforms import current_platform

    torch.manual_seed(0)
    threads = torch.get_num_threads()
    alone = _kernel_figures()
    busy = _all_busy(threads)
    step, layer, seq = _step_overhead_ms()
    slices = max(1, len(_allowed_cores()) // threads)
    memory = current_platform().free_memory_bytes() / 1e9 / slices  # the slices share the host's memory
    latency_us, tp_ms = _tp_overheads()
    gbps, ep_rest = _two_ranks()
    call_s, expert_rest = alone["gemm_call_us"] * 1e-6, alone["expert_us"]
    expert = max(0.0, expert_rest)  # beyond the GEMMs as timed, their calls' fixed cost in it (the planner's too)
    # beyond what the planner counts for a MoE layer over a dense one: a router and 2 x 2 expert GEMM calls for
    # the MLP's 2, and the two experts hit
    moe_layer = max(0.0, _moe_layer_ms() * 1e3 - 3 * call_s * 1e6 - 2 * expert)
    # EP's bookkeeping at 32 and 128 tokens (16 and 64 rows a rank, top 2 over two ranks): a part per row, the rest
    # per layer once the experts' own share (counted per expert hit) is out
    (r32, hits32), (r128, _) = ep_rest[32], ep_rest[128]
    ep_row = max(0.0, (r128 - r32) / (64 - 16))
    ep_layer = max(0.0, r32 - hits32 * expert_rest - 16 * ep_row)
    dev = Device("this-cpu", round(memory, 2), **_rounded(alone), fp8_tflops=None, mem_efficiency=1.0,
                 compute_efficiency=1.0, step_overhead_ms=round(step, 3), layer_overhead_ms=round(layer, 4),
                 seq_overhead_ms=round(seq, 4), stage_overhead_ms=round(_stage_overhead_ms(), 3),
                 tp_overhead_ms=round(tp_ms, 3), link_latency_us=round(latency_us, 1), link_gbps=round(gbps, 3),
                 moe_layer_us=round(moe_layer, 2), ep_layer_us=round(ep_layer, 2), ep_row_us=round(ep_row, 3),
                 busy=_rounded(busy) if busy else None)
    if write:
        path = probe_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(dev.__dict__, indent=2) + "\n")
    return dev


def _rounded(figures: dict[str, Any]) -> dict[str, Any]:
    """`_kernel_figures` as Device fields (the expert's rest clamped at 0)."""
    return {"mem_bw_gbps": round(figures["mem_bw_gbps"], 2), "bf16_tflops": max(figures["gemm_tflops"].values()),
            "gemm_call_us": round(figures["gemm_call_us"], 2), "gemm_tflops": figures["gemm_tflops"],
            "gemm_call_us_rows": figures["gemm_call_us_rows"],
            "attn_decode_tflops": round(figures["attn_decode_tflops"], 4),
            "attn_prefill_tflops": round(figures["attn_prefill_tflops"], 4), "act_gbps": round(figures["act_gbps"], 2),
            "expert_us": round(max(0.0, figures["expert_us"]), 2)}


def _kernel_figures(pace: Lockstep | None = None) -> dict[str, Any]:
    """What the kernels reach on this process's cores: weight streaming (GB/s), a GEMM call's fixed cost (µs), the
    FLOP rate by rows, attention, the element-wise kernels, a routed expert's rest (µs, unclamped). `pace`: timed
    with every slice of the cores busy (`_all_busy`)."""
    import torch

    from rivulet.kernels.ops import get_op

    dtype = torch.bfloat16
    k, n = 4096, 16384  # a 128 MiB bf16 weight: well past the caches
    weight = torch.randn(n, k, dtype=dtype) * 0.02
    pack = get_op("pack_linear_weight")
    packed = pack(weight)
    linear = get_op("packed_linear")

    def mm(x: torch.Tensor) -> Callable[[], object]:
        return (lambda: linear(x, packed, None)) if packed is not None else (lambda: torch.nn.functional.linear(x, weight))

    # 48 layer-sized weights (4 MiB each) streamed one call after another, and the same bytes in 12 calls (16 MiB
    # each): what each call costs beyond its bytes, whatever the bandwidth of the moment
    def weights(n_out: int, count: int) -> list[torch.Tensor]:
        return [pack(w) if packed is not None else w
                for w in (torch.randn(n_out, 1024, dtype=dtype) * 0.02 for _ in range(count))]
    small, large = weights(2048, 48), weights(8192, 12)

    def stream(x: torch.Tensor, ws: list[torch.Tensor] = small) -> Callable[[], None]:
        def run() -> None:
            for w in ws:
                linear(x, w, None) if packed is not None else torch.nn.functional.linear(x, w)
        return run

    with torch.inference_mode():
        decode = typical(mm(torch.randn(1, k, dtype=dtype)), 20, pace)
        # by rows: the call cost (48 calls against the same FLOPs in 12) and the FLOP rate without it (the planner
        # adds it per call); with several threads a call of a few rows pays their split and join (~20 µs here)
        calls, curve = {}, {}
        for rows in GEMM_ROWS:
            x = torch.randn(rows, 1024, dtype=dtype)
            t12 = typical(stream(x, large), 7 if rows <= 16 else 3, pace)
            calls[rows] = max(0.0, (typical(stream(x), 7 if rows <= 16 else 3, pace) - t12) / (48 - 12))
            curve[rows] = round(2 * rows * 48 * 1024 * 2048 / max(1e-9, t12 - 12 * calls[rows]) / 1e12, 4)
        attn_decode, attn_prefill = _attention_tflops(pace)
        act = _activation_gbps(pace)
        expert_rest = _expert_us(pace)
    return {"mem_bw_gbps": k * n * 2 / decode / 1e9, "gemm_call_us": calls[1] * 1e6, "gemm_tflops": curve,
            "gemm_call_us_rows": {rows: round(c * 1e6, 2) for rows, c in calls.items()},
            "attn_decode_tflops": attn_decode, "attn_prefill_tflops": attn_prefill, "act_gbps": act,
            "expert_us": expert_rest}



def _allowed_cores() -> list[int]:
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def _all_busy(threads: int) -> dict[str, Any] | None:
    """`_kernel_figures` of a device of `threads` cores while every other slice of this machine's cores runs the
    same timings at the same moment (a process each, bound to its slice, as Rivulet binds its ranks): the memory
    bus and the last-level cache are shared, so a tensor-parallel group's ranks, which run together, each stream
    weights slower than one rank alone (here 25 against 39-45 GB/s a core). None when the device is the whole
    machine."""
    import threading

    import torch.multiprocessing as mp

    from rivulet.worker.worker import use_rank_threads

    slices = len(_allowed_cores()) // threads
    if slices < 2 or not hasattr(os, "sched_setaffinity"):
        return None
    ctx = mp.get_context("spawn")
    start, stop, done, ready = ctx.Barrier(slices), ctx.Barrier(slices), ctx.Value("i", 0, lock=False), ctx.Semaphore(0)
    procs = [ctx.Process(target=_busy_slice, args=(slices, rank, start, stop, done, ready), daemon=True)
             for rank in range(1, slices)]
    for p in procs:
        p.start()
    cores = use_rank_threads(slices, 0)
    try:
        started = 0
        while started < len(procs):  # each slice up (a process that dies on the way is not waited for)
            if ready.acquire(timeout=0.2):
                started += 1
            elif any(p.exitcode is not None for p in procs):
                raise threading.BrokenBarrierError
        return _kernel_figures(Lockstep(start, stop, done, leader=True))
    except threading.BrokenBarrierError:
        raise RuntimeError(f"the all-busy probe: a slice stopped or did not reach a timing within {BUSY_WAIT_S:.0f} s "
                           f"(exit codes {[p.exitcode for p in procs]})") from None
    finally:
        cores.restore()
        for p in procs:
            p.join(BUSY_WAIT_S)
            if p.is_alive():
                p.kill()


def _busy_slice(slices: int, rank: int, start: Any, stop: Any, done: Any, ready: Any) -> None:
    """Slice `rank` of `_all_busy`: the same timings, in step with slice 0 (whose figures are kept)."""
    import torch

    from rivulet.worker.worker import use_rank_threads

    use_rank_threads(slices, rank)
    torch.manual_seed(0)
    ready.release()
    try:
        _kernel_figures(Lockstep(start, stop, done, leader=False))
    except Exception:
        start.abort()
        stop.abort()
        raise



def _activation_gbps(pace: Lockstep | None = None) -> float:
    """GB/s the element-wise kernels between the GEMMs reach on a step's activations: a residual add + RMSNorm
    (1024 wide) and a SiLU-and-mul (2 x 2816 wide) at 256 rows less at 16 (the calls' fixed cost cancels; the
    planner has it in the per-layer overhead), bytes read and written."""
    import torch

    from rivulet.kernels.ops import get_op

    norm, act = get_op("fused_add_rms_norm"), get_op("silu_and_mul")
    h, i = 1024, 2816
    weight = torch.ones(h, dtype=torch.bfloat16)

    def ops(rows: int) -> Callable[[], object]:
        x, res = torch.randn(rows, h).to(torch.bfloat16), torch.randn(rows, h).to(torch.bfloat16)
        gate_up = torch.randn(rows, 2 * i).to(torch.bfloat16)
        return lambda: (norm(x, res, weight, 1e-5), act(gate_up))

    per_row = (4 * h + 3 * i) * 2
    return (256 - 16) * per_row / max(1e-9, typical(ops(256), 21, pace) - typical(ops(16), 21, pace)) / 1e9


def _expert_us(pace: Lockstep | None = None) -> float:
    """µs per routed expert a step hits, beyond its GEMMs: Rivulet's MoE layer (8 experts of 512 x 1024, top 2,
    the backend's packed weights) on 32 tokens, less the same GEMMs on the same rows alone, over the experts hit
    (choosing the rows, gathering them, the activation, weighting and adding them back)."""
    import torch

    from rivulet.kernels.ops import get_op
    from rivulet.layers.moe import FusedMoE

    e, k, h, i, tokens = 8, 2, 512, 1024, 32
    moe = FusedMoE(e, k, h, i, True)
    moe.w13_weight.data = (torch.randn(e, 2 * i, h) * 0.02).to(torch.bfloat16)
    moe.w2_weight.data = (torch.randn(e, h, i) * 0.02).to(torch.bfloat16)
    packed = moe.pack_experts()
    x, logits = torch.randn(tokens, h).to(torch.bfloat16), torch.randn(tokens, e)
    ids = get_op("topk_routing")(logits, k, True)[1]
    rows = torch.bincount(ids.flatten(), minlength=e).tolist()
    if packed:
        linear, w13, w2 = get_op("packed_linear"), *moe.packed  # type: ignore[misc]
    else:
        linear, w13, w2 = (lambda a, w, b: torch.nn.functional.linear(a, w)), moe.w13_weight, moe.w2_weight
    inputs = [(torch.randn(n, h).to(torch.bfloat16), torch.randn(n, i).to(torch.bfloat16), j) for j, n in enumerate(rows) if n]

    def gemms() -> None:
        for a, b, j in inputs:
            linear(a, w13[j], None)
            linear(b, w2[j], None)
    return (typical(lambda: moe(x, logits), 21, pace) - typical(gemms, 21, pace)) / len(inputs) * 1e6


ATTN_HEADS, ATTN_KV_HEADS, ATTN_HEAD_SIZE = 8, 4, 64  # the timed attention's shape
ATTN_LAYERS = 8  # caches read in turn: 8 x 8 MiB for the decode batch, past a 32 MiB last-level cache


def _attention_tflops(pace: Lockstep | None = None) -> tuple[float, float]:
    """FLOP/s (in TFLOP/s) the platform's attention reaches, counted as the planner counts it (2 x query tokens x
    context x heads x 2 x head size): 32 decode rows over 256 cached tokens each, and one 128-token prefill
    chunk from position 0 (causal: 64 tokens of context on average), bf16, over the paged cache, each call on
    another layer's cache (in a step, the weights streamed between two layers' attention evict the last one's KV:
    a decode batch's attention runs about half as fast cold as in a loop over one cache)."""
    import torch

    from rivulet.kernels.attention import get_attention_backend
    from rivulet.platforms import current_platform
    from rivulet.worker.batch import SeqChunk, build_flat_batch

    bs, d = 16, ATTN_HEAD_SIZE
    attend = get_attention_backend(current_platform().attention_backend())

    def rate(chunks: list[SeqChunk], context: float) -> float:
        batch = build_flat_batch(chunks, bs, torch.device("cpu"))
        blocks = 1 + max(b for c in chunks for b in c.block_table)
        # a layer's cache each, read in turn as a model's layers read theirs: cold, not the last call's in cache
        caches = [torch.randn(2, blocks, bs, ATTN_KV_HEADS, d).to(torch.bfloat16) for _ in range(ATTN_LAYERS)]
        q = torch.randn(len(batch.input_ids), ATTN_HEADS, d).to(torch.bfloat16)

        def layers() -> None:
            for cache in caches:
                attend(q, cache, batch.meta, d ** -0.5)
        with torch.inference_mode():
            t = typical(layers, 5, pace) / ATTN_LAYERS
        return 2 * q.shape[0] * context * ATTN_HEADS * 2 * d / t / 1e12

    decode = [SeqChunk([1], 255, list(range(16 * i, 16 * i + 16))) for i in range(32)]
    return rate(decode, 256), rate([SeqChunk([1] * 128, 0, list(range(8)))], 64)
