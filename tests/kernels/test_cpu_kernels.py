"""The C++ CPU kernels (`rivulet.kernels.cpu`) against their PyTorch references, float32 and bf16."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers.paged import scattered_batch
from rivulet.kernels import paged_attention_ref
from rivulet.kernels.activation import silu_and_mul_ref
from rivulet.kernels.attention import rotary_write_kv_cache_ref, write_kv_cache_ref
from rivulet.kernels.cpu.attention import paged_attention_cpu
from rivulet.kernels.cpu import load_cpu_ext
from rivulet.kernels.norm import fused_add_rms_norm_ref, rms_norm_ref
from rivulet.kernels.quant import int8_linear_ref, quantize_int8_weight
from rivulet.kernels.rotary import apply_rotary_ref, rope_cos_sin_cache

ext = load_cpu_ext()
# skipped only where the extension is not meant to exist; a compiler whose build failed fails the tests
COMPILER = shutil.which(os.environ.get("CXX", "c++")) is not None and os.environ.get("RIVULET_DISABLE_CPU_EXT") != "1"
pytestmark = pytest.mark.skipif(not COMPILER, reason="no C++ compiler on this machine (the references run instead)")


def test_the_extension_builds_where_a_compiler_is() -> None:
    assert ext is not None, "a C++ compiler is here but the CPU kernels did not build (see the warning logged)"


def test_a_linked_cache_and_a_killed_build_s_lock_cost_no_rebuild(tmp_path) -> None:
    """A cache folder reached through a link is the same build (ninja compares absolute paths), and a `lock` file
    left by a build that was killed does not make the next start wait for it forever."""
    assert ext is not None
    build = Path(ext.__file__).parent
    so_mtime = Path(ext.__file__).stat().st_mtime
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "cpu_ext").symlink_to(build.parent, target_is_directory=True)
    (build / "lock").touch()  # what torch's build leaves when its process dies mid-build
    env = dict(os.environ, RIVULET_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=str(Path(__file__).parents[2]))
    code = "from rivulet.kernels.cpu import load_cpu_ext; print(load_cpu_ext().__file__)"
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert Path(p.stdout.strip()) == Path(ext.__file__) and not (build / "lock").exists()
    assert Path(ext.__file__).stat().st_mtime == so_mtime  # loaded, not rebuilt


DTYPES = [torch.float32, torch.bfloat16]


def randn(*shape: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def ulp_close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    """float32: equal to rounding; bf16: within one bf16 step of the value."""
    tol = 1e-6 if dtype == torch.float32 else 2 ** -7
    torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 576), (7, 64), (3, 5, 24)])
def test_rms_norms(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    x, r = randn(*shape, dtype=dtype), randn(*shape, dtype=dtype, seed=1)
    w = randn(shape[-1], dtype=dtype, seed=2)
    ulp_close(ext.rms_norm(x, w, 1e-5), rms_norm_ref(x, w, 1e-5), dtype)
    out, res = ext.fused_add_rms_norm(x, r, w, 1e-5)
    want_out, want_res = fused_add_rms_norm_ref(x, r, w, 1e-5)
    ulp_close(res, want_res, dtype)
    ulp_close(out, want_out, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 64), (7, 3072), (3, 5, 48), (2, 2 * 21)])  # tails of 16-lane vectors
def test_silu_and_mul(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    x = randn(*shape, dtype=dtype) * 4
    x.view(-1)[:4] = torch.tensor([-100.0, 100.0, 0.0, -0.5]).to(dtype)  # saturated, zero and small gates
    ulp_close(ext.silu_and_mul(x), silu_and_mul_ref(x), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("d,rot", [(64, 64), (24, 24), (128, 64)])  # full and partial rotary
def test_rotary(dtype: torch.dtype, interleaved: bool, d: int, rot: int) -> None:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rot, 2).float() / rot))
    cache = rope_cos_sin_cache(inv_freq, 512)
    qkv = randn(9, (4 + 2 * 2) * d, dtype=dtype)  # q/k are strided views of a fused projection
    q, k, _ = qkv.split([4 * d, 2 * d, 2 * d], dim=-1)
    q, k = q.reshape(9, 4, d), k.reshape(9, 2, d)
    pos = torch.tensor([0, 1, 2, 100, 511, 7, 3, 3, 250])
    got_q, got_k = ext.apply_rotary(pos, q, k, cache, interleaved)
    want_q, want_k = apply_rotary_ref(pos, q, k, cache, interleaved)
    ulp_close(got_q, want_q, dtype)
    ulp_close(got_k, want_k, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("d,rot", [(64, 64), (24, 24), (128, 64)])
def test_rotary_prefill_rows_are_the_reference_bits(dtype: torch.dtype, interleaved: bool, d: int, rot: int) -> None:
    # a prefill chunk: many rows over both threads; the vector path must round exactly like the reference
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rot, 2).float() / rot))
    cache = rope_cos_sin_cache(inv_freq, 4096)
    q, k = randn(300, 9, d, dtype=dtype), randn(300, 3, d, dtype=dtype, seed=1)
    positions = torch.randint(0, 4096, (300,), generator=torch.Generator().manual_seed(2))
    got, want = ext.apply_rotary(positions, q, k, cache, interleaved), apply_rotary_ref(positions, q, k, cache, interleaved)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_cache_skips_negative_slots(dtype: torch.dtype) -> None:
    cache, want = torch.zeros(2, 6, 4, 3, 8, dtype=dtype), torch.zeros(2, 6, 4, 3, 8, dtype=dtype)
    k, v = randn(5, 3, 8, dtype=dtype), randn(5, 3, 8, dtype=dtype, seed=1)
    slots = torch.tensor([3, 17, -1, 0, 22])
    ext.write_kv_cache(k, v, cache, slots)
    keep = slots >= 0
    write_kv_cache_ref(k[keep], v[keep], want, slots[keep])
    assert torch.equal(cache, want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 128, 80])  # head rows of whole cache lines (streaming stores), and not
def test_write_kv_cache_from_a_fused_projection_into_a_big_cache(dtype: torch.dtype, d: int) -> None:
    """Keys and values sliced out of one qkv output (strided rows), written at scattered slots of a
    huge-page cache, as a decode step writes them; a negative slot is skipped."""
    from rivulet.platforms.cpu import CpuPlatform

    t, hq, hk = 37, 9, 3
    qkv = randn(t, (hq + 2 * hk) * d, dtype=dtype)
    _, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    k, v = k.reshape(t, hk, d), v.reshape(t, hk, d)
    cache = CpuPlatform().zeros((2, 300, 16, hk, d), dtype)
    slots = torch.randperm(300 * 16, generator=torch.Generator().manual_seed(3))[:t]
    slots[5] = -1
    ext.write_kv_cache(k, v, cache, slots)
    want = torch.zeros_like(cache)
    keep = slots >= 0
    write_kv_cache_ref(k[keep], v[keep], want, slots[keep])
    assert torch.equal(cache, want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("d,rot,t", [(64, 64, 37), (128, 64, 5), (24, 24, 300)])  # streaming rows or not; rot < D
def test_rotary_write_kv_cache_is_the_two_ops_bit_for_bit(dtype: torch.dtype, interleaved: bool, d: int, rot: int,
                                                         t: int) -> None:
    """The fused op (what the RoPE + KV-write pass calls) returns apply_rotary's queries and leaves the
    cache exactly as apply_rotary then write_kv_cache would; q/k/v are views of one qkv output, as the
    model passes them, and a negative slot writes nothing."""
    from rivulet.platforms.cpu import CpuPlatform

    hq, hk = 9, 3
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rot, 2).float() / rot))
    cs = rope_cos_sin_cache(inv_freq, 4096)
    q, k, v = randn(t, (hq + 2 * hk) * d, dtype=dtype).split([hq * d, hk * d, hk * d], dim=-1)
    q, k, v = q.reshape(t, hq, d), k.reshape(t, hk, d), v.reshape(t, hk, d)
    positions = torch.randint(0, 4096, (t,), generator=torch.Generator().manual_seed(2))
    slots = torch.randperm(300 * 16, generator=torch.Generator().manual_seed(3))[:t]
    slots[t // 2] = -1
    cache = CpuPlatform().zeros((2, 300, 16, hk, d), dtype)
    got_q = ext.rotary_write_kv_cache(positions, q, k, v, cs, interleaved, cache, slots)
    want_cache = torch.zeros_like(cache)
    want_q, want_k = ext.apply_rotary(positions, q, k, cs, interleaved)
    ext.write_kv_cache(want_k, v, want_cache, slots)
    assert torch.equal(got_q, want_q) and torch.equal(cache, want_cache)
    ref_cache = torch.zeros_like(cache)  # and the reference composition agrees with both
    keep = slots >= 0
    ref_q = rotary_write_kv_cache_ref(positions[keep], q[keep], k[keep], v[keep], cs, interleaved, ref_cache, slots[keep])
    assert torch.equal(ref_q, got_q[keep]) and torch.equal(ref_cache, cache)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hk,d", [(9, 3, 64), (4, 4, 32), (8, 1, 16), (16, 1, 64), (4, 2, 80), (6, 3, 24)])  # G > 8; generic D
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("many", [False, True], ids=["few", "many"])  # per (sequence, head) tasks / per sequence
def test_decode_attention_matches_reference(dtype: torch.dtype, hq: int, hk: int, d: int, window: int | None,
                                            many: bool) -> None:
    bs = 4
    spec = [(20, 1), (0, 1), (3, 4), (47, 1), (16, 1)]  # decodes around a prefill chunk
    if many:
        spec += [(c, 1) for c in (5, 33, 2, 17, 64, 9, 1, 40, 11, 28, 7)]
    meta, cache, q = _paged_batch(spec, bs, hq, hk, d, dtype)
    got = paged_attention_cpu(q, cache, meta, d**-0.5, window)
    want = paged_attention_ref(q, cache, meta, d**-0.5, window)
    tol = 2e-6 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hk,d", [(9, 3, 64), (8, 1, 16), (4, 2, 80), (6, 3, 24)])  # 24: the SDPA path
def test_attention_reads_an_fp8_cache(dtype: torch.dtype, hq: int, hk: int, d: int) -> None:
    """A float8_e5m2 cache (`--kv-cache-dtype fp8_e5m2`): the decode kernel widens the bytes exactly, so it gives
    what it gives over the same values held in float32; prefill chunks (the SDPA path) too."""
    from rivulet.kernels.cpu.attention import FP8_DECODE

    spec = [(20, 1), (0, 1), (3, 4), (47, 1), (16, 1), (0, 6)]
    meta, cache, q = _paged_batch(spec, 4, hq, hk, d, dtype)
    fp8 = cache.to(torch.float8_e5m2)
    got = paged_attention_cpu(q, fp8, meta, d**-0.5)
    want = paged_attention_cpu(q.float(), fp8.float(), meta, d**-0.5)
    tol = 2e-6 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)
    if ext is not None and hasattr(ext, "prefill_attention_amx"):  # an AVX-512 build: its decode kernel reads fp8
        assert FP8_DECODE


def _paged_batch(spec: list[tuple[int, int]], bs: int, hq: int, hk: int, d: int, dtype: torch.dtype):
    """A flat batch of (cached, new) chunks over scattered pages, a random cache and queries."""
    meta, num_blocks = scattered_batch(spec, bs)
    cache = randn(2, num_blocks, bs, hk, d, dtype=dtype, seed=1)
    q = randn(len(meta.slot_mapping), hq, d, dtype=dtype, seed=2)
    return meta, cache, q


@pytest.fixture(params=[True, False], ids=["amx", "avx512"])
def amx(request: pytest.FixtureRequest):
    """bf16 prefill attention on AMX tiles (where this machine grants them) and on AVX-512 dot products."""
    if request.param and not (hasattr(ext, "prefill_attention_amx") and ext.amx_linear_available()):
        pytest.skip("no usable AMX on this CPU (the AVX-512 variant runs)")
    if not hasattr(ext, "prefill_attention_amx"):  # AVX2 build: the SDPA path
        yield False
        return
    before = ext.prefill_attention_amx(request.param)
    yield request.param
    ext.prefill_attention_amx(before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hk,d", [(9, 3, 64), (4, 4, 32), (8, 1, 16), (32, 1, 128), (4, 2, 80), (6, 3, 24), (40, 1, 16)])
@pytest.mark.parametrize("window", [None, 5, 40])
def test_prefill_attention_matches_reference(dtype: torch.dtype, hq: int, hk: int, d: int, window: int | None,
                                             amx: bool) -> None:
    """Chunks from position 0 and after a cached prefix, k-token steps, across the kernels' tiles (32 rows, or
    32 tokens in halves of 16 on AMX) and key blocks (32 keys); 40 query heads per kv head is past the AVX-512 kernel (the
    SDPA path runs)."""
    from rivulet.kernels.cpu.attention import prefill_kernel

    bs = 16
    meta, cache, q = _paged_batch([(0, 70), (33, 45), (0, 1), (100, 3), (5, 2), (0, 33), (47, 1)], bs, hq, hk, d, dtype)
    built = hasattr(ext, "prefill_attention")  # the kernel is AVX-512 code; AVX2 CPUs take the SDPA path
    bf16_ok = dtype == torch.float32 or (built and ext.PREFILL_ATTENTION_BF16)
    assert prefill_kernel(q, cache) == (built and hq // hk <= 32 and bf16_ok)
    if built:
        assert ext.prefill_attention_amx_used(d, bs) == (amx and d % 32 == 0)
    got = paged_attention_cpu(q, cache, meta, d**-0.5, window)
    want = paged_attention_ref(q.float(), cache.float(), meta, d**-0.5, window)
    tol = 2e-6 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("hq,hk,d,bs", [(9, 3, 64, 16), (8, 2, 128, 32), (4, 4, 32, 48), (9, 3, 64, 8)])
@pytest.mark.parametrize("window", [None, 100])
def test_long_bf16_prefill_attention_matches_reference(hq: int, hk: int, d: int, bs: int, window: int | None,
                                                       amx: bool) -> None:
    """bf16 prompts of hundreds of tokens (many key blocks, partial last tiles, pages of 8-48 tokens), after
    a cached prefix or from 0: the shapes of a real prefill step. Pages of 8 keys are not for AMX (16 keys
    are read as one tile from one page)."""
    meta, cache, q = _paged_batch([(0, 300), (75, 190), (0, 17), (129, 2)], bs, hq, hk, d, torch.bfloat16)
    if hasattr(ext, "prefill_attention_amx_used"):
        assert ext.prefill_attention_amx_used(d, bs) == (amx and bs % 16 == 0)
    got = paged_attention_cpu(q, cache, meta, d**-0.5, window)
    want = paged_attention_ref(q.float(), cache.float(), meta, d**-0.5, window)
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("growth", [1.0, 4.0, 0.25])
def test_prefill_attention_with_scores_that_rise_or_fall_along_the_keys(growth: float, amx: bool) -> None:
    """Keys scaled by growth^(position / 256): with 4, each 256-key block's scores pass the running max by far, so
    the AMX kernel's lazy max moves and rescales its accumulators (it moves only past 2^8 of P); with 0.25 the
    first block's max holds. Against the float32 reference, from 0 and after a cached prefix."""
    bs, hq, hk, d = 16, 9, 3, 64
    meta, cache, q = _paged_batch([(0, 900), (600, 200)], bs, hq, hk, d, torch.bfloat16)
    for i, n in enumerate(meta.seq_lens.tolist()):
        for p in range(0, n, bs):  # each page of the sequence, in position order
            page = int(meta.block_tables[i, p // bs])
            cache[0, page] = (cache[0, page].float() * growth ** (p / 256)).to(torch.bfloat16)
    got = paged_attention_cpu(q, cache, meta, d**-0.5, None)
    want = paged_attention_ref(q.float(), cache.float(), meta, d**-0.5, None)
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 3, 8, 11])  # below, at and across the kernel's 8-row tile
@pytest.mark.parametrize("n,k", [(40, 64), (17, 100), (33, 576)])  # K not a multiple of 64 too
def test_int8_linear_matches_reference(dtype: torch.dtype, m: int, n: int, k: int) -> None:
    w = randn(n, k, dtype=torch.float32, seed=3) * 0.1
    wq = quantize_int8_weight(w)
    x, bias = randn(m, k, dtype=dtype, seed=4), randn(n, dtype=dtype, seed=5)
    for b in (None, bias):
        got = ext.int8_linear(x, wq, n, b)
        want = int8_linear_ref(x, wq, n, b)
        tol = 1e-5 if dtype == torch.float32 else 2 ** -7
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * want.abs().max().item())
        assert torch.equal(torch.cat([ext.int8_linear(x[i:i + 1], wq, n, b) for i in range(m)]), got)
    # and the quantization itself costs little against the float matmul
    exact = x.float() @ w.t()
    assert ((ext.int8_linear(x, wq, n, None).float() - exact).abs().max() / exact.abs().max()) < 0.03
    with pytest.raises(RuntimeError, match="panels do not hold"):
        ext.int8_linear(x, wq, n + 16, None)


def test_int8_panel_layout() -> None:
    """The bytes are where quant_linear.cpp says: row i of a panel, element 4g + j of block b in byte
    64g + 4i + j of the block (offset-binary), then the 16 rows' scales; rows past N (18 -> 32): 128, scale 0."""
    from rivulet.kernels.quant import dequantize_int8_weight

    n, k = 18, 128
    q = torch.randint(-127, 128, (n, k), generator=torch.Generator().manual_seed(2))
    q[:, ::64] = 127  # every block's max is 127: scale = amax / 127 = 0.5
    w = q.float() * 0.5
    packed = quantize_int8_weight(w)
    assert packed.shape == (2, 2, 1088) and packed.dtype == torch.uint8
    for row, b, g, j in [(0, 0, 0, 0), (5, 1, 9, 3), (17, 1, 15, 1), (16, 0, 1, 2)]:
        p, i = divmod(row, 16)
        assert int(packed[p, b, 64 * g + 4 * i + j]) == q[row, 64 * b + 4 * g + j] + 128
        assert packed[p, b, 1024 + 4 * i:1024 + 4 * i + 4].view(torch.float32).item() == 0.5
    assert (packed[1, :, :1024].view(2, 16, 16, 4)[:, :, 2:] == 128).all()  # rows 18..31: zero weights
    assert not packed[1, :, 1024:].view(2, 16, 4)[:, 2:].any()  # and scale 0
    torch.testing.assert_close(dequantize_int8_weight(packed, n), w, rtol=0, atol=0)


def test_int4_quantization_round_trips_q4_1_values() -> None:
    """Weights already on a Q4_1 grid (d * q + m per block of 32, fp16 d and m, q spanning 0..15) come back
    exactly."""
    g = torch.Generator().manual_seed(6)
    n, k = 8, 128
    q = torch.randint(0, 16, (n, k // 32, 32), generator=g)
    q[..., 0], q[..., 1] = 0, 15  # llama.cpp's rule puts the block min at 0 and max at 15
    d, m = torch.rand(n, k // 32, 1, generator=g) * 0.1, torch.randn(n, k // 32, 1, generator=g) * 0.1
    d, m = d.half().float(), m.half().float()  # Q4_1 stores them in fp16
    w = (q * d + m).view(n, k)
    from rivulet.kernels.quant import dequantize_int4_weight, quantize_int4_weight

    torch.testing.assert_close(dequantize_int4_weight(quantize_int4_weight(w), n), w, rtol=0, atol=1e-6)


def test_int4_panel_layout() -> None:
    """The bytes are where quant_linear.cpp says: row i of a panel, element 8v + j (j < 4) in the low nibble of
    byte 64v + 4i + j of its block, element 8v + 4 + j in the high one; then the 16 rows' d and m (fp16); rows
    past N (here 18 -> 32) zero."""
    from rivulet.kernels.quant import quantize_int4_weight

    n, k = 18, 64
    q = torch.randint(0, 16, (n, k), generator=torch.Generator().manual_seed(2))
    q[:, ::32], q[:, 1::32] = 0, 15  # every block spans 0..15: d = 1, m = -3
    w = (q - 3).float()
    packed = quantize_int4_weight(w)
    assert packed.shape == (2, 2, 320) and packed.dtype == torch.uint8
    for row, b, v, j in [(0, 0, 0, 0), (5, 1, 2, 3), (17, 1, 3, 1), (16, 0, 1, 2)]:
        p, i = divmod(row, 16)
        byte = int(packed[p, b, 64 * v + 4 * i + j])
        assert byte & 0x0F == q[row, 32 * b + 8 * v + j] and byte >> 4 == q[row, 32 * b + 8 * v + 4 + j]
        d, m = (packed[p, b, o + 2 * i:o + 2 * i + 2].view(torch.float16).item() for o in (256, 288))
        assert (d, m) == (1.0, -3.0)
    assert not packed[1, :, :256].view(2, 4, 16, 4)[:, :, 2:].any()  # rows 18..31: no nibbles
    assert not packed[1, :, 256:].view(2, 2, 16, 2)[:, :, 2:].any()  # nor d, m


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k", [(40, 64), (17, 100), (33, 576), (3, 1536)])
def test_int4_quantizer_is_the_reference_bitwise(dtype: torch.dtype, n: int, k: int) -> None:
    from rivulet.kernels.quant import quantize_int4_weight

    w = (randn(n, k, dtype=torch.float32, seed=6) * 0.05).to(dtype)
    w[0, :32] = 0.25  # a constant block: d = 0, every q = 0
    w[1, 32:64] = torch.linspace(-1, 1, 32)  # values on the rounding boundaries of (w - m) / d
    got, want = ext.quantize_int4(w), quantize_int4_weight(w)
    assert got.dtype == want.dtype == torch.uint8 and torch.equal(got, want)


def test_int4_scales_beyond_fp16_are_refused() -> None:
    from rivulet.kernels.quant import quantize_int4_weight

    w = torch.zeros(2, 64)
    w[0, 0] = 1e6  # d = 1e6 / 15 > 65504
    with pytest.raises(ValueError, match="beyond the fp16 range"):
        quantize_int4_weight(w)
    with pytest.raises(RuntimeError, match="beyond the fp16 range"):
        ext.quantize_int4(w)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 4, 6, 8, 11])
@pytest.mark.parametrize("n,k", [(40, 64), (17, 100), (33, 576)])
def test_int4_linear_matches_reference(dtype: torch.dtype, m: int, n: int, k: int) -> None:
    """Close to the reference arithmetic and to the float product; each row's numbers do not depend on the
    rows beside it (tiles of up to 8 rows share the weight loads)."""
    from rivulet.kernels.quant import int4_linear_ref, quantize_int4_weight

    w = randn(n, k, dtype=torch.float32, seed=3) * 0.1
    packed = quantize_int4_weight(w)
    x, bias = randn(m, k, dtype=dtype, seed=4), randn(n, dtype=dtype, seed=5)
    for b in (None, bias):
        got = ext.int4_linear(x, packed, n, b)
        want = int4_linear_ref(x, packed, n, b)
        tol = 1e-5 if dtype == torch.float32 else 2 ** -7
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * want.abs().max().item())
        assert torch.equal(torch.cat([ext.int4_linear(x[i:i + 1], packed, n, b) for i in range(m)]), got)
    exact = x.float() @ w.t()
    assert ((ext.int4_linear(x, packed, n, None).float() - exact).abs().max() / exact.abs().max()) < 0.15
    with pytest.raises(RuntimeError, match="panels do not hold"):
        ext.int4_linear(x, packed, n + 16, None)



@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("halves", [2, 1])  # keys and values; a latent cache (MLA)
def test_copy_blocks_equals_the_reference(dtype: torch.dtype, halves: int) -> None:
    """Every layer's blocks from a cache into a host buffer's slots and back, bit for bit as the
    reference's gather and scatter; nothing else of either is written."""
    from rivulet.kernels.cpu.ops import copy_blocks
    from rivulet.kernels.kv_copy import copy_blocks_ref

    shapes = [(halves, 40, 4, 3, 8), (halves, 40, 4, 1, 24)]  # layers may differ in heads and head size
    caches = [randn(*s, dtype=dtype, seed=i) for i, s in enumerate(shapes)]
    host = [randn(s[0], 17, *s[2:], dtype=dtype, seed=10 + i) for i, s in enumerate(shapes)]
    blocks, slots = torch.tensor([39, 0, 7, 12, 3]), torch.tensor([16, 2, 0, 9, 5])
    for src, dst, a, b in [(caches, host, blocks, slots), (host, caches, slots, blocks)]:
        want = [t.clone() for t in dst]
        copy_blocks_ref(src, want, a, b)
        copy_blocks(src, dst, a, b)
        assert all(torch.equal(x, y) for x, y in zip(dst, want))
    with pytest.raises(RuntimeError, match="out of range"):
        ext.copy_blocks(caches, host, torch.tensor([40]), torch.tensor([0]))
    with pytest.raises(RuntimeError, match="same block shape"):
        ext.copy_blocks(caches[:1], host[1:], blocks, slots)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [1, 7, 16, 33, 49152])
def test_argmax_rows_is_torchs_argmax(vocab: int, dtype: torch.dtype) -> None:
    """Greedy sampling's argmax: torch's index everywhere, ties (the first), +-inf, NaN (the first NaN, as torch),
    rows of a wider tensor, vocabularies that are not a multiple of the vector width; bf16 logits give the
    index of their float32 copies (an all-greedy step samples the LM head's bf16 output without widening it)."""
    from rivulet.kernels.cpu.ops import argmax_rows

    x = randn(9, vocab, dtype=torch.float32).to(dtype)
    x = torch.cat([x, x], 1)[:, :vocab] if vocab > 1 else x  # rows with a stride wider than the vocabulary
    x[1] = 0.5  # all tied: index 0
    x[2] = float("-inf")
    if vocab > 1:
        x[3, vocab - 1] = float("inf")  # the maximum in the tail
        x[4, [vocab // 3, vocab - 1]] = 99.0  # tied maxima: the first
        x[5, [vocab - 1, vocab // 2]] = float("nan")  # NaNs win, the first of them
        x[6, 0], x[6, vocab // 2] = -0.0, 0.0
        x[6, 1:vocab // 2], x[6, vocab // 2 + 1:] = -1.0, -1.0
    assert torch.equal(argmax_rows(x), x.float().argmax(dim=-1))
    assert argmax_rows(x).dtype == torch.int64
    if dtype == torch.bfloat16 and vocab > 16:  # the C++ kernel, not torch's fallback: bf16 ties broken by index
        assert x.dtype == torch.bfloat16 and x.stride(1) == 1
        y = torch.zeros(2, vocab, dtype=dtype)
        y[0, 5], y[0, vocab - 2] = 1.0, 1.0
        y[1, vocab - 1] = torch.finfo(torch.bfloat16).tiny
        assert argmax_rows(y).tolist() == [5, vocab - 1]
