// What the two prefill attention kernels share: prefill_attention.cpp (AVX-512 dot products, the
// query rows in the vector lanes) and amx_attention.cpp (both matmuls of a key block on AMX tiles).
#pragma once
#ifdef __AVX512F__
#include <torch/extension.h>
#include <immintrin.h>

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
};

// exp of 16 floats (Cephes' expf, as in cpu_ops.cpp); the softmax's arguments are <= 0.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}

// Two vectors of 16 bf16 (as 16-bit words) interleaved into 16 dwords: lo[i] | hi[i] << 16.
inline __m512i interleave_bf16(__m256i lo, __m256i hi) {
  return _mm512_or_si512(_mm512_cvtepu16_epi32(lo), _mm512_slli_epi32(_mm512_cvtepu16_epi32(hi), 16));
}

// The AMX kernel (amx_attention.cpp); callers check amx_linear_available() first.
void run_tiles_amx(const Args& a, const std::vector<Tile>& tiles);

}  // namespace prefill

bool amx_linear_available();  // amx_linear.cpp: AMX-BF16 present and granted to this process
#endif
