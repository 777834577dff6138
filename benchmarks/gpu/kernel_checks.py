"""Sections "ceilings" and "kernels" of the GPU check.

ceilings: HBM copy bandwidth and bf16 matmul throughput, the roofs the kernels are measured against.
kernels: every Triton op against its PyTorch reference at real sizes (Llama-3-8B shapes; a
Mixtral-like MoE), with the time of both and the bytes/flops each case moves, so the report can
state each kernel's bandwidth (or compute) as a fraction of the ceiling.

Correctness: the Triton op runs in the benchmark dtype (bf16); the truth is the reference run
in float32 on the same (upcast) inputs; a case passes when max|got - truth| <= tol * max|truth|.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from common import Deadline, PartWriter, error_text, free_memory, sync, time_call


@dataclass
class Sizes:
    """Shapes of one run: `REAL` on the GPU, `TINY` for the CPU dry run."""

    tokens: int  # rows of the elementwise cases
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    inter: int
    block_size: int
    decode_seqs: int
    decode_ctx: int  # mean context of a decode sequence (they vary by +-50%)
    long_ctx: int  # one long decode sequence (the split-K path)
    prefill_chunk: int
    experts: int
    top_k: int
    moe_hidden: int
    moe_inter: int
    moe_tokens: int  # the MoE prefill case
    copy_mib: int  # ceilings
    matmul_n: int
    layers: int  # the KV tier's block copies: caches of this many layers
    copy_blocks: int  # blocks copied at once


REAL = Sizes(tokens=4096, hidden=4096, heads=32, kv_heads=8, head_dim=128, inter=14336, block_size=16,
             decode_seqs=64, decode_ctx=2048, long_ctx=8192, prefill_chunk=512, experts=8, top_k=2,
             moe_hidden=4096, moe_inter=14336, moe_tokens=512, copy_mib=2048, matmul_n=8192, layers=32,
             copy_blocks=256)
TINY = Sizes(tokens=6, hidden=64, heads=4, kv_heads=2, head_dim=32, inter=48, block_size=16,
             decode_seqs=3, decode_ctx=24, long_ctx=70, prefill_chunk=9, experts=4, top_k=2,
             moe_hidden=64, moe_inter=32, moe_tokens=5, copy_mib=4, matmul_n=128, layers=2, copy_blocks=5)


# ---- ceilings ----

def run_ceilings(out: PartWriter, sizes: Sizes, device: torch.device, dtype: torch.dtype) -> None:
    n = sizes.copy_mib * (1 << 20) // 2
    src = torch.randn(n, device=device, dtype=torch.float32).to(torch.bfloat16)
    dst = torch.empty_like(src)
    t = time_call(lambda: dst.copy_(src), device, target_s=0.5)
    out.set("copy_bytes", 2 * src.numel() * src.element_size())
    out.set("copy_gbps", 2 * src.numel() * src.element_size() / t / 1e9)  # read + write
    del src, dst
    m = sizes.matmul_n
    a, b = torch.randn(m, m, device=device, dtype=dtype), torch.randn(m, m, device=device, dtype=dtype)
    t = time_call(lambda: a @ b, device, target_s=0.5)
    out.set("matmul_n", m)
    out.set("matmul_dtype", str(dtype).removeprefix("torch."))
    out.set("matmul_tflops", 2 * m**3 / t / 1e12)
    del a, b
    free_memory(device)


# ---- kernel cases ----

Out = torch.Tensor | tuple[torch.Tensor, ...]


@dataclass
class Case:
    kernel: str
    shape: str
    fast: Callable[[], Out]  # the Triton op, benchmark dtype
    ref: Callable[[], Out]  # the reference, benchmark dtype (timed only)
    truth: Callable[[], Out]  # the reference in float32 (compared against)
    tol: float
    bytes: float = 0.0  # bytes the op must move at least (inputs read + outputs written)
    flops: float = 0.0


def _rand(*shape: int, device: torch.device, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, device=device) * scale).to(dtype)


def _f32(*ts: torch.Tensor) -> list[torch.Tensor]:
    return [t.float() for t in ts]


def case_rms_norm(s: Sizes, dev: torch.device, dt: torch.dtype) -> list[Case]:
    from rivulet.kernels import fused_add_rms_norm_ref, rms_norm_ref
    from rivulet.kernels.triton.norm import fused_add_rms_norm, rms_norm

    x, r, w = _rand(s.tokens, s.hidden, device=dev, dtype=dt), _rand(s.tokens, s.hidden, device=dev, dtype=dt), \
        _rand(s.hidden, device=dev, dtype=dt)
    xf, rf, wf = _f32(x, r, w)
    e = x.element_size() * x.numel()
    shape = f"{s.tokens}x{s.hidden}"
    return [
        Case("rms_norm", shape, lambda: rms_norm(x, w, 1e-5), lambda: rms_norm_ref(x, w, 1e-5),
             lambda: rms_norm_ref(xf, wf, 1e-5), 1e-2, bytes=2 * e),
        Case("fused_add_rms_norm", shape, lambda: fused_add_rms_norm(x, r, w, 1e-5),
             lambda: fused_add_rms_norm_ref(x, r, w, 1e-5), lambda: fused_add_rms_norm_ref(xf, rf, wf, 1e-5),
             1e-2, bytes=4 * e),
    ]


def case_silu_and_mul(s: Sizes, dev: torch.device, dt: torch.dtype) -> list[Case]:
    from rivulet.kernels import silu_and_mul_ref
    from rivulet.kernels.triton.activation import silu_and_mul

    t = max(s.tokens // 2, 1)
    x = _rand(t, 2 * s.inter, device=dev, dtype=dt, scale=2.0)
    (xf,) = _f32(x)
    return [Case("silu_and_mul", f"{t}x2*{s.inter}", lambda: silu_and_mul(x), lambda: silu_and_mul_ref(x),
                 lambda: silu_and_mul_ref(xf), 1e-2, bytes=1.5 * x.numel() * x.element_size())]


def case_rotary(s: Sizes, dev: torch.device, dt: torch.dtype) -> list[Case]:
    from rivulet.kernels import apply_rotary_ref, rope_cos_sin_cache
    from rivulet.kernels.triton.rotary import apply_rotary

    d, cases = s.head_dim, []
    for interleaved, rot in ((False, d), (True, d), (False, d // 2)):
        inv_freq = 1.0 / (500000.0 ** (torch.arange(0, rot, 2, device=dev).float() / rot))
        cache = rope_cos_sin_cache(inv_freq.cpu(), 8192).to(dev)
        pos = torch.randint(0, 8192, (s.tokens,), device=dev)
        q, k = _rand(s.tokens, s.heads, d, device=dev, dtype=dt), _rand(s.tokens, s.kv_heads, d, device=dev, dtype=dt)
        qf, kf = _f32(q, k)
        nbytes = 2 * (q.numel() + k.numel()) * q.element_size()
        name = "rotary_" + ("interleaved" if interleaved else "neox") + ("" if rot == d else f"_partial{rot}")
        cases.append(Case(name, f"T={s.tokens} q{s.heads}/k{s.kv_heads}x{d}",
                          lambda q=q, k=k, c=cache, p=pos, i=interleaved: apply_rotary(p, q, k, c, i),
                          lambda q=q, k=k, c=cache, p=pos, i=interleaved: apply_rotary_ref(p, q, k, c, i),
                          lambda q=qf, k=kf, c=cache, p=pos, i=interleaved: apply_rotary_ref(p, q, k, c, i),
                          1e-2, bytes=nbytes))
    return cases


def case_write_kv(s: Sizes, dev: torch.device, dt: torch.dtype) -> list[Case]:
    from rivulet.kernels import write_kv_cache_ref
    from rivulet.kernels.triton.kv_cache import write_kv_cache

    num_blocks = 2 * s.tokens // s.block_size + 4
    cache = _rand(2, num_blocks, s.block_size, s.kv_heads, s.head_dim, device=dev, dtype=dt)
    slots = torch.randperm(num_blocks * s.block_size, device=dev)[: s.tokens]
    k, v = (_rand(s.tokens, s.kv_heads, s.head_dim, device=dev, dtype=dt) for _ in range(2))
    ref_cache = cache.clone()

    def fast() -> torch.Tensor:
        write_kv_cache(k, v, cache, slots)
        return cache

    def truth() -> torch.Tensor:
        write_kv_cache_ref(k, v, ref_cache, slots)
        return ref_cache

    return [Case("write_kv_cache", f"T={s.tokens} {s.kv_heads}x{s.head_dim} bs={s.block_size}", fast,
                 lambda: write_kv_cache_ref(k, v, ref_cache, slots) or ref_cache, truth, 0.0,
                 bytes=4 * k.numel() * k.element_size())]


def case_kv_copy(s: Sizes, dev: torch.device, dt: torch.dtype) -> list[Case]:
    """The KV tier's batched block copies: `copy_blocks` blocks of every layer's cache, to other blocks of the
    same caches (one launch) and to pinned host slots (gathered on the device, one transfer), against the
    reference's indexing per layer. Copies are exact (tolerance 0)."""
    from rivulet.kernels.kv_copy import copy_blocks_ref
    from rivulet.kernels.triton.kv_copy import copy_blocks

    blocks = 4 * s.copy_blocks
    caches = [_rand(2, blocks, s.block_size, s.kv_heads, s.head_dim, device=dev, dtype=dt) for _ in range(s.layers)]
    pin = dev.type == "cuda"
    host = [torch.zeros(2, 2 * s.copy_blocks, *caches[0].shape[2:], dtype=dt, pin_memory=pin)
            for _ in range(s.layers)]
    perm = torch.randperm(blocks, device=dev)
    src, dst = perm[: s.copy_blocks], perm[s.copy_blocks: 2 * s.copy_blocks]
    slots = torch.randperm(2 * s.copy_blocks)[: s.copy_blocks]
    nbytes = 2 * s.layers * 2 * s.copy_blocks * caches[0][0, 0].numel() * caches[0].element_size()  # read + write
    to_dev, to_dev_ref = [c.clone() for c in caches], [c.clone() for c in caches]
    to_host, to_host_ref = [h.clone() for h in host], [h.clone() for h in host]
    shape = f"{s.layers} layers x {s.copy_blocks} blocks of {s.block_size}x{s.kv_heads}x{s.head_dim}"

    def run(fn: Callable[..., None], a: list[torch.Tensor], b: list[torch.Tensor], i: torch.Tensor,
            j: torch.Tensor) -> Callable[[], tuple[torch.Tensor, ...]]:
        return lambda: fn(a, b, i, j) or tuple(b)

    return [Case("copy_blocks (device)", shape, run(copy_blocks, caches, to_dev, src, dst),
                 run(copy_blocks_ref, caches, to_dev_ref, src, dst), run(copy_blocks_ref, caches, to_dev_ref, src, dst),
                 0.0, bytes=nbytes),
            Case("copy_blocks (to host)", shape, run(copy_blocks, caches, to_host, src, slots),
                 run(copy_blocks_ref, caches, to_host_ref, src, slots),
                 run(copy_blocks_ref, caches, to_host_ref, src, slots), 0.0, bytes=nbytes)]


def _attention_case(name: str, spec: list[tuple[int, int]], s: Sizes, dev: torch.device, dt: torch.dtype,
                    window: int | None = None) -> Case:
    """One batch of (cached, new) tokens per sequence over a random cache with scattered blocks."""
    from rivulet.kernels import paged_attention_ref
    from rivulet.kernels.triton.attention import paged_attention
    from rivulet.worker.batch import SeqChunk, build_flat_batch

    bs = s.block_size
    need = sum(-(-(c + n) // bs) for c, n in spec)
    perm = torch.randperm(need + 8).tolist()
    chunks = []
    for cached, new in spec:
        nb = -(-(cached + new) // bs)
        chunks.append(SeqChunk([0] * new, cached, perm[:nb]))
        perm = perm[nb:]
    meta = build_flat_batch(chunks, bs, dev).meta
    cache = _rand(2, need + 8, bs, s.kv_heads, s.head_dim, device=dev, dtype=dt)
    q = _rand(len(meta.slot_mapping), s.heads, s.head_dim, device=dev, dtype=dt)
    qf, cf = _f32(q, cache)
    scale = s.head_dim**-0.5
    kv_tokens = sum(c + n if window is None else min(c + n, window + n) for c, n in spec)
    nbytes = 2 * kv_tokens * s.kv_heads * s.head_dim * cache.element_size() + 2 * q.numel() * q.element_size()
    # causal score + value products of every query token over the keys it sees
    flops = 4 * s.heads * s.head_dim * sum(
        sum(min(c + j + 1, window or c + j + 1) for j in range(n)) for c, n in spec)
    total_q = sum(n for _, n in spec)
    shape = f"{len(spec)} seqs, {total_q} q tok, {kv_tokens} kv tok" + (f", window {window}" if window else "")
    return Case(name, shape, lambda: paged_attention(q, cache, meta, scale, window),
                lambda: paged_attention_ref(q, cache, meta, scale, window),
                lambda: paged_attention_ref(qf, cf, meta, scale, window), 2e-2, bytes=nbytes, flops=flops)


def case_attention(s: Sizes, dev: torch.device, dt: torch.dtype) -> list[Case]:
    g = torch.Generator().manual_seed(0)
    lens = (torch.rand(s.decode_seqs, generator=g) * s.decode_ctx + s.decode_ctx // 2).long().tolist()
    decode = [(n - 1, 1) for n in lens]
    mixed = [(0, s.prefill_chunk), (s.prefill_chunk, s.prefill_chunk // 2 + 1), (s.decode_ctx, s.prefill_chunk)]
    mixed += decode[: max(s.decode_seqs // 2, 1)]
    return [
        _attention_case("attention_decode", decode, s, dev, dt),
        _attention_case("attention_decode_b1_long", [(s.long_ctx - 1, 1)], s, dev, dt),
        _attention_case("attention_mixed", mixed, s, dev, dt),
        _attention_case("attention_decode_window", decode, s, dev, dt, window=s.decode_ctx // 2),
        _attention_case("attention_mixed_window", mixed, s, dev, dt, window=s.prefill_chunk // 2),
    ]


def case_moe(s: Sizes, dev: torch.device, dt: torch.dtype) -> list[Case]:
    from rivulet.kernels import fused_moe_ref, topk_routing_ref
    from rivulet.kernels.triton.moe import fused_moe, topk_routing

    # float32 router logits: bf16 ones tie often, and tied experts may come in either order
    logits = _rand(s.tokens, s.experts, device=dev, dtype=torch.float32, scale=2.0)
    lf = logits
    cases = [Case("topk_routing", f"T={s.tokens} E={s.experts} k={s.top_k}",
                  lambda: topk_routing(logits, s.top_k, True), lambda: topk_routing_ref(logits, s.top_k, True),
                  lambda: topk_routing_ref(lf, s.top_k, True), 1e-5, bytes=logits.numel() * logits.element_size())]
    h, i, e = s.moe_hidden, s.moe_inter, s.experts
    w13 = _rand(e, 2 * i, h, device=dev, dtype=dt, scale=h**-0.5)
    w2 = _rand(e, h, i, device=dev, dtype=dt, scale=i**-0.5)
    w13f, w2f = _f32(w13, w2)
    expert_bytes = 3 * i * h * w13.element_size()
    for t in (1, s.moe_tokens):
        x = _rand(t, h, device=dev, dtype=dt)
        weights, ids = topk_routing_ref(_rand(t, e, device=dev, dtype=torch.float32), s.top_k, True)
        (xf,) = _f32(x)
        active = int(torch.unique(ids).numel())
        cases.append(Case(f"fused_moe_T{t}", f"T={t} H={h} I={i} E={e} k={s.top_k}",
                          lambda x=x, w=weights, d=ids: fused_moe(x, w13, w2, w, d),
                          lambda x=x, w=weights, d=ids: fused_moe_ref(x, w13, w2, w, d),
                          lambda x=xf, w=weights, d=ids: fused_moe_ref(x, w13f, w2f, w, d), 3e-2,
                          bytes=active * expert_bytes, flops=2 * t * s.top_k * 3 * i * h))
    return cases


def case_fp8(s: Sizes, dev: torch.device, dt: torch.dtype) -> list[Case]:
    from rivulet.kernels.quant import fp8_linear_ref, quantize_fp8_weight
    from rivulet.kernels.triton.fp8_linear import fp8_linear

    n, k = s.inter, s.hidden
    w = _rand(n, k, device=dev, dtype=torch.float32, scale=k**-0.5)
    cases = []
    for per_channel in (False, True):
        w_q, scale = quantize_fp8_weight(w, per_channel)
        for m in sorted({1, 16, max(s.tokens // 8, 1)}):
            x = _rand(m, k, device=dev, dtype=dt)
            (xf,) = _f32(x)
            kind = "per_channel" if per_channel else "per_tensor"
            cases.append(Case(f"fp8_linear_{kind}_M{m}", f"M={m} N={n} K={k}",
                              lambda x=x, wq=w_q, sc=scale: fp8_linear(x, wq, sc),
                              lambda x=x, wq=w_q, sc=scale: fp8_linear_ref(x, wq, sc),
                              lambda x=xf, wq=w_q, sc=scale: fp8_linear_ref(x, wq, sc), 2e-2,
                              bytes=n * k + (m * k + m * n) * x.element_size(), flops=2 * m * n * k))
    return cases


CASE_BUILDERS: list[Callable[[Sizes, torch.device, torch.dtype], list[Case]]] = [
    case_rms_norm, case_silu_and_mul, case_rotary, case_write_kv, case_kv_copy, case_attention, case_moe,
    case_fp8,
]


def _as_list(o: Out) -> list[torch.Tensor]:
    return list(o) if isinstance(o, (tuple, list)) else [o]


def compare(got: Out, want: Out) -> tuple[float, float]:
    """(max absolute error, the same relative to max|want|) over all outputs of an op."""
    err, scale = 0.0, 0.0
    for g, w in zip(_as_list(got), _as_list(want)):
        if g.shape != w.shape:
            raise AssertionError(f"shape {tuple(g.shape)} != reference {tuple(w.shape)}")
        if not g.dtype.is_floating_point:
            err = max(err, float((g != w).sum()))  # integer outputs (expert ids): count mismatches
            continue
        err = max(err, float((g.float() - w.float()).abs().max()))
        scale = max(scale, float(w.float().abs().max()))
    return err, err / scale if scale else err


def run_kernels(out: PartWriter, sizes: Sizes, device: torch.device, dtype: torch.dtype, deadline: Deadline,
                quick: bool = False, groups: list[str] | None = None) -> None:
    """Every case of the builders named in `groups` (all by default); `quick` times each op once
    (the CPU dry run)."""
    torch.manual_seed(0)
    timing = {"target_s": 0.0, "min_iters": 1} if quick else {}
    for build in CASE_BUILDERS:
        group = build.__name__.removeprefix("case_")
        if groups and group not in groups:
            continue
        if not deadline.fits(10):
            out.append("rows", {"kernel": group, "error": "skipped: time budget"})
            continue
        try:
            cases = build(sizes, device, dtype)
        except Exception as e:  # noqa: BLE001 - one failing group must not stop the others
            out.append("rows", {"kernel": group, "error": error_text(e)})
            continue
        for case in cases:
            row: dict[str, object] = {"kernel": case.kernel, "shape": case.shape,
                                      "dtype": str(dtype).removeprefix("torch."), "tol": case.tol,
                                      "bytes": case.bytes, "flops": case.flops}
            try:
                got = case.fast()
                sync(device)
                want = case.truth()
                err, rel = compare(got, want)
                row.update(max_abs_err=err, rel_err=rel, passed=rel <= case.tol)
                del got, want
                row["ms"] = time_call(case.fast, device, **timing) * 1e3
                row["ref_ms"] = time_call(case.ref, device, **({"target_s": 0.1, "max_iters": 20} | timing)) * 1e3
            except Exception as e:  # noqa: BLE001
                row["error"] = error_text(e)
            out.append("rows", row)
        del cases
        free_memory(device)
