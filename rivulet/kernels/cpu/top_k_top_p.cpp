// Top-k and top-p (nucleus) masks for CPUs, without sorting the vocabulary. Each row's threshold is the logit of
// the token where a count (top-k) or a probability mass (top-p), summed over the tokens in descending order of
// logit, first reaches its target; it is found by a radix select over the logits' order-preserving bit patterns
// (three histogram passes over 11, 11 and 10 bits, each narrowing the candidates to one bucket), with masses
// exp(x - max) summed in float64. Tokens below the threshold become -inf; tokens tied with it stay.
// rivulet/kernels/sampling.py's top_k_top_p_ref (a descending sort, a float64 cumulative sum) is the reference.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "simd.h"

namespace {

// An unsigned key per float that orders like the float (NaNs above +inf or below -inf, by their sign bit); -0
// and +0 have one key (x + 0 is +0 for both), as they compare equal.
inline uint32_t order_key(float x) {
  uint32_t b;
  x += 0.0f;
  std::memcpy(&b, &x, sizeof b);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

constexpr int kLevels = 3;
constexpr int kShift[kLevels] = {21, 10, 0};
constexpr uint32_t kDigits[kLevels] = {0x7FF, 0x7FF, 0x3FF};

struct Scratch {
  std::vector<uint32_t> keys;  // [V]
  std::vector<float> mass;     // [V]: exp(x - max) of the tokens top-k keeps, else 0
  std::vector<int32_t> from, to;
  double hist[2048];
};

// The key of the token where a running sum over the tokens in descending key order first reaches the target
// (weights: 1 per token, or `mass`); the target is `fraction` of the total where `of_total`, else `fraction`
// itself. False where the sum never reaches it (rounding near a total of 1): then nothing is masked.
template <bool kCount>
bool select_key(Scratch& s, int64_t V, double fraction, bool of_total, uint32_t& key) {
  double above = 0.0, target = fraction;
  int64_t n = V;
  for (int level = 0; level < kLevels; ++level) {
    const int shift = kShift[level];
    const uint32_t digits = kDigits[level];
    std::fill(s.hist, s.hist + digits + 1, 0.0);
    auto add = [&](int64_t i) { s.hist[(s.keys[i] >> shift) & digits] += kCount ? 1.0 : double(s.mass[i]); };
    if (level == 0) {
      for (int64_t i = 0; i < V; ++i) add(i);
      if (of_total) {
        double total = 0.0;
        for (uint32_t d = 0; d <= digits; ++d) total += s.hist[d];
        target = fraction * total;
      }
    } else {
      for (int64_t j = 0; j < n; ++j) add(s.from[j]);
    }
    int64_t d = digits;
    for (; d >= 0; --d) {
      if (s.hist[d] > 0.0 && above + s.hist[d] >= target) break;
      above += s.hist[d];
    }
    if (d < 0) return false;
    int64_t m = 0;
    if (level == 0) {
      for (int64_t i = 0; i < V; ++i)
        if (((s.keys[i] >> shift) & digits) == uint32_t(d)) s.to[m++] = int32_t(i);
    } else {
      for (int64_t j = 0; j < n; ++j)
        if (((s.keys[s.from[j]] >> shift) & digits) == uint32_t(d)) s.to[m++] = s.from[j];
    }
    std::swap(s.from, s.to);
    n = m;
  }
  key = s.keys[s.from[0]];  // every candidate left has this key
  return true;
}

// Keys of a row and its maximum.
float keys_and_max(const float* x, int64_t V, uint32_t* keys) {
  float m = -std::numeric_limits<float>::infinity();
  int64_t i = 0;
#ifdef __AVX512F__
  __m512 vm = _mm512_set1_ps(m);
  const __m512i sign = _mm512_set1_epi32(int32_t(0x80000000u));
  for (; i + 16 <= V; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    // -0 made +0; then negative: all bits flipped, else the sign bit set
    const __m512i b = _mm512_castps_si512(_mm512_add_ps(v, _mm512_setzero_ps()));
    _mm512_storeu_si512(keys + i, _mm512_xor_si512(b, _mm512_or_si512(_mm512_srai_epi32(b, 31), sign)));
    vm = _mm512_max_ps(v, vm);  // a NaN in v gives vm back
  }
  m = _mm512_reduce_max_ps(vm);
#endif
  for (; i < V; ++i) {
    keys[i] = order_key(x[i]);
    if (x[i] > m) m = x[i];  // NaNs are left out of the maximum
  }
  return m;
}

// mass[i] = exp(x[i] - m) where keys[i] >= floor_key and x[i] > -inf, else 0.
void masses(const float* x, const uint32_t* keys, int64_t V, float m, uint32_t floor_key, float* mass) {
  int64_t i = 0;
#ifdef __AVX512F__
  const __m512 vm = _mm512_set1_ps(m), ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512i vfloor = _mm512_set1_epi32(int32_t(floor_key));
  for (; i + 16 <= V; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    const __m512i k = _mm512_loadu_si512(keys + i);
    const __mmask16 keep = _mm512_cmp_epu32_mask(k, vfloor, _MM_CMPINT_NLT) & _mm512_cmp_ps_mask(v, ninf, _CMP_GT_OQ);
    _mm512_storeu_ps(mass + i, _mm512_maskz_mov_ps(keep, simd::exp16(_mm512_sub_ps(v, vm))));
  }
#endif
  for (; i < V; ++i) mass[i] = (keys[i] >= floor_key && x[i] > -std::numeric_limits<float>::infinity())
                                   ? std::exp(x[i] - m) : 0.0f;
}

void filter_row(float* x, int64_t V, int64_t k, float p, Scratch& s) {
  const bool use_k = k > 0 && k < V, use_p = p < 1.0f;
  if (!use_k && !use_p) return;
  const float m = keys_and_max(x, V, s.keys.data());
  if (!(m > -std::numeric_limits<float>::infinity()) || std::isinf(m)) return;  // all masked, or +inf logits
  uint32_t threshold = 0;
  if (use_k && !select_key<true>(s, V, double(k), false, threshold)) threshold = 0;
  if (use_p) {
    masses(x, s.keys.data(), V, m, threshold, s.mass.data());
    uint32_t kp;
    if (select_key<false>(s, V, double(p), true, kp)) threshold = std::max(threshold, kp);
  }
  if (threshold == 0) return;
  const float ninf = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < V; ++i)
    if (s.keys[i] < threshold) x[i] = ninf;
}

}  // namespace

// logits float32 [R, V] (rows contiguous), masked in place; top_k int64 [R] (values <= 0 or >= V: no top-k) or
// empty; top_p float32 [R] (values >= 1: no top-p) or empty. Rows over the threads.
void top_k_top_p_(torch::Tensor logits, torch::Tensor top_k, torch::Tensor top_p) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == torch::kFloat && logits.stride(1) == 1 &&
              logits.size(1) < (int64_t(1) << 31), "top_k_top_p_: float32 [rows, vocab] with contiguous rows");
  const int64_t R = logits.size(0), V = logits.size(1), ld = logits.stride(0);
  auto kc = top_k.numel() ? top_k.to(torch::kLong).contiguous() : top_k;
  auto pc = top_p.numel() ? top_p.to(torch::kFloat).contiguous() : top_p;
  TORCH_CHECK((kc.numel() == 0 || kc.numel() == R) && (pc.numel() == 0 || pc.numel() == R),
              "top_k_top_p_: top_k and top_p have one value per row, or none");
  const int64_t* kp = kc.numel() ? kc.data_ptr<int64_t>() : nullptr;
  const float* pp = pc.numel() ? pc.data_ptr<float>() : nullptr;
  float* lp = logits.data_ptr<float>();
  at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
    Scratch s;
    s.keys.resize(V);
    s.mass.resize(V);
    s.from.resize(V);
    s.to.resize(V);
    for (int64_t r = r0; r < r1; ++r) filter_row(lp + r * ld, V, kp ? kp[r] : 0, pp ? pp[r] : 1.0f, s);
  });
}

void register_top_k_top_p_ops(py::module& m) { m.def("top_k_top_p_", &top_k_top_p_); }
