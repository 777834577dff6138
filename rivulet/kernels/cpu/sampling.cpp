// The sampler's kernels for CPUs: the grammar bitmask, greedy argmax, and random draws by a Gumbel race over
// counter-based noise (rivulet/kernels/sampling.py is the PyTorch reference of the last).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <climits>
#include <limits>
#include <vector>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

// logits [R, V] float32, in place: -inf where bit (t % 32) of word t / 32 of the row's int32 bitmask
// [R, ceil(V / 32)] is 0 (structured output). Words of all ones (the common case of a free row, or of
// a grammar allowing much) are skipped.
void apply_token_bitmask(torch::Tensor logits, torch::Tensor bitmask) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == torch::kFloat && logits.is_contiguous(),
              "apply_token_bitmask: logits must be contiguous float32 [rows, vocab]");
  auto mask = bitmask.contiguous();
  const int64_t R = logits.size(0), V = logits.size(1), W = (V + 31) / 32;
  TORCH_CHECK(mask.scalar_type() == torch::kInt && mask.dim() == 2 && mask.size(0) == R && mask.size(1) >= W,
              "apply_token_bitmask: bitmask must be int32 [rows, ceil(vocab / 32)]");
  float* lp = logits.data_ptr<float>();
  const uint32_t* mp = reinterpret_cast<const uint32_t*>(mask.data_ptr<int32_t>());
  const int64_t stride = mask.size(1);
  const float ninf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      float* row = lp + r * V;
      const uint32_t* words = mp + r * stride;
      for (int64_t w = 0; w < W; ++w) {
        const uint32_t m = words[w];
        if (m == 0xffffffffu) continue;
        const int64_t base = w * 32, n = std::min<int64_t>(32, V - base);
        for (int64_t j = 0; j < n; ++j)
          if (!((m >> j) & 1u)) row[base + j] = ninf;
      }
    }
  });
}

// 16 logits as float32 (bf16 widened exactly).
static inline float logit_at(const float* x, int64_t i) { return x[i]; }
static inline float logit_at(const at::BFloat16* x, int64_t i) { return float(x[i]); }
#ifdef __AVX512F__
static inline __m512 load_logits(const float* x) { return _mm512_loadu_ps(x); }
static inline __m512 load_logits(const at::BFloat16* x) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#endif

// The first index of a row's maximum, torch.argmax's answer (a NaN counts as the maximum: its first wins).
// bf16 rows give the answer of their float32 copies (the widening is exact), without making them.
template <typename T>
static int64_t argmax_row(const T* x, int64_t n) {
  int64_t j = 0, best = 0;
  float m = logit_at(x, 0);
#ifdef __AVX512F__
  if (n >= 16) {  // per lane the first index of its maximum, then the smallest index among the lanes holding it
    __m512 bv = load_logits(x);
    __m512i bi = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), idx = bi;
    const __m512i step = _mm512_set1_epi32(16);
    __mmask16 nan = _mm512_cmp_ps_mask(bv, bv, _CMP_UNORD_Q);
    for (j = 16; j + 16 <= n; j += 16) {
      idx = _mm512_add_epi32(idx, step);
      const __m512 v = load_logits(x + j);
      nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      const __mmask16 gt = _mm512_cmp_ps_mask(v, bv, _CMP_GT_OQ);
      bv = _mm512_mask_mov_ps(bv, gt, v);
      bi = _mm512_mask_mov_epi32(bi, gt, idx);
    }
    if (nan) {
      for (int64_t i = 0; i < j; ++i)
        if (std::isnan(logit_at(x, i))) return i;
    }
    m = _mm512_reduce_max_ps(bv);
    best = _mm512_mask_reduce_min_epi32(_mm512_cmp_ps_mask(bv, _mm512_set1_ps(m), _CMP_EQ_OQ), bi);
  }
#endif
  if (j == 0) {
    if (std::isnan(m)) return 0;
    j = 1;
  }
  for (; j < n; ++j) {  // the tail (all of a short row): later indices win only when greater
    const float v = logit_at(x, j);
    if (std::isnan(v)) return j;
    if (v > m) m = v, best = j;
  }
  return best;
}

// logits [R, V] float32 or bf16 (rows contiguous) -> int64 [R]: greedy sampling's argmax, vectorized, rows
// over threads. (torch's argmax over a float32 [64, 49152] batch took 2.7 ms of a 44 ms decode step on 2
// cores; this ~0.3. On bf16 logits it also spares the float32 copy an all-greedy step would not use.)
torch::Tensor argmax_rows(torch::Tensor logits) {
  const auto dtype = logits.scalar_type();
  TORCH_CHECK(logits.dim() == 2 && (dtype == torch::kFloat || dtype == torch::kBFloat16) && logits.size(1) > 0 &&
              logits.stride(1) == 1 && logits.size(1) < (int64_t(1) << 31),
              "argmax_rows: float32 or bf16 [rows, vocab] with contiguous rows");
  const int64_t R = logits.size(0), V = logits.size(1), ld = logits.stride(0);
  auto out = torch::empty({R}, logits.options().dtype(torch::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  if (dtype == torch::kFloat) {
    const float* lp = logits.data_ptr<float>();
    at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) op[r] = argmax_row(lp + r * ld, V);
    });
  } else {
    const at::BFloat16* lp = logits.data_ptr<at::BFloat16>();
    at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) op[r] = argmax_row(lp + r * ld, V);
    });
  }
  return out;
}

// A random draw from softmax(x / t) by a Gumbel race: the index of the largest x[v] / t + g[v], g[v] a
// Gumbel(0, 1) variate. The noise is not drawn from a stream: g[v] = -log(-log(u)) with u a uniform number
// hashed from (the row's 64-bit key, v) (two rounds of murmur3's 32-bit finalizer over v * golden ^ key.lo,
// then key.hi; 23 bits, u = (m + 1/2) / 2^23 in (0, 1)), so every token's noise is its own. That makes a draw
// robust where an inverse CDF is fragile: logits that differ in their last bits (a batch of another
// shape, a sequence recomputed after preemption) change the token only when two tokens' scores are that
// close, not whenever the uniform number falls near any of the vocabulary's cumulative-sum boundaries.
// The same key gives the same noise on any row of any batch: a seeded request's key is position_seed(seed,
// position). u is in [2^-24, 1 - 2^-24], so g is in [-2.82, 16.64].
namespace {

// Each step below exists twice, for one token (scalar) and for 16 (AVX-512), with the same operations in the
// same order (no FMA: the build has -ffp-contract=off), so a token's noise has the same bits either way.
inline uint32_t fmix32(uint32_t h) {
  h ^= h >> 16;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  h *= 0xC2B2AE35u;
  return h ^ (h >> 16);
}

inline uint32_t noise_bits(uint32_t lo, uint32_t hi, uint32_t v) {  // the 23 bits u is made of
  return fmix32(fmix32((v * 0x9E3779B9u) ^ lo) ^ hi) >> 9;
}

// log(x) for normal x > 0: Cephes' logf (x = m 2^e with m in [sqrt(1/2), sqrt(2)), a degree-8 polynomial in
// m - 1; ~1 ulp).
constexpr float kLogPoly[9] = {7.0376836292e-2f,  -1.1514610310e-1f, 1.1676998740e-1f,
                               -1.2420140846e-1f, 1.4249322787e-1f,  -1.6668057665e-1f,
                               2.0000714765e-1f,  -2.4999993993e-1f, 3.3333331174e-1f};

inline float log_positive(float x) {
  int32_t i;
  std::memcpy(&i, &x, 4);
  int32_t e = ((i >> 23) & 0xff) - 126;
  const int32_t mi = (i & 0x007fffff) | 0x3f000000;  // x = m 2^e, m in [0.5, 1)
  float m;
  std::memcpy(&m, &mi, 4);
  if (m < 0.707106781186547524f) {
    e -= 1;
    m = m + m;
  }
  m = m - 1.0f;
  const float z = m * m;
  float y = kLogPoly[0];
  for (int k = 1; k < 9; ++k) y = y * m + kLogPoly[k];
  y = y * m * z;
  const float fe = static_cast<float>(e);
  y = y + -2.12194440e-4f * fe;
  y = y + -0.5f * z;
  return (m + y) + 0.693359375f * fe;
}

inline float gumbel_of_bits(uint32_t m) {  // rises with m
  const float u = (static_cast<float>(m) + 0.5f) * 0x1p-23f;
  return -log_positive(-log_positive(u));
}

inline float gumbel_noise(uint32_t lo, uint32_t hi, uint32_t v) { return gumbel_of_bits(noise_bits(lo, hi, v)); }

#ifdef __AVX512F__
inline __m512i fmix32x16(__m512i h) {
  h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 16));
  h = _mm512_mullo_epi32(h, _mm512_set1_epi32(static_cast<int>(0x85EBCA6Bu)));
  h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 13));
  h = _mm512_mullo_epi32(h, _mm512_set1_epi32(static_cast<int>(0xC2B2AE35u)));
  return _mm512_xor_si512(h, _mm512_srli_epi32(h, 16));
}

inline __m512i noise_bits16(uint32_t lo, uint32_t hi, __m512i v) {
  const __m512i h = _mm512_mullo_epi32(v, _mm512_set1_epi32(static_cast<int>(0x9E3779B9u)));
  const __m512i h1 = fmix32x16(_mm512_xor_si512(h, _mm512_set1_epi32(static_cast<int>(lo))));
  return _mm512_srli_epi32(fmix32x16(_mm512_xor_si512(h1, _mm512_set1_epi32(static_cast<int>(hi)))), 9);
}

inline __m512 log_positive16(__m512 x) {
  const __m512i i = _mm512_castps_si512(x);
  __m512i e = _mm512_sub_epi32(_mm512_and_si512(_mm512_srli_epi32(i, 23), _mm512_set1_epi32(0xff)),
                               _mm512_set1_epi32(126));
  __m512 m = _mm512_castsi512_ps(_mm512_or_si512(_mm512_and_si512(i, _mm512_set1_epi32(0x007fffff)),
                                                 _mm512_set1_epi32(0x3f000000)));
  const __mmask16 small = _mm512_cmp_ps_mask(m, _mm512_set1_ps(0.707106781186547524f), _CMP_LT_OQ);
  e = _mm512_mask_sub_epi32(e, small, e, _mm512_set1_epi32(1));
  m = _mm512_mask_add_ps(m, small, m, m);
  m = _mm512_sub_ps(m, _mm512_set1_ps(1.0f));
  const __m512 z = _mm512_mul_ps(m, m);
  __m512 y = _mm512_set1_ps(kLogPoly[0]);
  for (int k = 1; k < 9; ++k) y = _mm512_add_ps(_mm512_mul_ps(y, m), _mm512_set1_ps(kLogPoly[k]));
  y = _mm512_mul_ps(_mm512_mul_ps(y, m), z);
  const __m512 fe = _mm512_cvtepi32_ps(e);
  y = _mm512_add_ps(y, _mm512_mul_ps(_mm512_set1_ps(-2.12194440e-4f), fe));
  y = _mm512_add_ps(y, _mm512_mul_ps(_mm512_set1_ps(-0.5f), z));
  return _mm512_add_ps(_mm512_add_ps(m, y), _mm512_mul_ps(_mm512_set1_ps(0.693359375f), fe));
}

inline __m512 neg16(__m512 x) {
  return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(x), _mm512_set1_epi32(INT32_MIN)));
}

inline __m512 gumbel_of_bits16(__m512i m) {
  const __m512 u =
      _mm512_mul_ps(_mm512_add_ps(_mm512_cvtepi32_ps(m), _mm512_set1_ps(0.5f)), _mm512_set1_ps(0x1p-23f));
  return neg16(log_positive16(neg16(log_positive16(u))));
}

inline __m512i iota16(uint32_t b) {
  return _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(b)),
                          _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
}
#endif

constexpr uint32_t kBlock = 64;

// The largest logit of the m tokens at x.
template <typename T>
inline float block_max(const T* x, uint32_t m) {
  float xmax = -std::numeric_limits<float>::infinity();
  uint32_t i = 0;
#ifdef __AVX512F__
  if (m >= 16) {
    __m512 xv = load_logits(x);
    for (i = 16; i + 16 <= m; i += 16) xv = _mm512_max_ps(xv, load_logits(x + i));
    xmax = _mm512_reduce_max_ps(xv);
  }
#endif
  for (; i < m; ++i) xmax = std::max(xmax, logit_at(x, i));
  return xmax;
}

// The largest noise bits of tokens b .. b + m - 1.
inline uint32_t block_max_bits(uint32_t lo, uint32_t hi, uint32_t b, uint32_t m) {
  uint32_t umax = 0, i = 0;
#ifdef __AVX512F__
  __m512i uv = _mm512_setzero_si512();
  for (; i + 16 <= m; i += 16) uv = _mm512_max_epu32(uv, noise_bits16(lo, hi, iota16(b + i)));
  umax = static_cast<uint32_t>(_mm512_reduce_max_epu32(uv));
#endif
  for (; i < m; ++i) umax = std::max(umax, noise_bits(lo, hi, b + i));
  return umax;
}

// Scores x / t + g of tokens b .. b + m - 1 (x points at token b) into s.
template <typename T>
inline void block_scores(const T* x, float t, uint32_t lo, uint32_t hi, uint32_t b, uint32_t m, float* s) {
  uint32_t i = 0;
#ifdef __AVX512F__
  const __m512 tv = _mm512_set1_ps(t);
  for (; i + 16 <= m; i += 16)
    _mm512_storeu_ps(s + i, _mm512_add_ps(_mm512_div_ps(load_logits(x + i), tv),
                                          gumbel_of_bits16(noise_bits16(lo, hi, iota16(b + i)))));
#endif
  for (; i < m; ++i) s[i] = logit_at(x, i) / t + gumbel_noise(lo, hi, b + i);
}

// bound[k] = xmax[k] / t + gumbel_of_bits(umax[k]) for k < n.
inline void block_bounds(const float* xmax, const uint32_t* umax, float t, uint32_t n, float* bound) {
  uint32_t k = 0;
#ifdef __AVX512F__
  const __m512 tv = _mm512_set1_ps(t);
  for (; k + 16 <= n; k += 16)
    _mm512_storeu_ps(bound + k, _mm512_add_ps(_mm512_div_ps(_mm512_loadu_ps(xmax + k), tv),
                                              gumbel_of_bits16(_mm512_loadu_si512(umax + k))));
#endif
  for (; k < n; ++k) bound[k] = xmax[k] / t + gumbel_of_bits(umax[k]);
}

struct RaceScratch {
  std::vector<float> xmax, bound;
  std::vector<uint32_t> umax;
};

// The race for one row. Scoring a token costs two logs (~120 operations), hashing it ~12, comparing its logit
// one; most tokens cannot win. So: the score of the row's argmax token, a first best; the largest logit of
// each block of 64 tokens; a block whose largest x / t plus the largest noise there is (16.64) cannot
// beat it is not hashed; the others get a bound, their largest x / t plus the noise of their largest u,
// which holds for each of their tokens (g rises with u); the block with the highest bound is scored first,
// then every block whose bound beats the best so far. The blocks left out change no draw.
template <typename T>
int64_t gumbel_row(const T* x, int64_t n, float t, uint64_t key, RaceScratch& scratch) {
  const uint32_t lo = static_cast<uint32_t>(key), hi = static_cast<uint32_t>(key >> 32);
  constexpr float ninf = -std::numeric_limits<float>::infinity();
  auto slack = [](float v) { return 1e-5f * std::fabs(v) + 1e-3f; };  // the logs' last bits
  const uint32_t N = static_cast<uint32_t>(n), nb = (N + kBlock - 1) / kBlock;
  scratch.xmax.resize(nb), scratch.bound.resize(nb), scratch.umax.resize(nb);
  float *xmax = scratch.xmax.data(), *bound = scratch.bound.data();
  uint32_t* umax = scratch.umax.data();
  uint32_t arg = static_cast<uint32_t>(argmax_row(x, n));  // (torch's answer: a NaN's first index)
  float best = logit_at(x, arg) / t + gumbel_noise(lo, hi, arg);
  if (!(best > ninf)) return arg;  // every token masked (or a NaN): nothing to race
  for (uint32_t k = 0; k < nb; ++k) xmax[k] = block_max(x + k * kBlock, std::min(kBlock, N - k * kBlock));
  const float reach = gumbel_of_bits(0x7fffff);
  for (uint32_t k = 0; k < nb; ++k) {
    const bool hopeless = xmax[k] / t + reach < best - slack(best);
    umax[k] = hopeless ? 0 : block_max_bits(lo, hi, k * kBlock, std::min(kBlock, N - k * kBlock));
    if (hopeless) xmax[k] = ninf;
  }
  block_bounds(xmax, umax, t, nb, bound);
  float s[kBlock];
  auto score = [&](uint32_t k) {
    const uint32_t b = k * kBlock, m = std::min(kBlock, N - b);
    block_scores(x + b, t, lo, hi, b, m, s);
    for (uint32_t i = 0; i < m; ++i)
      if (s[i] > best || (s[i] == best && b + i < arg)) best = s[i], arg = b + i;
  };
  const uint32_t first = static_cast<uint32_t>(std::max_element(bound, bound + nb) - bound);
  score(first);
  for (uint32_t k = 0; k < nb; ++k)
    if (k != first && bound[k] >= best - slack(best)) score(k);  // (a hopeless block's bound is -inf)
  return static_cast<int64_t>(arg);
}

}  // namespace

// logits [R, V] float32 or bf16 (rows contiguous), temperature float32 [R], keys int64 [R] -> int64 [R]:
// row r's draw from softmax(logits[r] / temperature[r]) keyed by keys[r] (above), or its argmax where the
// temperature is 0. Rows over threads.
torch::Tensor sample_rows(torch::Tensor logits, torch::Tensor temperature, torch::Tensor keys) {
  const auto dtype = logits.scalar_type();
  TORCH_CHECK(logits.dim() == 2 && (dtype == torch::kFloat || dtype == torch::kBFloat16) && logits.size(1) > 0 &&
              logits.stride(1) == 1 && logits.size(1) < (int64_t(1) << 31),
              "sample_rows: float32 or bf16 [rows, vocab] with contiguous rows");
  const int64_t R = logits.size(0), V = logits.size(1), ld = logits.stride(0);
  auto tc = temperature.to(torch::kFloat).contiguous();
  auto kc = keys.to(torch::kLong).contiguous();
  TORCH_CHECK(tc.numel() == R && kc.numel() == R, "sample_rows: one temperature and one key per row");
  const float* tp = tc.data_ptr<float>();
  const int64_t* kp = kc.data_ptr<int64_t>();
  auto out = torch::empty({R}, logits.options().dtype(torch::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  auto run = [&](auto* lp) {
    at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
      RaceScratch scratch;
      for (int64_t r = r0; r < r1; ++r)
        op[r] = tp[r] == 0.0f ? argmax_row(lp + r * ld, V)
                              : gumbel_row(lp + r * ld, V, tp[r], static_cast<uint64_t>(kp[r]), scratch);
    });
  };
  if (dtype == torch::kFloat) run(logits.data_ptr<float>());
  else run(logits.data_ptr<at::BFloat16>());
  return out;
}

// The noise of gumbel_row for each key of keys int64 [R] and token 0..V-1: float32 [R, V], computed 16 tokens at a
// time where the CPU has AVX-512 (`vectors`) or one at a time (tests compare both, and the reference).
torch::Tensor gumbel_noise_rows(torch::Tensor keys, int64_t V, bool vectors) {
  auto kc = keys.to(torch::kLong).contiguous();
  const int64_t R = kc.numel();
  auto out = torch::empty({R, V}, torch::kFloat);
  const auto zeros = std::vector<float>(V, 0.0f);
  for (int64_t r = 0; r < R; ++r) {
    const uint64_t key = static_cast<uint64_t>(kc.data_ptr<int64_t>()[r]);
    const uint32_t lo = static_cast<uint32_t>(key), hi = static_cast<uint32_t>(key >> 32);
    float* row = out.data_ptr<float>() + r * V;
    if (vectors) block_scores(zeros.data(), 1.0f, lo, hi, 0, static_cast<uint32_t>(V), row);  // 0 / 1 + g = g
    else for (int64_t v = 0; v < V; ++v) row[v] = gumbel_noise(lo, hi, static_cast<uint32_t>(v));
  }
  return out;
}

void register_sampling_ops(py::module& m) {
  m.def("apply_token_bitmask", &apply_token_bitmask);
  m.def("argmax_rows", &argmax_rows);
  m.def("sample_rows", &sample_rows);
  m.def("gumbel_noise_rows", &gumbel_noise_rows);
}
