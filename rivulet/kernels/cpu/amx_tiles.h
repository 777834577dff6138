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

#include "rowwise.h"
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

// The end of a block: its C tiles' sums (rows x ncols fp32, row stride 64 floats, in `c`) -> bf16 out rows
// (+ bias), each rounded once (nearest even). silu_mul: the block's two column blocks are gate block j and up
// block j of a fused gate/up projection and out gets their 16 columns of silu_mul_row(round(gate), round(up)),
// the plain linear followed by silu_and_mul bit for bit (no bias). The blocks hand their end to the next block,
// which runs it a few rows per K step after that step's tile products: the vector work then overlaps the AMX
// unit's instead of leaving it idle (the gate/up kernel 0.6-0.7x the time of ending each block itself).
struct Epilogue {
  alignas(64) float c[32 * 64];
  int rows = 0, done = 0, ncols = 0;
  bool silu_mul = false;
  const at::BFloat16* bias = nullptr;
  at::BFloat16* out = nullptr;
  int64_t ldo = 0;

  __attribute__((target("avx512f,avx512bf16"))) inline void row(int r) {
    const float* cr = c + r * 64;
    at::BFloat16* o = out + r * ldo;
    if (silu_mul) {
      const __m512 g = round_to(at::BFloat16{}, _mm512_load_ps(cr)), u = round_to(at::BFloat16{}, _mm512_load_ps(cr + kTileN));
      const __m512 e = simd::exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
      const __m512 s = round_to(at::BFloat16{}, _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e)));
      store_rounded16(o, _mm512_mul_ps(s, u), __mmask16(0xFFFF));
      return;
    }
    for (int j = 0; j < ncols; j += kTileN) {
      __m512 v = _mm512_load_ps(cr + j);
      if (bias) {
        const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bias + j));
        v = _mm512_add_ps(v, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16)));
      }
      const __m256bh h = _mm512_cvtneps_pbh(v);
      std::memcpy(o + j, &h, 32);
    }
  }
  // `n` more rows of the pending block
  inline void step(int n) {
    for (const int end = std::min(rows, done + n); done < end; ++done) row(done);
  }
  inline void flush() {
    step(rows);
    rows = done = 0;
  }
  // the rows still to finish per K step of a block of kb_count steps
  int per_step(int64_t kb_count) const { return static_cast<int>((rows - done + kb_count - 1) / kb_count); }
  void pend(int rows_, int ncols_, bool silu_mul_, const at::BFloat16* bias_, at::BFloat16* out_, int64_t ldo_) {
    rows = rows_, done = 0, ncols = ncols_, silu_mul = silu_mul_, bias = bias_, out = out_, ldo = ldo_;
    // the rows' output lines, asked for with intent to write now: the next block's K steps store into them a few
    // rows at a time, and a store that misses stalls the tile loads behind it (prefill steps 0.92-0.94x the time)
    for (int r = 0; r < rows; ++r) __builtin_prefetch(out + r * ldo, 1, 3);
  }
};

// (x, ldx, w, elements from one column block of w to the block's next, kb_count, rows, bias, out, ldo, silu_mul,
// the epilogue: the previous block's to run, this block's to leave)
using BlockFn = void (*)(const at::BFloat16*, int64_t, const at::BFloat16*, int64_t, int64_t, int,
                         const at::BFloat16*, at::BFloat16*, int64_t, bool, Epilogue&);

// Up to 16 rows: tmm0-3 C (rows x 16 fp32), tmm4 A (rows x 32 bf16), tmm5 B (16 k-pairs x 16 columns x 2)
__attribute__((target("amx-tile"))) inline void configure_1xg(int rows) {
  TileConfig cfg;
  for (int t = 0; t < 4; ++t) cfg.rows[t] = rows, cfg.colsb[t] = 64;
  cfg.rows[4] = rows, cfg.colsb[4] = 64;
  cfg.rows[5] = 16, cfg.colsb[5] = 64;
  _tile_loadconfig(&cfg);
}

// G column blocks of 16 (G <= 4), `block_stride` elements apart in w, for `rows` rows starting at x
template <int G>
__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bf16"))) void tile_block(
    const at::BFloat16* x, int64_t ldx, const at::BFloat16* w, int64_t block_stride, int64_t kb_count, int rows,
    const at::BFloat16* bias, at::BFloat16* out, int64_t ldo, bool silu_mul, Epilogue& e) {
  _tile_zero(0);
  if constexpr (G > 1) _tile_zero(1);
  if constexpr (G > 2) _tile_zero(2);
  if constexpr (G > 3) _tile_zero(3);
  const int per = e.per_step(kb_count);
  for (int64_t kb = 0; kb < kb_count; ++kb) {
    _tile_loadd(4, x + kb * kTileK, ldx * 2);
    const at::BFloat16* b = w + kb * kTileElems;
    _tile_loadd(5, b, 64);
    _tile_dpbf16ps(0, 4, 5);
    if constexpr (G > 1) { _tile_loadd(5, b + block_stride, 64); _tile_dpbf16ps(1, 4, 5); }
    if constexpr (G > 2) { _tile_loadd(5, b + 2 * block_stride, 64); _tile_dpbf16ps(2, 4, 5); }
    if constexpr (G > 3) { _tile_loadd(5, b + 3 * block_stride, 64); _tile_dpbf16ps(3, 4, 5); }
    e.step(per);
  }
  e.flush();
  _tile_stored(0, e.c, 256);
  if constexpr (G > 1) _tile_stored(1, e.c + 16, 256);
  if constexpr (G > 2) _tile_stored(2, e.c + 32, 256);
  if constexpr (G > 3) _tile_stored(3, e.c + 48, 256);
  e.pend(rows, G * kTileN, silu_mul, bias, out, ldo);
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
    const at::BFloat16* x, int64_t ldx, const at::BFloat16* w, int64_t block_stride, int64_t kb_count, int rows,
    const at::BFloat16* bias, at::BFloat16* out, int64_t ldo, bool silu_mul, Epilogue& e) {
  _tile_zero(0);
  if constexpr (C > 1) _tile_zero(1);
  if constexpr (R > 1) _tile_zero(2);
  if constexpr (R > 1 && C > 1) _tile_zero(3);
  const at::BFloat16* w1 = w + block_stride;  // the second column block
  const at::BFloat16* x1 = x + 16 * ldx;
  const int per = e.per_step(kb_count);
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
    e.step(per);  // the previous block's end, after this step's products are issued
  }
  e.flush();
  _tile_stored(0, e.c, 256);
  if constexpr (C > 1) _tile_stored(1, e.c + 16, 256);
  if constexpr (R > 1) _tile_stored(2, e.c + 16 * 64, 256);
  if constexpr (R > 1 && C > 1) _tile_stored(3, e.c + 16 * 64 + 16, 256);
  e.pend(rows, C * kTileN, silu_mul, bias, out, ldo);
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
// even), the others 16 x (g x 16) blocks. `up` > 0: W is a fused gate/up projection whose up half starts at
// column block `up`, [nb0, nb1) are gate blocks, and out [M, N/2] gets SiLU(gate) * up: each gate block j runs
// with up block j + up as one 2-column block. The caller releases the tiles (`TileState::done`).
inline void span(const at::BFloat16* x, int64_t ldx, int64_t m0, int64_t m1, bool wide, const at::BFloat16* w,
                 int64_t kb_count, int64_t nb0, int64_t nb1, int g, const at::BFloat16* bias, at::BFloat16* out,
                 int64_t ldo, TileState& tiles, int64_t up = 0) {
  static constexpr BlockFn kBlocks[5] = {nullptr, tile_block<1>, tile_block<2>, tile_block<3>, tile_block<4>};
  static constexpr BlockFn kBlocks2x2[2][3][3] = {  // [first block of rows][row tiles][column blocks]
      {{nullptr, nullptr, nullptr}, {nullptr, tile_block_2x2<1, 1, false>, tile_block_2x2<1, 2, false>},
       {nullptr, tile_block_2x2<2, 1, false>, tile_block_2x2<2, 2, false>}},
      {{nullptr, nullptr, nullptr}, {nullptr, tile_block_2x2<1, 1, true>, tile_block_2x2<1, 2, true>},
       {nullptr, tile_block_2x2<2, 1, true>, tile_block_2x2<2, 2, true>}}};
  const int64_t block = kb_count * kTileElems;  // elements per column block
  Epilogue e;
  const int step = up ? 1 : wide ? 2 : g;
  for (int64_t nb = nb0; nb < nb1; nb += step) {
    const int cols = static_cast<int>(std::min<int64_t>(step, nb1 - nb));
    const at::BFloat16* wb = w + nb * block;
    const at::BFloat16* bb = bias ? bias + nb * kTileN : nullptr;
    const int64_t stride = up ? up * block : block;  // to the block's second column block
    for (int64_t m = m0; m < m1; m += wide ? 32 : 16) {
      const int rows = static_cast<int>(std::min<int64_t>(wide ? 32 : 16, m1 - m));
      const int shape = wide ? 16 + rows : rows;  // (a wide block of <= 16 rows is a 2 x 2 shape too)
      if (shape != tiles.shape) {
        if (wide) configure_2x2(std::min(rows, 16), std::max(rows - 16, 0));
        else configure_1xg(rows);
        tiles.shape = shape;
      }
      const int rt = rows > 16 ? 2 : 1;
      const BlockFn fn = wide ? kBlocks2x2[m == m0][rt][up ? 2 : cols] : kBlocks[up ? 2 : cols];
      fn(x + m * ldx, ldx, wb, stride, kb_count, rows, bb, out + m * ldo + nb * kTileN, ldo, up > 0, e);
    }
  }
  e.flush();
}

}  // namespace amx
