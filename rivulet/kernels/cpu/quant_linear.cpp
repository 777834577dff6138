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
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) { gemv_rows<T>(fmt, xq.data(), M, n0, n1, bp, yp, N); });
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
void register_decode_program(py::module& m);

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
  register_decode_program(m);
  m.def("int8_linear", &int8_linear, "weight-only int8 linear (VNNI)", py::arg("x"), py::arg("w"),
        py::arg("w_scale"), py::arg("bias") = py::none());
  m.def("int4_linear", &int4_linear, "weight-only 4-bit (Q4_1-style) linear (VNNI)", py::arg("x"), py::arg("w"),
        py::arg("scale"), py::arg("minv"), py::arg("bias") = py::none());
  m.def("quantize_int4", &quantize_int4, "quantize_int4_weight in one pass (same bits)", py::arg("weight"));
  m.def("has_vnni", &has_vnni);
}
