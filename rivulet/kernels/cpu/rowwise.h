// Row-wise building blocks of the CPU kernels (cpu_ops.cpp, decode_program.cpp): float/bf16 loads and
// rounding, RMSNorm of a row (with the residual add), a head's rotary embedding, SiLU-and-mul of a row.
// Each computes the PyTorch reference's numbers (float32 math, rounded to T where the reference rounds).
#pragma once
#include <torch/extension.h>
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "simd.h"
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace {

template <typename T> inline float f32(T v) { return static_cast<float>(v); }

#ifdef __AVX512F__
// 16 lanes of float from float or bf16 memory; lanes outside `mask` are zero.
inline __m512 load16(const float* p, __mmask16 mask) { return _mm512_maskz_loadu_ps(mask, p); }
inline __m512 load16(const at::BFloat16* p, __mmask16 mask) {
  const __m256i h = _mm256_maskz_loadu_epi16(mask, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __mmask16 tail_mask(int64_t left) { return left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1); }
// v rounded to T (round to nearest even for bf16, as a float), and stored as T. With AVX512-BF16 the rounding
// is one vcvtneps2bf16 (the integer rounding's 5 instructions, 2 with the store): the same bits except for
// floats below 2^-126, which it flushes to zero.
inline __m512 round_to(float, __m512 v) { return v; }
inline __m512 round_to(at::BFloat16, __m512 v) {
#ifdef __AVX512BF16__
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
#else
  __m512i b = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  b = _mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  return _mm512_castsi512_ps(_mm512_and_si512(b, _mm512_set1_epi32(int(0xFFFF0000u))));
#endif
}
inline void store16(float* p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }
inline void store16(at::BFloat16* p, __m512 v, __mmask16 m) {  // v already rounded
  _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v), 16)));
}
// round_to then store16, in one conversion where the machine has one
inline void store_rounded16(float* p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }
inline void store_rounded16(at::BFloat16* p, __m512 v, __mmask16 m) {
#ifdef __AVX512BF16__
  _mm256_mask_storeu_epi16(p, m, (__m256i)_mm512_cvtneps_pbh(v));
#else
  store16(p, round_to(at::BFloat16{}, v), m);
#endif
}
// store_rounded16, returning the rounded value
inline __m512 round_store16(float* p, __m512 v, __mmask16 m) { return _mm512_mask_storeu_ps(p, m, v), v; }
inline __m512 round_store16(at::BFloat16* p, __m512 v, __mmask16 m) {
#ifdef __AVX512BF16__
  const __m256i h = (__m256i)_mm512_cvtneps_pbh(v);
  _mm256_mask_storeu_epi16(p, m, h);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
#else
  v = round_to(at::BFloat16{}, v);
  store16(p, v, m);
  return v;
#endif
}
#endif

// sum_d q[d] * k[d], q in float.
template <typename T>
inline float dot(const float* q, const T* k, int64_t D) {
#ifdef __AVX512F__
  __m512 acc = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 16) {
    const __mmask16 m = tail_mask(D - d);
    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, q + d), load16(k + d, m), acc);
  }
  return _mm512_reduce_add_ps(acc);
#else
  float acc = 0.f;
  for (int64_t d = 0; d < D; ++d) acc += q[d] * f32(k[d]);
  return acc;
#endif
}

// sum_d p[d] * q[d] of two vectors of one dtype, in float.
template <typename T>
inline float dot_same(const T* p, const T* q, int64_t D) {
#ifdef __AVX512F__
  __m512 acc = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 16) {
    const __mmask16 m = tail_mask(D - d);
    acc = _mm512_fmadd_ps(load16(p + d, m), load16(q + d, m), acc);
  }
  return _mm512_reduce_add_ps(acc);
#else
  float acc = 0.f;
  for (int64_t d = 0; d < D; ++d) acc += f32(p[d]) * f32(q[d]);
  return acc;
#endif
}

// acc[d] += p * v[d], acc in float.
template <typename T>
inline void axpy(float* acc, float p, const T* v, int64_t D) {
#ifdef __AVX512F__
  const __m512 pv = _mm512_set1_ps(p);
  for (int64_t d = 0; d < D; d += 16) {
    const __mmask16 m = tail_mask(D - d);
    _mm512_mask_storeu_ps(acc + d, m, _mm512_fmadd_ps(pv, load16(v + d, m), _mm512_maskz_loadu_ps(m, acc + d)));
  }
#else
  for (int64_t d = 0; d < D; ++d) acc[d] += p * f32(v[d]);
#endif
}

template <typename F>
void dispatch(const torch::Tensor& t, const char* name, F&& f) {
  if (t.scalar_type() == torch::kFloat32) f(float{});
  else if (t.scalar_type() == torch::kBFloat16) f(at::BFloat16{});
  else TORCH_CHECK(false, name, ": float32 or bfloat16 expected, got ", t.scalar_type());
}

// sum of x[i]^2 for i < H: in four sums (chunk c of 16 floats into sum c % 4), added up in a fixed order (one chain
// of dependent adds, 4 cycles each, had bounded the norm: residual + RMSNorm 0.94-0.95x the time)
inline float sum_squares(const float* x, int64_t H) {
#ifdef __AVX512F__
  __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  int64_t i = 0;
  for (; i + 64 <= H; i += 64)
    for (int k = 0; k < 4; ++k) {
      const __m512 v = _mm512_loadu_ps(x + i + 16 * k);
      acc[k] = _mm512_add_ps(acc[k], _mm512_mul_ps(v, v));
    }
  for (int k = 0; i < H; i += 16, ++k) {
    const __m512 v = _mm512_maskz_loadu_ps(tail_mask(H - i), x + i);
    acc[k] = _mm512_add_ps(acc[k], _mm512_mul_ps(v, v));
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3])));
#else
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < H; ++i) ss += x[i] * x[i];
  return ss;
#endif
}

// out = weight * round_T(x * rsqrt(mean(x^2) + eps)); x already in float, the weight in T or already in float.
template <typename T, typename W = T>
inline void norm_row(const float* x, const W* w, T* out, int64_t H, float eps) {
  const float r = 1.f / std::sqrt(sum_squares(x, H) / H + eps);
#ifdef __AVX512F__
  const __m512 rv = _mm512_set1_ps(r);
  for (int64_t i = 0; i < H; i += 16) {
    const __mmask16 m = tail_mask(H - i);
    const __m512 n = round_to(T{}, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + i), rv));
    store_rounded16(out + i, _mm512_mul_ps(load16(w + i, m), n), m);
  }
#else
  for (int64_t i = 0; i < H; ++i) out[i] = static_cast<T>(f32(w[i]) * f32(static_cast<T>(x[i] * r)));
#endif
}

// buf = float(x), or with a residual: res = round_T(x + residual) and buf = float(res).
template <typename T>
inline void load_row(const T* x, const T* residual, T* res, float* buf, int64_t H) {
#ifdef __AVX512F__
  for (int64_t i = 0; i < H; i += 16) {
    const __mmask16 m = tail_mask(H - i);
    __m512 v = load16(x + i, m);
    if (residual != nullptr) v = round_store16(res + i, _mm512_add_ps(v, load16(residual + i, m)), m);  // adds in T
    _mm512_mask_storeu_ps(buf + i, m, v);
  }
#else
  for (int64_t i = 0; i < H; ++i) {
    if (residual != nullptr) {
      const T s = static_cast<T>(f32(x[i]) + f32(residual[i]));  // the reference adds in T
      res[i] = s;
      buf[i] = f32(s);
    } else {
      buf[i] = f32(x[i]);
    }
  }
#endif
}

// One head's rotary embedding, s -> d (D values; the first `rot` rotated by the position's cos/sin
// row cs = [cos half | sin half], the rest copied): neox pairs (i, i + rot/2) or interleaved pairs
// (2i, 2i + 1). The reference rounds cos/sin to T and each product to T too.
template <typename TT>
inline void rotate_head(const TT* s, TT* d, const float* cs, int64_t D, int64_t rot, bool interleaved) {
  const int64_t half = rot / 2;
#ifdef __AVX512F__
  if (!interleaved) {  // neox pairs (i, i + half): 16 pairs per vector
    for (int64_t i = 0; i < half; i += 16) {
      const __mmask16 m = tail_mask(half - i);
      const __m512 c = round_to(TT{}, _mm512_maskz_loadu_ps(m, cs + i));
      const __m512 sn = round_to(TT{}, _mm512_maskz_loadu_ps(m, cs + half + i));
      const __m512 x1 = load16(s + i, m), x2 = load16(s + half + i, m);
      const __m512 p1 = round_to(TT{}, _mm512_mul_ps(x1, c)), p2 = round_to(TT{}, _mm512_mul_ps(x2, sn));
      const __m512 p3 = round_to(TT{}, _mm512_mul_ps(x2, c)), p4 = round_to(TT{}, _mm512_mul_ps(x1, sn));
      store_rounded16(d + i, _mm512_sub_ps(p1, p2), m);
      store_rounded16(d + half + i, _mm512_add_ps(p3, p4), m);
    }
    for (int64_t i = rot; i < D; ++i) d[i] = s[i];
    return;
  }
#endif
  for (int64_t i = 0; i < half; ++i) {
    const float c = f32(static_cast<TT>(cs[i])), sn = f32(static_cast<TT>(cs[half + i]));
    const int64_t a = interleaved ? 2 * i : i, b = interleaved ? 2 * i + 1 : i + half;
    const float x1 = f32(s[a]), x2 = f32(s[b]);
    const float p1 = f32(static_cast<TT>(x1 * c)), p2 = f32(static_cast<TT>(x2 * sn));
    const float p3 = f32(static_cast<TT>(x2 * c)), p4 = f32(static_cast<TT>(x1 * sn));
    d[a] = static_cast<TT>(p1 - p2);
    d[b] = static_cast<TT>(p3 + p4);
  }
  for (int64_t i = rot; i < D; ++i) d[i] = s[i];
}

// o[i] = round_T(round_T(silu(g[i])) * u[i]) for i < D: the reference's two roundings (SiLU as
// g / (1 + exp(-g)) in float, like PyTorch's kernel).
template <typename T>
inline void silu_mul_row(const T* g, const T* u, T* o, int64_t D) {
#ifdef __AVX512F__
  for (int64_t i = 0; i < D; i += 16) {
    const __mmask16 m = tail_mask(D - i);
    const __m512 gv = load16(g + i, m), uv = load16(u + i, m);
    const __m512 e = simd::exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv));
    const __m512 s = round_to(T{}, _mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.f), e)));
    store_rounded16(o + i, _mm512_mul_ps(s, uv), m);
  }
#else
  for (int64_t i = 0; i < D; ++i) {
    const float gf = f32(g[i]);
    const T s = static_cast<T>(gf / (1.f + std::exp(-gf)));
    o[i] = static_cast<T>(f32(s) * f32(u[i]));
  }
#endif
}

}  // namespace
