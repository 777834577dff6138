// Decode attention's inner kernel for AVX-512 (cpu_ops.cpp's decode_attention, decode_program.cpp):
// the query heads of one KV head group over one sequence's paged context, fp32 softmax.
#pragma once
#include <torch/extension.h>
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "rowwise.h"
#ifdef __AVX512F__

namespace {

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// float8_e5m2 (a `--kv-cache-dtype fp8_e5m2` cache): the high byte of an IEEE half, so 16 of them widen to
// halves by a byte shift and to floats by vcvtph2ps (AVX-512F)
struct E5M2 {
  uint8_t bits;
};
inline __m512 load16(const E5M2* p) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(b), 8));
}

using simd::exp16;

// The horizontal sums of a, b, c, d as one vector [sum a, sum b, sum c, sum d].
inline __m128 reduce4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));  // per 128-bit lane
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  const __m512 v = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, 0x44), _mm512_shuffle_ps(ab, cd, 0xEE));
  return _mm_add_ps(_mm_add_ps(_mm512_extractf32x4_ps(v, 0), _mm512_extractf32x4_ps(v, 1)),
                    _mm_add_ps(_mm512_extractf32x4_ps(v, 2), _mm512_extractf32x4_ps(v, 3)));
}

// In place: sc[0..n) -> softmax(sc), float32.
inline void softmax_row(float* sc, int64_t n) {
  __m512 mx = _mm512_set1_ps(-INFINITY);
  for (int64_t j = 0; j < n; j += 16) mx = _mm512_max_ps(mx, _mm512_maskz_loadu_ps(tail_mask(n - j), sc + j));
  const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 k = tail_mask(n - j);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, sc + j), m));
    _mm512_mask_storeu_ps(sc + j, k, e);
    sum = _mm512_mask_add_ps(sum, k, sum, e);
  }
  const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(sum));
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 k = tail_mask(n - j);
    _mm512_mask_storeu_ps(sc + j, k, _mm512_mul_ps(_mm512_maskz_loadu_ps(k, sc + j), inv));
  }
}

// The rows of the next page of a sequence, one per row computed of the current one: the pages of a
// sequence lie anywhere in the cache, so the hardware prefetcher, which follows addresses, cannot
// run ahead across them. Spread out (not a burst of 2 x 16 lines at a page's start, which fills the
// core's line-fill buffers), each request has one page of compute (~150 ns) to arrive.
template <typename TT, int NV>
inline void prefetch_row(const TT* next_page, int64_t row, int64_t tok_stride) {
  if (next_page == nullptr) return;
  const char* p = reinterpret_cast<const char*>(next_page + row * tok_stride);
  for (int64_t b = 0; b < int64_t(NV * 16 * sizeof(TT)); b += 64) _mm_prefetch(p + b, _MM_HINT_T0);
}

template <typename TT>
inline const TT* page_after(const TT* base, const int* table, int64_t t, int64_t L, int64_t bs, int64_t page_stride) {
  const int64_t p = t / bs + 1;
  return p * bs < L ? base + int64_t(table[p]) * page_stride : nullptr;
}

// One (sequence, kv head): the G query heads of the group [G, NV*16] (float) over context tokens
// [start, L), read page by page in place, the next page prefetched while one is computed. Each key
// and value row is loaded once for all G heads.
template <typename TT, int NV>
void decode_group(const float* q, int64_t G, const TT* keys, const TT* values, const int* table, int64_t start,
                  int64_t L, int64_t bs, int64_t page_stride, int64_t tok_stride, float scale, float* sc, float* out) {
  constexpr int64_t D = NV * 16;
  const int64_t n = L - start;
  for (int64_t t = start; t < L;) {  // scores, page by page
    const int64_t off = t % bs, m = std::min(bs - off, L - t);
    const TT* kp = keys + int64_t(table[t / bs]) * page_stride + off * tok_stride;
    // the next key page, or during the last one the first value page (the value pass starts there)
    const TT* kn = page_after(keys, table, t, L, bs, page_stride);
    if (kn == nullptr) kn = values + int64_t(table[start / bs]) * page_stride;
    int64_t j = 0;
    for (; j + 4 <= m; j += 4, kp += 4 * tok_stride) {  // 4 tokens: their keys in float once, one 4-way reduction
      alignas(64) float kf[4][D];
      for (int r = 0; r < 4; ++r) {
        prefetch_row<TT, NV>(kn, j + r, tok_stride);
        for (int v = 0; v < NV; ++v) _mm512_store_ps(kf[r] + 16 * v, load16(kp + r * tok_stride + 16 * v));
      }
      for (int64_t g = 0; g < G; ++g) {
        __m512 a[4];
        for (int r = 0; r < 4; ++r) {
          a[r] = _mm512_mul_ps(_mm512_loadu_ps(q + g * D), _mm512_load_ps(kf[r]));
          for (int v = 1; v < NV; ++v)
            a[r] = _mm512_fmadd_ps(_mm512_loadu_ps(q + g * D + 16 * v), _mm512_load_ps(kf[r] + 16 * v), a[r]);
        }
        _mm_storeu_ps(sc + g * n + (t + j - start), _mm_mul_ps(reduce4(a[0], a[1], a[2], a[3]), _mm_set1_ps(scale)));
      }
    }
    for (; j < m; ++j, kp += tok_stride) {
      __m512 kv[NV];
      for (int v = 0; v < NV; ++v) kv[v] = load16(kp + 16 * v);
      for (int64_t g = 0; g < G; ++g) {
        __m512 a = _mm512_mul_ps(_mm512_loadu_ps(q + g * D), kv[0]);
        for (int v = 1; v < NV; ++v) a = _mm512_fmadd_ps(_mm512_loadu_ps(q + g * D + 16 * v), kv[v], a);
        sc[g * n + (t + j - start)] = _mm512_reduce_add_ps(a) * scale;
      }
    }
    t += m;
  }
  for (int64_t g = 0; g < G; ++g) softmax_row(sc + g * n, n);
  constexpr int64_t GB = 8;  // heads whose accumulators stay in registers while the values stream by
  for (int64_t g0 = 0; g0 < G; g0 += GB) {
    const int64_t gn = std::min(GB, G - g0);
    __m512 acc[GB][NV];
    for (int64_t g = 0; g < GB; ++g)
      for (int v = 0; v < NV; ++v) acc[g][v] = _mm512_setzero_ps();
    for (int64_t t = start; t < L;) {
      const int64_t off = t % bs, m = std::min(bs - off, L - t);
      const TT* vp = values + int64_t(table[t / bs]) * page_stride + off * tok_stride;
      const TT* vn = g0 == 0 ? page_after(values, table, t, L, bs, page_stride) : nullptr;
      for (int64_t j = 0; j < m; ++j, vp += tok_stride) {
        prefetch_row<TT, NV>(vn, j, tok_stride);
        __m512 vv[NV];
        for (int v = 0; v < NV; ++v) vv[v] = load16(vp + 16 * v);
        const int64_t col = t + j - start;
        for (int64_t g = 0; g < GB; ++g) {  // a fixed trip count keeps the accumulators in registers
          if (g >= gn) break;
          const __m512 p = _mm512_set1_ps(sc[(g0 + g) * n + col]);
          for (int v = 0; v < NV; ++v) acc[g][v] = _mm512_fmadd_ps(p, vv[v], acc[g][v]);
        }
      }
      t += m;
    }
    for (int64_t g = 0; g < gn; ++g)
      for (int v = 0; v < NV; ++v) _mm512_storeu_ps(out + (g0 + g) * D + 16 * v, acc[g][v]);
  }
}

template <typename TT>
using DecodeGroupFn = void (*)(const float*, int64_t, const TT*, const TT*, const int*, int64_t, int64_t, int64_t,
                               int64_t, int64_t, float, float*, float*);

template <typename TT>
DecodeGroupFn<TT> decode_group_for(int64_t D) {
  switch (D) {
    case 16: return decode_group<TT, 1>;
    case 32: return decode_group<TT, 2>;
    case 64: return decode_group<TT, 4>;
    case 80: return decode_group<TT, 5>;
    case 96: return decode_group<TT, 6>;
    case 128: return decode_group<TT, 8>;
    case 256: return decode_group<TT, 16>;
    default: return nullptr;
  }
}

}  // namespace
#endif  // __AVX512F__
