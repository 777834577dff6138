// The AVX512-BF16 panel kernel of bf16_linear.cpp (the layout and the micro-kernel are described
// there), shared with decode_program.cpp: `panel_rows` computes the output columns of the panels
// [p0, p1) for M input rows, which is one thread's share of a linear.
#pragma once
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define RIVULET_BF16_PANELS 1

namespace {

constexpr int64_t kPanel = 16;  // output columns per packed panel (one fp32 vector)
constexpr int kMaxRows = 6, kMaxPanels = 4;

template <int MR, int G>
void micro_kernel(const at::BFloat16* x, int64_t ldx, const at::BFloat16* w, int64_t panel_stride, int64_t K2,
                  const float* bias, at::BFloat16* y, int64_t ldy) {
  __m512 acc[MR][G];
  for (int r = 0; r < MR; ++r)
    for (int g = 0; g < G; ++g) acc[r][g] = _mm512_setzero_ps();
  const uint32_t* xr[MR];
  for (int r = 0; r < MR; ++r) xr[r] = reinterpret_cast<const uint32_t*>(x + r * ldx);
  for (int64_t kp = 0; kp < K2; ++kp) {
    __m512bh b[G];
    for (int g = 0; g < G; ++g) b[g] = (__m512bh)_mm512_loadu_si512(w + g * panel_stride + kp * 32);
    for (int r = 0; r < MR; ++r) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(int(xr[r][kp]));
      for (int g = 0; g < G; ++g) acc[r][g] = _mm512_dpbf16_ps(acc[r][g], a, b[g]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int g = 0; g < G; ++g) {
      __m512 v = acc[r][g];
      if (bias != nullptr) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + g * kPanel));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * ldy + g * kPanel), (__m256i)_mm512_cvtneps_pbh(v));
    }
}

using KernelFn = void (*)(const at::BFloat16*, int64_t, const at::BFloat16*, int64_t, int64_t, const float*,
                          at::BFloat16*, int64_t);

template <int MR>
constexpr KernelFn kernel_row(int g) {
  return g == 1 ? micro_kernel<MR, 1> : g == 2 ? micro_kernel<MR, 2> : g == 3 ? micro_kernel<MR, 3> : micro_kernel<MR, 4>;
}

KernelFn kernel_for(int rows, int panels) {
  switch (rows) {
    case 1: return kernel_row<1>(panels);
    case 2: return kernel_row<2>(panels);
    case 3: return kernel_row<3>(panels);
    case 4: return kernel_row<4>(panels);
    case 5: return kernel_row<5>(panels);
    default: return kernel_row<6>(panels);
  }
}

// y[M, N] (row stride N) = x[M, K] W^T + bias for the columns of panels [p0, p1): groups of up to 4
// panels, each over all rows in blocks of up to 6. Every output is computed the same way whatever the
// range (each column is its own chain of dot products).
inline void panel_rows(const at::BFloat16* x, int64_t M, int64_t K, const at::BFloat16* w, int64_t p0, int64_t p1,
                       const float* bias, at::BFloat16* y, int64_t N) {
  const int64_t K2 = K / 2, panel_stride = K2 * 32;
  for (int64_t p = p0; p < p1; p += kMaxPanels) {
    const int g = int(std::min<int64_t>(kMaxPanels, p1 - p));
    for (int64_t m = 0; m < M; m += kMaxRows) {
      const int rows = int(std::min<int64_t>(kMaxRows, M - m));
      kernel_for(rows, g)(x + m * K, K, w + p * panel_stride, panel_stride, K2, bias ? bias + p * kPanel : nullptr,
                          y + m * N + p * kPanel, N);
    }
  }
}

}  // namespace
#endif
