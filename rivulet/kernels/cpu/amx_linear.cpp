// bf16 linears on Intel AMX tiles, for the few-row matmuls of decode steps.
//
// oneDNN's own AMX matmul (what `torch.ops.mkldnn._linear_pointwise` runs) spends ~35 us per call
// outside the arithmetic here (a primitive descriptor built per call, its scratchpad allocated, the
// boxed dispatch): most of a 576 x 576 matmul of one row, ~4.5 ms of a decode step's 121 linears.
// This kernel is that matmul with nothing around it: the weight packed once into 1 KiB B tiles
// ([N/16][K/32][16 k-pairs][16 columns][2]), C tiles of 16 rows x 16 columns accumulated in fp32,
// rounded to bf16 once (round to nearest even, as oneDNN and PyTorch). Each output row depends on its
// own input row only, whatever the batch: the blocking changes with M (1 x 4 tiles up to 16 rows, where the
// weight streams from memory once; 2 x 2 tiles above, 1.1-1.3x faster at 32-2048 rows), the order of each
// row's sums does not.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "simd.h"

namespace {

constexpr int kTileK = 32;  // bf16 along K per tile row (64 bytes)
constexpr int kTileN = 16;  // fp32 columns per C tile
constexpr int kTileElems = kTileK * kTileN;  // one packed B tile: 512 bf16

bool cpu_has_amx_bf16() {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  const bool tile = d & (1u << 24), bf16 = d & (1u << 22);
  return tile && bf16;
}

// Linux hands a process the AMX register state only when asked (arch_prctl ARCH_REQ_XCOMP_PERM).
bool amx_usable() {
  static const bool ok = [] {
    if (!cpu_has_amx_bf16()) return false;
    constexpr int kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

// tmm0-3: C (rows x 16 fp32), tmm4: A (rows x 32 bf16), tmm5: B (16 k-pairs x 16 columns x 2)
__attribute__((target("amx-tile"))) void configure_tiles(int rows) {
  TileConfig cfg;
  for (int t = 0; t < 4; ++t) cfg.rows[t] = rows, cfg.colsb[t] = 64;
  cfg.rows[4] = rows, cfg.colsb[4] = 64;
  cfg.rows[5] = 16, cfg.colsb[5] = 64;
  _tile_loadconfig(&cfg);
}

// C tile t (rows x 16 fp32, row stride 64 floats) -> bf16 out rows, + bias
__attribute__((target("avx512f,avx512bf16"))) void store_rows(const float* c, int rows, int ncols, const at::BFloat16* bias,
                                                              at::BFloat16* out, int64_t ldo) {
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

// Steps of more than 16 rows: blocks of up to 32 rows x 32 columns, C tiles 0-3 (A tile r x B tile c in 2r + c),
// A tiles 4-5 (rows 0-15 and 16-31 of the block), B tiles 6-7 (two column blocks). Each tile load serves two
// products (one per tile in the 1 x G blocks above); rows1 = 0: one A tile.
__attribute__((target("amx-tile"))) void configure_tiles_2x2(int rows0, int rows1) {
  TileConfig cfg;
  cfg.rows[0] = cfg.rows[1] = cfg.rows[4] = rows0;
  cfg.rows[2] = cfg.rows[3] = cfg.rows[5] = rows1;
  cfg.rows[6] = cfg.rows[7] = 16;
  for (int t = 0; t < 8; ++t) cfg.colsb[t] = cfg.rows[t] ? 64 : 0;
  _tile_loadconfig(&cfg);
}

template <int R, int C>
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

constexpr BlockFn kBlocks2x2[3][3] = {{nullptr, nullptr, nullptr},
                                      {nullptr, tile_block_2x2<1, 1>, tile_block_2x2<1, 2>},
                                      {nullptr, tile_block_2x2<2, 1>, tile_block_2x2<2, 2>}};

__attribute__((target("amx-tile"))) void release_tiles() { _tile_release(); }

constexpr BlockFn kBlocks[5] = {nullptr, tile_block<1>, tile_block<2>, tile_block<3>, tile_block<4>};

}  // namespace

bool amx_linear_available() { return amx_usable(); }

// weight [N, K] bf16 -> [N/16, K/32, 16, 32]: tile (nb, kb) holds element (n, k-pair p, j) at [p][n][j]
torch::Tensor amx_pack_weight(torch::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kBFloat16, "amx_pack_weight: a 2-D bf16 weight");
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(n % kTileN == 0 && k % kTileK == 0, "amx_pack_weight: N must be a multiple of 16 and K of 32");
  // [nb, 16 n, kb, 16 p, 2 j] -> [nb, kb, 16 p, 16 n, 2 j]
  return weight.contiguous().view({n / kTileN, kTileN, k / kTileK, kTileK / 2, 2}).permute({0, 2, 3, 1, 4})
      .contiguous().view({n / kTileN, k / kTileK, kTileN, kTileK});
}

torch::Tensor amx_linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(amx_usable(), "amx_linear: no usable AMX-BF16 on this machine");
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && packed.scalar_type() == torch::kBFloat16 && packed.dim() == 4,
              "amx_linear: bf16 input and a weight from amx_pack_weight");
  const int64_t nb_count = packed.size(0), kb_count = packed.size(1);
  const int64_t n = nb_count * kTileN, k = kb_count * kTileK;
  TORCH_CHECK(x.size(-1) == k, "amx_linear: input has ", x.size(-1), " features, the weight ", k);
  auto sizes = x.sizes().vec();
  auto x2 = x.reshape({-1, k});
  if (x2.stride(1) != 1) x2 = x2.contiguous();
  const int64_t m = x2.size(0), ldx = x2.stride(0);
  sizes.back() = n;
  auto out = torch::empty({m, n}, x.options());
  const at::BFloat16* bp = nullptr;
  torch::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->contiguous();
    TORCH_CHECK(b.scalar_type() == torch::kBFloat16 && b.numel() == n, "amx_linear: bias of N bf16");
    bp = b.data_ptr<at::BFloat16>();
  }
  const auto* xp = x2.data_ptr<at::BFloat16>();
  const auto* wp = packed.data_ptr<at::BFloat16>();
  auto* op = out.data_ptr<at::BFloat16>();
  const int64_t threads = at::get_num_threads();
  if (m > 16) {
    // each thread a contiguous share of the column pairs; rows in super blocks whose input (MS x K) stays in
    // L2 while the thread's pairs pass, each pair's weight (2 x K x 32 bytes) in L1 while the block's rows pass
    const int64_t pairs = (nb_count + 1) / 2;
    const int64_t ms_rows = std::max<int64_t>(32, (int64_t(512) * 1024 / (2 * k)) / 32 * 32);
    at::parallel_for(0, pairs, (pairs + threads - 1) / threads, [&](int64_t p0, int64_t p1) {
      int configured = -1;
      for (int64_t ms = 0; ms < m; ms += ms_rows) {
        const int64_t ms_end = std::min(m, ms + ms_rows);
        for (int64_t p = p0; p < p1; ++p) {
          const int64_t nb = 2 * p;
          const int cols = static_cast<int>(std::min<int64_t>(2, nb_count - nb));
          for (int64_t m0 = ms; m0 < ms_end; m0 += 32) {
            const int rows = static_cast<int>(std::min<int64_t>(32, ms_end - m0));
            if (rows != configured) configure_tiles_2x2(std::min(rows, 16), std::max(rows - 16, 0)), configured = rows;
            kBlocks2x2[rows > 16 ? 2 : 1][cols](xp + m0 * ldx, ldx, wp + nb * kb_count * kTileElems, kb_count, rows,
                                                  bp ? bp + nb * kTileN : nullptr, op + m0 * n + nb * kTileN, n);
          }
        }
      }
      if (configured >= 0) release_tiles();
    });
    return out.view(sizes);
  }
  // tasks of G column blocks; G as large as keeps every thread busy (fewer, longer weight streams)
  int g = 4;
  while (g > 1 && (nb_count + g - 1) / g < 4 * threads) g /= 2;
  const int64_t tasks = (nb_count + g - 1) / g;
  at::parallel_for(0, tasks, 1, [&](int64_t t0, int64_t t1) {
    int configured = 0;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t nb = t * g;
      const int cols = static_cast<int>(std::min<int64_t>(g, nb_count - nb));
      for (int64_t m0 = 0; m0 < m; m0 += 16) {
        const int rows = static_cast<int>(std::min<int64_t>(16, m - m0));
        if (rows != configured) configure_tiles(rows), configured = rows;
        kBlocks[cols](xp + m0 * ldx, ldx, wp + nb * kb_count * kTileElems, kb_count, rows,
                      bp ? bp + nb * kTileN : nullptr, op + m0 * n + nb * kTileN, n);
      }
    }
    if (configured) release_tiles();
  });
  return out.view(sizes);
}

TORCH_LIBRARY_FRAGMENT(rivulet, m) { m.def("amx_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor"); }
TORCH_LIBRARY_IMPL(rivulet, CPU, m) { m.impl("amx_linear", &amx_linear); }

void register_amx_ops(py::module& m) {
  m.def("amx_linear_available", &amx_linear_available);
  m.def("amx_pack_weight", &amx_pack_weight, py::arg("weight"));
  m.def("amx_linear", &amx_linear, py::arg("x"), py::arg("packed"), py::arg("bias") = py::none());
}
