// Prefill attention over the paged KV cache: every sequence of the step with more than one query
// token (prefill chunks, k-token verification steps) in one call, reading the key/value pages in
// place: no gathered copy of the context, no mask tensor, no per-sequence Python loop.
//
// Flash attention with the rows in the vector lanes. A tile is up to 32 query rows of one
// (sequence, kv head): TQ consecutive positions x the G query heads that share the kv head. Its
// queries are packed once, transposed (Qp[w][row]), so that a score vector S[key][row0:row0+16]
// is a chain of FMAs (bf16: `vdpbf16ps` over pairs of the head dim) of one broadcast key dword
// against Qp. With the rows in the lanes the online softmax is vertical (no horizontal reduction
// per row), and P V is the same shape again: O^T[d][rows] += V[key][d] (broadcast) x P^T[key][rows].
// bf16 inputs, fp32 scores, softmax and accumulators; P rounded to bf16 for P V, as PyTorch's
// flash kernel does.
#include "prefill_attention.h"

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#ifdef __AVX512F__
namespace {

constexpr int64_t R = 32;   // rows of a tile: two vectors of 16 lanes
constexpr int64_t KB = 32;  // keys per block of the online softmax
constexpr int64_t KG = 8;   // keys (scores) or head dims (P V) whose 2 x 8 accumulators stay in registers

using prefill::Args;
using prefill::Tile;
using prefill::exp16;

// The element type's arithmetic on "dwords": KP elements of T packed in 32 bits (bf16: a pair of
// the reduced dimension, for vdpbf16ps; float: one element, for an FMA).
struct F32 {
  using T = float;
  static constexpr int64_t KP = 1;
  static __m512 dot(__m512 acc, __m512i a, __m512i b) {
    return _mm512_fmadd_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(b), acc);
  }
  static __m512i pack_p(__m512 p0, __m512) { return _mm512_castps_si512(p0); }
  // the dwords of value rows v0 (and v1) at head dims [d, d + 16)
  static __m512i pack_v(const T* v0, const T*, int64_t d, __mmask16 m) { return _mm512_maskz_loadu_epi32(m, v0 + d); }
};

#ifdef __AVX512BF16__
struct BF16 {
  using T = at::BFloat16;
  static constexpr int64_t KP = 2;
  static __m512 dot(__m512 acc, __m512i a, __m512i b) { return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b); }
  static __m512i interleave(__m256i lo, __m256i hi) { return prefill::interleave_bf16(lo, hi); }
  static __m512i pack_p(__m512 p0, __m512 p1) {
    return interleave((__m256i)_mm512_cvtneps_pbh(p0), (__m256i)_mm512_cvtneps_pbh(p1));
  }
  static __m512i pack_v(const T* v0, const T* v1, int64_t d, __mmask16 m) {
    return interleave(_mm256_maskz_loadu_epi16(m, v0 + d), _mm256_maskz_loadu_epi16(m, v1 + d));
  }
};
#endif

struct Scratch {
  line_vector<uint32_t> qp, kc, pp, vp;
  line_vector<float> s, ot;
  Scratch(int64_t D) : qp(D * R), kc(KB * D), pp(KB * R), vp(KB * D), s(KB * R), ot(D * R) {}
};

template <typename Op, int64_t DC>
void prefill_tile(const Args& a, const Tile& t, Scratch& sc) {
  using T = typename Op::T;
  constexpr int64_t KP = Op::KP;
  const int64_t D = DC ? DC : a.D, DW = D / KP, G = a.G;
  const int64_t rows = t.n * G;
  // queries, transposed: qp[w * R + r] = dword w of row r (rows past the tile are zero)
  uint32_t* qp = sc.qp.data();
  std::fill(qp, qp + DW * R, 0u);
  int32_t pos[R];
  for (int64_t r = 0; r < R; ++r) {
    const int64_t i = std::min(r, rows - 1) / G;
    pos[r] = int32_t(t.start + t.first + i);
    if (r >= rows) continue;
    const T* q = static_cast<const T*>(a.query) + (t.row0 + t.first + i) * a.q_stride0 + (t.h * G + r % G) * a.q_stride1;
    for (int64_t w = 0; w < DW; ++w) std::memcpy(&qp[w * R + r], q + w * KP, 4);
  }
  const __m512i posv[2] = {_mm512_loadu_si512(pos), _mm512_loadu_si512(pos + 16)};
  __m512 m[2] = {_mm512_set1_ps(-INFINITY), _mm512_set1_ps(-INFINITY)}, l[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
  float* ot = sc.ot.data();  // O^T [D][R]
  std::fill(ot, ot + D * R, 0.f);
  const int64_t hi = pos[rows - 1] + 1;
  const int64_t lo = a.window > 0 ? std::max<int64_t>(0, pos[0] - a.window + 1) : 0;
  const T* keys = static_cast<const T*>(a.keys);
  const T* values = static_cast<const T*>(a.values);
  auto token = [&](const T* plane, int64_t k) {
    return plane + (int64_t(t.table[k / a.bs]) * a.bs + k % a.bs) * a.tok_stride + t.h * D;
  };
  float* s = sc.s.data();
  uint32_t* kc = sc.kc.data();
  uint32_t* pp = sc.pp.data();
  uint32_t* vp = sc.vp.data();
  for (int64_t k0 = lo; k0 < hi; k0 += KB) {
    const int64_t n = std::min(KB, hi - k0), nk = (n + KG - 1) / KG * KG;
    // the block's keys side by side (past the context: the last key again, masked below)
    for (int64_t j = 0; j < nk; ++j) std::memcpy(kc + j * DW, token(keys, std::min(k0 + j, hi - 1)), D * sizeof(T));
    const __m512 scale = _mm512_set1_ps(a.scale);
    for (int64_t j0 = 0; j0 < nk; j0 += KG) {  // scores S^T[key][rows]
      __m512 acc[KG][2];
      for (int64_t j = 0; j < KG; ++j) acc[j][0] = acc[j][1] = _mm512_setzero_ps();
      for (int64_t w = 0; w < DW; ++w) {
        const __m512i q0 = _mm512_loadu_si512(qp + w * R), q1 = _mm512_loadu_si512(qp + w * R + 16);
        for (int64_t j = 0; j < KG; ++j) {
          const __m512i kb = _mm512_set1_epi32(int(kc[(j0 + j) * DW + w]));
          acc[j][0] = Op::dot(acc[j][0], kb, q0);
          acc[j][1] = Op::dot(acc[j][1], kb, q1);
        }
      }
      for (int64_t j = 0; j < KG; ++j) {
        _mm512_storeu_ps(s + (j0 + j) * R, _mm512_mul_ps(acc[j][0], scale));
        _mm512_storeu_ps(s + (j0 + j) * R + 16, _mm512_mul_ps(acc[j][1], scale));
      }
    }
    // online softmax, per lane (row): causal (key <= row position) and the window
    __m512 alpha[2];
    for (int v = 0; v < 2; ++v) {
      __mmask16 valid[KB];
      __m512 bmax = _mm512_set1_ps(-INFINITY);
      for (int64_t j = 0; j < n; ++j) {
        const __m512i key = _mm512_set1_epi32(int(k0 + j));
        valid[j] = _mm512_cmpge_epi32_mask(posv[v], key);
        if (a.window > 0)
          valid[j] &= _mm512_cmplt_epi32_mask(_mm512_sub_epi32(posv[v], key), _mm512_set1_epi32(int(a.window)));
        bmax = _mm512_mask_max_ps(bmax, valid[j], bmax, _mm512_loadu_ps(s + j * R + 16 * v));
      }
      const __m512 mn = _mm512_max_ps(m[v], bmax);
      const __m512 mu = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(mn, _mm512_set1_ps(-INFINITY), _CMP_EQ_OQ), mn,
                                             _mm512_setzero_ps());  // rows with nothing seen yet: 0
      alpha[v] = exp16(_mm512_sub_ps(m[v], mu));
      __m512 sum = _mm512_setzero_ps();
      for (int64_t j = 0; j < n; ++j) {
        const __m512 p = _mm512_maskz_mov_ps(valid[j], exp16(_mm512_sub_ps(_mm512_loadu_ps(s + j * R + 16 * v), mu)));
        _mm512_storeu_ps(s + j * R + 16 * v, p);
        sum = _mm512_add_ps(sum, p);
      }
      for (int64_t j = n; j < (n + KP - 1) / KP * KP; ++j) _mm512_storeu_ps(s + j * R + 16 * v, _mm512_setzero_ps());
      l[v] = _mm512_fmadd_ps(l[v], alpha[v], sum);
      m[v] = mn;
    }
    // P^T and V in dwords: pp[jp][rows], vp[jp][d] (KP consecutive keys per dword)
    const int64_t np = (n + KP - 1) / KP;
    for (int64_t jp = 0; jp < np; ++jp) {
      const int64_t j = jp * KP;
      for (int v = 0; v < 2; ++v)
        _mm512_storeu_si512(pp + jp * R + 16 * v,
                            Op::pack_p(_mm512_loadu_ps(s + j * R + 16 * v), _mm512_loadu_ps(s + (j + KP - 1) * R + 16 * v)));
      const T* v0 = token(values, std::min(k0 + j, hi - 1));
      const T* v1 = token(values, std::min(k0 + j + KP - 1, hi - 1));
      for (int64_t d = 0; d < D; d += 16) {
        const __mmask16 mk = D - d >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (D - d)) - 1);
        _mm512_mask_storeu_epi32(vp + jp * D + d, mk, Op::pack_v(v0, v1, d, mk));
      }
    }
    // O^T = alpha * O^T + V^T P^T
    int64_t d0 = 0;
    for (; d0 + KG <= D; d0 += KG) {
      __m512 acc[KG][2];
      for (int64_t d = 0; d < KG; ++d)
        for (int v = 0; v < 2; ++v) acc[d][v] = _mm512_mul_ps(_mm512_loadu_ps(ot + (d0 + d) * R + 16 * v), alpha[v]);
      for (int64_t jp = 0; jp < np; ++jp) {
        const __m512i p0 = _mm512_loadu_si512(pp + jp * R), p1 = _mm512_loadu_si512(pp + jp * R + 16);
        for (int64_t d = 0; d < KG; ++d) {
          const __m512i vb = _mm512_set1_epi32(int(vp[jp * D + d0 + d]));
          acc[d][0] = Op::dot(acc[d][0], vb, p0);
          acc[d][1] = Op::dot(acc[d][1], vb, p1);
        }
      }
      for (int64_t d = 0; d < KG; ++d)
        for (int v = 0; v < 2; ++v) _mm512_storeu_ps(ot + (d0 + d) * R + 16 * v, acc[d][v]);
    }
    for (; d0 < D; ++d0) {
      __m512 acc[2] = {_mm512_mul_ps(_mm512_loadu_ps(ot + d0 * R), alpha[0]),
                       _mm512_mul_ps(_mm512_loadu_ps(ot + d0 * R + 16), alpha[1])};
      for (int64_t jp = 0; jp < np; ++jp) {
        const __m512i vb = _mm512_set1_epi32(int(vp[jp * D + d0]));
        acc[0] = Op::dot(acc[0], vb, _mm512_loadu_si512(pp + jp * R));
        acc[1] = Op::dot(acc[1], vb, _mm512_loadu_si512(pp + jp * R + 16));
      }
      _mm512_storeu_ps(ot + d0 * R, acc[0]);
      _mm512_storeu_ps(ot + d0 * R + 16, acc[1]);
    }
  }
  float inv[R];
  _mm512_storeu_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.f), l[0]));
  _mm512_storeu_ps(inv + 16, _mm512_div_ps(_mm512_set1_ps(1.f), l[1]));
  T* out = static_cast<T*>(a.out);
  for (int64_t r = 0; r < rows; ++r) {
    T* o = out + ((t.row0 + t.first + r / G) * a.Hq + t.h * G + r % G) * D;
    for (int64_t d = 0; d < D; ++d) o[d] = static_cast<T>(ot[d * R + r] * inv[r]);
  }
}

template <typename Op>
using TileFn = void (*)(const Args&, const Tile&, Scratch&);

template <typename Op>
TileFn<Op> tile_for(int64_t D) {
  switch (D) {
    case 32: return prefill_tile<Op, 32>;
    case 64: return prefill_tile<Op, 64>;
    case 128: return prefill_tile<Op, 128>;
    default: return prefill_tile<Op, 0>;
  }
}

template <typename Op>
void run_tiles(const Args& a, const std::vector<Tile>& tiles) {
  const TileFn<Op> fn = tile_for<Op>(a.D);
  std::atomic<int64_t> next{0};
  // one task per thread, each taking the next tile (longest first) until none is left
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    Scratch sc(a.D);
    for (int64_t i = next++; i < int64_t(tiles.size()); i = next++) fn(a, tiles[i], sc);
  });
}

std::atomic<bool> amx_enabled{true};

// bf16 on AMX tiles (amx_attention.cpp) where the process may use them, the head dim is whole tile rows
// and 16 keys never straddle a page
bool use_amx(c10::ScalarType dtype, int64_t D, int64_t bs) {
#ifdef __AVX512BF16__
  return amx_enabled && dtype == torch::kBFloat16 && D % 32 == 0 && bs % 16 == 0 && amx_linear_available();
#else
  return false;
#endif
}

}  // namespace

// Causal attention of every listed sequence's query tokens over its context in the paged cache.
// query [T, Hq, D] (head dim contiguous), kv_cache [2, blocks, block_size, Hk, D], out [T, Hq, D]
// contiguous, written at the rows of the listed sequences only; query_start_loc [S + 1], seq_lens [S]
// (host int32), seqs: the sequences to compute. window > 0: the last `window` positions only.
void prefill_attention(torch::Tensor query, torch::Tensor kv_cache, torch::Tensor block_tables,
                       torch::Tensor query_start_loc, torch::Tensor seq_lens, torch::Tensor seqs, torch::Tensor out,
                       double scale, int64_t window) {
  TORCH_CHECK(kv_cache[0].is_contiguous() && out.is_contiguous() && query.stride(2) == 1, "prefill_attention: layouts");
  TORCH_CHECK(kv_cache.scalar_type() == query.scalar_type() && out.scalar_type() == query.scalar_type(),
              "prefill_attention: dtypes");
  auto bt = block_tables.to(torch::kInt).contiguous();
  auto qsl = query_start_loc.to(torch::kInt).contiguous();
  auto sl = seq_lens.to(torch::kInt).contiguous();
  auto sq = seqs.to(torch::kLong).contiguous();
  const int64_t Hq = query.size(1), D = query.size(2), bs = kv_cache.size(2), Hk = kv_cache.size(3);
  const int64_t G = Hq / Hk, plane = kv_cache.stride(0), maxb = bt.size(1);  // 0: values are the keys (MLA)
  TORCH_CHECK(Hq % Hk == 0, "prefill_attention: query heads a multiple of kv heads");
  const bool amx = use_amx(query.scalar_type(), D, bs);
  TORCH_CHECK(amx || G <= R, "prefill_attention: at most 32 query heads per kv head");
  const int64_t TQ = amx ? 32 : R / G;  // query tokens per tile
  std::vector<Tile> tiles;
  for (int64_t i = 0; i < sq.numel(); ++i) {
    const int64_t s = sq.data_ptr<int64_t>()[i];
    const int64_t q0 = qsl.data_ptr<int>()[s], q_len = qsl.data_ptr<int>()[s + 1] - q0, L = sl.data_ptr<int>()[s];
    for (int64_t f = 0; f < q_len; f += TQ) {
      const int64_t n = std::min(TQ, q_len - f), last = L - q_len + f + n - 1;
      const int64_t lo = window > 0 ? std::max<int64_t>(0, L - q_len + f - window + 1) : 0;
      for (int64_t h = 0; h < Hk; ++h) tiles.push_back({bt.data_ptr<int>() + s * maxb, q0, f, n, L - q_len, h, last + 1 - lo, i});
    }
  }
  std::stable_sort(tiles.begin(), tiles.end(), [](const Tile& x, const Tile& y) { return x.cost > y.cost; });
  const int64_t esize = query.element_size();
  Args a{query.data_ptr(), query.stride(0), query.stride(1), out.data_ptr(), nullptr, nullptr,
         bs, Hk * D, D, G, Hq, float(scale), window};
  const char* base = static_cast<const char*>(kv_cache.data_ptr());
  a.keys = base;
  a.values = base + plane * esize;
  if (query.scalar_type() == torch::kFloat32) {
    run_tiles<F32>(a, tiles);
  } else {
#ifdef __AVX512BF16__
    TORCH_CHECK(query.scalar_type() == torch::kBFloat16 && D % 2 == 0, "prefill_attention: bf16 with an even head dim");
    if (amx)
      prefill::run_tiles_amx(a, tiles);
    else
      run_tiles<BF16>(a, tiles);
#else
    TORCH_CHECK(false, "prefill_attention: bf16 needs AVX512-BF16");
#endif
  }
}

TORCH_LIBRARY_FRAGMENT(rivulet, m) {
  m.def("prefill_attention(Tensor query, Tensor kv_cache, Tensor block_tables, Tensor query_start_loc, "
        "Tensor seq_lens, Tensor seqs, Tensor(a!) out, float scale, int window) -> ()");
}
TORCH_LIBRARY_IMPL(rivulet, CPU, m) { m.impl("prefill_attention", &prefill_attention); }

void register_prefill_attention(py::module& m) {
  m.def("prefill_attention", &prefill_attention);
  // bf16 prefill attention on AMX tiles where usable (on by default); returns the previous setting
  m.def("prefill_attention_amx", [](bool on) { return amx_enabled.exchange(on); });
  m.def("prefill_attention_amx_used", [](int64_t D, int64_t bs) { return use_amx(torch::kBFloat16, D, bs); });
#ifdef __AVX512BF16__
  m.attr("PREFILL_ATTENTION_BF16") = true;
#else
  m.attr("PREFILL_ATTENTION_BF16") = false;
#endif
}
#else
void register_prefill_attention(py::module&) {}
#endif
