// Prefill attention on Intel AMX tiles: the flash attention of prefill_attention.cpp with both matmuls of
// a key block on the tile unit, for bf16 caches with head dims of whole 32-element tile rows.
//
// A tile of work is 16 consecutive query tokens of one (sequence, kv head) with all G query heads that
// share it. For each block of 32 keys:
//   S^T [keys x tokens] = K Q^T   A: 16 keys read in place from their cache page (block_size % 16 == 0),
//                                 B: the head's Q^T in dim pairs, packed once per tile; fp32 C tiles
//   online softmax with the tokens in the vector lanes (vertical, as in the AVX-512 kernel)
//   O [tokens x D] += P V         A: P in bf16 (the lanes' P^T packed in key pairs, then a 16 x 16
//                                 dword transpose), B: value rows interleaved in key pairs, packed once
//                                 per key block for the G heads
// O stays in fp32 outside the tiles (scaled by the softmax's correction per token) and is normalized at
// the end. bf16 inputs, fp32 scores and sums, P rounded to bf16 for P V: the arithmetic of the AVX-512
// kernel and of PyTorch's flash kernel, in another order of the sums.
#include "prefill_attention.h"

#ifdef __AVX512BF16__
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>

namespace prefill {
namespace {

constexpr int64_t M = 16;   // query tokens of a tile (rows of the C and A tiles)
constexpr int64_t KB = 32;  // keys of a block: two S^T tiles, the K dim of one P tile
// tiles (their numbers are immediates): S^T in C tiles 0-1 from A tile 2 (keys) and B tile 3 (Q^T); P V in C
// tiles 4-5 from A tile 6 (P) and B tile 7 (V). Apart, so that the next head's S^T is on the tile unit while
// the vector units run this head's softmax.

__attribute__((target("amx-tile"))) void configure_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;  // every tile 16 rows of 64 bytes
  _tile_loadconfig(&cfg);
}

__attribute__((target("amx-tile"))) void release_tiles() { _tile_release(); }

// r[i][j] -> r[j][i] for 16 vectors of 16 dwords (4 x 4 blocks inside 128-bit lanes, then across lanes).
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  __m512i u[16];  // u[4i + k], lane L: column 4L + k of rows 4i..4i+3
  for (int i = 0; i < 4; ++i) {
    u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int k = 0; k < 4; ++k) {  // column 4L + k = lane L of u[k], u[4 + k], u[8 + k], u[12 + k]
    const __m512i x0 = _mm512_shuffle_i32x4(u[k], u[4 + k], 0x44), x1 = _mm512_shuffle_i32x4(u[k], u[4 + k], 0xEE);
    const __m512i y0 = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0x44), y1 = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0xEE);
    r[k] = _mm512_shuffle_i32x4(x0, y0, 0x88);
    r[4 + k] = _mm512_shuffle_i32x4(x0, y0, 0xDD);
    r[8 + k] = _mm512_shuffle_i32x4(x1, y1, 0x88);
    r[12 + k] = _mm512_shuffle_i32x4(x1, y1, 0xDD);
  }
}

struct Scratch {
  std::vector<uint32_t> qt;  // [G][D/2 dim pairs][16 tokens]: Q^T, B tiles of 16 pairs each
  std::vector<uint32_t> vb;  // [D/16][16 key pairs][16 dims]: V in key pairs, a B tile per 16 dims
  std::vector<float> s;      // [2][32 keys][16 tokens]: S^T of two heads (one stored while the next computes)
  std::vector<uint32_t> pa;  // [16 tokens][16 key pairs]: P, an A tile
  std::vector<float> pv;     // [16 tokens][64]: two C tiles of P V (row stride 64 floats)
  std::vector<float> o;      // [G][16 tokens][D]: output accumulators
  std::vector<float> ml;     // [G][2][16]: running max and sum per token
  Scratch(int64_t G, int64_t D)
      : qt(G * D / 2 * M), vb(D * M), s(2 * KB * M), pa(M * M), pv(M * 64), o(G * M * D), ml(G * 2 * M) {}
};

// S^T of one head for the block's 16 or 32 keys into C tiles 0 (and 1): kp0/kp1 are the keys' page rows
__attribute__((target("amx-tile,amx-bf16"))) inline void issue_scores(const uint32_t* qt, const at::BFloat16* kp0,
                                                                     const at::BFloat16* kp1, int64_t kstride, int64_t D) {
  _tile_zero(0);
  _tile_zero(1);
  for (int64_t c = 0; c < D / 32; ++c) {
    _tile_loadd(3, qt + c * M * M, 64);
    _tile_loadd(2, kp0 + c * 32, kstride);
    _tile_dpbf16ps(0, 2, 3);
    if (kp1) {
      _tile_loadd(2, kp1 + c * 32, kstride);
      _tile_dpbf16ps(1, 2, 3);
    }
  }
}

__attribute__((target("amx-tile,amx-bf16"))) void amx_tile(const Args& a, const Tile& t, Scratch& sc) {
  using T = at::BFloat16;
  const int64_t D = a.D, G = a.G, DW = D / 2, DN = D / 16, n = t.n;
  int32_t pos[M];
  for (int64_t r = 0; r < M; ++r) pos[r] = int32_t(t.start + t.first + std::min(r, n - 1));
  const __m512i posv = _mm512_loadu_si512(pos);
  const int64_t hi = pos[n - 1] + 1;
  const int64_t lo = a.window > 0 ? std::max<int64_t>(0, pos[0] - a.window + 1) : 0;
  // Q^T of each head in dim pairs (tokens past the tile repeat the last one: finite, never written out)
  for (int64_t g = 0; g < G; ++g) {
    uint32_t* qt = sc.qt.data() + g * DW * M;
    for (int64_t r = 0; r < M; ++r) {
      const T* q = static_cast<const T*>(a.query) + (t.row0 + t.first + std::min(r, n - 1)) * a.q_stride0 +
                   (t.h * G + g) * a.q_stride1;
      for (int64_t w = 0; w < DW; ++w) std::memcpy(&qt[w * M + r], q + 2 * w, 4);
    }
  }
  std::fill(sc.o.begin(), sc.o.end(), 0.f);
  for (int64_t g = 0; g < G; ++g) {
    _mm512_storeu_ps(sc.ml.data() + g * 2 * M, _mm512_set1_ps(-INFINITY));
    _mm512_storeu_ps(sc.ml.data() + g * 2 * M + M, _mm512_setzero_ps());
  }
  const T* keys = static_cast<const T*>(a.keys);
  const T* values = static_cast<const T*>(a.values);
  auto token = [&](const T* plane, int64_t k) {
    return plane + (int64_t(t.table[k / a.bs]) * a.bs + k % a.bs) * a.tok_stride + t.h * D;
  };
  const int64_t kstride = a.tok_stride * int64_t(sizeof(T));
  for (int64_t k0 = lo / M * M; k0 < hi; k0 += KB) {
    const int64_t nk = std::min(KB, hi - k0);  // keys before the end (those before `lo` are masked)
    // V in key pairs for all heads (keys past the end: the last key again, with P = 0). Each 16 keys lie in
    // one page, so a row is its group's page row plus an offset (no division per key).
    const T* vpage[2] = {token(values, k0), nk > M ? token(values, k0 + M) : nullptr};
    auto vrow = [&](int64_t j) {
      j = std::min(j, nk - 1);
      return vpage[j / M] + (j % M) * a.tok_stride;
    };
    for (int64_t jp = 0; jp < KB / 2; ++jp) {
      const T* v0 = vrow(2 * jp);
      const T* v1 = vrow(2 * jp + 1);
      for (int64_t dn = 0; dn < DN; ++dn)
        _mm512_storeu_si512(sc.vb.data() + (dn * M + jp) * M,
                            interleave_bf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v0 + dn * 16)),
                                            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v1 + dn * 16))));
    }
    __mmask16 valid[KB];  // per key: the tokens (lanes) that see it
    for (int64_t j = 0; j < KB; ++j) {
      const __m512i key = _mm512_set1_epi32(int(k0 + j));
      valid[j] = j < nk ? _mm512_cmpge_epi32_mask(posv, key) : __mmask16(0);
      if (a.window > 0)
        valid[j] &= _mm512_cmplt_epi32_mask(_mm512_sub_epi32(posv, key), _mm512_set1_epi32(int(a.window)));
    }
    const T* kp0 = token(keys, k0);  // 16 keys of one page
    const T* kp1 = nk > M ? token(keys, k0 + M) : nullptr;
    issue_scores(sc.qt.data(), kp0, kp1, kstride, D);  // S^T = K Q^T of the first head
    for (int64_t g = 0; g < G; ++g) {
      float* s = sc.s.data() + (g & 1) * KB * M;
      _tile_stored(0, s, 64);
      if (kp1) _tile_stored(1, s + M * M, 64);
      if (g + 1 < G) issue_scores(sc.qt.data() + (g + 1) * DW * M, kp0, kp1, kstride, D);  // runs beside the softmax
      // online softmax over the block, per token (lane)
      float* ml = sc.ml.data() + g * 2 * M;
      const __m512 m_old = _mm512_loadu_ps(ml), l_old = _mm512_loadu_ps(ml + M);
      const __m512 scale = _mm512_set1_ps(a.scale);
      __m512 bmax = _mm512_set1_ps(-INFINITY);
      for (int64_t j = 0; j < nk; ++j)
        bmax = _mm512_mask_max_ps(bmax, valid[j], bmax, _mm512_mul_ps(_mm512_loadu_ps(s + j * M), scale));
      const __m512 mn = _mm512_max_ps(m_old, bmax);
      const __m512 mu = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(mn, _mm512_set1_ps(-INFINITY), _CMP_EQ_OQ), mn,
                                             _mm512_setzero_ps());  // tokens with nothing seen yet: 0
      const __m512 alpha = exp16(_mm512_sub_ps(m_old, mu));
      __m512 sum = _mm512_setzero_ps();
      __m512i pr[M];  // P^T in key pairs: pr[jp] lane r = (P[r][2jp], P[r][2jp + 1])
      for (int64_t jp = 0; jp < M; ++jp) {
        __m512 p[2];
        for (int e = 0; e < 2; ++e) {
          const int64_t j = 2 * jp + e;
          p[e] = j < nk ? _mm512_maskz_mov_ps(valid[j], exp16(_mm512_fmsub_ps(_mm512_loadu_ps(s + j * M), scale, mu)))
                        : _mm512_setzero_ps();
          sum = _mm512_add_ps(sum, p[e]);
        }
        pr[jp] = interleave_bf16((__m256i)_mm512_cvtneps_pbh(p[0]), (__m256i)_mm512_cvtneps_pbh(p[1]));
      }
      _mm512_storeu_ps(ml, mn);
      _mm512_storeu_ps(ml + M, _mm512_fmadd_ps(l_old, alpha, sum));
      transpose16(pr);  // pr[r] lane jp: P in key pairs, row r
      for (int64_t r = 0; r < M; ++r) _mm512_storeu_si512(sc.pa.data() + r * M, pr[r]);
      alignas(64) float al[M];
      _mm512_store_ps(al, alpha);
      // O = alpha O + P V, 32 dims (two C tiles) at a time
      float* o = sc.o.data() + g * M * D;
      _tile_loadd(6, sc.pa.data(), 64);
      for (int64_t dn0 = 0; dn0 < DN; dn0 += 2) {
        const int64_t cnt = std::min<int64_t>(2, DN - dn0);
        const uint32_t* vb = sc.vb.data() + dn0 * M * M;
        _tile_zero(4);
        _tile_loadd(7, vb, 64);
        _tile_dpbf16ps(4, 6, 7);
        if (cnt > 1) {
          _tile_zero(5);
          _tile_loadd(7, vb + M * M, 64);
          _tile_dpbf16ps(5, 6, 7);
        }
        _tile_stored(4, sc.pv.data(), 256);
        if (cnt > 1) _tile_stored(5, sc.pv.data() + 16, 256);
        for (int64_t r = 0; r < M; ++r) {
          const __m512 ar = _mm512_set1_ps(al[r]);
          float* orow = o + r * D + dn0 * 16;
          for (int64_t i = 0; i < cnt; ++i)
            _mm512_storeu_ps(orow + i * 16, _mm512_fmadd_ps(_mm512_loadu_ps(orow + i * 16), ar,
                                                              _mm512_loadu_ps(sc.pv.data() + r * 64 + i * 16)));
        }
      }
    }
  }
  T* out = static_cast<T*>(a.out);
  for (int64_t g = 0; g < G; ++g) {
    alignas(64) float inv[M];
    _mm512_store_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.f), _mm512_loadu_ps(sc.ml.data() + g * 2 * M + M)));
    for (int64_t r = 0; r < n; ++r) {
      const float* orow = sc.o.data() + (g * M + r) * D;
      T* dst = out + ((t.row0 + t.first + r) * a.Hq + t.h * G + g) * D;
      const __m512 ir = _mm512_set1_ps(inv[r]);
      for (int64_t d = 0; d < D; d += 16) {
        const __m256bh h = _mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(orow + d), ir));
        std::memcpy(dst + d, &h, 32);
      }
    }
  }
}

}  // namespace

void run_tiles_amx(const Args& a, const std::vector<Tile>& tiles) {
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    Scratch sc(a.G, a.D);
    configure_tiles();
    for (int64_t i = next++; i < int64_t(tiles.size()); i = next++) amx_tile(a, tiles[i], sc);
    release_tiles();
  });
}

}  // namespace prefill
#endif
