// What the AMX tile instructions cost on this machine, one thread, data in L1: a 16-row tile load, a tile
// product alone and in dependent chains, a tile store, a 2 x 2 linear block's K step (four loads, four
// products), and that K step with AVX-512 bf16 dot products between its instructions (do the vector units run
// beside the tile unit?); and tiles loaded from L1 and from L2 with rows of several strides, with and without
// software prefetch into L1; and what one tile product costs after the tile unit idled a while (it sleeps).
// Prints JSON.
//
//   g++ -O2 -march=native -o /tmp/amx_tile_timings benchmarks/amx_tile_timings.cpp && /tmp/amx_tile_timings
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <cstdint>
#include <cstdio>
#include <vector>

namespace {

struct alignas(64) TileConfig {
  uint8_t palette_id = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

using Clock = std::chrono::steady_clock;
double ns_since(Clock::time_point t0, double per) {
  return std::chrono::duration<double, std::nano>(Clock::now() - t0).count() / per;
}

constexpr int kN = 100000;

// four tiles loaded from (or stored to) the four KiB at b, again and again
double tile_moves(char* b, bool store) {
  const auto t0 = Clock::now();
  for (int i = 0; i < kN; ++i) {
    if (store) {
      _tile_stored(0, b, 64);
      _tile_stored(1, b + 1024, 64);
      _tile_stored(2, b + 2048, 64);
      _tile_stored(3, b + 3072, 64);
    } else {
      _tile_loadd(0, b, 64);
      _tile_loadd(1, b + 1024, 64);
      _tile_loadd(2, b + 2048, 64);
      _tile_loadd(3, b + 3072, 64);
    }
  }
  return ns_since(t0, 4.0 * kN);
}

double product_chain(int chains) {
  const auto t0 = Clock::now();
  for (int i = 0; i < kN; ++i) {
    if (chains == 1) {
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(0, 5, 7);
      _tile_dpbf16ps(0, 4, 7);
      _tile_dpbf16ps(0, 5, 6);
    } else {
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 5, 7);
      _tile_dpbf16ps(2, 4, 7);
      _tile_dpbf16ps(3, 5, 6);
    }
  }
  return ns_since(t0, 4.0 * kN);
}

// one K step of a 2 x 2 block (A rows 1152 bytes apart, as a 576-feature input; kTiles false: none) and kNv
// vector dot products after it
template <bool kTiles, int kNv>
__attribute__((noinline)) double k_step(const char* a, const char* b, const char* w, __m512* acc) {
  const int n = kN / 10;
  const auto t0 = Clock::now();
  for (int i = 0; i < n; ++i)
    for (int kb = 0; kb < 18; ++kb) {
      if constexpr (kTiles) {
        _tile_loadd(4, a + kb * 64, 1152);
        _tile_loadd(6, b + kb * 1024, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_loadd(7, b + 18432 + kb * 1024, 64);
        _tile_dpbf16ps(1, 4, 7);
        _tile_loadd(5, a + 16 * 1152 + kb * 64, 1152);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
#pragma GCC unroll 16
      for (int v = 0; v < kNv; ++v) {
        const __m512i wv = _mm512_loadu_si512(w + ((kb * kNv + v) & 255) * 64);
        const __m512i xv = _mm512_set1_epi32(*reinterpret_cast<const int*>(a + (v & 3) * 1152 + kb * 64 + v));
        acc[v] = _mm512_dpbf16_ps(acc[v], (__m512bh)xv, (__m512bh)wv);
      }
    }
  return ns_since(t0, 18.0 * n);
}

// 16-row tile loads walking `bytes` of b (rows `stride` bytes apart, the tiles of a row band side by side), each
// tile loaded twice (the second load finds its lines in L1); pf: each tile's 16 lines prefetched into L1 that many
// tiles ahead (0: none). ns per tile (both loads)
double tile_walk(const char* b, size_t bytes, int stride, int pf) {
  const size_t cols = stride / 64, span = size_t(16) * stride, tiles = bytes / span * cols;
  const int reps = int(std::max<size_t>(1, (size_t(64) << 20) / bytes));
  const auto t0 = Clock::now();
  for (int r = 0; r < reps; ++r)
    for (size_t i = 0; i < tiles; ++i) {
      if (pf) {
        const size_t j = (i + pf) % tiles;
        const char* q = b + j / cols * span + j % cols * 64;
        for (int k = 0; k < 16; ++k) _mm_prefetch(q + k * stride, _MM_HINT_T0);
      }
      const char* p = b + i / cols * span + i % cols * 64;
      _tile_loadd(0, p, stride);
      _tile_loadd(1, p, stride);
    }
  return ns_since(t0, double(tiles) * reps);
}

// ns that one tile product adds after n dependent scalar adds (the tile unit idle meanwhile), against the adds alone
double product_after_idle(int n) {
  auto adds = [n] {
    uint64_t x = 1;
    for (int i = 0; i < n; ++i) asm volatile("add $3, %0" : "+r"(x));
    return x;
  };
  const int reps = 20000;
  double best[2] = {1e30, 1e30};
  for (int rep = 0; rep < 3; ++rep)
    for (int with = 0; with < 2; ++with) {
      const auto t0 = Clock::now();
      for (int r = 0; r < reps; ++r) {
        adds();
        if (with) _tile_dpbf16ps(0, 4, 6);
      }
      best[with] = std::min(best[with], ns_since(t0, reps));
    }
  return best[1] - best[0];
}

}  // namespace

// `bytes` of value-1 bytes from a 64-byte line plus `offset` (16: every 64-byte tile row across two lines, as in a
// buffer from malloc, which aligns to 16)
char* buffer(size_t bytes, size_t offset) {
  char* p = static_cast<char*>(std::aligned_alloc(64, (bytes + offset + 63) / 64 * 64)) + offset;
  std::memset(p, 1, bytes);
  return p;
}

int main() {
  constexpr int kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) != 0) {
    std::printf("{\"error\": \"no AMX tile state granted\"}\n");
    return 1;
  }
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  _tile_loadconfig(&cfg);
  alignas(64) static char st[4096];
  __m512 acc[16];
  for (auto& v : acc) v = _mm512_setzero_ps();
  _tile_zero(0);  // (tile numbers are immediates)
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  _tile_zero(4);
  _tile_zero(5);
  _tile_zero(6);
  _tile_zero(7);
  const char* names[2] = {"lines", "across_lines"};  // tile rows on whole 64-byte lines, or each across two
  double best[2][8];
  for (auto& b : best)
    for (double& x : b) x = 1e30;
  for (int off = 0; off < 2; ++off) {
    char *buf = buffer(64 * 1024, 16 * off), *a = buffer(64 * 1024, 16 * off), *b = buffer(40 * 1024, 16 * off);
    char* w = buffer(16 * 1024, 0);
    for (int rep = 0; rep < 5; ++rep) {  // best of 5: this VM's tile unit is slower in some minutes than others
      const double r[7] = {tile_moves(buf, false), product_chain(1), product_chain(4), tile_moves(st, true),
                           k_step<true, 0>(a, b, w, acc), k_step<true, 16>(a, b, w, acc), k_step<false, 16>(a, b, w, acc)};
      for (int i = 0; i < 7; ++i) best[off][i] = std::min(best[off][i], r[i]);
    }
  }
  // tiles from L1 (16 KiB) and from L2 (1 MiB): rows 64 bytes apart (a packed operand) and 384 / 1152 apart (keys
  // in a KV cache page, activations of 576 features), without and with software prefetch into L1
  const char *l1 = buffer(16 * 1024, 0), *l2 = buffer(1024 * 1024, 0), *l2x = buffer(1024 * 1024, 16);
  struct Walk { const char* name; const char* b; size_t bytes; int stride, pf; double best; };
  Walk walks[] = {{"l1_stride_64", l1, 16 << 10, 64, 0, 1e30},          {"l1_stride_384", l1, 16 << 10, 384, 0, 1e30},
                  {"l2_stride_64", l2, 1 << 20, 64, 0, 1e30},           {"l2_stride_64_prefetch", l2, 1 << 20, 64, 4, 1e30},
                  {"l2_stride_384", l2, 1 << 20, 384, 0, 1e30},         {"l2_stride_384_prefetch", l2, 1 << 20, 384, 4, 1e30},
                  {"l2_stride_1152", l2, 1 << 20, 1152, 0, 1e30},       {"l2_stride_1152_prefetch", l2, 1 << 20, 1152, 4, 1e30},
                  {"l2_stride_64_across_lines", l2x, 1 << 20, 64, 0, 1e30}};
  for (int rep = 0; rep < 5; ++rep)
    for (Walk& w : walks) w.best = std::min(w.best, tile_walk(w.b, w.bytes, w.stride, w.pf));
  // the tile unit after idling: ~0.25, 0.5, 1 and 4 us of scalar work (one add a cycle) before one product
  const int idle_adds[4] = {1000, 2000, 4000, 16000};
  double idle_ns[4];
  for (int i = 0; i < 4; ++i) idle_ns[i] = product_after_idle(idle_adds[i]);
  _tile_release();
  __m512 sum = _mm512_setzero_ps();
  for (auto& v : acc) sum = _mm512_add_ps(sum, v);
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, sum);
  float sink = 0;
  for (float x : lanes) sink += x;
  std::printf("{\"ns\": {");
  for (int off = 0; off < 2; ++off)
    std::printf(
        "%s\"%s\": {\"tile_load_16_rows\": %.2f, \"product_one_chain\": %.2f, \"product_four_chains\": %.2f, "
        "\"tile_store\": %.2f, \"k_step_2x2\": %.2f, \"k_step_2x2_plus_16_vdpbf16ps\": %.2f, "
        "\"16_vdpbf16ps_alone\": %.2f}",
        off ? ", " : "", names[off], best[off][0], best[off][1], best[off][2], best[off][3], best[off][4], best[off][5],
        best[off][6]);
  std::printf("}, \"tile_loaded_twice_ns\": {");
  for (const Walk& w : walks) std::printf("%s\"%s\": %.2f", &w == walks ? "" : ", ", w.name, w.best);
  std::printf("}, \"product_after_idle_ns\": {");
  for (int i = 0; i < 4; ++i) std::printf("%s\"after_%d_adds\": %.1f", i ? ", " : "", idle_adds[i], idle_ns[i]);
  std::printf("}, \"sink\": %g}\n", sink);
  return 0;
}
