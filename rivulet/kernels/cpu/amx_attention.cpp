// Prefill attention on Intel AMX tiles: the flash attention of prefill_attention.cpp with both matmuls of
// a key block on the tile unit, for bf16 caches with head dims of whole 32-element tile rows.
//
// A tile of work is 16 consecutive query tokens of one (sequence, kv head); its G query heads are done one
// after another, each over softmax blocks of 256 keys (eight sub-blocks of 32):
//   S^T [keys x tokens] = K Q^T   A: 16 keys read in place from their cache page (block_size % 16 == 0),
//                                 B: the head's Q^T in dim pairs, packed once per tile (16 x 16 dword
//                                 transposes); fp32 C tiles
//   online softmax with the tokens in the vector lanes (vertical, as in the AVX-512 kernel), in base 2
//   O^T [D x tokens] += V^T P^T   A: the values transposed, in key pairs (16 dims x 16 key pairs), packed
//                                 once per call for every (sequence, kv head) and shared by all its tiles,
//                                 B: P^T in bf16 key pairs as the softmax leaves it in the lanes (no transpose)
// V^T P^T of a block's eight sub-blocks sums in the C tiles; O^T stays in fp32 outside them (scaled by the
// softmax's correction, one vector over the tokens, once a block), and is normalized and transposed at the end. The scores of the next
// (head, block) are issued to the tile unit before this block's softmax, so that they run beside it.
// bf16 inputs, fp32 scores and sums, P rounded to bf16 for P V: the arithmetic of the AVX-512 kernel and of
// PyTorch's flash kernel, in another order of the sums. 1.1x the kernel with 32-key blocks, heads side by
// side and V packed per tile (benchmarks/cpu_prefill_attention.py, 1024-token prompts).
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
constexpr int64_t KB = 32;  // keys of a sub-block: two S^T tiles, the K dim of one P tile
// tiles (their numbers are immediates): S^T in C tiles 0-1, P V in C tiles 4-5; the inputs of each in the
// others, chosen so that no load waits for a product still reading its tile (see sub_scores and the P V loop).

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

constexpr int64_t NSB = 8;         // 32-key sub-blocks of a softmax block (4: 1.1x the time at 1k tokens)
constexpr int64_t KS = KB * NSB;   // keys of a softmax block
constexpr float kLog2e = 1.44269504088896341f;

// 2^x for 16 floats, x finite (softmax in base 2, the scale and log2(e) folded into one multiply): 2^r for
// r = x - floor(x) in [0, 1) (one vreduceps) by a degree-3 polynomial fitted to its relative error (at most
// 7.5e-5, 1/50 of bf16's rounding of P; degree 4 took 1.02x the kernel's time), times 2^floor(x) by scalef, which
// floors its exponent itself.
inline __m512 exp2_16(__m512 x) {
  const __m512 r = _mm512_reduce_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 p = _mm512_set1_ps(7.802452147006989e-2f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(2.2606715559959412e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(6.958335638046265e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(9.999251961708069e-1f));
  return _mm512_scalef_ps(p, x);
}

// Where each (sequence, kv head)'s packed values start: 32-key blocks from key 32 * b0.
struct VSpan {
  const uint32_t* base = nullptr;
  int64_t b0 = 0;
};

struct Scratch {
  std::vector<uint32_t> qt;  // [G][D/2 dim pairs][16 tokens]: Q^T of each head, B tiles of 16 pairs
  std::vector<float> s;      // [2][KS keys][16 tokens]: S^T of two softmax blocks (the next one in flight)
  std::vector<uint32_t> pb;  // [NSB][16 key pairs][16 tokens]: P^T in key pairs, a B tile per sub-block
  std::vector<float> pv;     // [32 dims][16 tokens]: two C tiles of (P V)^T
  std::vector<float> o;      // [D][16 tokens]: output accumulators of the head, transposed
  Scratch(int64_t G, int64_t D) : qt(G * D / 2 * M), s(2 * KS * M), pb(NSB * M * M), pv(32 * M), o(D * M) {}
};

// S^T of one 32-key sub-block (its halves at page rows kp0, kp1; kp1 null: 16 keys) into C tiles 0-1, stored.
// Dims in pairs of 32: Q^T in tiles 3 and 7, the keys in 2, 6 and 4, 5, so that no load waits for a product
// still reading its tile (tiles 4-7 are the P V tiles, free here: P V comes after in program order).
__attribute__((target("amx-tile,amx-bf16"))) inline void sub_scores(const uint32_t* qt, const at::BFloat16* kp0,
                                                                   const at::BFloat16* kp1, int64_t kstride,
                                                                   int64_t D, float* s) {
  _tile_zero(0);
  _tile_zero(1);
  for (int64_t c = 0; c < D / 32; c += 2) {
    const bool pair = c + 1 < D / 32;
    _tile_loadd(3, qt + c * M * M, 64);
    _tile_loadd(2, kp0 + c * 32, kstride);
    if (kp1) _tile_loadd(6, kp1 + c * 32, kstride);
    if (pair) {
      _tile_loadd(7, qt + (c + 1) * M * M, 64);
      _tile_loadd(4, kp0 + (c + 1) * 32, kstride);
      if (kp1) _tile_loadd(5, kp1 + (c + 1) * 32, kstride);
    }
    _tile_dpbf16ps(0, 2, 3);
    if (kp1) _tile_dpbf16ps(1, 6, 3);
    if (pair) {
      _tile_dpbf16ps(0, 4, 7);
      if (kp1) _tile_dpbf16ps(1, 5, 7);
    }
  }
  _tile_stored(0, s, 64);
  if (kp1) _tile_stored(1, s + M * M, 64);
}

// A tile's work as jobs (head g, softmax block from key ks), one after another; the scores of job i + 1 are
// issued to the tile unit before job i's softmax, so that they run beside it.
__attribute__((target("amx-tile,amx-bf16"))) void amx_tile(const Args& a, const Tile& t, const VSpan& vs,
                                                              Scratch& sc) {
  using T = at::BFloat16;
  const int64_t D = a.D, G = a.G, DW = D / 2, DN = D / 16, n = t.n;
  int32_t pos[M];
  for (int64_t r = 0; r < M; ++r) pos[r] = int32_t(t.start + t.first + std::min(r, n - 1));
  const __m512i posv = _mm512_loadu_si512(pos);
  const int64_t hi = pos[n - 1] + 1;
  const int64_t lo = a.window > 0 ? std::max<int64_t>(0, pos[0] - a.window + 1) : 0;
  const int64_t k_first = lo / KB * KB, blocks = (hi - k_first + KS - 1) / KS, jobs = G * blocks;
  for (int64_t g = 0; g < G; ++g) {  // Q^T in dim pairs, 16 at a time (tokens past the tile repeat the last one)
    const T* q0 = static_cast<const T*>(a.query) + (t.row0 + t.first) * a.q_stride0 + (t.h * G + g) * a.q_stride1;
    for (int64_t w0 = 0; w0 < DW; w0 += M) {
      __m512i r[M];
      for (int64_t i = 0; i < M; ++i) r[i] = _mm512_loadu_si512(q0 + std::min(i, n - 1) * a.q_stride0 + 2 * w0);
      transpose16(r);
      for (int64_t w = 0; w < M; ++w) _mm512_storeu_si512(sc.qt.data() + (g * DW + w0 + w) * M, r[w]);
    }
  }
  const T* keys = static_cast<const T*>(a.keys);
  auto key_row = [&](int64_t k) {
    return keys + (int64_t(t.table[k / a.bs]) * a.bs + k % a.bs) * a.tok_stride + t.h * D;
  };
  const int64_t kstride = a.tok_stride * int64_t(sizeof(T));
  auto issue = [&](int64_t job) {  // S^T of a job's sub-blocks into its half of sc.s
    const int64_t g = job / blocks, ks = k_first + job % blocks * KS;
    float* s = sc.s.data() + (job & 1) * KS * M;
    for (int64_t k0 = ks; k0 < std::min(hi, ks + KS); k0 += KB)
      sub_scores(sc.qt.data() + g * DW * M, key_row(k0), hi - k0 > M ? key_row(k0 + M) : nullptr, kstride, D,
                 s + (k0 - ks) * M);
  };
  const __m512 c = _mm512_set1_ps(a.scale * kLog2e);
  // words (p0[0..15], p1[0..15]) -> (p0[0], p1[0], p0[1], p1[1], ...)
  const __m512i pair_words = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                                              6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const int64_t vblock = D * KB / 2;  // uint32 per packed 32-key block
  T* out = static_cast<T*>(a.out);
  __m512 m = _mm512_set1_ps(-INFINITY), l = _mm512_setzero_ps();  // running max (base 2, scaled) and sum
  std::fill(sc.o.begin(), sc.o.end(), 0.f);
  issue(0);
  for (int64_t job = 0; job < jobs; ++job) {
    if (job + 1 < jobs) issue(job + 1);
    const int64_t g = job / blocks, ks = k_first + job % blocks * KS;
    const float* s = sc.s.data() + (job & 1) * KS * M;
    const int64_t nkeys = std::min(KS, hi - ks), nsb = (nkeys + KB - 1) / KB;
    // online softmax over the block, per token (lane). Its first `open` keys are seen by every token and need no
    // masks: without a window, all up to the tile's first position (the causal diagonal's 16 keys are masked)
    const bool whole = ks + nkeys - 1 <= pos[0] && ks >= lo && (a.window == 0 || pos[M - 1] - ks < a.window);
    const int64_t open = whole ? nkeys : a.window > 0 ? 0 : std::clamp<int64_t>(pos[0] - ks + 1, 0, nkeys);
    __mmask16 valid[KS];
    __m512 bmax = _mm512_set1_ps(-INFINITY);
    {  // four running maxima, not one chain of dependent max ops (0.96-0.97x the kernel's time)
      __m512 b1 = bmax, b2 = bmax, b3 = bmax;
      int64_t j = 0;
      for (; j + 4 <= open; j += 4) {
        bmax = _mm512_max_ps(bmax, _mm512_loadu_ps(s + j * M));
        b1 = _mm512_max_ps(b1, _mm512_loadu_ps(s + (j + 1) * M));
        b2 = _mm512_max_ps(b2, _mm512_loadu_ps(s + (j + 2) * M));
        b3 = _mm512_max_ps(b3, _mm512_loadu_ps(s + (j + 3) * M));
      }
      for (; j < open; ++j) bmax = _mm512_max_ps(bmax, _mm512_loadu_ps(s + j * M));
      bmax = _mm512_max_ps(_mm512_max_ps(bmax, b1), _mm512_max_ps(b2, b3));
    }
    for (int64_t j = open; j < nkeys; ++j) {
      const __m512i key = _mm512_set1_epi32(int(ks + j));
      __mmask16 v = _mm512_cmpge_epi32_mask(posv, key);
      if (a.window > 0) v &= _mm512_cmplt_epi32_mask(_mm512_sub_epi32(posv, key), _mm512_set1_epi32(int(a.window)));
      valid[j] = v;
      bmax = _mm512_mask_max_ps(bmax, v, bmax, _mm512_loadu_ps(s + j * M));
    }
    const __m512 mn = _mm512_max_ps(m, _mm512_mul_ps(bmax, c));
    const __m512 mu = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(mn, _mm512_set1_ps(-INFINITY), _CMP_EQ_OQ), mn,
                                           _mm512_setzero_ps());  // tokens with nothing seen yet: 0
    const __m512 alpha = exp2_16(_mm512_max_ps(_mm512_sub_ps(m, mu), _mm512_set1_ps(-127.f)));  // m = -inf: 0
    __m512 sum = _mm512_setzero_ps(), sum1 = sum;  // two running sums (keys of even and odd index)
    for (int64_t sb = 0; sb < nsb; ++sb) {
      for (int64_t jp = 0; jp < M; ++jp) {
        __m512 p[2];
        for (int e = 0; e < 2; ++e) {
          const int64_t j = sb * KB + 2 * jp + e;
          if (j >= nkeys) {
            p[e] = _mm512_setzero_ps();
            continue;
          }
          p[e] = exp2_16(_mm512_fmsub_ps(_mm512_loadu_ps(s + j * M), c, mu));
          if (j >= open) p[e] = _mm512_maskz_mov_ps(valid[j], p[e]);
          if (e) sum1 = _mm512_add_ps(sum1, p[e]); else sum = _mm512_add_ps(sum, p[e]);
        }
        // row jp of the sub-block's B tile: P^T in key pairs, as it is (the tokens are the lanes): both keys
        // rounded by one instruction, their words then paired by one permute
        _mm512_storeu_si512(sc.pb.data() + (sb * M + jp) * M,
                            _mm512_permutexvar_epi16(pair_words, (__m512i)_mm512_cvtne2ps_pbh(p[1], p[0])));
      }
    }
    m = mn;
    l = _mm512_fmadd_ps(l, alpha, _mm512_add_ps(sum, sum1));
    // O^T = alpha O^T + V^T P^T, 32 dims (two C tiles of 16 dims x 16 tokens) at a time, summed over the
    // sub-blocks in the tiles: A the values transposed (packed so), B P^T as the softmax left it in its lanes
    const uint32_t* vb = vs.base + (ks / KB - vs.b0) * vblock;
    for (int64_t dn0 = 0; dn0 < DN; dn0 += 2) {
      const bool two = dn0 + 1 < DN;
      _tile_zero(4);
      if (two) _tile_zero(5);
      // sub-blocks by turns in tiles 6, 7, 3 and 2, 0, 1 (P^T, V^T, V^T): loads never wait for the last products
      for (int64_t sb = 0; sb < nsb; ++sb) {
        const uint32_t* v = vb + sb * vblock + dn0 * M * M;
        const uint32_t* pb = sc.pb.data() + sb * M * M;
        if (sb & 1) {
          _tile_loadd(2, pb, 64);
          _tile_loadd(0, v, 64);
          if (two) _tile_loadd(1, v + M * M, 64);
          _tile_dpbf16ps(4, 0, 2);
          if (two) _tile_dpbf16ps(5, 1, 2);
        } else {
          _tile_loadd(6, pb, 64);
          _tile_loadd(7, v, 64);
          if (two) _tile_loadd(3, v + M * M, 64);
          _tile_dpbf16ps(4, 7, 6);
          if (two) _tile_dpbf16ps(5, 3, 6);
        }
      }
      _tile_stored(4, sc.pv.data(), 64);
      if (two) _tile_stored(5, sc.pv.data() + M * M, 64);
      float* o = sc.o.data() + dn0 * 16 * M;  // rows of 16 tokens, one per dim: alpha is per lane
      for (int64_t d = 0; d < (two ? 32 : 16); ++d)
        _mm512_storeu_ps(o + d * M, _mm512_fmadd_ps(_mm512_loadu_ps(o + d * M), alpha, _mm512_loadu_ps(sc.pv.data() + d * M)));
    }
    if (job % blocks == blocks - 1) {  // the head's last block: normalize, transpose and write out, then the next head
      const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.f), l);
      for (int64_t d0 = 0; d0 < D; d0 += 16) {
        __m512i r[M];  // r[d] lane t -> after the transpose r[t] lane d
        for (int64_t d = 0; d < M; ++d) r[d] = _mm512_castps_si512(_mm512_mul_ps(_mm512_loadu_ps(sc.o.data() + (d0 + d) * M), inv));
        transpose16(r);
        for (int64_t t2 = 0; t2 < n; ++t2) {
          T* dst = out + ((t.row0 + t.first + t2) * a.Hq + t.h * G + g) * D + d0;
          const __m256bh h = _mm512_cvtneps_pbh(_mm512_castsi512_ps(r[t2]));
          std::memcpy(dst, &h, 32);
        }
      }
      m = _mm512_set1_ps(-INFINITY), l = _mm512_setzero_ps();
      std::fill(sc.o.begin(), sc.o.end(), 0.f);
    }
  }
}

// The values of 32 keys from k0 (those from `end` on: the last key again, finite, their P is 0), transposed, in
// key pairs: D/16 A tiles of [16 dims][16 key pairs].
void pack_values(const Args& a, const int* table, int64_t h, int64_t k0, int64_t end, uint32_t* dst) {
  using T = at::BFloat16;
  const T* values = static_cast<const T*>(a.values);
  auto row = [&](int64_t k) {
    k = std::min(k, end - 1);
    return values + (int64_t(table[k / a.bs]) * a.bs + k % a.bs) * a.tok_stride + h * a.D;
  };
  for (int64_t dn = 0; dn < a.D / 16; ++dn) {
    __m512i r[M];  // r[jp] lane d: (V[2jp][d], V[2jp + 1][d]) -> transposed, r[d] lane jp
    for (int64_t jp = 0; jp < KB / 2; ++jp)
      r[jp] = interleave_bf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row(k0 + 2 * jp) + dn * 16)),
                              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row(k0 + 2 * jp + 1) + dn * 16)));
    transpose16(r);
    for (int64_t d = 0; d < M; ++d) _mm512_storeu_si512(dst + (dn * M + d) * M, r[d]);
  }
}

}  // namespace

void run_tiles_amx(const Args& a, const std::vector<Tile>& tiles) {
  // the keys each (sequence, kv head) is read at, from its tiles; their values packed once, for all tiles
  const int64_t Hk = a.Hq / a.G;
  int64_t nseq = 0;
  for (const Tile& t : tiles) nseq = std::max(nseq, t.seq + 1);
  std::vector<int64_t> lo(nseq * Hk, INT64_MAX), hi(nseq * Hk, 0), off(nseq * Hk, 0), first(nseq * Hk, 0);
  std::vector<const int*> table(nseq, nullptr);
  for (const Tile& t : tiles) {
    const int64_t i = t.seq * Hk + t.h, p0 = t.start + t.first;
    lo[i] = std::min(lo[i], a.window > 0 ? std::max<int64_t>(0, p0 - a.window + 1) : 0);
    hi[i] = std::max(hi[i], p0 + t.n);
    table[t.seq] = t.table;
  }
  const int64_t vblock = a.D * KB / 2;
  std::vector<std::pair<int64_t, int64_t>> units;  // (sequence x head, block)
  int64_t total = 0;
  for (int64_t i = 0; i < nseq * Hk; ++i) {
    if (hi[i] == 0) continue;
    const int64_t b0 = lo[i] / KB, b1 = (hi[i] + KB - 1) / KB;
    off[i] = total, first[i] = b0;
    total += (b1 - b0) * vblock;
    for (int64_t b = b0; b < b1; ++b) units.emplace_back(i, b);
  }
  // kept between calls (no page faults per step), one per calling thread; the team reads it through `vp`
  thread_local std::vector<uint32_t> vpack;
  if (int64_t(vpack.size()) < total) vpack.resize(total);
  uint32_t* const vp = vpack.data();
  at::parallel_for(0, int64_t(units.size()), 4, [&](int64_t u0, int64_t u1) {
    for (int64_t u = u0; u < u1; ++u) {
      const auto [i, b] = units[u];
      pack_values(a, table[i / Hk], i % Hk, b * KB, hi[i], vp + off[i] + (b - first[i]) * vblock);
    }
  });
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    Scratch sc(a.G, a.D);
    configure_tiles();
    for (int64_t i = next++; i < int64_t(tiles.size()); i = next++) {
      const Tile& t = tiles[i];
      amx_tile(a, t, VSpan{vp + off[t.seq * Hk + t.h], first[t.seq * Hk + t.h]}, sc);
    }
    release_tiles();
  });
}

}  // namespace prefill
#endif
