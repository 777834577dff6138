// The weight-only quantized formats of the CPU linears (quant_linear.cpp's arithmetic, shared with
// decode_program.cpp): activations quantized to int8 per block (`QuantRow`) and the dot products of
// one panel of 16 weight rows with up to 8 activation rows, for int8 (Q8_0-like) and int4
// (Q4_1-like) weights. The layouts and the arithmetic are described at the top of quant_linear.cpp.
#pragma once
#include <torch/extension.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
#include <immintrin.h>
#define RIVULET_VNNI 1
#endif

namespace {

constexpr int64_t kChunk = 64;  // activations are padded to a multiple of this
constexpr int64_t kQuantPanel = 16;  // weight rows per panel: one zmm of int32 / float lanes
constexpr int kMaxTile = 8;     // activation rows sharing each weight load
constexpr int64_t kPrefetchBlocks = 8;  // weight blocks read ahead of the one in use (one stream per panel)

// the fp16 value stored at p, as float
inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// the 4 activation bytes k .. k + 3 of a quantized row as one int32 (vpdpbusd's broadcast operand)
inline int32_t four(const int8_t* q) {
  int32_t v;
  std::memcpy(&v, q, 4);
  return v;
}

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

// int8 weights in panels of 16 rows (quant_linear.cpp describes the layout): one block of 64 is 16
// groups of 64 bytes, row i's elements 4g .. 4g + 3 in bytes 4i .. 4i + 3 of group g, then the 16
// rows' scales. One vpdpbusd per group against 4 activation bytes broadcast covers the 16 rows.
struct Int8Format {
  static constexpr int64_t kBlock = 64, kBlockBytes = 1088;
  const uint8_t* w; int64_t nb;  // w [P, nb, kBlockBytes]

  // out[r * 16 + i] = x_r . W[16 p + i] for R activation rows
  template <int R>
  void panel(int64_t p, const QuantRow* xr, float* out) const {
    const uint8_t* wp = w + p * nb * kBlockBytes;
#ifdef RIVULET_VNNI
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = wp + b * kBlockBytes;
      for (int64_t o = 0; o < kBlockBytes; o += 64)
        _mm_prefetch(reinterpret_cast<const char*>(blk + kPrefetchBlocks * kBlockBytes + o), _MM_HINT_T0);
      __m512i s[R];
      for (int r = 0; r < R; ++r) s[r] = _mm512_setzero_si512();
      for (int g = 0; g < 16; ++g) {
        const __m512i wv = _mm512_loadu_si512(blk + g * 64);
        for (int r = 0; r < R; ++r)
          s[r] = _mm512_dpbusd_epi32(s[r], wv, _mm512_set1_epi32(four(xr[r].q.data() + b * kBlock + g * 4)));
      }
      const __m512 sv = _mm512_loadu_ps(reinterpret_cast<const float*>(blk + 1024));
      for (int r = 0; r < R; ++r) {  // (dot - 128 * xsum) * ws * sx, the offset of the stored weights removed
        const __m512 c = _mm512_mul_ps(sv, _mm512_set1_ps(xr[r].scale[b]));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[r]), c, acc[r]);
        acc[r] = _mm512_fnmadd_ps(c, _mm512_set1_ps(128.f * xr[r].sum[b]), acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * kQuantPanel, acc[r]);
#else
    for (int r = 0; r < R; ++r) {
      for (int i = 0; i < kQuantPanel; ++i) {
        float acc = 0.f;
        for (int64_t b = 0; b < nb; ++b) {
          const uint8_t* blk = wp + b * kBlockBytes;
          int32_t dot = 0;
          for (int g = 0; g < 16; ++g)
            for (int j = 0; j < 4; ++j) dot += int32_t(blk[g * 64 + i * 4 + j]) * xr[r].q[b * kBlock + g * 4 + j];
          float ws;
          std::memcpy(&ws, blk + 1024 + 4 * i, 4);
          const float c = ws * xr[r].scale[b];
          acc = std::fma(float(dot), c, acc);
          acc = std::fma(-c, 128.f * xr[r].sum[b], acc);
        }
        out[r * kQuantPanel + i] = acc;
      }
    }
#endif
  }
};

// int4 weights in panels of 16 rows (quant_linear.cpp describes the layout): one weight block of a
// panel is kBlockBytes bytes, 4 groups of 64 bytes of 4-bit values then the 16 rows' d and m (fp16). One
// vpdpbusd of a group's low (high) nibbles against 4 activation bytes broadcast adds to all 16 rows'
// block dots at once, so the block's sum needs no horizontal reduction: 16 lanes are 16 outputs.
struct Int4Format {
  static constexpr int64_t kBlock = 32, kBlockBytes = 320;
  const uint8_t* w; int64_t nb;  // w [P, nb, kBlockBytes]

  // out[r * 16 + i] = x_r . W[16 p + i] for R activation rows
  template <int R>
  void panel(int64_t p, const QuantRow* xr, float* out) const {
    const uint8_t* wp = w + p * nb * kBlockBytes;
#ifdef RIVULET_VNNI
    const __m512i low = _mm512_set1_epi8(0x0F);
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = wp + b * kBlockBytes;
      for (int64_t o = 0; o < kBlockBytes; o += 64)
        _mm_prefetch(reinterpret_cast<const char*>(blk + kPrefetchBlocks * kBlockBytes + o), _MM_HINT_T0);
      __m512i s0[R], s1[R];
      for (int r = 0; r < R; ++r) s0[r] = s1[r] = _mm512_setzero_si512();
      for (int v = 0; v < 4; ++v) {
        const __m512i wv = _mm512_loadu_si512(blk + v * 64);
        const __m512i lo = _mm512_and_si512(wv, low), hi = _mm512_and_si512(_mm512_srli_epi16(wv, 4), low);
        for (int r = 0; r < R; ++r) {
          const int8_t* xq = xr[r].q.data() + b * kBlock + v * 8;
          s0[r] = _mm512_dpbusd_epi32(s0[r], lo, _mm512_set1_epi32(four(xq)));
          s1[r] = _mm512_dpbusd_epi32(s1[r], hi, _mm512_set1_epi32(four(xq + 4)));
        }
      }
      const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 256)));
      const __m512 mv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 288)));
      for (int r = 0; r < R; ++r) {
        const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(s0[r], s1[r]));
        acc[r] = _mm512_fmadd_ps(dot, _mm512_mul_ps(dv, _mm512_set1_ps(xr[r].scale[b])), acc[r]);
        acc[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(xr[r].scaled_sum[b]), acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * kQuantPanel, acc[r]);
#else
    for (int r = 0; r < R; ++r) {
      for (int i = 0; i < kQuantPanel; ++i) {
        float acc = 0.f;
        for (int64_t b = 0; b < nb; ++b) {
          const uint8_t* blk = wp + b * kBlockBytes;
          int32_t dot = 0;
          for (int v = 0; v < 4; ++v)
            for (int j = 0; j < 4; ++j) {
              const uint8_t byte = blk[v * 64 + i * 4 + j];
              dot += int32_t(byte & 0x0F) * xr[r].q[b * kBlock + v * 8 + j];
              dot += int32_t(byte >> 4) * xr[r].q[b * kBlock + v * 8 + 4 + j];
            }
          const float d = half_at(blk + 256 + 2 * i), m = half_at(blk + 288 + 2 * i);
          acc = std::fma(float(dot), d * xr[r].scale[b], acc);
          acc = std::fma(m, xr[r].scaled_sum[b], acc);
        }
        out[r * kQuantPanel + i] = acc;
      }
    }
#endif
  }
};

// y[m, n] = round_T(x_m . W_n + b[n]) for the panels [p0, p1) of 16 weight rows (n < N) and the M
// quantized rows xq, up to kMaxTile rows at a time (as even as possible). Each output is computed
// the same way whatever the tiling (rows are independent lanes of the kernel).
template <typename T, typename Fmt>
void gemv_panels(const Fmt& fmt, const QuantRow* xq, int64_t M, int64_t p0, int64_t p1, const T* bias, T* y,
                 int64_t N) {
  float tile[kMaxTile * kQuantPanel];
  const int64_t tiles = (M + kMaxTile - 1) / kMaxTile;
  for (int64_t p = p0; p < p1; ++p) {
    const int64_t n0 = p * kQuantPanel, cols = std::min(kQuantPanel, N - n0);
    for (int64_t t = 0, m = 0; t < tiles; ++t) {
      const int64_t r = (M - m) / (tiles - t);
      switch (r) {
        case 1: fmt.template panel<1>(p, xq + m, tile); break;
        case 2: fmt.template panel<2>(p, xq + m, tile); break;
        case 3: fmt.template panel<3>(p, xq + m, tile); break;
        case 4: fmt.template panel<4>(p, xq + m, tile); break;
        case 5: fmt.template panel<5>(p, xq + m, tile); break;
        case 6: fmt.template panel<6>(p, xq + m, tile); break;
        case 7: fmt.template panel<7>(p, xq + m, tile); break;
        default: fmt.template panel<kMaxTile>(p, xq + m, tile); break;
      }
      for (int64_t i = 0; i < r; ++i)
        for (int64_t c = 0; c < cols; ++c)
          y[(m + i) * N + n0 + c] = static_cast<T>(tile[i * kQuantPanel + c] + (bias ? to_float(bias[n0 + c]) : 0.f));
      m += r;
    }
  }
}

}  // namespace
