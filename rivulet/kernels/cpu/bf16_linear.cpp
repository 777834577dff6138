// bf16 linears for CPUs without usable AMX: `vdpbf16ps` on AVX512-BF16 (AMD Zen 4/5, Intel Cooper Lake),
// fp32 FMAs on AVX2-only CPUs (AMD Zen 2/3, Intel before Ice Lake's server parts), where oneDNN has no bf16
// matmul and PyTorch's is emulated (7 GFLOP/s on a Zen 3). y[M, N] = x[M, K] W[N, K]^T + bias, fp32 sums
// rounded to bf16 once (round to nearest even).
//
// The weight is packed once into panels of 16 output columns, each [K/2][16][2]: one k-pair of 16
// columns is one vector, which `vdpbf16ps` multiplies by a broadcast k-pair of an input row. A
// micro-kernel keeps MR <= 6 rows x G <= 4 panels (64 columns) of fp32 sums in 24 registers, so per
// k-pair it loads 4 weight vectors and broadcasts 6 input dwords for 24 dot products. Each thread
// takes a contiguous range of panels; for every group of 4 of them it runs all row blocks, so the
// group's weights (64 x K x 2 bytes) stay in its L2 while the rows stream by. Like the AMX kernel,
// nothing is chosen by M: each output row depends on its own input row only, and a call costs no
// more than the arithmetic (oneDNN's packed matmul spent ~35 us per call outside it).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstring>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include "bf16_panels.h"

bool bf16_linear_available() { return true; }

// weight [N, K] bf16 (N % 16 == 0, K even) -> [N / 16, K / 2, 32]: panel p, k-pair kp holds columns
// 16p..16p+15, each as (W[n, 2kp], W[n, 2kp + 1]).
torch::Tensor bf16_pack_weight(torch::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kBFloat16, "bf16_pack_weight: a 2-D bf16 weight");
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(N % kPanel == 0 && K % 2 == 0, "bf16_pack_weight: N % 16 == 0 and K % 2 == 0 expected");
  auto w = weight.contiguous();
  // [N/16, 16, K/2, 2] -> [N/16, K/2, 16, 2]
  return w.view({N / kPanel, kPanel, K / 2, 2}).permute({0, 2, 1, 3}).contiguous().view({N / kPanel, K / 2, 32});
}

torch::Tensor bf16_linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && packed.dim() == 3 && packed.size(2) == 32, "bf16_linear: inputs");
  const int64_t P = packed.size(0), K2 = packed.size(1), K = 2 * K2, N = P * kPanel;
  TORCH_CHECK(x.size(-1) == K, "bf16_linear: x has ", x.size(-1), " features, the weight ", K);
  auto xs = x.reshape({-1, K}).contiguous();
  const int64_t M = xs.size(0);
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  auto y = torch::empty(sizes, x.options());
  if (M == 0) return y;
  torch::Tensor bf;
  if (bias.has_value() && bias->defined()) bf = bias->to(torch::kFloat).contiguous();
  const float* bp = bf.defined() ? bf.data_ptr<float>() : nullptr;
  const at::BFloat16* xp = xs.data_ptr<at::BFloat16>();
  const at::BFloat16* wp = packed.data_ptr<at::BFloat16>();
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();
  // panels split evenly between the threads (a decode step has one or a few rows)
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) { panel_rows(xp, M, K, wp, p0, p1, bp, yp, N); });
  return y;
}

TORCH_LIBRARY_FRAGMENT(rivulet, m) { m.def("bf16_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor"); }
TORCH_LIBRARY_IMPL(rivulet, CPU, m) { m.impl("bf16_linear", &bf16_linear); }

void register_bf16_linear(py::module& m) {
  m.def("bf16_linear_available", &bf16_linear_available);
  m.def("bf16_pack_weight", &bf16_pack_weight);
  m.def("bf16_linear", &bf16_linear, py::arg("x"), py::arg("packed"), py::arg("bias") = py::none());
  m.attr("BF16_LINEAR_ISA") = "avx512_bf16";
}
#elif defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#include <immintrin.h>

// The AVX2 kernel reads the same packed layout: a 256-bit load of a panel's k-pair row holds 8 columns'
// (W[n, 2kp], W[n, 2kp + 1]) as 32-bit words, so a shift left by 16 gives the 8 even-k weights as fp32
// and a mask of the low half the 8 odd-k ones. The input is converted to fp32 once per call; a
// micro-kernel keeps MR rows x 2G vectors (16G columns) of fp32 sums, at most 12 of the 16 registers.
namespace {

constexpr int64_t kPanel = 16;
constexpr int kMaxRows = 6;

template <int MR, int G>
void micro_kernel(const float* x, int64_t ldx, const at::BFloat16* w, int64_t panel_stride, int64_t K2,
                  const float* bias, at::BFloat16* y, int64_t ldy) {
  __m256 acc[MR][2 * G];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < 2 * G; ++v) acc[r][v] = _mm256_setzero_ps();
  const __m256i hi = _mm256_set1_epi32(int(0xFFFF0000u));
  for (int64_t kp = 0; kp < K2; ++kp) {
    for (int g = 0; g < G; ++g) {
      const at::BFloat16* wp = w + g * panel_stride + kp * 32;
      for (int h = 0; h < 2; ++h) {
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + 16 * h));
        const __m256 even = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
        const __m256 odd = _mm256_castsi256_ps(_mm256_and_si256(raw, hi));
        for (int r = 0; r < MR; ++r) {
          const float* xr = x + r * ldx + 2 * kp;
          acc[r][2 * g + h] = _mm256_fmadd_ps(_mm256_broadcast_ss(xr), even, acc[r][2 * g + h]);
          acc[r][2 * g + h] = _mm256_fmadd_ps(_mm256_broadcast_ss(xr + 1), odd, acc[r][2 * g + h]);
        }
      }
    }
  }
  alignas(32) float out[8];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < 2 * G; ++v) {
      __m256 s = acc[r][v];
      if (bias != nullptr) s = _mm256_add_ps(s, _mm256_loadu_ps(bias + 8 * v));
      _mm256_store_ps(out, s);
      for (int i = 0; i < 8; ++i) y[r * ldy + 8 * v + i] = at::BFloat16(out[i]);  // round to nearest even
    }
}

using KernelFn = void (*)(const float*, int64_t, const at::BFloat16*, int64_t, int64_t, const float*, at::BFloat16*,
                          int64_t);

template <int MR>
constexpr KernelFn kernel_row(int g) {
  return g == 1 ? micro_kernel<MR, 1> : g == 2 ? micro_kernel<MR, 2> : g == 3 ? micro_kernel<MR, 3> : micro_kernel<MR, 4>;
}

KernelFn kernel_for(int rows, int panels) {
  switch (rows) {
    case 1: return kernel_row<1>(panels);
    case 2: return kernel_row<2>(std::min(panels, 3));
    case 3: return kernel_row<3>(std::min(panels, 2));
    case 4: return micro_kernel<4, 1>;
    case 5: return micro_kernel<5, 1>;
    default: return micro_kernel<6, 1>;
  }
}

// panels one micro-kernel call covers when its row block has `rows` rows (12 accumulators at most)
int panels_for(int64_t rows) { return rows == 1 ? 4 : rows == 2 ? 3 : rows == 3 ? 2 : 1; }

}  // namespace

bool bf16_linear_available() { return true; }

torch::Tensor bf16_pack_weight(torch::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kBFloat16, "bf16_pack_weight: a 2-D bf16 weight");
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(N % kPanel == 0 && K % 2 == 0, "bf16_pack_weight: N % 16 == 0 and K % 2 == 0 expected");
  auto w = weight.contiguous();
  return w.view({N / kPanel, kPanel, K / 2, 2}).permute({0, 2, 1, 3}).contiguous().view({N / kPanel, K / 2, 32});
}

torch::Tensor bf16_linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && packed.dim() == 3 && packed.size(2) == 32, "bf16_linear: inputs");
  const int64_t P = packed.size(0), K2 = packed.size(1), K = 2 * K2, N = P * kPanel;
  TORCH_CHECK(x.size(-1) == K, "bf16_linear: x has ", x.size(-1), " features, the weight ", K);
  auto xf = x.reshape({-1, K}).to(torch::kFloat).contiguous();
  const int64_t M = xf.size(0);
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  auto y = torch::empty(sizes, x.options());
  if (M == 0) return y;
  torch::Tensor bf;
  if (bias.has_value() && bias->defined()) bf = bias->to(torch::kFloat).contiguous();
  const float* bp = bf.defined() ? bf.data_ptr<float>() : nullptr;
  const float* xp = xf.data_ptr<float>();
  const at::BFloat16* wp = packed.data_ptr<at::BFloat16>();
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();
  const int64_t panel_stride = K2 * 32;
  const int gmax = panels_for(std::min<int64_t>(M, kMaxRows));
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; p += gmax) {
      const int g = int(std::min<int64_t>(gmax, p1 - p));
      for (int64_t m = 0; m < M; m += kMaxRows) {
        const int rows = int(std::min<int64_t>(kMaxRows, M - m));
        // a short last row block covers the group in calls of the panels its kernel takes
        for (int done = 0; done < g;) {
          const int take = std::min(g - done, panels_for(rows));
          kernel_for(rows, take)(xp + m * K, K, wp + (p + done) * panel_stride, panel_stride, K2,
                                 bp ? bp + (p + done) * kPanel : nullptr, yp + m * N + (p + done) * kPanel, N);
          done += take;
        }
      }
    }
  });
  return y;
}

TORCH_LIBRARY_FRAGMENT(rivulet, m) { m.def("bf16_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor"); }
TORCH_LIBRARY_IMPL(rivulet, CPU, m) { m.impl("bf16_linear", &bf16_linear); }

void register_bf16_linear(py::module& m) {
  m.def("bf16_linear_available", &bf16_linear_available);
  m.def("bf16_pack_weight", &bf16_pack_weight);
  m.def("bf16_linear", &bf16_linear, py::arg("x"), py::arg("packed"), py::arg("bias") = py::none());
  m.attr("BF16_LINEAR_ISA") = "avx2";
}
#else
bool bf16_linear_available() { return false; }
void register_bf16_linear(py::module& m) {
  m.def("bf16_linear_available", &bf16_linear_available);
  m.attr("BF16_LINEAR_ISA") = "";
}
#endif
