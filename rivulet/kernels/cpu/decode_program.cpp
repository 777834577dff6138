// A pre-norm decoder's small step as one call: embedding, every layer, the final norm. Small: at
// most `max_rows` tokens, set by the caller (32 with int8/int4 weights, 8 on AMX CPUs: the steps that read
// those copies; 64 with bf16 weights in panels or AMX tiles): decode steps, k-token verify steps, short prefill chunks. The
// layer-by-layer forward of the same step makes ~11 dispatcher calls a layer, each a fork/join of
// the OpenMP team plus the interpreter between them; for a small model that host work is most of
// the step (SmolLM2-135M in int4: ~3 of 5 ms). Here one OpenMP region runs the whole step, the
// threads meeting at a barrier after each of a layer's 6 phases:
//
//   1. residual add + RMSNorm + int8 quantization of the rows, then the thread's share of the QKV
//      projection's output columns;
//   2. RoPE of each (token, KV head)'s key, written with its value to the token's slot;
//   3. attention per (token, KV head): RoPE of the group's query heads, then the group over the
//      token's context [0, position] in its sequence's pages (the decode kernel, one query row:
//      causal within a multi-token sequence, since its earlier tokens were written in phase 2);
//   4. quantization of the attention output, the thread's share of o_proj;
//   5. residual add + RMSNorm + quantization, the thread's share of gate_up;
//   6. SiLU-and-mul + quantization, the thread's share of down_proj.
//
// The row work (norms, SiLU, quantization) of up to kRedundantRows rows is done by every thread on
// its own copies (residual stream included): no barrier for it. More rows are split between the
// threads, with one more barrier before the linear that reads them.
//
// Every number of a decode step is the layer-by-layer path's: the same row functions (rowwise.h),
// the same quantized dot products (quant_gemv.h) and bf16 kernels (bf16_panels.h, amx_tiles.h), the same
// attention kernel (decode_attention.h), rounded to the activation dtype where those ops round. A
// token of a multi-token step gets exactly what it would get decoded alone (the layer-by-layer path
// takes multi-token sequences through the prefill kernel, whose sums run in another order). What a
// program cannot run (other weights or architectures) is decided in Python
// (rivulet/models/decode_program.py), which then keeps the layer-by-layer path.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <omp.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "amx_tiles.h"
#include "bf16_panels.h"
#include "quant_gemv.h"
#include "rowwise.h"
#include "decode_attention.h"

#if defined(RIVULET_VNNI) && defined(__AVX512F__)
namespace {

constexpr int64_t kRedundantRows = 4;  // up to this many rows every thread does the row work itself

// One linear of N outputs: weight-only int8 or int4 (panels of 16 rows, quant_linear.cpp's layouts), or
// bf16 weights packed in panels ([N/16, K/2, 32], bf16_linear.cpp's layout) or in AMX tiles ([N/16, K/32, 16,
// 32], amx_linear.cpp's); the bf16 layouts take bf16 activations only and read them as they are.
struct QLinear {
  enum Kind { kInt8, kInt4, kPanels, kAmx };
  torch::Tensor keep;
  Kind kind = kInt8;
  int64_t N = 0, Kp = 0;
  Int8Format f8{};
  Int4Format f4{};

  QLinear() = default;
  QLinear(const torch::Tensor& w, int64_t n) : keep(w), N(n) {
    if (w.dim() == 4) {
      TORCH_CHECK(w.is_contiguous() && w.scalar_type() == torch::kBFloat16 && w.size(0) * 16 == N &&
                  w.size(2) == 16 && w.size(3) == 32 && amx::usable(),
                  "decode program: bf16 AMX tiles [N/16, K/32, 16, 32] on an AMX CPU");
      kind = kAmx;
      Kp = w.size(1) * 32;
      return;
    }
    TORCH_CHECK(w.is_contiguous() && w.dim() == 3, "decode program: a linear's weight is 3-d panels or 4-d tiles");
    if (w.scalar_type() == torch::kUInt8) {
      TORCH_CHECK(w.size(0) == (N + kQuantPanel - 1) / kQuantPanel &&
                  (w.size(2) == Int8Format::kBlockBytes || w.size(2) == Int4Format::kBlockBytes),
                  "decode program: int8/int4 panels [ceil(N/16), blocks, 1088 or 384]");
      kind = w.size(2) == Int8Format::kBlockBytes ? kInt8 : kInt4;
      Kp = w.size(1) * (kind == kInt8 ? Int8Format::kBlock : Int4Format::kBlock);
      if (kind == kInt8) f8 = Int8Format{w.data_ptr<uint8_t>(), w.size(1)};
      else f4 = Int4Format{w.data_ptr<uint8_t>(), w.size(1)};
      return;
    }
#ifdef RIVULET_BF16_PANELS
    TORCH_CHECK(w.size(2) == 32 && w.scalar_type() == torch::kBFloat16 && w.size(0) * 16 == N,
                "decode program: bf16 panels [N/16, K/2, 32]");
    kind = kPanels;
    Kp = w.size(1) * 2;
#else
    TORCH_CHECK(false, "decode program: bf16 panels need AVX512-BF16");
#endif
  }

  bool quantized() const { return kind == kInt8 || kind == kInt4; }
  // whether it takes inputs of width K (the quantized kinds pad K to a multiple of 64)
  bool takes(int64_t K) const { return quantized() ? Kp >= K && Kp < K + 64 : Kp == K; }

  // x's rows first, first + stride, ... quantized into xq (the panels read x as it is)
  template <typename T>
  void quantize(const T* x, int64_t K, int64_t M, int64_t first, int64_t stride, QuantRow* xq) const {
    if (!quantized()) return;
    const int64_t block = kind == kInt4 ? Int4Format::kBlock : Int8Format::kBlock;
    for (int64_t m = first; m < M; m += stride) quantize_row(x + m * K, K, Kp, block, xq[m]);
  }

  // this thread's share of the columns of y [M, N] = x [M, K] W^T (+ bias: T for the quantized kinds and AMX
  // tiles, float for panels), from x's quantized rows xq or, for bf16 weights, x itself
  template <typename T>
  void gemv(const T* x, int64_t K, int64_t M, const QuantRow* xq, const T* bias, const float* bias_f, T* y, int tid,
            int nthr, amx::TileState& tiles) const {
    if (kind == kAmx) {
      if constexpr (std::is_same_v<T, at::BFloat16>) {  // amx_linear's split: column pairs above 16 rows
        const bool wide = M > 16;
        const int64_t P = N / 16, unit = wide ? 2 : 1, units = (P + unit - 1) / unit;
        const int64_t chunk = (units + nthr - 1) / nthr;
        const int64_t nb0 = std::min(P, tid * chunk * unit), nb1 = std::min(P, (tid + 1) * chunk * unit);
        amx::span(x, K, 0, M, wide, keep.data_ptr<at::BFloat16>(), K / 32, nb0, nb1, 4, bias, y, N, tiles);
      }
      return;
    }
    if (kind == kPanels) {
#ifdef RIVULET_BF16_PANELS
      if constexpr (std::is_same_v<T, at::BFloat16>) {
        const int64_t P = N / 16, chunk = (P + nthr - 1) / nthr, p0 = std::min(P, tid * chunk);
        panel_rows(x, M, K, keep.data_ptr<at::BFloat16>(), p0, std::min(P, p0 + chunk), bias_f, y, N);
      }
#endif
      return;
    }
    const int64_t P = (N + kQuantPanel - 1) / kQuantPanel, chunk = (P + nthr - 1) / nthr, p0 = std::min(P, tid * chunk);
    if (kind == kInt4) gemv_panels<T>(f4, xq, M, p0, std::min(P, p0 + chunk), bias, y, N);
    else gemv_panels<T>(f8, xq, M, p0, std::min(P, p0 + chunk), bias, y, N);
  }

  // a gate/up projection on AMX tiles runs SiLU-and-mul in its blocks' ends (amx::span's `up`)
  bool fuses_silu_mul() const { return kind == kAmx && N % 32 == 0; }

  // this thread's share of the columns of y [M, N/2] = SiLU(x W_gate^T) * (x W_up^T), W = [W_gate; W_up]
  template <typename T>
  void gemv_silu_mul(const T* x, int64_t K, int64_t M, T* y, int tid, int nthr, amx::TileState& tiles) const {
    if constexpr (std::is_same_v<T, at::BFloat16>) {
      const int64_t P = N / 32, chunk = (P + nthr - 1) / nthr;  // gate blocks, each with its up block
      const int64_t nb0 = std::min(P, tid * chunk), nb1 = std::min(P, (tid + 1) * chunk);
      amx::span(x, K, 0, M, M > 16, keep.data_ptr<at::BFloat16>(), K / 32, nb0, nb1, 1, nullptr, y, N / 2, tiles, P);
    }
  }
};

struct Layer {
  torch::Tensor in_norm, post_norm, qkv_bias, qkv_bias_f, kv_cache;
  torch::Tensor q_norm, k_norm;  // per-head RMSNorm of queries and keys before RoPE (Qwen3), or undefined
  QLinear qkv, o, gate_up, down;
};

// What one thread keeps across the step: its copy of the residual stream and its scratch.
template <typename T>
struct Scratch {
  line_vector<T> residual, act;  // [rows, hidden], [rows, max width]: the AMX linears' inputs, on whole lines
  line_vector<float> buf, qf, acc, sc;
  line_vector<T> rot, normed;  // one rotated head, one normed head
  std::vector<QuantRow> xq;
};

class DecodeProgram {
 public:
  DecodeProgram(torch::Tensor embed, torch::Tensor final_norm, torch::Tensor cos_sin, bool interleaved, double eps,
                double scale, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t intermediate,
                int64_t max_rows)
      : embed_(embed), final_norm_(final_norm), cos_sin_(cos_sin), interleaved_(interleaved), eps_(float(eps)),
        scale_(float(scale)), Hq_(num_heads), Hk_(num_kv_heads), D_(head_dim), I_(intermediate), max_rows_(max_rows) {
    TORCH_CHECK(embed.dim() == 2 && embed.is_contiguous(), "decode program: embedding [vocab, hidden]");
    TORCH_CHECK(cos_sin.scalar_type() == torch::kFloat32 && cos_sin.is_contiguous(), "decode program: float32 cos/sin");
    TORCH_CHECK(embed.scalar_type() == torch::kFloat32 || embed.scalar_type() == torch::kBFloat16,
                "decode program: float32 or bfloat16 activations");
    TORCH_CHECK(Hq_ % Hk_ == 0 && decode_group_for<float>(D_) != nullptr, "decode program: head layout");
    H_ = embed.size(1);
    dtype_ = embed.scalar_type();
  }

  // a layer's weights: each linear's one tensor (int8/int4 or bf16 panels)
  void add_layer(torch::Tensor in_norm, torch::Tensor post_norm, torch::Tensor qkv,
                 c10::optional<torch::Tensor> qkv_bias, torch::Tensor o, torch::Tensor gate_up, torch::Tensor down,
                 torch::Tensor kv_cache, c10::optional<torch::Tensor> q_norm, c10::optional<torch::Tensor> k_norm) {
    Layer l;
    TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "decode program: q and k norms together");
    if (q_norm.has_value() && q_norm->defined()) {
      TORCH_CHECK(q_norm->numel() == D_ && k_norm->numel() == D_, "decode program: q/k norms over the head dim");
      l.q_norm = q_norm->to(dtype_).contiguous();
      l.k_norm = k_norm->to(dtype_).contiguous();
    }
    l.in_norm = in_norm.to(dtype_).contiguous();
    l.post_norm = post_norm.to(dtype_).contiguous();
    if (qkv_bias.has_value() && qkv_bias->defined()) {
      l.qkv_bias = qkv_bias->to(dtype_).contiguous();
      l.qkv_bias_f = qkv_bias->to(torch::kFloat).contiguous();
    }
    l.qkv = QLinear(qkv, (Hq_ + 2 * Hk_) * D_); l.o = QLinear(o, H_);
    l.gate_up = QLinear(gate_up, 2 * I_); l.down = QLinear(down, H_);
    for (const QLinear* q : {&l.qkv, &l.o, &l.gate_up, &l.down})
      TORCH_CHECK(q->quantized() || dtype_ == torch::kBFloat16, "decode program: bf16 weights need bf16 activations");
    TORCH_CHECK(l.qkv.takes(H_) && l.o.takes(Hq_ * D_) && l.gate_up.takes(H_) && l.down.takes(I_),
                "decode program: projection shapes");
    TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.size(3) == Hk_ && kv_cache.size(4) == D_ &&
                kv_cache.scalar_type() == dtype_ && kv_cache[0].is_contiguous() && kv_cache.stride(3) == D_,
                "decode program: KV cache [2, blocks, block_size, kv_heads, head_dim] in the activation dtype");
    l.kv_cache = kv_cache;
    layers_.push_back(std::move(l));
  }

  int64_t num_layers() const { return int64_t(layers_.size()); }

  // Hidden states after the final norm [M, hidden] of the step's M tokens; token i belongs to the
  // sequence of block table row token_seqs[i] (i itself when omitted: one token per sequence) and
  // attends to positions [0, positions[i]] of it.
  torch::Tensor run(torch::Tensor input_ids, torch::Tensor positions, torch::Tensor slot_mapping,
                    torch::Tensor block_tables, c10::optional<torch::Tensor> token_seqs) {
    const int64_t M = input_ids.numel();
    TORCH_CHECK(M >= 1 && M <= max_rows_, "decode program: 1 to ", max_rows_, " tokens, got ", M);
    const bool per_seq = !token_seqs.has_value() || !token_seqs->defined();
    TORCH_CHECK(positions.numel() == M && slot_mapping.numel() == M && block_tables.dim() == 2 &&
                (per_seq ? block_tables.size(0) == M : token_seqs->numel() == M), "decode program: step layout");
    auto seqs = per_seq ? torch::arange(M, torch::kLong) : token_seqs->to(torch::kLong).contiguous();
    auto out = torch::empty({M, H_}, embed_.options());
    if (dtype_ == torch::kBFloat16) run_t<at::BFloat16>(input_ids, positions, slot_mapping, block_tables, seqs, out);
    else run_t<float>(input_ids, positions, slot_mapping, block_tables, seqs, out);
    return out;
  }

 private:
  template <typename T>
  std::vector<Scratch<T>>& scratch();

  template <typename T>
  void run_t(const torch::Tensor& ids_in, const torch::Tensor& pos_in, const torch::Tensor& slots_in,
             const torch::Tensor& bt_in, const torch::Tensor& seqs, torch::Tensor& out) {
    auto ids = ids_in.to(torch::kLong).contiguous(), pos = pos_in.to(torch::kLong).contiguous();
    auto slots = slots_in.to(torch::kLong).contiguous();
    auto bt = bt_in.to(torch::kInt).contiguous();
    const int64_t M = ids.numel(), H = H_, D = D_, Hq = Hq_, Hk = Hk_, G = Hq / Hk, I = I_;
    const int64_t qkv_n = (Hq + 2 * Hk) * D, rot = cos_sin_.size(1), maxb = bt.size(1);
    const int64_t* idp = ids.data_ptr<int64_t>(); const int64_t* pp = pos.data_ptr<int64_t>();
    const int64_t* sp = slots.data_ptr<int64_t>(); const int* btp = bt.data_ptr<int>();
    const int64_t* sq = seqs.data_ptr<int64_t>();
    int64_t maxL = 1;
    for (int64_t i = 0; i < M; ++i) {
      TORCH_CHECK(idp[i] >= 0 && idp[i] < embed_.size(0), "decode program: token id out of range");
      TORCH_CHECK(pp[i] >= 0 && pp[i] < cos_sin_.size(0), "decode program: position beyond the rotary table");
      TORCH_CHECK(pp[i] < maxb * layers_.front().kv_cache.size(2) && sq[i] >= 0 && sq[i] < bt.size(0),
                  "decode program: a token's context does not fit its block table");
      maxL = std::max<int64_t>(maxL, pp[i] + 1);
    }
    // shared between the threads: each phase's output
    qkv_.resize(M * qkv_n * sizeof(T)); attn_.resize(M * Hq * D * sizeof(T));
    hid_.resize(M * H * sizeof(T)); gu_.resize(M * 2 * I * sizeof(T));
    T* qkv = reinterpret_cast<T*>(qkv_.data()); T* attn = reinterpret_cast<T*>(attn_.data());
    T* hid = reinterpret_cast<T*>(hid_.data()); T* gu = reinterpret_cast<T*>(gu_.data());
    // a step of more than kRedundantRows rows splits the row work (norms, SiLU, quantization) between the
    // threads, with a barrier after it; fewer rows are done by every thread on its own copies, no barrier
    const bool split = M > kRedundantRows;
    const int64_t width = std::max({H, I, Hq * D});
    if (split) {
      res_.resize(M * H * sizeof(T)); act_.resize(M * width * sizeof(T));
      if (int64_t(xq_.size()) < M) xq_.resize(M);
    }
    const int nt = at::get_num_threads();
    auto& scr = scratch<T>();
    if (int(scr.size()) < nt) scr.resize(nt);
    for (auto& s : scr) {  // sized here, outside the parallel region (no allocation inside it)
      if (!split) { s.residual.resize(M * H); s.act.resize(M * width); }
      s.buf.resize(H);
      s.qf.resize(G * D); s.acc.resize(G * D); s.rot.resize(D); s.normed.resize(D);
      if (int64_t(s.sc.size()) < G * maxL) s.sc.resize(G * maxL);
      if (!split && int64_t(s.xq.size()) < M) s.xq.resize(M);
    }
    const T* emb = embed_.data_ptr<T>(); const float* cs_all = cos_sin_.data_ptr<float>();
    T* outp = out.data_ptr<T>();
    const auto group = decode_group_for<T>(D);

#pragma omp parallel num_threads(nt)
    {
      const int tid = omp_get_thread_num(), nthr = omp_get_num_threads();
      Scratch<T>& S = scr[tid];
      T* res = split ? reinterpret_cast<T*>(res_.data()) : S.residual.data();
      T* act = split ? reinterpret_cast<T*>(act_.data()) : S.act.data();
      QuantRow* xq = split ? xq_.data() : S.xq.data();
      float* buf = S.buf.data();
      const int64_t r0 = split ? tid : 0, rs = split ? nthr : 1;  // this thread's rows: r0, r0 + rs, ...
      amx::TileState tiles;  // AMX tiles, configured by the first linear on them, released after the last layer
      for (size_t li = 0; li < layers_.size(); ++li) {
        const Layer& L = layers_[li];
        // 1. (residual +) RMSNorm, QKV
        for (int64_t m = r0; m < M; m += rs) {
          if (li == 0) {
            std::memcpy(res + m * H, emb + idp[m] * H, H * sizeof(T));
            load_row<T>(res + m * H, nullptr, nullptr, buf, H);
          } else {
            load_row<T>(hid + m * H, res + m * H, res + m * H, buf, H);
          }
          norm_row<T>(buf, L.in_norm.data_ptr<T>(), act + m * H, H, eps_);
        }
        L.qkv.quantize<T>(act, H, M, r0, rs, xq);
        if (split) {
#pragma omp barrier
        }
        L.qkv.gemv<T>(act, H, M, xq, L.qkv_bias.defined() ? L.qkv_bias.data_ptr<T>() : nullptr,
                      L.qkv_bias_f.defined() ? L.qkv_bias_f.data_ptr<float>() : nullptr, qkv, tid, nthr, tiles);
#pragma omp barrier
        // 2. RoPE of the keys, the KV write (before any attention reads: a sequence's later tokens see them)
        T* cache = L.kv_cache.data_ptr<T>();
        const int64_t bs = L.kv_cache.size(2), plane = L.kv_cache.stride(0);
        for (int64_t w = tid; w < M * Hk; w += nthr) {
          const int64_t i = w / Hk, h = w % Hk;
          if (sp[i] < 0) continue;
          const T* row = qkv + i * qkv_n;
          const T* key = row + Hq * D + h * D;
          if (L.k_norm.defined()) {  // RMSNorm of the head, rounded to T, then RoPE (the layer path's order)
            load_row<T>(key, nullptr, nullptr, S.qf.data(), D);
            norm_row<T>(S.qf.data(), L.k_norm.data_ptr<T>(), S.normed.data(), D, eps_);
            key = S.normed.data();
          }
          rotate_head<T>(key, cache + sp[i] * Hk * D + h * D, cs_all + pp[i] * rot, D, rot, interleaved_);
          std::memcpy(cache + plane + sp[i] * Hk * D + h * D, row + (Hq + Hk) * D + h * D, D * sizeof(T));
        }
#pragma omp barrier
        // 3. attention, per (token, KV head), over the token's context [0, position]
        for (int64_t w = tid; w < M * Hk; w += nthr) {
          const int64_t i = w / Hk, h = w % Hk;
          const T* row = qkv + i * qkv_n;
          for (int64_t g = 0; g < G; ++g) {
            const T* query = row + (h * G + g) * D;
            if (L.q_norm.defined()) {
              load_row<T>(query, nullptr, nullptr, S.acc.data(), D);
              norm_row<T>(S.acc.data(), L.q_norm.data_ptr<T>(), S.normed.data(), D, eps_);
              query = S.normed.data();
            }
            rotate_head<T>(query, S.rot.data(), cs_all + pp[i] * rot, D, rot, interleaved_);
            for (int64_t d = 0; d < D; ++d) S.qf[g * D + d] = f32(S.rot[d]);
          }
          group(S.qf.data(), G, cache + h * D, cache + plane + h * D, btp + sq[i] * maxb, 0, pp[i] + 1, bs,
                bs * Hk * D, Hk * D, scale_, S.sc.data(), S.acc.data());
          for (int64_t g = 0; g < G; ++g)
            for (int64_t d = 0; d < D; ++d) attn[(i * Hq + h * G + g) * D + d] = static_cast<T>(S.acc[g * D + d]);
        }
#pragma omp barrier
        // 4. o_proj
        L.o.quantize<T>(attn, Hq * D, M, r0, rs, xq);
        if (split && L.o.quantized()) {
#pragma omp barrier
        }
        L.o.gemv<T>(attn, Hq * D, M, xq, nullptr, nullptr, hid, tid, nthr, tiles);
#pragma omp barrier
        // 5. residual + RMSNorm, gate_up
        for (int64_t m = r0; m < M; m += rs) {
          load_row<T>(hid + m * H, res + m * H, res + m * H, buf, H);
          norm_row<T>(buf, L.post_norm.data_ptr<T>(), act + m * H, H, eps_);
        }
        L.gate_up.quantize<T>(act, H, M, r0, rs, xq);
        if (split) {
#pragma omp barrier
        }
        // (on AMX tiles with SiLU-and-mul in its blocks' ends: gu gets the [M, I] activation)
        const bool fused = L.gate_up.fuses_silu_mul();
        if (fused) L.gate_up.gemv_silu_mul<T>(act, H, M, gu, tid, nthr, tiles);
        else L.gate_up.gemv<T>(act, H, M, xq, nullptr, nullptr, gu, tid, nthr, tiles);
#pragma omp barrier
        // 6. SiLU-and-mul, down_proj (hid is free again: every thread has read it in phase 5)
        if (!fused)
          for (int64_t m = r0; m < M; m += rs) silu_mul_row<T>(gu + m * 2 * I, gu + m * 2 * I + I, act + m * I, I);
        const T* mid = fused ? gu : act;
        L.down.quantize<T>(mid, I, M, r0, rs, xq);
        if (split) {
#pragma omp barrier
        }
        L.down.gemv<T>(mid, I, M, xq, nullptr, nullptr, hid, tid, nthr, tiles);
#pragma omp barrier
      }
      tiles.done();
      if (tid == 0) {
        for (int64_t m = 0; m < M; ++m) {
          load_row<T>(hid + m * H, res + m * H, res + m * H, buf, H);
          norm_row<T>(buf, final_norm_.data_ptr<T>(), outp + m * H, H, eps_);
        }
      }
    }
  }

  torch::Tensor embed_, final_norm_, cos_sin_;
  bool interleaved_;
  float eps_, scale_;
  int64_t Hq_, Hk_, D_, I_, max_rows_, H_ = 0;
  torch::ScalarType dtype_;
  std::vector<Layer> layers_;
  line_vector<char> qkv_, attn_, hid_, gu_, res_, act_;  // shared by the threads (res_, act_: split steps)
  std::vector<QuantRow> xq_;
  std::vector<Scratch<float>> scratch_f_;
  std::vector<Scratch<at::BFloat16>> scratch_b_;
};

template <>
std::vector<Scratch<float>>& DecodeProgram::scratch<float>() { return scratch_f_; }
template <>
std::vector<Scratch<at::BFloat16>>& DecodeProgram::scratch<at::BFloat16>() { return scratch_b_; }

}  // namespace

void register_decode_program(py::module& m) {
  py::class_<DecodeProgram>(m, "DecodeProgram")
      .def(py::init<torch::Tensor, torch::Tensor, torch::Tensor, bool, double, double, int64_t, int64_t, int64_t,
                    int64_t, int64_t>(),
           py::arg("embed"), py::arg("final_norm"), py::arg("cos_sin"), py::arg("interleaved"), py::arg("eps"),
           py::arg("scale"), py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"),
           py::arg("intermediate"), py::arg("max_rows"))
      .def("add_layer", &DecodeProgram::add_layer, py::arg("in_norm"), py::arg("post_norm"), py::arg("qkv"),
           py::arg("qkv_bias"), py::arg("o"), py::arg("gate_up"), py::arg("down"), py::arg("kv_cache"),
           py::arg("q_norm") = py::none(), py::arg("k_norm") = py::none())
      .def_property_readonly("num_layers", &DecodeProgram::num_layers)
      .def("run", &DecodeProgram::run, py::arg("input_ids"), py::arg("positions"), py::arg("slot_mapping"),
           py::arg("block_tables"), py::arg("token_seqs") = py::none(), py::call_guard<py::gil_scoped_release>());
#ifdef RIVULET_BF16_PANELS
  m.attr("DECODE_PROGRAM_PANELS") = true;
#else
  m.attr("DECODE_PROGRAM_PANELS") = false;
#endif
}
#else
void register_decode_program(py::module&) {}  // AVX512-VNNI only: elsewhere the layer-by-layer path runs
#endif
