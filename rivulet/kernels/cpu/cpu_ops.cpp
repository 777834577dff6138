// Fused elementwise ops and decode attention for CPUs. Each is one call where the PyTorch
// reference (rivulet/kernels/*.py) takes several; the numbers are the reference's (float32 math,
// rounded to the input dtype where the reference rounds).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "simd.h"
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#include "rowwise.h"

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  auto xc = x.contiguous();
  auto out = torch::empty_like(xc);
  const int64_t H = xc.size(-1), R = xc.numel() / H;
  dispatch(xc, "rms_norm", [&](auto tag) {
    using T = decltype(tag);
    auto w = weight.to(xc.scalar_type()).contiguous();
    const T* xp = xc.data_ptr<T>(); const T* wp = w.data_ptr<T>(); T* op = out.data_ptr<T>();
    at::parallel_for(0, R, 16, [&](int64_t r0, int64_t r1) {
      std::vector<float> buf(H), wf(H);  // the weight in float once, not per row
      for (int64_t i = 0; i < H; ++i) wf[i] = f32(wp[i]);
      for (int64_t r = r0; r < r1; ++r) {
        load_row<T>(xp + r * H, nullptr, nullptr, buf.data(), H);
        norm_row<T>(buf.data(), wf.data(), op + r * H, H, float(eps));
      }
    });
  });
  return out;
}

std::vector<torch::Tensor> fused_add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps) {
  auto xc = x.contiguous(), rc = residual.contiguous();
  TORCH_CHECK(xc.sizes() == rc.sizes() && xc.scalar_type() == rc.scalar_type(), "fused_add_rms_norm: x/residual");
  auto out = torch::empty_like(xc), res = torch::empty_like(xc);
  const int64_t H = xc.size(-1), R = xc.numel() / H;
  dispatch(xc, "fused_add_rms_norm", [&](auto tag) {
    using T = decltype(tag);
    auto w = weight.to(xc.scalar_type()).contiguous();
    const T* xp = xc.data_ptr<T>(); const T* rp = rc.data_ptr<T>(); const T* wp = w.data_ptr<T>();
    T* op = out.data_ptr<T>(); T* sp = res.data_ptr<T>();
    at::parallel_for(0, R, 16, [&](int64_t r0, int64_t r1) {
      std::vector<float> buf(H), wf(H);  // the weight in float once, not per row
      for (int64_t i = 0; i < H; ++i) wf[i] = f32(wp[i]);
      for (int64_t r = r0; r < r1; ++r) {
        load_row<T>(xp + r * H, rp + r * H, sp + r * H, buf.data(), H);
        norm_row<T>(buf.data(), wf.data(), op + r * H, H, float(eps));
      }
    });
  });
  return {out, res};
}

// Rotate q [T, Hq, D] and k [T, Hk, D] (last dim contiguous) by cos_sin_cache[positions]
// ([max_pos, rot] float32: cos then sin halves). Returns new contiguous tensors.
std::vector<torch::Tensor> apply_rotary(torch::Tensor positions, torch::Tensor q, torch::Tensor k,
                                        torch::Tensor cache, bool interleaved) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.stride(2) == 1 && k.stride(2) == 1, "apply_rotary: q/k [T, H, D]");
  TORCH_CHECK(cache.scalar_type() == torch::kFloat32 && cache.is_contiguous(), "apply_rotary: float32 cache");
  auto pos = positions.to(torch::kLong).contiguous();
  auto qo = torch::empty(q.sizes(), q.options()), ko = torch::empty(k.sizes(), k.options());
  const int64_t T = q.size(0), D = q.size(2), rot = cache.size(1);
  dispatch(q, "apply_rotary", [&](auto tag) {
    using TT = decltype(tag);
    const int64_t* pp = pos.data_ptr<int64_t>(); const float* cp = cache.data_ptr<float>();
    auto one = [&](const torch::Tensor& src, torch::Tensor& dst, int64_t t, const float* cs) {
      const int64_t H = src.size(1);
      const TT* s0 = src.data_ptr<TT>() + t * src.stride(0);
      TT* d0 = dst.data_ptr<TT>() + t * dst.stride(0);
      for (int64_t h = 0; h < H; ++h) rotate_head<TT>(s0 + h * src.stride(1), d0 + h * D, cs, D, rot, interleaved);
    };
    at::parallel_for(0, T, 8, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const float* cs = cp + pp[t] * rot;
        one(q, qo, t, cs);
        one(k, ko, t, cs);
      }
    });
  });
  return {qo, ko};
}

// Where a head row of D elements goes into a KV cache: by streaming stores when whole cache lines allow.
// The slots are scattered over a cache of gigabytes, so an ordinary store first reads each line from
// memory (150-180 us for the 64 tokens of a decode step, one line at a time); a streaming store writes
// the line without reading it. Callers end with `kv_store_fence` so the rows are visible to every core
// before attention reads them.
template <typename TT>
struct KVRowStore {
  bool stream = false;
  KVRowStore(const TT* cache, int64_t D, int64_t row, int64_t plane, bool contiguous_rows) {
#ifdef __AVX512F__
    stream = contiguous_rows && (D * sizeof(TT)) % 64 == 0 && (reinterpret_cast<uintptr_t>(cache) % 64) == 0 &&
             (row * sizeof(TT)) % 64 == 0 && (plane * sizeof(TT)) % 64 == 0;
#endif
  }
  // dst <- src[i * stride] for i < D
  void operator()(TT* dst, const TT* src, int64_t D, int64_t stride) const {
#ifdef __AVX512F__
    if (stream) {
      for (int64_t b = 0; b < int64_t(D * sizeof(TT)); b += 64)
        _mm512_stream_si512(reinterpret_cast<__m512i*>(reinterpret_cast<char*>(dst) + b),
                            _mm512_loadu_si512(reinterpret_cast<const char*>(src) + b));
      return;
    }
#endif
    if (stride == 1) std::memcpy(dst, src, D * sizeof(TT));
    else for (int64_t i = 0; i < D; ++i) dst[i] = src[i * stride];
  }
  void fence() const {
#ifdef __AVX512F__
    if (stream) _mm_sfence();
#endif
  }
};

// Store key/value [T, Hk, D] into kv_cache [2, num_blocks, block_size, Hk, D] at slot_mapping.
void write_kv_cache(torch::Tensor key, torch::Tensor value, torch::Tensor kv_cache, torch::Tensor slot_mapping) {
  TORCH_CHECK(kv_cache.is_contiguous() && key.scalar_type() == kv_cache.scalar_type(), "write_kv_cache: cache");
  auto slots = slot_mapping.to(torch::kLong).contiguous();
  const int64_t T = key.size(0), Hk = key.size(1), D = key.size(2);
  const int64_t plane = kv_cache.numel() / 2, row = Hk * D;
  dispatch(key, "write_kv_cache", [&](auto tag) {
    using TT = decltype(tag);
    TT* c = kv_cache.data_ptr<TT>();
    const int64_t* sp = slots.data_ptr<int64_t>();
    const TT* kp = key.data_ptr<TT>(); const TT* vp = value.data_ptr<TT>();
    const int64_t ks0 = key.stride(0), ks1 = key.stride(1), ks2 = key.stride(2);
    const int64_t vs0 = value.stride(0), vs1 = value.stride(1), vs2 = value.stride(2);
    // one thread: a 2048-token chunk moves ~1.5 MB, less than a fork/join of the OpenMP team costs
    // when the other thread is late (seen as barrier waits in prefill profiles)
    const KVRowStore<TT> store(c, D, row, plane, ks2 == 1 && vs2 == 1);
    for (int64_t t = 0; t < T; ++t) {
      if (sp[t] < 0) continue;
      for (int64_t h = 0; h < Hk; ++h) {
        store(c + sp[t] * row + h * D, kp + t * ks0 + h * ks1, D, ks2);
        store(c + plane + sp[t] * row + h * D, vp + t * vs0 + h * vs1, D, vs2);
      }
    }
    store.fence();
  });
}

// apply_rotary, then write_kv_cache of the rotated keys, in one pass: each key head is rotated into a
// buffer on the stack and stored into its cache slot (the rotated keys are never a tensor); returns the
// rotated queries. The same arithmetic as the two ops (`rotate_head`), so the cache holds the same bits.
// q [T, Hq, D], k [T, Hk, D] (last dims contiguous), value [T, Hk, D].
torch::Tensor rotary_write_kv_cache(torch::Tensor positions, torch::Tensor q, torch::Tensor k, torch::Tensor value,
                                    torch::Tensor cache, bool interleaved, torch::Tensor kv_cache,
                                    torch::Tensor slot_mapping) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.stride(2) == 1 && k.stride(2) == 1,
              "rotary_write_kv_cache: q/k [T, H, D]");
  TORCH_CHECK(cache.scalar_type() == torch::kFloat32 && cache.is_contiguous(), "rotary_write_kv_cache: float32 cache");
  TORCH_CHECK(kv_cache.is_contiguous() && k.scalar_type() == kv_cache.scalar_type() &&
              value.scalar_type() == k.scalar_type() && value.dim() == 3 && value.sizes() == k.sizes() &&
              kv_cache.size(-2) * kv_cache.size(-1) == k.size(1) * k.size(2),
              "rotary_write_kv_cache: key/value [T, Hk, D] of the cache's dtype and row");
  auto pos = positions.to(torch::kLong).contiguous();
  auto slots = slot_mapping.to(torch::kLong).contiguous();
  auto qo = torch::empty(q.sizes(), q.options());
  const int64_t T = q.size(0), D = q.size(2), Hk = k.size(1), rot = cache.size(1);
  const int64_t plane = kv_cache.numel() / 2, row = Hk * D;
  dispatch(q, "rotary_write_kv_cache", [&](auto tag) {
    using TT = decltype(tag);
    const int64_t* pp = pos.data_ptr<int64_t>(); const int64_t* sp = slots.data_ptr<int64_t>();
    const float* cp = cache.data_ptr<float>();
    TT* c = kv_cache.data_ptr<TT>();
    const int64_t vs0 = value.stride(0), vs1 = value.stride(1), vs2 = value.stride(2);
    const KVRowStore<TT> store(c, D, row, plane, vs2 == 1);
    at::parallel_for(0, T, 8, [&](int64_t t0, int64_t t1) {
      std::vector<TT> buf(D);  // one rotated key head
      TT* kr = buf.data();
      for (int64_t t = t0; t < t1; ++t) {
        const float* cs = cp + pp[t] * rot;
        const TT* qs = q.data_ptr<TT>() + t * q.stride(0);
        TT* qd = qo.data_ptr<TT>() + t * qo.stride(0);
        for (int64_t h = 0; h < q.size(1); ++h) rotate_head<TT>(qs + h * q.stride(1), qd + h * D, cs, D, rot, interleaved);
        if (sp[t] < 0) continue;
        const TT* ks = k.data_ptr<TT>() + t * k.stride(0);
        for (int64_t h = 0; h < Hk; ++h) {
          rotate_head<TT>(ks + h * k.stride(1), kr, cs, D, rot, interleaved);
          store(c + sp[t] * row + h * D, kr, D, 1);
          store(c + plane + sp[t] * row + h * D, value.data_ptr<TT>() + t * vs0 + h * vs1, D, vs2);
        }
      }
      store.fence();  // each thread's own streaming stores
    });
  });
  return qo;
}

#ifdef __AVX512F__
#include "decode_attention.h"
#elif defined(__AVX2__) && defined(__FMA__)
namespace {

// AVX2 (8 lanes, 16 registers: AMD Zen 2/3, Intel Haswell to Alder Lake) versions of the decode kernel's
// pieces. The same arithmetic as the AVX-512 kernel (fp32 scores, the same exp polynomial), in a
// simpler order: one key row at a time, and the output accumulated in L1 across the group's heads
// (a head's 64 floats are 8 of the 16 registers), each value row converted to float once per group.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// exp of 8 floats <= 0 (exp16's polynomial; 2^n built in the exponent bits: n >= -126 after the clamp).
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

inline void softmax_row(float* sc, int64_t n) {
  const int64_t nv = n & ~int64_t(7);
  __m256 mx8 = _mm256_set1_ps(-INFINITY);
  for (int64_t j = 0; j < nv; j += 8) mx8 = _mm256_max_ps(mx8, _mm256_loadu_ps(sc + j));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, mx8);
  float mx = -INFINITY;
  for (float v : lanes) mx = std::max(mx, v);
  for (int64_t j = nv; j < n; ++j) mx = std::max(mx, sc[j]);
  const __m256 m = _mm256_set1_ps(mx);
  __m256 sum8 = _mm256_setzero_ps();
  for (int64_t j = 0; j < nv; j += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sc + j), m));
    _mm256_storeu_ps(sc + j, e);
    sum8 = _mm256_add_ps(sum8, e);
  }
  float sum = hsum8(sum8);
  for (int64_t j = nv; j < n; ++j) { sc[j] = std::exp(sc[j] - mx); sum += sc[j]; }
  const float inv = 1.f / sum;
  for (int64_t j = 0; j < n; ++j) sc[j] *= inv;
}

// The rows of a sequence's next page, one per row computed of the current one (see the AVX-512 build).
template <typename TT, int64_t D>
inline void prefetch_row(const TT* next_page, int64_t row, int64_t tok_stride) {
  if (next_page == nullptr) return;
  const char* p = reinterpret_cast<const char*>(next_page + row * tok_stride);
  for (int64_t b = 0; b < int64_t(D * sizeof(TT)); b += 64) _mm_prefetch(p + b, _MM_HINT_T0);
}

template <typename TT>
inline const TT* page_after(const TT* base, const int* table, int64_t t, int64_t L, int64_t bs, int64_t page_stride) {
  const int64_t p = t / bs + 1;
  return p * bs < L ? base + int64_t(table[p]) * page_stride : nullptr;
}

// One (sequence, kv head), as decode_group of the AVX-512 build: D = NV * 8.
template <typename TT, int NV>
void decode_group(const float* q, int64_t G, const TT* keys, const TT* values, const int* table, int64_t start,
                  int64_t L, int64_t bs, int64_t page_stride, int64_t tok_stride, float scale, float* sc, float* out) {
  constexpr int64_t D = NV * 8;
  const int64_t n = L - start;
  for (int64_t t = start; t < L;) {  // scores, page by page
    const int64_t off = t % bs, m = std::min(bs - off, L - t);
    const TT* kp = keys + int64_t(table[t / bs]) * page_stride + off * tok_stride;
    const TT* kn = page_after(keys, table, t, L, bs, page_stride);  // prefetched row by row, as above
    if (kn == nullptr) kn = values + int64_t(table[start / bs]) * page_stride;
    for (int64_t j = 0; j < m; ++j, kp += tok_stride) {
      prefetch_row<TT, D>(kn, j, tok_stride);
      __m256 kv[NV];
      for (int v = 0; v < NV; ++v) kv[v] = load8(kp + 8 * v);
      for (int64_t g = 0; g < G; ++g) {
        __m256 a = _mm256_mul_ps(_mm256_loadu_ps(q + g * D), kv[0]);
        for (int v = 1; v < NV; ++v) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * D + 8 * v), kv[v], a);
        sc[g * n + (t + j - start)] = hsum8(a) * scale;
      }
    }
    t += m;
  }
  for (int64_t g = 0; g < G; ++g) softmax_row(sc + g * n, n);
  for (int64_t i = 0; i < G * D; i += 8) _mm256_storeu_ps(out + i, _mm256_setzero_ps());
  for (int64_t t = start; t < L;) {
    const int64_t off = t % bs, m = std::min(bs - off, L - t);
    const TT* vp = values + int64_t(table[t / bs]) * page_stride + off * tok_stride;
    const TT* vn = page_after(values, table, t, L, bs, page_stride);
    for (int64_t j = 0; j < m; ++j, vp += tok_stride) {
      prefetch_row<TT, D>(vn, j, tok_stride);
      __m256 vv[NV];
      for (int v = 0; v < NV; ++v) vv[v] = load8(vp + 8 * v);
      const int64_t col = t + j - start;
      for (int64_t g = 0; g < G; ++g) {
        const __m256 p = _mm256_set1_ps(sc[g * n + col]);
        float* o = out + g * D;
        for (int v = 0; v < NV; ++v) _mm256_storeu_ps(o + 8 * v, _mm256_fmadd_ps(p, vv[v], _mm256_loadu_ps(o + 8 * v)));
      }
    }
    t += m;
  }
}

template <typename TT>
using DecodeGroupFn = void (*)(const float*, int64_t, const TT*, const TT*, const int*, int64_t, int64_t, int64_t,
                               int64_t, int64_t, float, float*, float*);

template <typename TT>
DecodeGroupFn<TT> decode_group_for(int64_t D) {
  switch (D) {
    case 16: return decode_group<TT, 2>;
    case 24: return decode_group<TT, 3>;
    case 32: return decode_group<TT, 4>;
    case 64: return decode_group<TT, 8>;
    case 80: return decode_group<TT, 10>;
    case 96: return decode_group<TT, 12>;
    case 128: return decode_group<TT, 16>;
    case 256: return decode_group<TT, 32>;
    default: return nullptr;
  }
}

}  // namespace
#define RIVULET_DECODE_KERNEL 1
#endif
#if defined(__AVX512F__)
#define RIVULET_DECODE_KERNEL 1
#endif

// Decode attention: one query token per listed sequence. query [T, Hq, D]; out [T, Hq, D] is
// written at `rows`; seqs[i] indexes block_tables/seq_lens. fp32 softmax; GQA by head groups.
void decode_attention(torch::Tensor query, torch::Tensor kv_cache, torch::Tensor block_tables,
                      torch::Tensor seq_lens, torch::Tensor rows, torch::Tensor seqs, torch::Tensor out,
                      double scale, int64_t sliding_window) {
  TORCH_CHECK(kv_cache[0].is_contiguous() && out.is_contiguous() && query.stride(2) == 1, "decode_attention: layouts");
  auto bt = block_tables.to(torch::kInt).contiguous();
  auto sl = seq_lens.to(torch::kInt).contiguous();
  auto rw = rows.to(torch::kLong).contiguous(), sq = seqs.to(torch::kLong).contiguous();
  const int64_t S = rw.numel(), Hq = query.size(1), D = query.size(2);
  // values start `plane` elements after the keys: a half, or 0 where they are the keys (an MLA latent cache)
  const int64_t bs = kv_cache.size(2), Hk = kv_cache.size(3), G = Hq / Hk, plane = kv_cache.stride(0);
  const int64_t maxb = bt.size(1);
  const bool fp8 = kv_cache.scalar_type() == at::ScalarType::Float8_e5m2;  // keys and values in one byte
  dispatch(query, "decode_attention", [&](auto tag) {
    using TT = decltype(tag);
    TORCH_CHECK(fp8 || kv_cache.scalar_type() == query.scalar_type(), "decode_attention: cache dtype");
    const TT* cache = fp8 ? nullptr : kv_cache.data_ptr<TT>();
#ifdef RIVULET_DECODE_KERNEL
    const DecodeGroupFn<TT> fast = decode_group_for<TT>(D);
    const DecodeGroupFn<E5M2> fast8 = fp8 ? decode_group_for<E5M2>(D) : nullptr;
    const E5M2* cache8 = fp8 ? reinterpret_cast<const E5M2*>(kv_cache.data_ptr()) : nullptr;
    TORCH_CHECK(!fp8 || fast8 != nullptr, "decode_attention: an fp8 cache takes head dims 16-256 of the kernel");
#else
    TORCH_CHECK(!fp8, "decode_attention: an fp8 cache needs the AVX-512 kernel");
#endif
    at::parallel_for(0, S * Hk, 1, [&](int64_t w0, int64_t w1) {
      std::vector<float> qf(G * D), acc(G * D), sc;
      for (int64_t w = w0; w < w1; ++w) {
        const int64_t i = w / Hk, h = w % Hk, row = rw.data_ptr<int64_t>()[i], s = sq.data_ptr<int64_t>()[i];
        const int64_t L = sl.data_ptr<int>()[s];
        const int64_t start = sliding_window > 0 ? std::max<int64_t>(0, L - sliding_window) : 0;
        const int* table = bt.data_ptr<int>() + s * maxb;
        for (int64_t g = 0; g < G; ++g) {
          const TT* qp = query.data_ptr<TT>() + row * query.stride(0) + (h * G + g) * query.stride(1);
          for (int64_t d = 0; d < D; ++d) qf[g * D + d] = f32(qp[d]);
        }
        const int64_t n = L - start;
        sc.assign(G * n, 0.f);
#ifdef RIVULET_DECODE_KERNEL
        if (fp8) {
          fast8(qf.data(), G, cache8 + h * D, cache8 + plane + h * D, table, start, L, bs, bs * Hk * D, Hk * D,
                float(scale), sc.data(), acc.data());
        } else if (fast != nullptr) {
          fast(qf.data(), G, cache + h * D, cache + plane + h * D, table, start, L, bs, bs * Hk * D, Hk * D,
               float(scale), sc.data(), acc.data());
        } else
#endif
        {
          for (int64_t t = start; t < L; ++t) {
            const TT* kp = cache + ((int64_t)table[t / bs] * bs + t % bs) * Hk * D + h * D;
            for (int64_t g = 0; g < G; ++g) sc[g * n + (t - start)] = dot(qf.data() + g * D, kp, D) * float(scale);
          }
          std::fill(acc.begin(), acc.end(), 0.f);
          for (int64_t g = 0; g < G; ++g) {
            float* sg = sc.data() + g * n;
            float mx = -INFINITY;
            for (int64_t j = 0; j < n; ++j) mx = std::max(mx, sg[j]);
            float sum = 0.f;
            for (int64_t j = 0; j < n; ++j) { sg[j] = std::exp(sg[j] - mx); sum += sg[j]; }
            const float inv = 1.f / sum;
            for (int64_t j = 0; j < n; ++j) sg[j] *= inv;
          }
          for (int64_t t = start; t < L; ++t) {
            const TT* vp = cache + plane + ((int64_t)table[t / bs] * bs + t % bs) * Hk * D + h * D;
            for (int64_t g = 0; g < G; ++g) axpy(acc.data() + g * D, sc[g * n + (t - start)], vp, D);
          }
        }
        TT* op = out.data_ptr<TT>();
        for (int64_t g = 0; g < G; ++g)
          for (int64_t d = 0; d < D; ++d) op[(row * Hq + h * G + g) * D + d] = static_cast<TT>(acc[g * D + d]);
      }
    });
  });
}


// out [..., d] = round(silu(x[..., :d])) * x[..., d:], rounded to T: the reference's two roundings
// (SiLU as x / (1 + exp(-x)) in float, like PyTorch's kernel).
torch::Tensor silu_and_mul(torch::Tensor x) {
  auto xc = x.contiguous();
  const int64_t D2 = xc.size(-1), D = D2 / 2, R = xc.numel() / std::max<int64_t>(D2, 1);
  auto sizes = xc.sizes().vec();
  sizes.back() = D;
  auto out = torch::empty(sizes, xc.options());
  dispatch(xc, "silu_and_mul", [&](auto tag) {
    using T = decltype(tag);
    const T* xp = xc.data_ptr<T>();
    T* op = out.data_ptr<T>();
    at::parallel_for(0, R, 8, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        silu_mul_row<T>(xp + r * D2, xp + r * D2 + D, op + r * D, D);
      }
    });
  });
  return out;
}


// y[tok[g], o0:o1] += sum_r t[g, r] * b[r, o0:o1] for a group of up to 4 tokens of one adapter, rows [r0, r1),
// o1 - o0 <= 64: 4 vectors of columns per token in registers (16 accumulators: no spills), each load of b
// shared by the group. y is rounded once.
template <typename Ty>
inline void lora_expand_block(Ty* y, int64_t ystride, int64_t o0, int64_t o1, const int64_t* tok, int64_t G,
                              const float* t, int64_t rows, int64_t r0, int64_t r1, const Ty* b, int64_t bstride) {
  const int64_t n = o1 - o0;
#ifdef __AVX512F__
  constexpr int V = 4;
  __m512 acc[4][V];
  __mmask16 m[V];
  for (int v = 0; v < V; ++v) m[v] = n > v * 16 ? tail_mask(n - v * 16) : __mmask16(0);
  for (int64_t g = 0; g < G; ++g)
    for (int v = 0; v < V; ++v) acc[g][v] = load16(y + tok[g] * ystride + o0 + v * 16, m[v]);
  for (int64_t r = r0; r < r1; ++r) {
    const Ty* br = b + r * bstride + o0;
    __m512 bv[V];
    for (int v = 0; v < V; ++v) bv[v] = load16(br + v * 16, m[v]);
    for (int64_t g = 0; g < G; ++g) {
      const __m512 tv = _mm512_set1_ps(t[g * rows + r]);
      for (int v = 0; v < V; ++v) acc[g][v] = _mm512_fmadd_ps(tv, bv[v], acc[g][v]);
    }
  }
  for (int64_t g = 0; g < G; ++g)
    for (int v = 0; v < V; ++v)
      if (m[v]) store_rounded16(y + tok[g] * ystride + o0 + v * 16, acc[g][v], m[v]);
#else
  for (int64_t g = 0; g < G; ++g) {
    Ty* yrow = y + tok[g] * ystride + o0;
    for (int64_t o = 0; o < n; ++o) {
      float acc = f32(yrow[o]);
      for (int64_t r = r0; r < r1; ++r) acc += t[g * rows + r] * f32(b[r * bstride + o0 + o]);
      yrow[o] = static_cast<Ty>(acc);
    }
  }
#endif
}

// t[g] = a . xf[g] for a group of up to 4 tokens (xf: their rows, already in float), each load of a shared by
// the group; per token the same sums, in the same order, as dot_same.
template <typename Ty>
inline void lora_shrink_row(const Ty* a, const float* xf, int64_t G, int64_t IN, float* out, int64_t ostride) {
#ifdef __AVX512F__
  __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  for (int64_t d = 0; d < IN; d += 16) {
    const __mmask16 m = tail_mask(IN - d);
    const __m512 av = load16(a + d, m);
    for (int64_t g = 0; g < G; ++g) acc[g] = _mm512_fmadd_ps(av, _mm512_maskz_loadu_ps(m, xf + g * IN + d), acc[g]);
  }
  for (int64_t g = 0; g < G; ++g) out[g * ostride] = _mm512_reduce_add_ps(acc[g]);
#else
  for (int64_t g = 0; g < G; ++g) {
    float acc = 0.f;
    for (int64_t d = 0; d < IN; ++d) acc += f32(a[d]) * xf[g * IN + d];
    out[g * ostride] = acc;
  }
#endif
}

// LoRA of a batch mixing adapters, in place: y[i] += B_s (A_s x[i]) for each token i of slot s = slots[i]
// (-1: the base model, untouched). a [S, R, in] and bt [S, R, out] (B transposed, scaled) in y's dtype;
// only the first `rows` rank rows are read. One call per layer whatever the number of adapters. The
// adapters' weights are cold in a decode step (the base weights stream through the caches between
// layers), so each is read once per group of up to 4 tokens of one adapter: t = A_s[:rows] x (each row
// of A against the group's tokens, loaded once for the group, `lora_shrink_row`; parallel over groups x
// rows), then y += t B_s^T (parallel over blocks of 64 columns held in registers, `lora_expand_block`).
//
// A fused layer (q/k/v, gate/up) passes `bounds`, its projections' first columns and its width, and
// `ranks`, each slot's adapter rank r: projection i's rows are [i r, (i + 1) r), the only ones read for
// its columns. Empty `bounds`, or a rank of 0 (an adapter of the fused layer as a whole): rows [0, rows).
void add_lora(torch::Tensor y, torch::Tensor x, torch::Tensor a, torch::Tensor bt, torch::Tensor slots,
              int64_t rows, std::vector<int64_t> bounds, std::vector<int64_t> ranks) {
  TORCH_CHECK(y.dim() == 2 && y.is_contiguous() && x.dim() == 2 && x.is_contiguous() && x.size(0) == y.size(0),
              "add_lora: y [T, out] and x [T, in] contiguous");
  TORCH_CHECK(a.is_contiguous() && bt.is_contiguous() && a.size(2) == x.size(1) && bt.size(2) == y.size(1) &&
              rows <= a.size(1), "add_lora: a [S, R, in] and bt [S, R, out] contiguous");
  TORCH_CHECK(x.scalar_type() == y.scalar_type() && a.scalar_type() == y.scalar_type() &&
              bt.scalar_type() == y.scalar_type(), "add_lora: x, y and the adapters' weights of one dtype");
  auto sl = slots.to(torch::kLong).contiguous();
  const int64_t T = y.size(0), OUT = y.size(1), IN = x.size(1), R = a.size(1);
  const int64_t* sp = sl.data_ptr<int64_t>();
  constexpr int64_t GROUP = 4;
  std::vector<int64_t> order;  // adapter tokens, grouped by slot
  for (int64_t i = 0; i < T; ++i) if (sp[i] >= 0) order.push_back(i);
  std::stable_sort(order.begin(), order.end(), [&](int64_t p, int64_t q) { return sp[p] < sp[q]; });
  std::vector<std::pair<int64_t, int64_t>> groups;  // [begin, end) in `order`, one slot each
  for (int64_t g = 0; g < int64_t(order.size());) {
    int64_t e = g + 1;
    while (e < int64_t(order.size()) && e - g < GROUP && sp[order[e]] == sp[order[g]]) ++e;
    groups.emplace_back(g, e);
    g = e;
  }
  if (groups.empty()) return;
  const int64_t NG = groups.size();
  std::vector<float> t(order.size() * rows);  // t[k * rows + r] for the k-th token of `order`
  dispatch(y, "add_lora", [&](auto tag) {
    using Ty = decltype(tag);
    const Ty* xp = x.data_ptr<Ty>();
    const Ty* ap = a.data_ptr<Ty>();
    const Ty* bp = bt.data_ptr<Ty>();
    Ty* yp = y.data_ptr<Ty>();
    std::vector<float> xf(order.size() * IN);  // the adapter tokens' rows in float, in `order`
    for (size_t k = 0; k < order.size(); ++k) {
      const Ty* src = xp + order[k] * IN;
      float* dst = xf.data() + k * IN;
#ifdef __AVX512F__
      for (int64_t d = 0; d < IN; d += 16) {
        const __mmask16 m = tail_mask(IN - d);
        _mm512_mask_storeu_ps(dst + d, m, load16(src + d, m));
      }
#else
      for (int64_t d = 0; d < IN; ++d) dst[d] = f32(src[d]);
#endif
    }
    at::parallel_for(0, NG * rows, 16, [&](int64_t j0, int64_t j1) {
      for (int64_t j = j0; j < j1; ++j) {
        const auto [g0, g1] = groups[j / rows];
        const int64_t r = j % rows;
        lora_shrink_row<Ty>(ap + (sp[order[g0]] * R + r) * IN, xf.data() + g0 * IN, g1 - g0, IN,
                            t.data() + g0 * rows + r, rows);
      }
    });
    // blocks of 64 columns; a fused layer's block meets one or two projections, each read with its rank rows
    constexpr int64_t BLOCK = 64;
    const int64_t blocks = (OUT + BLOCK - 1) / BLOCK;
    const int64_t nproj = int64_t(bounds.size()) - 1;
    at::parallel_for(0, blocks, 1, [&](int64_t c0, int64_t c1) {
      for (int64_t c = c0; c < c1; ++c) {
        const int64_t o0 = c * BLOCK, o1 = std::min(OUT, o0 + BLOCK);
        for (const auto& [g0, g1] : groups) {
          const int64_t s = sp[order[g0]];
          const int64_t* tok = order.data() + g0;
          const float* tg = t.data() + g0 * rows;
          const Ty* bs = bp + s * R * OUT;
          if (nproj > 1 && ranks[s] > 0) {
            const int64_t rk = ranks[s];
            for (int64_t i = 0; i < nproj; ++i) {
              const int64_t lo = std::max(o0, bounds[i]), hi = std::min(o1, bounds[i + 1]);
              if (lo < hi && i * rk < rows)
                lora_expand_block<Ty>(yp, OUT, lo, hi, tok, g1 - g0, tg, rows, i * rk, std::min(rows, (i + 1) * rk),
                                      bs, OUT);
            }
          } else {
            lora_expand_block<Ty>(yp, OUT, o0, o1, tok, g1 - g0, tg, rows, 0, rows, bs, OUT);
          }
        }
      }
    });
  });
}

// The same kernels as dispatcher ops (torch.ops.rivulet.*): what torch.compile records in its graphs
// (their fake implementations are in ops.py). Tuples rather than lists: the schemas name two outputs.
std::tuple<torch::Tensor, torch::Tensor> fused_add_rms_norm_op(const torch::Tensor& x, const torch::Tensor& residual,
                                                               const torch::Tensor& weight, double eps) {
  auto r = fused_add_rms_norm(x, residual, weight, eps);
  return {r[0], r[1]};
}
std::tuple<torch::Tensor, torch::Tensor> apply_rotary_op(const torch::Tensor& positions, const torch::Tensor& q,
                                                         const torch::Tensor& k, const torch::Tensor& cache,
                                                         bool interleaved) {
  auto r = apply_rotary(positions, q, k, cache, interleaved);
  return {r[0], r[1]};
}

TORCH_LIBRARY_FRAGMENT(rivulet, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("fused_add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("apply_rotary(Tensor positions, Tensor q, Tensor k, Tensor cos_sin_cache, bool interleaved) -> (Tensor, Tensor)");
  m.def("write_kv_cache(Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slot_mapping) -> ()");
  m.def("rotary_write_kv_cache(Tensor positions, Tensor q, Tensor k, Tensor value, Tensor cos_sin_cache, "
        "bool interleaved, Tensor(a!) kv_cache, Tensor slot_mapping) -> Tensor");
  m.def("decode_attention(Tensor query, Tensor kv_cache, Tensor block_tables, Tensor seq_lens, Tensor rows, "
        "Tensor seqs, Tensor(a!) out, float scale, int sliding_window) -> ()");
  m.def("silu_and_mul(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(rivulet, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("fused_add_rms_norm", &fused_add_rms_norm_op);
  m.impl("apply_rotary", &apply_rotary_op);
  m.impl("write_kv_cache", &write_kv_cache);
  m.impl("rotary_write_kv_cache", &rotary_write_kv_cache);
  m.impl("decode_attention", &decode_attention);
  m.impl("silu_and_mul", &silu_and_mul);
}

// KV blocks between caches of the same block shape (the KV tier: a layer's device cache and its host
// buffer, each [halves, blocks, ...] with contiguous blocks): dst[l][h, dst_idx[i]] = src[l][h, src_idx[i]]
// for every layer l, half h and pair i, one memcpy each, all of them spread over the threads.
void copy_blocks(std::vector<torch::Tensor> src, std::vector<torch::Tensor> dst, torch::Tensor src_idx,
                 torch::Tensor dst_idx) {
  TORCH_CHECK(src.size() == dst.size(), "copy_blocks: as many source as destination layers");
  TORCH_CHECK(src_idx.dim() == 1 && dst_idx.dim() == 1 && src_idx.numel() == dst_idx.numel(),
              "copy_blocks: index vectors of one length");
  auto si = src_idx.to(torch::kLong).contiguous(), di = dst_idx.to(torch::kLong).contiguous();
  const int64_t n = si.numel(), L = static_cast<int64_t>(src.size());
  if (n == 0 || L == 0) return;
  const int64_t* sp = si.data_ptr<int64_t>();
  const int64_t* dp = di.data_ptr<int64_t>();
  std::vector<char*> s_base(L), d_base(L);
  std::vector<int64_t> halves(L), bytes(L), s_half(L), d_half(L), s_block(L), d_block(L);
  for (int64_t l = 0; l < L; ++l) {
    const auto& s = src[l];
    const auto& d = dst[l];
    TORCH_CHECK(s.device().is_cpu() && d.device().is_cpu(), "copy_blocks: CPU tensors");
    TORCH_CHECK(s.scalar_type() == d.scalar_type() && s.dim() >= 2 && d.dim() == s.dim() &&
                s.size(0) == d.size(0), "copy_blocks: layer ", l, ": same dtype, halves and block shape");
    for (int64_t k = 2; k < s.dim(); ++k)
      TORCH_CHECK(s.size(k) == d.size(k), "copy_blocks: layer ", l, ": same block shape");
    const int64_t elems = s.numel() / std::max<int64_t>(1, s.size(0) * s.size(1));
    TORCH_CHECK(s[0][0].is_contiguous() && d[0][0].is_contiguous() && s.stride(1) == elems && d.stride(1) == elems,
                "copy_blocks: layer ", l, ": blocks must be contiguous");
    const int64_t isz = s.element_size();
    s_base[l] = static_cast<char*>(s.data_ptr());
    d_base[l] = static_cast<char*>(d.data_ptr());
    halves[l] = s.size(0);
    bytes[l] = elems * isz;
    s_half[l] = s.stride(0) * isz;
    d_half[l] = d.stride(0) * isz;
    s_block[l] = s.stride(1) * isz;
    d_block[l] = d.stride(1) * isz;
    for (int64_t i = 0; i < n; ++i)
      TORCH_CHECK(sp[i] >= 0 && sp[i] < s.size(1) && dp[i] >= 0 && dp[i] < d.size(1),
                  "copy_blocks: block index out of range");
  }
  const int64_t H = *std::max_element(halves.begin(), halves.end());
  at::parallel_for(0, L * H * n, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t i = t % n, lh = t / n, l = lh / H, h = lh % H;
      if (h >= halves[l]) continue;
      std::memcpy(d_base[l] + h * d_half[l] + dp[i] * d_block[l], s_base[l] + h * s_half[l] + sp[i] * s_block[l],
                  bytes[l]);
    }
  });
}

void register_cpu_ops(py::module& m) {
#ifdef RIVULET_DECODE_KERNEL
  m.attr("FP8_DECODE_KERNEL") = true;  // decode_attention reads float8_e5m2 caches
#else
  m.attr("FP8_DECODE_KERNEL") = false;
#endif
  m.def("copy_blocks", &copy_blocks);
  m.def("rms_norm", &rms_norm);
  m.def("fused_add_rms_norm", &fused_add_rms_norm);
  m.def("apply_rotary", &apply_rotary);
  m.def("write_kv_cache", &write_kv_cache);
  m.def("rotary_write_kv_cache", &rotary_write_kv_cache);
  m.def("decode_attention", &decode_attention);
  m.def("silu_and_mul", &silu_and_mul);
  m.def("add_lora", &add_lora);
}
