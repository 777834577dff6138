// Weight-only quantized linears for CPUs: y[M, N] = x[M, K] @ dequant(W)[N, K]^T (+ bias).
//
// Each row of x is quantized on the fly to int8 in blocks (one scale per block, like llama.cpp's
// Q8 activations), so the inner loop is one AVX512-VNNI `vpdpbusd` (u8 x s8) per 64
// multiply-adds, with float scaling once per block:
//
// int8:  W stored offset-binary (u8 = s8 + 128), one float scale per block of 64 of a row (Q8_0):
//          dot_b = sum_k u8(W)[n,k] * xq[k] = sum_k s8(W)[n,k] xq[k] + 128 * xsum[b]
//          y[n]  = sum_b ws[n,b] * sx[b] * (dot_b - 128 * xsum[b])
// int4:  W = d * q + m with q in 0..15, d and m per block of 32 of a row (llama.cpp's Q4_1, so a
//        Q4_1 GGUF tensor is represented exactly); two nibbles per byte, byte j of each 64-chunk
//        holding elements j (low nibble) and j + 32 (high nibble):
//          y[n]  = sum_b sx[b] * (d[n,b] * dot(q, xq)_b + m[n,b] * xsum[b])
//        taken 8 blocks at a time: the block dots of 4 chunks gathered into one vector, then two
//        vector FMAs (no scalar work per block), 1.2-1.5x the per-block scalar scaling (docs/cpu.md).
// Both read the weight rows a few rows ahead (software prefetch: ~1.2x at decode sizes, where the
// weights stream from memory).
// Without AVX512-VNNI scalar loops compute the same numbers.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstdint>
#include <vector>
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
#include <immintrin.h>
#define RIVULET_VNNI 1
#endif

namespace {

constexpr int64_t kChunk = 64;   // bytes of activations per vpdpbusd
constexpr int64_t kRowTile = 4;  // rows of x sharing each weight load
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

template <typename T, typename Fmt>
torch::Tensor run(const torch::Tensor& x_in, const Fmt& fmt, int64_t N, int64_t Kp, const c10::optional<torch::Tensor>& bias) {
  auto x = x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  auto y = torch::empty({M, N}, x.options());
  const bool has_bias = bias.has_value() && bias->defined();
  auto bb = has_bias ? bias->to(x.scalar_type()).contiguous() : torch::Tensor();
  const T* xp = x.data_ptr<T>(); const T* bp = has_bias ? bb.data_ptr<T>() : nullptr; T* yp = y.data_ptr<T>();
  std::vector<QuantRow> xq(M);
  at::parallel_for(0, M, 1, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) quantize_row(xp + m * K, K, Kp, Fmt::kBlock, xq[m]);
  });
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    float tile[kRowTile];
    for (int64_t n = n0; n < n1; ++n) {
      const float b = bp ? to_float(bp[n]) : 0.f;
      int64_t m = 0;
      for (; m + kRowTile <= M; m += kRowTile) {
        fmt.template dot<kRowTile>(n, xq.data() + m, tile);
        for (int r = 0; r < kRowTile; ++r) yp[(m + r) * N + n] = static_cast<T>(tile[r] + b);
      }
      for (; m < M; ++m) {
        fmt.template dot<1>(n, xq.data() + m, tile);
        yp[m * N + n] = static_cast<T>(tile[0] + b);
      }
    }
  });
  return y;
}

template <typename Fmt>
torch::Tensor dispatch(const torch::Tensor& x, const Fmt& fmt, int64_t N, int64_t Kp,
                       const c10::optional<torch::Tensor>& bias) {
  if (x.scalar_type() == torch::kBFloat16) return run<at::BFloat16>(x, fmt, N, Kp, bias);
  TORCH_CHECK(x.scalar_type() == torch::kFloat32, "quantized linear: x must be float32 or bfloat16");
  return run<float>(x, fmt, N, Kp, bias);
}

void check_x(const torch::Tensor& x, int64_t Kp) {
  TORCH_CHECK(x.dim() == 2, "quantized linear: x must be [M, K]");
  TORCH_CHECK(Kp % kChunk == 0 && Kp >= x.size(1) && Kp < x.size(1) + kChunk, "quantized linear: padded width ", Kp,
              " does not fit K=", x.size(1));
}

}  // namespace

// w [N, Kp] uint8 (Kp = K rounded up to 64, padding 128); w_scale [N, Kp / 64] float32.
torch::Tensor int8_linear(torch::Tensor x, torch::Tensor w, torch::Tensor w_scale, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kUInt8 && w.is_contiguous(), "int8_linear: w [N, Kp] uint8");
  const int64_t N = w.size(0), Kp = w.size(1);
  check_x(x, Kp);
  TORCH_CHECK(w_scale.scalar_type() == torch::kFloat32 && w_scale.is_contiguous() && w_scale.numel() == N * (Kp / 64),
              "int8_linear: w_scale [N, Kp/64] float32");
  Int8Format fmt{w.data_ptr<uint8_t>(), w_scale.data_ptr<float>(), Kp, Kp / 64};
  return dispatch(x, fmt, N, Kp, bias);
}

// w [N, Kp / 2] uint8 (two 4-bit values per byte); scale, min [N, Kp / 32] float32.
torch::Tensor int4_linear(torch::Tensor x, torch::Tensor w, torch::Tensor scale, torch::Tensor minv,
                          c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kUInt8 && w.is_contiguous(), "int4_linear: w [N, Kp/2] uint8");
  const int64_t N = w.size(0), Kp = w.size(1) * 2;
  check_x(x, Kp);
  for (const auto* t : {&scale, &minv})
    TORCH_CHECK(t->scalar_type() == torch::kFloat32 && t->is_contiguous() && t->numel() == N * (Kp / 32),
                "int4_linear: scale/min [N, Kp/32] float32");
  Int4Format fmt{w.data_ptr<uint8_t>(), scale.data_ptr<float>(), minv.data_ptr<float>(), Kp / 2, Kp / 32};
  return dispatch(x, fmt, N, Kp, bias);
}

// quantize_int4_weight (rivulet/kernels/quant.py) in one pass over the weight, with the same float32
// operations in the same order (so the same bits): per block of 32 (K zero-padded to a multiple of
// 64) m = min, d = (max - min) / 15, q = round-half-even((w - m) / d) clamped to 0..15 (0 where
// d == 0); byte j of each 64-chunk holds q[j] | q[j + 32] << 4. Returns (packed, d, m).
template <typename T>
void quantize_int4_rows(const T* w, int64_t N, int64_t K, int64_t Kp, uint8_t* packed, float* d, float* m) {
  const int64_t nb = Kp / 32;
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    float blk[32];
    uint8_t q[64];
    for (int64_t n = n0; n < n1; ++n) {
      const T* row = w + n * K;
      for (int64_t c = 0; c < Kp / 64; ++c) {
        for (int h = 0; h < 2; ++h) {
          const int64_t b = 2 * c + h, k0 = b * 32;
          float lo = INFINITY, hi = -INFINITY;
          for (int j = 0; j < 32; ++j) {
            blk[j] = k0 + j < K ? to_float(row[k0 + j]) : 0.f;
            lo = std::min(lo, blk[j]);
            hi = std::max(hi, blk[j]);
          }
          const float dd = (hi - lo) / 15.f;
          d[n * nb + b] = dd;
          m[n * nb + b] = lo;
          for (int j = 0; j < 32; ++j) {
            const float v = dd > 0.f ? std::nearbyint((blk[j] - lo) / dd) : 0.f;
            q[h * 32 + j] = static_cast<uint8_t>(std::min(std::max(v, 0.f), 15.f));
          }
        }
        uint8_t* out = packed + n * (Kp / 2) + c * 32;
        for (int j = 0; j < 32; ++j) out[j] = static_cast<uint8_t>(q[j] | (q[32 + j] << 4));
      }
    }
  });
}

std::vector<torch::Tensor> quantize_int4(torch::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2, "quantize_int4: weight [N, K]");
  auto w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1), Kp = (K + kChunk - 1) / kChunk * kChunk;
  auto packed = torch::empty({N, Kp / 2}, w.options().dtype(torch::kUInt8));
  auto d = torch::empty({N, Kp / 32}, w.options().dtype(torch::kFloat32));
  auto m = torch::empty_like(d);
  if (w.scalar_type() == torch::kBFloat16) {
    quantize_int4_rows(w.data_ptr<at::BFloat16>(), N, K, Kp, packed.data_ptr<uint8_t>(), d.data_ptr<float>(),
                       m.data_ptr<float>());
  } else {
    auto wf = w.to(torch::kFloat32);
    quantize_int4_rows(wf.data_ptr<float>(), N, K, Kp, packed.data_ptr<uint8_t>(), d.data_ptr<float>(),
                       m.data_ptr<float>());
  }
  return {packed, d, m};
}

bool has_vnni() {
#ifdef RIVULET_VNNI
  return true;
#else
  return false;
#endif
}

void register_cpu_ops(py::module& m);
void register_gguf_ops(py::module& m);
void register_amx_ops(py::module& m);
void register_prefill_attention(py::module& m);
void register_bf16_linear(py::module& m);

TORCH_LIBRARY_FRAGMENT(rivulet, m) {
  m.def("int8_linear(Tensor x, Tensor w, Tensor w_scale, Tensor? bias) -> Tensor");
  m.def("int4_linear(Tensor x, Tensor w, Tensor scale, Tensor minv, Tensor? bias) -> Tensor");
}
TORCH_LIBRARY_IMPL(rivulet, CPU, m) {
  m.impl("int8_linear", &int8_linear);
  m.impl("int4_linear", &int4_linear);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  register_cpu_ops(m);
  register_gguf_ops(m);
  register_amx_ops(m);
  register_prefill_attention(m);
  register_bf16_linear(m);
  m.def("int8_linear", &int8_linear, "weight-only int8 linear (VNNI)", py::arg("x"), py::arg("w"),
        py::arg("w_scale"), py::arg("bias") = py::none());
  m.def("int4_linear", &int4_linear, "weight-only 4-bit (Q4_1-style) linear (VNNI)", py::arg("x"), py::arg("w"),
        py::arg("scale"), py::arg("minv"), py::arg("bias") = py::none());
  m.def("quantize_int4", &quantize_int4, "quantize_int4_weight in one pass (same bits)", py::arg("weight"));
  m.def("has_vnni", &has_vnni);
}
