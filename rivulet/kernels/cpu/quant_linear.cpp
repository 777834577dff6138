// Weight-only quantized linears for CPUs: y[M, N] = x[M, K] @ dequant(W)[N, K]^T (+ bias).
//
// Each row of x is quantized on the fly to int8 in blocks (one scale per block, like llama.cpp's
// Q8 activations), so the inner loop is one AVX512-VNNI `vpdpbusd` (u8 x s8) per 64
// multiply-adds, with float scaling once per block:
//
// Both store W in panels of 16 rows, one stream of bytes per panel (read 8 blocks ahead), laid out
// so that one vpdpbusd of 64 weight bytes against 4 activation bytes broadcast adds to the block
// dots of all 16 rows: each lane of the sums is one output, no horizontal sums per block, and the
// weights loaded serve up to 8 activation rows (the rows of a verify step or a small decode batch).
//
// int8:  W stored offset-binary (u8 = s8 + 128), one float scale per block of 64 of a row (Q8_0),
//        w [P = ceil(N / 16), Kp / 64, 1088] uint8: per panel and block, 16 groups of 64 bytes where
//        bytes 4i .. 4i + 3 of group g hold row i's elements 4g .. 4g + 3, then the 16 rows' scales
//        (float32). Rows past N: weights 128, scale 0.
//          dot_b = sum_k u8(W)[n,k] * xq[k] = sum_k s8(W)[n,k] xq[k] + 128 * xsum[b]
//          y[n]  = sum_b ws[n,b] * sx[b] * (dot_b - 128 * xsum[b])
// int4:  W = d * q + m with q in 0..15, d and m per block of 32 of a row (llama.cpp's Q4_1, so a
//        Q4_1 GGUF tensor is represented exactly), w [P, Kp / 32, 320] uint8: per panel and block, 4
//        groups of 64 bytes where bytes 4i .. 4i + 3 of group v hold row i's elements 8v .. 8v + 3
//        (low nibbles) and 8v + 4 .. 8v + 7 (high ones), then the 16 rows' d and m (fp16, as in
//        Q4_1: 0.625 bytes a weight, where float32 scales made it 0.75). Rows past N are zero.
//          y[n]  = sum_b sx[b] * (d[n,b] * dot(q, xq)_b + m[n,b] * xsum[b])
// Against row-major weights (one row's dot across the lanes, reduced per block or per 8 blocks), a
// 5-row step of the default model's int4 linears takes ~0.5x the time (docs/cpu.md).
// Without AVX512-VNNI scalar loops compute the same numbers.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "quant_gemv.h"

namespace {

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
  at::parallel_for(0, (N + kQuantPanel - 1) / kQuantPanel, 1,
                   [&](int64_t p0, int64_t p1) { gemv_panels<T>(fmt, xq.data(), M, p0, p1, bp, yp, N); });
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

static void check_panels(const torch::Tensor& w, int64_t n, int64_t block_bytes, const char* what) {
  TORCH_CHECK(w.dim() == 3 && w.scalar_type() == torch::kUInt8 && w.is_contiguous() && w.size(2) == block_bytes,
              what, ": w [ceil(N/16), blocks, ", block_bytes, "] uint8");
  TORCH_CHECK(n > 0 && (n + kQuantPanel - 1) / kQuantPanel == w.size(0), what, ": ", w.size(0), " panels do not hold ", n, " rows");
}

// w [ceil(n / 16), Kp / 64, 1088] uint8: the panels above.
torch::Tensor int8_linear(torch::Tensor x, torch::Tensor w, int64_t n, c10::optional<torch::Tensor> bias) {
  check_panels(w, n, Int8Format::kBlockBytes, "int8_linear");
  const int64_t Kp = w.size(1) * Int8Format::kBlock;
  check_x(x, Kp);
  return dispatch(x, Int8Format{w.data_ptr<uint8_t>(), w.size(1)}, n, Kp, bias);
}

// w [ceil(n / 16), Kp / 32, 320] uint8: the panels above.
torch::Tensor int4_linear(torch::Tensor x, torch::Tensor w, int64_t n, c10::optional<torch::Tensor> bias) {
  check_panels(w, n, Int4Format::kBlockBytes, "int4_linear");
  const int64_t Kp = w.size(1) * Int4Format::kBlock;
  check_x(x, Kp);
  return dispatch(x, Int4Format{w.data_ptr<uint8_t>(), w.size(1)}, n, Kp, bias);
}

// quantize_int4_weight (rivulet/kernels/quant.py) in one pass over the weight, with the same float32
// operations in the same order (so the same bits): per block of 32 (K zero-padded to a multiple of
// 64) m = fp16(min), d = fp16((max - min) / 15), q = round-half-even((w - m) / d) clamped to 0..15
// (0 where d == 0), written into the panel layout above.
template <typename T>
void quantize_int4_rows(const T* w, int64_t N, int64_t K, int64_t nb, uint8_t* out) {
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    float blk[32];
    for (int64_t n = n0; n < n1; ++n) {
      const T* row = w + n * K;
      const int64_t i = n % kQuantPanel;
      for (int64_t b = 0; b < nb; ++b) {
        const int64_t k0 = b * 32;
        float lo = INFINITY, hi = -INFINITY;
        for (int j = 0; j < 32; ++j) {
          blk[j] = k0 + j < K ? to_float(row[k0 + j]) : 0.f;
          lo = std::min(lo, blk[j]);
          hi = std::max(hi, blk[j]);
        }
        const c10::Half d16((hi - lo) / 15.f), m16(lo);
        const float dd = static_cast<float>(d16), mm = static_cast<float>(m16);
        TORCH_CHECK(std::isfinite(dd) && std::isfinite(mm), "quantize_int4: weights beyond the fp16 range of the scales");
        uint8_t* dst = out + ((n / kQuantPanel) * nb + b) * Int4Format::kBlockBytes;
        std::memcpy(dst + 256 + 2 * i, &d16.x, 2);
        std::memcpy(dst + 288 + 2 * i, &m16.x, 2);
        uint8_t q[32];
        for (int j = 0; j < 32; ++j) {
          const float v = dd > 0.f ? std::nearbyint((blk[j] - mm) / dd) : 0.f;
          q[j] = static_cast<uint8_t>(std::min(std::max(v, 0.f), 15.f));
        }
        for (int v = 0; v < 4; ++v)
          for (int j = 0; j < 4; ++j) dst[v * 64 + i * 4 + j] = static_cast<uint8_t>(q[8 * v + j] | (q[8 * v + 4 + j] << 4));
      }
    }
  });
}

torch::Tensor quantize_int4(torch::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2, "quantize_int4: weight [N, K]");
  auto w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1), Kp = (K + kChunk - 1) / kChunk * kChunk, nb = Kp / 32;
  auto out = torch::zeros({(N + kQuantPanel - 1) / kQuantPanel, nb, Int4Format::kBlockBytes},
                          w.options().dtype(torch::kUInt8));
  if (w.scalar_type() == torch::kBFloat16) {
    quantize_int4_rows(w.data_ptr<at::BFloat16>(), N, K, nb, out.data_ptr<uint8_t>());
  } else {
    auto wf = w.to(torch::kFloat32);
    quantize_int4_rows(wf.data_ptr<float>(), N, K, nb, out.data_ptr<uint8_t>());
  }
  return out;
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
void register_decode_program(py::module& m);
void register_sampling_ops(py::module& m);
void register_top_k_top_p_ops(py::module& m);

TORCH_LIBRARY_FRAGMENT(rivulet, m) {
  m.def("int8_linear(Tensor x, Tensor w, int n, Tensor? bias) -> Tensor");
  m.def("int4_linear(Tensor x, Tensor w, int n, Tensor? bias) -> Tensor");
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
  register_decode_program(m);
  register_sampling_ops(m);
  register_top_k_top_p_ops(m);
  m.def("int8_linear", &int8_linear, "weight-only int8 linear (VNNI)", py::arg("x"), py::arg("w"), py::arg("n"),
        py::arg("bias") = py::none());
  m.def("int4_linear", &int4_linear, "weight-only 4-bit (Q4_1-style) linear (VNNI)", py::arg("x"), py::arg("w"),
        py::arg("n"), py::arg("bias") = py::none());
  m.def("quantize_int4", &quantize_int4, "quantize_int4_weight in one pass (same bits)", py::arg("weight"));
  m.def("has_vnni", &has_vnni);
}
