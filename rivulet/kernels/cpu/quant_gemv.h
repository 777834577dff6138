// The weight-only quantized formats of the CPU linears (quant_linear.cpp's arithmetic, shared with
// decode_program.cpp): activations quantized to int8 per block (`QuantRow`) and the dot product of
// one weight row with up to kRowTile activation rows, for int8 (Q8_0-like) and int4 (Q4_1-like)
// weights. The layouts and the arithmetic are described at the top of quant_linear.cpp.
#pragma once
#include <torch/extension.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
#include <immintrin.h>
#define RIVULET_VNNI 1
#endif

namespace {

constexpr int64_t kChunk = 64;   // bytes of activations per vpdpbusd
constexpr int64_t kRowTile = 5;  // rows of x sharing each weight load, at most (6 spills registers)
constexpr int64_t kPrefetchRows = 4;  // weight rows read ahead of the one in use

struct QuantRow {
  std::vector<int8_t> q;    // [K padded to kChunk]
  std::vector<float> scale;  // [num_blocks]
  std::vector<float> sum;    // [num_blocks] sum of q over the block
  std::vector<float> scaled_sum;  // [num_blocks] scale * sum
};

template <typename T>
inline float to_float(T v) { return static_cast<float>(v); }

template <typename T>
void quantize_row(const T* x, int64_t K, int64_t Kp, int64_t block, QuantRow& out) {
  const int64_t nb = Kp / block;
  out.q.assign(Kp, 0);
  out.scale.assign(nb, 0.f);
  out.sum.assign(nb, 0.f);
  out.scaled_sum.assign(nb, 0.f);
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t k0 = b * block, k1 = std::min(K, k0 + block);
    float amax = 0.f;
    for (int64_t k = k0; k < k1; ++k) amax = std::max(amax, std::fabs(to_float(x[k])));
    const float s = amax / 127.f;
    int32_t sum = 0;
    for (int64_t k = k0; k < k1; ++k) {
      const int32_t v = s > 0.f ? static_cast<int32_t>(std::nearbyint(to_float(x[k]) / s)) : 0;
      out.q[k] = static_cast<int8_t>(v);
      sum += v;
    }
    out.scale[b] = s;
    out.sum[b] = static_cast<float>(sum);
    out.scaled_sum[b] = s * static_cast<float>(sum);
  }
}

#ifdef RIVULET_VNNI
// The 8 block sums of 4 chunks' vpdpbusd results d0..d3 (lanes 0-7 of chunk j: block 2j, lanes
// 8-15: block 2j + 1), in block order.
inline __m256i block_sums(__m512i d0, __m512i d1, __m512i d2, __m512i d3) {
  const __m512i a = _mm512_add_epi32(_mm512_unpacklo_epi32(d0, d1), _mm512_unpackhi_epi32(d0, d1));
  const __m512i b = _mm512_add_epi32(_mm512_unpacklo_epi32(d2, d3), _mm512_unpackhi_epi32(d2, d3));
  // 128-bit lane L of c: [d0, d1, d2, d3] summed over their 4 lanes in L (L 0-1: first blocks, 2-3: second)
  const __m512i c = _mm512_add_epi32(_mm512_unpacklo_epi64(a, b), _mm512_unpackhi_epi64(a, b));
  const __m512i idx = _mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15);
  const __m512i p = _mm512_permutexvar_epi32(idx, c);
  return _mm256_add_epi32(_mm512_castsi512_si256(p), _mm512_extracti64x4_epi64(p, 1));
}

inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#endif

// A weight format: its block size, bytes per 64-chunk, and the dot of one weight row with R
// activation rows.
struct Int8Format {
  static constexpr int64_t kBlock = 64;
  const uint8_t* w; const float* ws; int64_t row_bytes, nb;

  template <int R>
  void dot(int64_t n, const QuantRow* xr, float* out) const {
    const uint8_t* wr = w + n * row_bytes;
    const float* s = ws + n * nb;
    float corr[R] = {};
#ifdef RIVULET_VNNI
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t o = 0; o < row_bytes; o += 64) _mm_prefetch(reinterpret_cast<const char*>(wr + kPrefetchRows * row_bytes + o), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(s + kPrefetchRows * nb), _MM_HINT_T0);
    for (int64_t b = 0; b < nb; ++b) {
      const __m512i wv = _mm512_loadu_si512(wr + b * 64);
      for (int r = 0; r < R; ++r) {
        const __m512i d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv, _mm512_loadu_si512(xr[r].q.data() + b * 64));
        const float c = s[b] * xr[r].scale[b];
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_set1_ps(c), acc[r]);
        corr[r] += c * 128.f * xr[r].sum[b];
      }
    }
    for (int r = 0; r < R; ++r) out[r] = _mm512_reduce_add_ps(acc[r]) - corr[r];
#else
    for (int r = 0; r < R; ++r) {
      float acc = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        int32_t d = 0;
        for (int64_t k = 0; k < 64; ++k) d += int32_t(wr[b * 64 + k]) * int32_t(xr[r].q[b * 64 + k]);
        acc += s[b] * xr[r].scale[b] * (float(d) - 128.f * xr[r].sum[b]);
      }
      out[r] = acc;
    }
    (void)corr;
#endif
  }
};

struct Int4Format {
  static constexpr int64_t kBlock = 32;
  const uint8_t* w; const float* wd; const float* wm; int64_t row_bytes, nb;

#ifdef RIVULET_VNNI
  // acc[r] += the 8 blocks of chunks c0 .. c0 + cn - 1 (cn <= 4) of weight row wr against activation row r
  template <int R>
  static inline __attribute__((always_inline)) void group(const uint8_t* wr, const float* d, const float* m,
                                                          const QuantRow* xr, int64_t c0, int cn, __m256* acc) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    __m512i dp[R][4];
    for (int j = 0; j < 4; ++j) {
      if (j >= cn) {
        for (int r = 0; r < R; ++r) dp[r][j] = _mm512_setzero_si512();
        continue;
      }
      const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr + (c0 + j) * 32));
      const __m256i lo = _mm256_and_si256(packed, low);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low);
      const __m512i wv = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);  // elements 0..63 in order
      for (int r = 0; r < R; ++r)
        dp[r][j] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv, _mm512_loadu_si512(xr[r].q.data() + (c0 + j) * 64));
    }
    const int64_t b0 = 2 * c0;
    const __mmask8 mask = static_cast<__mmask8>((1u << (2 * cn)) - 1);
    const __m256 dv = _mm256_maskz_loadu_ps(mask, d + b0), mv = _mm256_maskz_loadu_ps(mask, m + b0);
    for (int r = 0; r < R; ++r) {
      const __m256 sums = _mm256_cvtepi32_ps(block_sums(dp[r][0], dp[r][1], dp[r][2], dp[r][3]));
      const __m256 sx = _mm256_maskz_loadu_ps(mask, xr[r].scale.data() + b0);
      acc[r] = _mm256_fmadd_ps(sums, _mm256_mul_ps(dv, sx), acc[r]);
      acc[r] = _mm256_fmadd_ps(mv, _mm256_maskz_loadu_ps(mask, xr[r].scaled_sum.data() + b0), acc[r]);
    }
  }
#endif

  template <int R>
  void dot(int64_t n, const QuantRow* xr, float* out) const {
    const uint8_t* wr = w + n * row_bytes;
    const float* d = wd + n * nb;
    const float* m = wm + n * nb;
#ifdef RIVULET_VNNI
    // Groups of 4 chunks (8 blocks): one vpdpbusd per chunk and activation row, then the 8 block
    // sums of the group in one vector, scaled by d * sx and with the min term m * sx * xsum added
    // 8 blocks at a time (no per-block scalar work).
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t o = 0; o < row_bytes; o += 64) _mm_prefetch(reinterpret_cast<const char*>(wr + kPrefetchRows * row_bytes + o), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(d + kPrefetchRows * nb), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(m + kPrefetchRows * nb), _MM_HINT_T0);
    const int64_t nc = nb / 2;  // chunks of 64 in the row
    int64_t c0 = 0;
    for (; c0 + 4 <= nc; c0 += 4) group<R>(wr, d, m, xr, c0, 4, acc);
    if (c0 < nc) group<R>(wr, d, m, xr, c0, static_cast<int>(nc - c0), acc);
    for (int r = 0; r < R; ++r) out[r] = hsum256(acc[r]);
#else
    for (int r = 0; r < R; ++r) {
      float acc = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        int32_t dp = 0;
        for (int64_t k = 0; k < 32; ++k) {
          const int64_t e = b * 32 + k, byte = (e / 64) * 32 + (e % 32);
          const int32_t q = (e % 64) < 32 ? (wr[byte] & 0x0F) : (wr[byte] >> 4);
          dp += q * int32_t(xr[r].q[e]);
        }
        acc += xr[r].scale[b] * (d[b] * float(dp) + m[b] * xr[r].sum[b]);
      }
      out[r] = acc;
    }
#endif
  }
};

// y[m, n] = round_T(x_m . W_n + b[n]) for the weight rows n in [n0, n1) and the M quantized rows xq,
// up to kRowTile rows of x sharing each weight row's loads (one thread's share of a linear). Each
// output is computed the same way whatever the tiling (rows are independent lanes of the kernel).
template <typename T, typename Fmt>
void gemv_rows(const Fmt& fmt, const QuantRow* xq, int64_t M, int64_t n0, int64_t n1, const T* bias, T* y, int64_t N) {
  float tile[kRowTile];
  const int64_t tiles = (M + kRowTile - 1) / kRowTile;  // as even as possible: 8 rows are 4 + 4, not 5 + 3
  for (int64_t n = n0; n < n1; ++n) {
    const float b = bias ? to_float(bias[n]) : 0.f;
    for (int64_t t = 0, m = 0; t < tiles; ++t) {
      const int64_t r = (M - m) / (tiles - t);
      switch (r) {
        case 1: fmt.template dot<1>(n, xq + m, tile); break;
        case 2: fmt.template dot<2>(n, xq + m, tile); break;
        case 3: fmt.template dot<3>(n, xq + m, tile); break;
        case 4: fmt.template dot<4>(n, xq + m, tile); break;
        default: fmt.template dot<kRowTile>(n, xq + m, tile); break;
      }
      for (int64_t i = 0; i < r; ++i) y[(m + i) * N + n] = static_cast<T>(tile[i] + b);
      m += r;
    }
  }
}

}  // namespace
