// Helpers shared by the C++ CPU kernels: AVX-512 math, and the AMX tile configuration's layout.
#pragma once
#include <cstddef>
#include <cstdint>
#include <new>
#include <vector>

// Memory on 64-byte lines for the kernels' own buffers (malloc aligns to 16): an AMX tile whose rows straddle two
// lines loads 2.5x slower than one on whole lines (benchmarks/amx_tile_timings.cpp), and a vector load across two
// lines costs two.
template <typename T>
struct LineAllocator {
  using value_type = T;
  LineAllocator() = default;
  template <typename U>
  LineAllocator(const LineAllocator<U>&) {}
  T* allocate(std::size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64))); }
  void deallocate(T* p, std::size_t) { ::operator delete(p, std::align_val_t(64)); }
  template <typename U>
  bool operator==(const LineAllocator<U>&) const { return true; }
  template <typename U>
  bool operator!=(const LineAllocator<U>&) const { return false; }
};
template <typename T>
using line_vector = std::vector<T, LineAllocator<T>>;
#ifdef __AVX512F__
#include <immintrin.h>

namespace simd {

// exp of 16 floats (Cephes' expf: range reduction by ln 2, degree-6 polynomial; ~1 ulp on the
// softmax's arguments, which are <= 0). Arguments below -87 give ~1e-38 instead of 0.
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

}  // namespace simd
#endif

// ldtilecfg's 64 bytes (palette 1): bytes per row and rows of each of the 8 tiles
struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
