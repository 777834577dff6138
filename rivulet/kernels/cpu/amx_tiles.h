// The AMX bf16 linear of amx_linear.cpp (layout, blockings and why there), shared with decode_program.cpp:
// `amx_span` computes the output column blocks [nb0, nb1) of rows [m0, m1), which is one thread's share of
// a linear. Each output element is the same sequence of tile products over K whatever the blocking, so
// any split of rows and columns gives the same numbers.
#pragma once
#include <torch/extension.h>

#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "simd.h"

namespace amx {

constexpr int kTileK = 32;  // bf16 along K per tile row (64 bytes)
constexpr int kTileN = 16;  // fp32 columns per C tile
constexpr int kTileElems = kTileK * kTileN;  // one packed B tile: 512 bf16

inline bool cpu_has_amx_bf16() {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  const bool tile = d & (1u << 24), bf16 = d & (1u << 22);
  return tile && bf16;
}

// Linux hands a process the AMX register state only when asked (arch_prctl ARCH_REQ_XCOMP_PERM).
inline bool usable() {
  static const bool ok = [] {
    if (!cpu_has_amx_bf16()) return false;
    constexpr int kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

// C tile t (rows x 16 fp32, row stride 64 floats) -> bf16 out rows, + bias
__attribute__((target("avx512f,avx512bf16"))) inline void store_rows(const float* c, int rows, int ncols,
                                                                     const at::BFloat16* bias, at::BFloat16* out,
                                                                     int64_t ldo) {
  for (int r = 0; r < rows; ++r) {
    for (int j = 0; j < ncols; j += kTileN) {
      __m512 v = _mm512_loadu_ps(c + r * 64 + j);
      if (bias) {
        __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bias + j));
        v = _mm512_add_ps(v, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16)));
      }
      __m256bh h = _mm512_cvtneps_pbh(v);
      std::memcpy(out + r * ldo + j, &h, 32);
    }
  }
}

using BlockFn = void (*)(const at::BFloat16*, int64_t, const at::BFloat16*, int64_t, int, const at::BFloat16*,
                         at::BFloat16*, int64_t);

// Up to 16 rows: tmm0-3 C (rows x 16 fp32), tmm4 A (rows x 32 bf16), tmm5 B (16 k-pairs x 16 columns x 2)
__attribute__((target("amx-tile"))) inline void configure_1xg(int rows) {
  TileConfig cfg;
  for (int t = 0; t < 4; ++t) cfg.rows[t] = rows, cfg.colsb[t] = 64;
  cfg.rows[4] = rows, cfg.colsb[4] = 64;
  cfg.rows[5] = 16, cfg.colsb[5] = 64;
  _tile_loadconfig(&cfg);
}

// G column blocks of 16 (G <= 4) for `rows` rows starting at x
template <int G>
__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bf16"))) void tile_block(
    const at::BFloat16* x, int64_t ldx, const at::BFloat16* w, int64_t kb_count, int rows, const at::BFloat16* bias,
    at::BFloat16* out, int64_t ldo) {
  _tile_zero(0);
  if constexpr (G > 1) _tile_zero(1);
  if constexpr (G > 2) _tile_zero(2);
  if constexpr (G > 3) _tile_zero(3);
  const int64_t block_stride = kb_count * kTileElems;  // elements between consecutive column blocks
  for (int64_t kb = 0; kb < kb_count; ++kb) {
    _tile_loadd(4, x + kb * kTileK, ldx * 2);
    const at::BFloat16* b = w + kb * kTileElems;
    _tile_loadd(5, b, 64);
    _tile_dpbf16ps(0, 4, 5);
    if constexpr (G > 1) { _tile_loadd(5, b + block_stride, 64); _tile_dpbf16ps(1, 4, 5); }
    if constexpr (G > 2) { _tile_loadd(5, b + 2 * block_stride, 64); _tile_dpbf16ps(2, 4, 5); }
    if constexpr (G > 3) { _tile_loadd(5, b + 3 * block_stride, 64); _tile_dpbf16ps(3, 4, 5); }
  }
  alignas(64) float c[16 * 64];
  _tile_stored(0, c, 256);
  if constexpr (G > 1) _tile_stored(1, c + 16, 256);
  if constexpr (G > 2) _tile_stored(2, c + 32, 256);
  if constexpr (G > 3) _tile_stored(3, c + 48, 256);
  store_rows(c, rows, G * kTileN, bias, out, ldo);
}

// More than 16 rows: blocks of up to 32 rows x 32 columns, C tiles 0-3 (A tile r x B tile c in 2r + c),
// A tiles 4-5 (rows 0-15 and 16-31 of the block), B tiles 6-7 (two column blocks). Each tile load serves two
// products (one per tile in the 1 x G blocks above); rows1 = 0: one A tile.
__attribute__((target("amx-tile"))) inline void configure_2x2(int rows0, int rows1) {
  TileConfig cfg;
  cfg.rows[0] = cfg.rows[1] = cfg.rows[4] = rows0;
  cfg.rows[2] = cfg.rows[3] = cfg.rows[5] = rows1;
  cfg.rows[6] = cfg.rows[7] = 16;
  for (int t = 0; t < 8; ++t) cfg.colsb[t] = cfg.rows[t] ? 64 : 0;
  _tile_loadconfig(&cfg);
}

// kStream: the first block of rows over these columns, whose B tiles come from memory (the later blocks find
// them in cache): each K step prefetches the tiles kPrefetchTiles steps ahead into L2, past the column block's
// end into the next one's (decode steps of 17-64 rows 3-10% shorter; prefetching in every block cost a 2048-row
// prefill step 9%).
constexpr int kPrefetchTiles = 4;

template <int R, int C, bool kStream>
__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bf16"))) void tile_block_2x2(
    const at::BFloat16* x, int64_t ldx, const at::BFloat16* w, int64_t kb_count, int rows, const at::BFloat16* bias,
    at::BFloat16* out, int64_t ldo) {
  _tile_zero(0);
  if constexpr (C > 1) _tile_zero(1);
  if constexpr (R > 1) _tile_zero(2);
  if constexpr (R > 1 && C > 1) _tile_zero(3);
  const at::BFloat16* w1 = w + kb_count * kTileElems;  // the second column block
  const at::BFloat16* x1 = x + 16 * ldx;
  for (int64_t kb = 0; kb < kb_count; ++kb) {
    if constexpr (kStream) {
      const char* b0 = reinterpret_cast<const char*>(w + (kb + kPrefetchTiles) * kTileElems);
      const char* b1 = reinterpret_cast<const char*>(w1 + (kb + kPrefetchTiles) * kTileElems);
      for (int l = 0; l < kTileElems * 2; l += 64) {
        _mm_prefetch(b0 + l, _MM_HINT_T1);
        if constexpr (C > 1) _mm_prefetch(b1 + l, _MM_HINT_T1);
      }
    }
    // A0's products first, so that the next A0 and B0 loads overlap this iteration's last products
    _tile_loadd(4, x + kb * kTileK, ldx * 2);
    _tile_loadd(6, w + kb * kTileElems, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (C > 1) { _tile_loadd(7, w1 + kb * kTileElems, 64); _tile_dpbf16ps(1, 4, 7); }
    if constexpr (R > 1) {
      _tile_loadd(5, x1 + kb * kTileK, ldx * 2);
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (C > 1) _tile_dpbf16ps(3, 5, 7);
    }
  }
  alignas(64) float c[32 * 64];
  _tile_stored(0, c, 256);
  if constexpr (C > 1) _tile_stored(1, c + 16, 256);
  if constexpr (R > 1) _tile_stored(2, c + 16 * 64, 256);
  if constexpr (R > 1 && C > 1) _tile_stored(3, c + 16 * 64 + 16, 256);
  store_rows(c, rows, C * kTileN, bias, out, ldo);
}

__attribute__((target("amx-tile"))) inline void release() { _tile_release(); }

// The tile shape a thread last loaded: 0 none, r (1-16) configure_1xg(r), 16 + r (17-48) a 2 x 2 block's of r rows.
struct TileState {
  int shape = 0;
  void done() {
    if (shape) release(), shape = 0;
  }
};

// Rows [m0, m1) x column blocks [nb0, nb1) of out [M, N] = x [M, K] W^T (+ bias), W packed [N/16, K/32, 16, 32]
// (kb_count = K/32). Steps of more than 16 rows (`wide`) run 32 x 32 blocks, column pairs from nb0 (so nb0
// even), the others 16 x (g x 16) blocks. The caller releases the tiles (`TileState::done`).
inline void span(const at::BFloat16* x, int64_t ldx, int64_t m0, int64_t m1, bool wide, const at::BFloat16* w,
                 int64_t kb_count, int64_t nb0, int64_t nb1, int g, const at::BFloat16* bias, at::BFloat16* out,
                 int64_t ldo, TileState& tiles) {
  static constexpr BlockFn kBlocks[5] = {nullptr, tile_block<1>, tile_block<2>, tile_block<3>, tile_block<4>};
  static constexpr BlockFn kBlocks2x2[2][3][3] = {  // [first block of rows][row tiles][column blocks]
      {{nullptr, nullptr, nullptr}, {nullptr, tile_block_2x2<1, 1, false>, tile_block_2x2<1, 2, false>},
       {nullptr, tile_block_2x2<2, 1, false>, tile_block_2x2<2, 2, false>}},
      {{nullptr, nullptr, nullptr}, {nullptr, tile_block_2x2<1, 1, true>, tile_block_2x2<1, 2, true>},
       {nullptr, tile_block_2x2<2, 1, true>, tile_block_2x2<2, 2, true>}}};
  const int step = wide ? 2 : g;
  for (int64_t nb = nb0; nb < nb1; nb += step) {
    const int cols = static_cast<int>(std::min<int64_t>(step, nb1 - nb));
    const at::BFloat16* wb = w + nb * kb_count * kTileElems;
    const at::BFloat16* bb = bias ? bias + nb * kTileN : nullptr;
    for (int64_t m = m0; m < m1; m += wide ? 32 : 16) {
      const int rows = static_cast<int>(std::min<int64_t>(wide ? 32 : 16, m1 - m));
      const int shape = wide ? 16 + rows : rows;  // (a wide block of <= 16 rows is a 2 x 2 shape too)
      if (shape != tiles.shape) {
        if (wide) configure_2x2(std::min(rows, 16), std::max(rows - 16, 0));
        else configure_1xg(rows);
        tiles.shape = shape;
      }
      const BlockFn fn = wide ? kBlocks2x2[m == m0][rows > 16 ? 2 : 1][cols] : kBlocks[cols];
      fn(x + m * ldx, ldx, wb, kb_count, rows, bb, out + m * ldo + nb * kTileN, ldo);
    }
  }
}

}  // namespace amx
