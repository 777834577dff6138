// Prefill attention on Intel AMX tiles: the flash attention of prefill_attention.cpp with both matmuls of
// a key block on the tile unit, for bf16 caches with head dims of whole 32-element tile rows.
//
// A tile of work is 32 consecutive query tokens of one (sequence, kv head), in two halves of 16; its G query heads
// are done one after another, each over softmax blocks of 256 keys (eight sub-blocks of 32). Both matmuls run in
// 2 x 2 tile blocks, as the linear's do, so that each tile load serves two products. Every buffer the tiles
// read or write is on 64-byte lines (`line_vector`): a tile whose rows cross lines loads ~6x slower
// (benchmarks/amx_tile_timings.cpp; misaligned scratch made this kernel 1.1-1.3x slower):
//   S^T [keys x tokens] = K Q^T   A: 16 keys read in place from their cache page (block_size % 16 == 0), two
//                                 per sub-block; B: a half's Q^T in dim pairs, packed once per tile (16 x 16
//                                 dword transposes); fp32 C tiles (key half x token half)
//   online softmax with the tokens in the vector lanes (vertical, as in the AVX-512 kernel), in base 2
//   O^T [D x tokens] += V^T P^T   A: the values transposed, in key pairs (16 dims x 16 key pairs), packed once per
//                                 call for every (sequence, kv head) and shared by all its tiles; B: a half's P^T
//                                 in bf16 key pairs as the softmax leaves it in the lanes (no transpose)
// O^T stays in fp32 outside the C tiles, which load it back for each block's V^T P^T and store it after the
// block's eight sub-blocks. The running max is lazy: it moves only when a block's scores pass it by more than
// 8 (base 2), so P <= 2^8 and O^T is rescaled (a vector pass) only then, rarely after a head's first block
// (with a max that moved every block, the tiles' sums would need that pass each time: 0.97-0.98x the kernel's
// time against it). O^T is normalized and transposed at the end. A tile of 16 tokens or fewer runs one half (no
// products for the other). The vector units and the tile unit do not overlap here, so the scores are computed
// right before their softmax (one buffer of 32 KiB, in L1).
// bf16 inputs, fp32 scores and sums, P rounded to bf16 for P V: the arithmetic of the AVX-512 kernel and of
// PyTorch's flash kernel, in another order of the sums.
#include "prefill_attention.h"

#ifdef __AVX512BF16__
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <type_traits>

namespace prefill {
namespace {

constexpr int64_t M = 16;   // query tokens of a tile's half (rows of the C tiles of S^T, columns of P^T's)
constexpr int64_t MT = 2 * M;  // query tokens of a tile
constexpr int64_t KB = 32;  // keys of a sub-block: two S^T tiles, the K dim of one P tile
// tiles (their numbers are immediates): C tiles 0-3, A tiles 4-5, B tiles 6-7 in both matmuls, as in the
// linear's 2 x 2 blocks (amx_tiles.h)

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
constexpr float kLazyMax = 8.f;  // log2 of the largest P the lazy max lets through (as exact in bf16 as P <= 1)

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
  line_vector<uint32_t> qt;  // [G][2 halves][D/2 dim pairs][16 tokens]: Q^T of each head, B tiles of 16 pairs
  line_vector<float> s;      // [KS keys][32 tokens]: S^T of the softmax block
  line_vector<uint32_t> pb;  // [NSB][2 halves][16 key pairs][16 tokens]: P^T in key pairs, B tiles
  line_vector<float> o;      // [D][32 tokens]: output accumulators of the head, transposed (C tiles' rows)
  Scratch(int64_t G, int64_t D) : qt(G * D * M), s(KS * MT), pb(NSB * 2 * M * M), o(D * MT) {}
};

// S^T of one 32-key sub-block (its halves at page rows kp0, kp1; kp1 null: 16 keys) for the tile's tokens, stored
// into s [32 keys][32 tokens]: C tiles 0-3 = (keys 0-15, tokens 0-15), (keys 16-31, tokens 0-15), (keys 0-15,
// tokens 16-31), (keys 16-31, tokens 16-31), the keys in A tiles 4-5, Q^T's halves in B tiles 6-7: each load
// serves two products (two = false: tokens 0-15 only).
__attribute__((target("amx-tile,amx-bf16"))) inline void sub_scores(const uint32_t* qt0, const uint32_t* qt1,
                                                                   const at::BFloat16* kp0, const at::BFloat16* kp1,
                                                                   bool two, int64_t kstride, int64_t D, float* s) {
  _tile_zero(0);
  if (kp1) _tile_zero(1);
  if (two) _tile_zero(2);
  if (two && kp1) _tile_zero(3);
  for (int64_t c = 0; c < D / 32; ++c) {
    _tile_loadd(4, kp0 + c * 32, kstride);
    _tile_loadd(6, qt0 + c * M * M, 64);
    _tile_dpbf16ps(0, 4, 6);
    if (kp1) {
      _tile_loadd(5, kp1 + c * 32, kstride);
      _tile_dpbf16ps(1, 5, 6);
    }
    if (two) {
      _tile_loadd(7, qt1 + c * M * M, 64);
      _tile_dpbf16ps(2, 4, 7);
      if (kp1) _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, s, MT * 4);
  if (kp1) _tile_stored(1, s + M * MT, MT * 4);
  if (two) _tile_stored(2, s + M, MT * 4);
  if (two && kp1) _tile_stored(3, s + M * MT + M, MT * 4);
}

// A tile's work as jobs (head g, softmax block from key ks), one after another: the block's S^T, its online softmax
// per token half, then O^T += V^T P^T in 2 x 2 blocks.
__attribute__((target("amx-tile,amx-bf16"))) void amx_tile(const Args& a, const Tile& t, const VSpan& vs,
                                                               Scratch& sc) {
  using T = at::BFloat16;
  const int64_t D = a.D, G = a.G, DW = D / 2, DN = D / 16, n = t.n, halves = n > M ? 2 : 1;
  const bool two = halves == 2;
  int32_t pos[MT];
  for (int64_t r = 0; r < MT; ++r) pos[r] = int32_t(t.start + t.first + std::min(r, n - 1));
  const __m512i posv[2] = {_mm512_loadu_si512(pos), _mm512_loadu_si512(pos + M)};
  const int64_t hi = pos[n - 1] + 1;
  const int64_t lo = a.window > 0 ? std::max<int64_t>(0, pos[0] - a.window + 1) : 0;
  const int64_t k_first = lo / KB * KB, blocks = (hi - k_first + KS - 1) / KS, jobs = G * blocks;
  for (int64_t g = 0; g < G; ++g)  // Q^T of each half in dim pairs (tokens past the tile repeat the last one)
    for (int64_t th = 0; th < halves; ++th) {
      const T* q0 = static_cast<const T*>(a.query) + (t.row0 + t.first) * a.q_stride0 + (t.h * G + g) * a.q_stride1;
      for (int64_t w0 = 0; w0 < DW; w0 += M) {
        __m512i r[M];
        for (int64_t i = 0; i < M; ++i) r[i] = _mm512_loadu_si512(q0 + std::min(th * M + i, n - 1) * a.q_stride0 + 2 * w0);
        transpose16(r);
        for (int64_t w = 0; w < M; ++w) _mm512_storeu_si512(sc.qt.data() + ((g * 2 + th) * DW + w0 + w) * M, r[w]);
      }
    }
  const T* keys = static_cast<const T*>(a.keys);
  auto key_row = [&](int64_t k) {
    return keys + (int64_t(t.table[k / a.bs]) * a.bs + k % a.bs) * a.tok_stride + t.h * D;
  };
  const int64_t kstride = a.tok_stride * int64_t(sizeof(T));
  auto issue = [&](int64_t job) {  // S^T of a job's sub-blocks into sc.s
    const int64_t g = job / blocks, ks = k_first + job % blocks * KS;
    float* s = sc.s.data();
    const uint32_t* qt = sc.qt.data() + g * 2 * DW * M;
    for (int64_t k0 = ks; k0 < std::min(hi, ks + KS); k0 += KB)
      sub_scores(qt, qt + DW * M, key_row(k0), hi - k0 > M ? key_row(k0 + M) : nullptr, two, kstride, D,
                 s + (k0 - ks) * MT);
  };
  const __m512 c = _mm512_set1_ps(a.scale * kLog2e);
  const __m512i pair_words = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                                              6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const int64_t vblock = D * KB / 2;
  T* out = static_cast<T*>(a.out);
  __m512 m[2], l[2];  // per token half: running (lazy) max, base 2 and scaled, and sum
  for (int th = 0; th < 2; ++th) m[th] = _mm512_set1_ps(-INFINITY), l[th] = _mm512_setzero_ps();
  for (int64_t job = 0; job < jobs; ++job) {
    issue(job);
    const int64_t g = job / blocks, ks = k_first + job % blocks * KS;
    const float* s = sc.s.data();
    const int64_t nkeys = std::min(KS, hi - ks), nsb = (nkeys + KB - 1) / KB;
    // online softmax over the block, per token (lane). Its first `open` keys are seen by every token and need no
    // masks: without a window, all up to the tile's first position (the causal diagonal's keys are masked)
    const bool whole = ks + nkeys - 1 <= pos[0] && ks >= lo && (a.window == 0 || pos[MT - 1] - ks < a.window);
    const int64_t open = whole ? nkeys : a.window > 0 ? 0 : std::clamp<int64_t>(pos[0] - ks + 1, 0, nkeys);
    __mmask16 valid[KS][2];
    __m512 alpha[2], mu[2], mn[2];
    bool moved = false;  // some token's max moved: O^T needs its correction
    // after a head's first block (no window: every token's max is finite) P is computed with the lazy max as it is
    // and the block's max found on the way, the block redone only where it moved (0.96x the kernel's time at
    // 1 x 1024 against a max pass first); a head's first block and windows take the max pass
    const bool fold = job % blocks != 0 && a.window == 0;
    auto lazy_update = [&](int th, __m512 bmax) {  // -> whether th's max moved
      const __m512 bm = _mm512_mul_ps(bmax, c);
      const __mmask16 up = _mm512_cmp_ps_mask(bm, _mm512_add_ps(m[th], _mm512_set1_ps(kLazyMax)), _CMP_GT_OQ);
      mn[th] = _mm512_mask_blend_ps(up, m[th], bm);
      mu[th] = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(mn[th], _mm512_set1_ps(-INFINITY), _CMP_EQ_OQ), mn[th],
                                    _mm512_setzero_ps());
      alpha[th] = _mm512_mask_blend_ps(up, _mm512_set1_ps(1.f),  // m = -inf: 0
                                       exp2_16(_mm512_max_ps(_mm512_sub_ps(m[th], mu[th]), _mm512_set1_ps(-127.f))));
      return up != 0;
    };
    for (int th = 0; fold && th < halves; ++th) {
      for (int64_t j = open; j < nkeys; ++j)
        valid[j][th] = _mm512_cmpge_epi32_mask(posv[th], _mm512_set1_epi32(int(ks + j)));
      mu[th] = mn[th] = m[th], alpha[th] = _mm512_set1_ps(1.f);
    }
    for (int th = 0; !fold && th < halves; ++th) {
      __m512 b0 = _mm512_set1_ps(-INFINITY), b1 = b0;  // two running maxima, not one chain of dependent max ops
      int64_t j = 0;
      for (; j + 2 <= open; j += 2) {
        b0 = _mm512_max_ps(b0, _mm512_loadu_ps(s + j * MT + th * M));
        b1 = _mm512_max_ps(b1, _mm512_loadu_ps(s + (j + 1) * MT + th * M));
      }
      for (; j < open; ++j) b0 = _mm512_max_ps(b0, _mm512_loadu_ps(s + j * MT + th * M));
      __m512 bmax = _mm512_max_ps(b0, b1);
      for (j = open; j < nkeys; ++j) {
        const __m512i key = _mm512_set1_epi32(int(ks + j));
        __mmask16 v = _mm512_cmpge_epi32_mask(posv[th], key);
        if (a.window > 0) v &= _mm512_cmplt_epi32_mask(_mm512_sub_epi32(posv[th], key), _mm512_set1_epi32(int(a.window)));
        valid[j][th] = v;
        bmax = _mm512_mask_max_ps(bmax, v, bmax, _mm512_loadu_ps(s + j * MT + th * M));
      }
      moved |= lazy_update(th, bmax);
    }
    __m512 sum[2][2], bmx[2];
    // P^T of one token half into the B tiles' rows, its two sums (even and odd keys) and, with kTrack, its block max:
    // the whole pairs of keys before the first masked one without a test, then the diagonal's keys masked
    auto exps_half = [&](auto track_c, int th) {
      constexpr bool kTrack = decltype(track_c)::value;
      const __m512 mut = mu[th];
      __m512 s0 = _mm512_setzero_ps(), s1 = s0, bm = _mm512_set1_ps(-INFINITY);
      const float* st = s + th * M;
      uint32_t* const pt = sc.pb.data() + th * M * M;
      // row j/2 of the sub-block's B tile: P^T in key pairs, as it is (the tokens are the lanes): both keys rounded by
      // one instruction, their words then paired by one permute
      auto store_pair = [&](int64_t j, __m512 p0, __m512 p1) {
        _mm512_storeu_si512(pt + j / KB * 2 * M * M + j % KB / 2 * M,
                            _mm512_permutexvar_epi16(pair_words, (__m512i)_mm512_cvtne2ps_pbh(p1, p0)));
      };
      int64_t j = 0;
      for (const int64_t clean = open / 2 * 2; j < clean; j += 2) {
        const __m512 v0 = _mm512_loadu_ps(st + j * MT), v1 = _mm512_loadu_ps(st + (j + 1) * MT);
        if constexpr (kTrack) bm = _mm512_max_ps(bm, _mm512_max_ps(v0, v1));
        const __m512 p0 = exp2_16(_mm512_fmsub_ps(v0, c, mut)), p1 = exp2_16(_mm512_fmsub_ps(v1, c, mut));
        s0 = _mm512_add_ps(s0, p0);
        s1 = _mm512_add_ps(s1, p1);
        store_pair(j, p0, p1);
      }
      for (; j < nsb * KB; j += 2) {
        __m512 p[2];
        for (int e = 0; e < 2; ++e) {
          const int64_t k = j + e;
          if (k >= nkeys) {
            p[e] = _mm512_setzero_ps();
            continue;
          }
          const __m512 sv = _mm512_loadu_ps(st + k * MT);
          if constexpr (kTrack) bm = k < open ? _mm512_max_ps(bm, sv) : _mm512_mask_max_ps(bm, valid[k][th], bm, sv);
          p[e] = exp2_16(_mm512_fmsub_ps(sv, c, mut));
          if (k >= open) p[e] = _mm512_maskz_mov_ps(valid[k][th], p[e]);
        }
        s0 = _mm512_add_ps(s0, p[0]);
        s1 = _mm512_add_ps(s1, p[1]);
        store_pair(j, p[0], p[1]);
      }
      sum[th][0] = s0, sum[th][1] = s1, bmx[th] = bm;
    };
    auto exps = [&](bool track) {  // P^T of the block, its sums; track: its max into bmx
      for (int th = 0; th < halves; ++th) track ? exps_half(std::true_type{}, th) : exps_half(std::false_type{}, th);
    };
    exps(fold);
    if (fold) {
      bool redo = false;
      for (int th = 0; th < halves; ++th) redo |= lazy_update(th, bmx[th]);
      if (redo) exps(false), moved = true;
    }
    for (int th = 0; th < halves; ++th) {
      m[th] = mn[th];
      l[th] = _mm512_fmadd_ps(l[th], alpha[th], _mm512_add_ps(sum[th][0], sum[th][1]));
    }
    // O^T = alpha O^T + V^T P^T in 2 x 2 blocks: O^T scaled first where a max moved (alpha per token), then loaded
    // into C tiles 0-3 = (dims dn0, half 0), (dn0 + 1, half 0), (dn0, half 1), (dn0 + 1, half 1) (zeros for a head's
    // first block), the sub-blocks' products added, and stored back; A the values transposed (tiles 4-5, packed
    // so), B P^T as the softmax left it in its lanes (tiles 6-7)
    const bool head_first = job % blocks == 0;
    float* const o = sc.o.data();
    if (moved && !head_first)
      for (int64_t d = 0; d < D; ++d)
        for (int th = 0; th < halves; ++th)
          _mm512_storeu_ps(o + d * MT + th * M, _mm512_mul_ps(_mm512_loadu_ps(o + d * MT + th * M), alpha[th]));
    const uint32_t* vb = vs.base + (ks / KB - vs.b0) * vblock;
    for (int64_t dn0 = 0; dn0 < DN; dn0 += 2) {
      float* od = o + dn0 * 16 * MT;
      if (head_first) {
        _tile_zero(0);
        _tile_zero(1);
        if (two) {
          _tile_zero(2);
          _tile_zero(3);
        }
      } else {
        _tile_loadd(0, od, MT * 4);
        _tile_loadd(1, od + M * MT, MT * 4);
        if (two) {
          _tile_loadd(2, od + M, MT * 4);
          _tile_loadd(3, od + M * MT + M, MT * 4);
        }
      }
      for (int64_t sb = 0; sb < nsb; ++sb) {
        const uint32_t* v = vb + sb * vblock + dn0 * M * M;
        const uint32_t* pb = sc.pb.data() + sb * 2 * M * M;
        _tile_loadd(4, v, 64);
        _tile_loadd(6, pb, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_loadd(5, v + M * M, 64);
        _tile_dpbf16ps(1, 5, 6);
        if (two) {
          _tile_loadd(7, pb + M * M, 64);
          _tile_dpbf16ps(2, 4, 7);
          _tile_dpbf16ps(3, 5, 7);
        }
      }
      _tile_stored(0, od, MT * 4);
      _tile_stored(1, od + M * MT, MT * 4);
      if (two) {
        _tile_stored(2, od + M, MT * 4);
        _tile_stored(3, od + M * MT + M, MT * 4);
      }
    }
    if (job % blocks == blocks - 1) {  // the head's last block: normalize, transpose and write out, then the next head
      for (int th = 0; th < halves; ++th) {
        const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.f), l[th]);
        for (int64_t d0 = 0; d0 < D; d0 += 16) {
          __m512i r[M];
          for (int64_t d = 0; d < M; ++d)
            r[d] = _mm512_castps_si512(_mm512_mul_ps(_mm512_loadu_ps(sc.o.data() + (d0 + d) * MT + th * M), inv));
          transpose16(r);
          for (int64_t t2 = 0; t2 < std::min<int64_t>(M, n - th * M); ++t2) {
            T* dst = out + ((t.row0 + t.first + th * M + t2) * a.Hq + t.h * G + g) * D + d0;
            const __m256bh h = _mm512_cvtneps_pbh(_mm512_castsi512_ps(r[t2]));
            std::memcpy(dst, &h, 32);
          }
        }
      }
      for (int th = 0; th < 2; ++th) m[th] = _mm512_set1_ps(-INFINITY), l[th] = _mm512_setzero_ps();
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
  thread_local line_vector<uint32_t> vpack;
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
