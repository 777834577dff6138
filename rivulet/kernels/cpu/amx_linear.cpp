// bf16 linears on Intel AMX tiles, for the few-row matmuls of decode steps.
//
// oneDNN's own AMX matmul (what `torch.ops.mkldnn._linear_pointwise` runs) spends ~35 us per call
// outside the arithmetic here (a primitive descriptor built per call, its scratchpad allocated, the
// boxed dispatch): most of a 576 x 576 matmul of one row, ~4.5 ms of a decode step's 121 linears.
// This kernel is that matmul with nothing around it: the weight packed once into 1 KiB B tiles
// ([N/16][K/32][16 k-pairs][16 columns][2]), C tiles of 16 rows x 16 columns accumulated in fp32,
// rounded to bf16 once (round to nearest even, as oneDNN and PyTorch). Each output row depends on its
// own input row only, whatever the batch: the blocking changes with M (1 x 4 tiles up to 16 rows, where the
// weight streams from memory once; 2 x 2 tiles above, 1.1-1.3x faster at 32-2048 rows), and so does the split
// between threads (columns, or rows from 512 rows on), the order of each row's sums does not.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>

#include "amx_tiles.h"

using amx::kTileElems;
using amx::kTileK;
using amx::kTileN;

bool amx_linear_available() { return amx::usable(); }

// weight [N, K] bf16 -> [N/16, K/32, 16, 32]: tile (nb, kb) holds element (n, k-pair p, j) at [p][n][j]
torch::Tensor amx_pack_weight(torch::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kBFloat16, "amx_pack_weight: a 2-D bf16 weight");
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(n % kTileN == 0 && k % kTileK == 0, "amx_pack_weight: N must be a multiple of 16 and K of 32");
  // [nb, 16 n, kb, 16 p, 2 j] -> [nb, kb, 16 p, 16 n, 2 j]
  return weight.contiguous().view({n / kTileN, kTileN, k / kTileK, kTileK / 2, 2}).permute({0, 2, 3, 1, 4})
      .contiguous().view({n / kTileN, k / kTileK, kTileN, kTileK});
}

namespace {

// steps of at least this many rows split their rows between the threads, fewer their columns (256: no difference)
constexpr int64_t kRowSplitRows = 512;

// out [M, N] = x W^T (+ bias), or with `silu_mul` out [M, N/2] = SiLU(gate) * up of a fused gate/up weight (its
// first N/2 columns the gate, the rest the up projection: amx::span's `up`)
torch::Tensor run(const char* name, torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias,
                  bool silu_mul) {
  TORCH_CHECK(amx::usable(), name, ": no usable AMX-BF16 on this machine");
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && packed.scalar_type() == torch::kBFloat16 && packed.dim() == 4,
              name, ": bf16 input and a weight from amx_pack_weight");
  const int64_t nb_count = packed.size(0), kb_count = packed.size(1);
  const int64_t k = kb_count * kTileK;
  TORCH_CHECK(x.size(-1) == k, name, ": input has ", x.size(-1), " features, the weight ", k);
  TORCH_CHECK(!silu_mul || nb_count % 2 == 0, name, ": a gate/up weight of 2 x (a multiple of 16) outputs");
  const int64_t up = silu_mul ? nb_count / 2 : 0;  // the up half's first column block
  const int64_t n = nb_count * kTileN, n_out = silu_mul ? n / 2 : n, units = silu_mul ? up : nb_count;
  auto sizes = x.sizes().vec();
  auto x2 = x.reshape({-1, k});
  if (x2.stride(1) != 1) x2 = x2.contiguous();
  const int64_t m = x2.size(0), ldx = x2.stride(0);
  sizes.back() = n_out;
  auto out = torch::empty({m, n_out}, x.options());
  const at::BFloat16* bp = nullptr;
  torch::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(!silu_mul, name, ": no bias");
    b = bias->contiguous();
    TORCH_CHECK(b.scalar_type() == torch::kBFloat16 && b.numel() == n, name, ": bias of N bf16");
    bp = b.data_ptr<at::BFloat16>();
  }
  const auto* xp = x2.data_ptr<at::BFloat16>();
  const auto* wp = packed.data_ptr<at::BFloat16>();
  auto* op = out.data_ptr<at::BFloat16>();
  const int64_t threads = at::get_num_threads();
  if (m > 16) {
    // rows in super blocks whose input (MS x K) stays in L2 while the column pairs pass, each pair's weight
    // (2 x K x 32 bytes) in L1 while the block's rows pass
    const int64_t per = silu_mul ? 1 : 2, pairs = (units + per - 1) / per;
    const int64_t ms_rows = std::max<int64_t>(32, (int64_t(512) * 1024 / (2 * k)) / 32 * 32);
    if (m >= kRowSplitRows) {
      // each thread a contiguous share of the rows, all columns: the rows it reads are those the row-wise op before
      // (norm, RoPE: at::parallel_for over rows) wrote on the same core, and the rows it writes those the next one
      // reads there, where a column split reads half its input from the other core's cache and leaves half its
      // output in it (prefill steps of 512-2048 tokens 0.92-0.96x the time)
      const int64_t share = (m + threads - 1) / threads;
      at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
        amx::TileState tiles;
        const int64_t r1 = std::min(m, t1 * share);
        for (int64_t ms = std::min(m, t0 * share); ms < r1; ms += ms_rows)
          amx::span(xp, ldx, ms, std::min(r1, ms + ms_rows), true, wp, kb_count, 0, units, 2, bp, op, n_out, tiles, up);
        tiles.done();
      });
      return out.view(sizes);
    }
    // fewer rows: each thread a contiguous share of the column pairs (gate/up: of the gate blocks, each paired with
    // its up block), so that each weight is read by one core (both reading every weight: 1x64 1.13x the step's time)
    at::parallel_for(0, pairs, (pairs + threads - 1) / threads, [&](int64_t p0, int64_t p1) {
      amx::TileState tiles;
      for (int64_t ms = 0; ms < m; ms += ms_rows)
        amx::span(xp, ldx, ms, std::min(m, ms + ms_rows), true, wp, kb_count, per * p0, std::min(units, per * p1), 2,
                  bp, op, n_out, tiles, up);
      tiles.done();
    });
    return out.view(sizes);
  }
  // tasks of G column blocks; G as large as keeps every thread busy (fewer, longer weight streams); gate/up: tasks
  // of one gate block and its up block
  int g = silu_mul ? 1 : 4;
  while (g > 1 && (units + g - 1) / g < 4 * threads) g /= 2;
  const int64_t tasks = (units + g - 1) / g;
  at::parallel_for(0, tasks, 1, [&](int64_t t0, int64_t t1) {
    amx::TileState tiles;
    amx::span(xp, ldx, 0, m, false, wp, kb_count, t0 * g, std::min(units, t1 * g), g, bp, op, n_out, tiles, up);
    tiles.done();
  });
  return out.view(sizes);
}

}  // namespace

torch::Tensor amx_linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias) {
  return run("amx_linear", x, packed, bias, false);
}

// SiLU(x W_gate^T) * (x W_up^T) for W = [W_gate; W_up] packed by amx_pack_weight: amx_linear then silu_and_mul,
// bit for bit, without the [M, N] projection ever written
torch::Tensor amx_linear_silu_mul(torch::Tensor x, torch::Tensor packed) {
  return run("amx_linear_silu_mul", x, packed, c10::nullopt, true);
}

TORCH_LIBRARY_FRAGMENT(rivulet, m) {
  m.def("amx_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor");
  m.def("amx_linear_silu_mul(Tensor x, Tensor packed) -> Tensor");
}
TORCH_LIBRARY_IMPL(rivulet, CPU, m) {
  m.impl("amx_linear", &amx_linear);
  m.impl("amx_linear_silu_mul", &amx_linear_silu_mul);
}

void register_amx_ops(py::module& m) {
  m.def("amx_linear_available", &amx_linear_available);
  m.def("amx_pack_weight", &amx_pack_weight, py::arg("weight"));
  m.def("amx_linear", &amx_linear, py::arg("x"), py::arg("packed"), py::arg("bias") = py::none());
  m.def("amx_linear_silu_mul", &amx_linear_silu_mul, py::arg("x"), py::arg("packed"));
}
