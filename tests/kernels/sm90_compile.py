"""Compile every Triton kernel for an H100/H200 (sm_90) on a machine without a GPU.

The CPU interpreter runs the kernels' Python, not Triton's compiler: type errors in loops, dot
shapes or layouts only show when compiling. Here each wrapper in `rivulet.kernels.triton` is
called on CPU tensors of the real dtypes and shapes' constants (bf16, head_dim 128, GQA 4, ...);
the kernel launch is intercepted and compiled ahead of time for sm_90 down to a cubin instead.

    python tests/kernels/sm90_compile.py [--all-dtypes]   # one line per variant; exit 1 on failure

bfloat16 by default (what models run in on a GPU); --all-dtypes adds float32 (slow to compile).

Must run without TRITON_INTERPRET (the test runs it in a subprocess).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32",
          torch.int64: "i64", torch.float8_e4m3fn: "fp8e4nv", torch.bool: "i1", torch.uint8: "u8"}

_launches: list[tuple[JITFunction, dict[str, Any]]] = []


def _capture(self: JITFunction, *args: Any, grid: Any = None, warmup: bool = False, **kwargs: Any) -> None:
    bound = dict(zip(self.arg_names, args)) | kwargs
    _launches.append((self, bound))


def _signature(fn: JITFunction, bound: dict[str, Any]) -> tuple[dict[str, str], dict[str, Any]]:
    const_names = {p.name for p in fn.params if p.is_constexpr}
    sig: dict[str, str] = {}
    consts: dict[str, Any] = {}
    for name in fn.arg_names:
        v = bound[name]
        if name in const_names:
            sig[name], consts[name] = "constexpr", v
        elif isinstance(v, torch.Tensor):
            sig[name] = "*" + _TYPES[v.dtype]
        elif isinstance(v, bool):
            sig[name] = "i1"
        elif isinstance(v, int):
            sig[name] = "i32" if -2**31 <= v < 2**31 else "i64"
        elif isinstance(v, float):
            sig[name] = "fp32"
        else:
            raise TypeError(f"{fn.__name__}.{name}: cannot type {type(v)}")
    return sig, consts


def _call_wrappers(dtypes: tuple[torch.dtype, ...]) -> None:
    """Every op in the variants the model and the benchmarks use."""
    from rivulet.kernels.quant import quantize_fp8_weight
    from rivulet.kernels.lora import LoRAPlan
    from rivulet.kernels.triton import (activation, attention, bitmask, fp8_linear, kv_cache, kv_copy, lora, moe,
                                        norm, rotary)
    from rivulet.worker.batch import SeqChunk, build_flat_batch

    cpu = torch.device("cpu")
    bitmask.apply_token_bitmask(torch.randn(16, 151936), torch.zeros(16, 4748, dtype=torch.int32))  # float32 only
    for dt in dtypes:
        x = torch.randn(4, 4096, dtype=dt)
        norm.rms_norm(x, x[0], 1e-5)
        norm.fused_add_rms_norm(x, x, x[0], 1e-5)
        activation.silu_and_mul(torch.randn(4, 2 * 14336, dtype=dt))
        activation.gelu_tanh_and_mul(torch.randn(4, 2 * 9216, dtype=dt))
        plan = LoRAPlan(torch.tensor([0, 2, -1, 3]), [0, 2, 3], None, None, None, 0)
        lora.add_lora(torch.randn(4, 960, dtype=dt), torch.randn(4, 576, dtype=dt), torch.randn(4, 48, 576, dtype=dt),
                      torch.randn(4, 48, 960, dtype=dt), plan, 48)
        cache = torch.randn(2, 40, 16, 8, 128, dtype=dt)
        for interleaved, rot in ((False, 128), (True, 128), (False, 64)):
            inv = 1.0 / (10000 ** (torch.arange(0, rot, 2).float() / rot))
            cs = torch.cat([inv.cos(), inv.sin()])[None].expand(64, -1).contiguous()
            rotary.apply_rotary(torch.zeros(3, dtype=torch.int64), torch.randn(3, 32, 128, dtype=dt),
                                torch.randn(3, 8, 128, dtype=dt), cs, interleaved)
            rotary.rotary_write_kv_cache(torch.zeros(3, dtype=torch.int64), torch.randn(3, 32, 128, dtype=dt),
                                         torch.randn(3, 8, 128, dtype=dt), torch.randn(3, 8, 128, dtype=dt), cs,
                                         interleaved, cache, torch.tensor([1, 5, -1]))
        kv_cache.write_kv_cache(torch.randn(3, 8, 128, dtype=dt), torch.randn(3, 8, 128, dtype=dt), cache,
                                torch.tensor([1, 5, -1]))
        kv_copy.copy_blocks([cache, cache], [cache[:, :8], cache[:, 8:16]], torch.tensor([3, 9]), torch.tensor([0, 7]))
        specs = {"decode_few": [(20, 1), (7, 1)], "decode_many": [(20, 1)] * 16, "mixed": [(0, 70), (5, 1), (30, 9)]}
        for name, spec in specs.items():
            meta = build_flat_batch([SeqChunk([0] * n, c, [0, 1, 2, 3, 4, 5]) for c, n in spec], 16, cpu).meta
            q = torch.randn(len(meta.slot_mapping), 32, 128, dtype=dt)
            for window in (None, 64):
                attention.paged_attention(q, cache, meta, 0.088, window)
            attention.paged_attention(q, cache, meta, 0.0625, 64, 50.0)  # Gemma 2: capped scores
        meta = build_flat_batch([SeqChunk([0] * 9, 3, [0, 1])], 16, cpu).meta  # head_dim 80, GQA 3
        attention.paged_attention(torch.randn(9, 6, 80, dtype=dt), torch.randn(2, 4, 16, 2, 80, dtype=dt), meta, 0.1)
        moe.topk_routing(torch.randn(5, 8, dtype=dt), 2, True)
        w13, w2 = torch.randn(8, 2 * 256, 128, dtype=dt), torch.randn(8, 128, 256, dtype=dt)
        for t in (1, 100):
            weights, ids = moe.topk_routing(torch.randn(t, 8), 2, True)
            ids = torch.randint(0, 8, (t, 2))  # the capture does not compute the routing
            moe.fused_moe(torch.randn(t, 128, dtype=dt), w13, w2, weights, ids)
        for per_channel in (False, True):
            w_q, scale = quantize_fp8_weight(torch.randn(256, 4096), per_channel)
            for m, bias in ((1, None), (64, torch.randn(256, dtype=dt))):
                fp8_linear.fp8_linear(torch.randn(m, 4096, dtype=dt), w_q, scale, bias)


def main() -> int:
    JITFunction.run = _capture  # type: ignore[method-assign]
    _call_wrappers((torch.bfloat16, torch.float32) if "--all-dtypes" in sys.argv else (torch.bfloat16,))
    target = GPUTarget("cuda", 90, 32)
    seen: set[str] = set()
    failed = 0
    for fn, bound in _launches:
        sig, consts = _signature(fn, bound)
        key = f"{fn.__name__} {sorted(sig.items())} {sorted(consts.items())} {bound.get('num_warps')}"
        if key in seen:
            continue
        seen.add(key)
        label = f"{fn.__name__} " + " ".join(f"{k}={v}" for k, v in consts.items())
        t0 = time.time()
        try:
            options = {k: bound[k] for k in ("num_warps", "num_stages") if k in bound}
            triton.compile(ASTSource(fn, sig, consts), target=target, options=options)
            print(f"ok   {time.time() - t0:4.1f}s {label}", flush=True)
        except Exception as e:  # noqa: BLE001 - report every failing variant
            failed += 1
            print(f"FAIL {label}\n{e}", flush=True)
    print(f"{len(seen) - failed} of {len(seen)} kernel variants compile for sm_90")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
