// Dequantization of GGUF's 32-weight blocks (Q8_0, Q4_0, Q4_1) to float32 or bfloat16, in one pass
// over the memory-mapped file: the arithmetic of `rivulet.kernels.quant.dequantize_gguf_blocks_ref`
// (and of the `gguf` package), bitwise. Built with -ffp-contract=off, so `d * q + m` rounds twice,
// as the reference's separate multiply and add do; bf16 is round-to-nearest-even of that float.
//
// Block layouts (little-endian), 32 weights each:
//   Q8_0: fp16 d, int8 q[32]                     w = q * d
//   Q4_0: fp16 d, uint8 qs[16]                   w = d * (nibble - 8)
//   Q4_1: fp16 d, fp16 m, uint8 qs[16]           w = d * nibble + m
// where weights 0-15 are the low nibbles of qs[0..15] and weights 16-31 the high ones.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cstdint>
#include <cstring>

namespace {

enum Kind : int64_t { kQ8_0 = 0, kQ4_0 = 1, kQ4_1 = 2 };

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

inline void store(float* out, int j, float v) { out[j] = v; }
inline void store(at::BFloat16* out, int j, float v) { out[j] = at::BFloat16(v); }

template <typename T>
void dequantize_block(Kind kind, const uint8_t* b, T* out) {
  const float d = half_at(b);
  if (kind == kQ8_0) {
    const int8_t* q = reinterpret_cast<const int8_t*>(b + 2);
    for (int j = 0; j < 32; ++j) store(out, j, static_cast<float>(q[j]) * d);
  } else if (kind == kQ4_0) {
    const uint8_t* qs = b + 2;
    for (int j = 0; j < 16; ++j) {
      store(out, j, d * static_cast<float>(static_cast<int>(qs[j] & 0x0F) - 8));
      store(out, j + 16, d * static_cast<float>(static_cast<int>(qs[j] >> 4) - 8));
    }
  } else {
    const float m = half_at(b + 2);
    const uint8_t* qs = b + 4;
    for (int j = 0; j < 16; ++j) {
      const float lo = d * static_cast<float>(qs[j] & 0x0F);
      const float hi = d * static_cast<float>(qs[j] >> 4);
      store(out, j, lo + m);
      store(out, j + 16, hi + m);
    }
  }
}

}  // namespace

// blocks: uint8 [n, bytes per block] (any contiguous view, e.g. of a read-only memory map);
// returns a flat tensor of n * 32 weights in `dtype` (float32 or bfloat16).
torch::Tensor dequantize_gguf_blocks(torch::Tensor blocks, int64_t kind, at::ScalarType dtype) {
  TORCH_CHECK(blocks.scalar_type() == torch::kUInt8 && blocks.dim() == 2 && blocks.is_contiguous(),
              "dequantize_gguf_blocks: contiguous uint8 [blocks, bytes] expected");
  TORCH_CHECK(kind >= kQ8_0 && kind <= kQ4_1, "dequantize_gguf_blocks: unknown block kind ", kind);
  const int64_t bpb = kind == kQ8_0 ? 34 : kind == kQ4_0 ? 18 : 20;
  TORCH_CHECK(blocks.size(1) == bpb, "dequantize_gguf_blocks: ", bpb, " bytes per block expected");
  TORCH_CHECK(dtype == torch::kFloat32 || dtype == torch::kBFloat16, "dequantize_gguf_blocks: float32 or bfloat16");
  const int64_t n = blocks.size(0);
  auto out = torch::empty({n * 32}, blocks.options().dtype(dtype));
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  const Kind k = static_cast<Kind>(kind);
  auto run = [&](auto* dst) {
    at::parallel_for(0, n, 4096, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) dequantize_block(k, src + b * bpb, dst + b * 32);
    });
  };
  if (dtype == torch::kFloat32) run(out.data_ptr<float>());
  else run(out.data_ptr<at::BFloat16>());
  return out;
}

void register_gguf_ops(py::module& m) {
  m.def("dequantize_gguf_blocks", &dequantize_gguf_blocks, "GGUF Q8_0/Q4_0/Q4_1 blocks to float32 or bfloat16",
        py::arg("blocks"), py::arg("kind"), py::arg("dtype"));
}
