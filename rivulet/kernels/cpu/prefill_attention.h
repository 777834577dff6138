// What the two prefill attention kernels share: prefill_attention.cpp (AVX-512 dot products, the
// query rows in the vector lanes) and amx_attention.cpp (both matmuls of a key block on AMX tiles).
#pragma once
#ifdef __AVX512F__
#include <torch/extension.h>

#include "simd.h"

#include <cstdint>
#include <vector>

namespace prefill {

struct Args {
  const void* query;
  int64_t q_stride0, q_stride1;
  void* out;  // [T, Hq, D] contiguous
  const void* keys;    // the cache's key plane [blocks, block_size, Hk, D]
  const void* values;  // its value plane
  int64_t bs, tok_stride, D, G, Hq;
  float scale;
  int64_t window;  // 0: none
};

// Consecutive query tokens of one (sequence, kv head): the unit of work, longest first.
struct Tile {
  const int* table;
  int64_t row0;    // flat-batch row of the sequence's first query token
  int64_t first;   // index of the tile's first query token in the chunk
  int64_t n;       // query tokens in the tile
  int64_t start;   // position of the chunk's first query token (context before it)
  int64_t h;       // kv head
  int64_t cost;    // keys it reads (for the schedule)
  int64_t seq;     // index of its sequence in the call's list
};

using simd::exp16;
using simd::interleave_bf16;

// The AMX kernel (amx_attention.cpp); callers check amx_linear_available() first.
void run_tiles_amx(const Args& a, const std::vector<Tile>& tiles);

}  // namespace prefill

bool amx_linear_available();  // amx_linear.cpp: AMX-BF16 present and granted to this process
#endif
