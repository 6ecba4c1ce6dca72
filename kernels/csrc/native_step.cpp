// radixserve_cpu::decode_step: every decoder layer of a decode step (1 to 8 rows) in one call, on one
// thread team meeting at barriers (radixserve/model/native_step.py chooses it at load).
//
// Why: the torch step runs ~60 ops a layer, each an OpenMP fork/join and a Python call, and each
// small op (a norm, the rotary embedding, SwiGLU's gate) reads and writes its activations once more.
// For a 135M model that is most of a decode step (issue 31: ~15 ms of a 20-27 ms step on 2 cores,
// against a 2-5 ms byte limit). Here one `omp parallel` region covers every layer; inside it each
// thread works on its own band of each product's output rows, the small ops run on the bands that
// produced their inputs, and the threads meet at 5 barriers a layer (after QKV with RoPE and the K/V
// write, attention, o_proj, gate/up with SiLU, down).
//
// Per layer, for M rows x [M, hidden] (the residual stream, updated in place):
//   h = rmsnorm(x) (each thread its own copy: M x hidden floats, cheaper than a barrier)
//   qkv = h [W_q; W_k; W_v]^T (+ bias); a thread's band is whole heads: q/k norm, RoPE, K/V into the
//   pages
//   attention over each row's pages (the vector path of the CPU attention, decode_kernel.cpp),
//   units (row, a run of its kv heads) over the threads
//   x += attn W_o^T
//   h = rmsnorm(x); gate/up: a thread computes gate and up rows [j0, j1) and silu(gate) * up there
//   x += act W_down^T
// The weights are streamed as they are held (fp32 or bf16 [N, K], or GGUF blocks [N, row bytes]), each
// read once for all M rows (step_products.h); nothing is copied per step but the input of a weight that
// takes it in another order (GPTQ act-order on blocks: each thread gathers its own copy, M x K floats).
// A fused projection comes as its parts (q, k, v; gate, up), each of its own kind: llama.cpp's k-quant
// files mix types within one (attn_v gets more bits than attn_q and attn_k in some layers). `outliers`
// gives each weight of int8 tiles its outlier channels and their fp32 columns [k, N] (two empty tensors
// where none: radixserve/model/outliers.py), two tensors a weight in the order of `kinds`.
//
// Numbers: fp32 and GGUF weights: the same operations as the torch model in fp32, summed in another
// order (the products' order is gemv.cpp's and gguf_linear.cpp's), so the step equals the reference
// within fp32 rounding. bf16 weights (an approximate mode): each product's x rounded to bf16, the
// products' sums, the residual stream, norms, RoPE, SiLU and attention in fp32, where the torch bf16
// model rounds every activation to bf16; so it is within bf16 rounding of that model, not equal.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "kernel_common.h"
#include "radixserve_cpu.h"
#include "step_products.h"
#include "step_weights.h"

namespace radixserve_cpu {
namespace {

using detail::Ctx;
using detail::KvType;
using detail::VecKernel;
using step::kPad;
using step::product;
using step::Weight;

constexpr int64_t kMaxRows = 8;
// This thread's share [begin, end) of `units` split into `parts` runs of whole `align`s.
std::pair<int64_t, int64_t> band(int64_t units, int64_t align, int64_t part, int64_t parts) {
  const int64_t groups = (units + align - 1) / align;
  const int64_t g0 = groups * part / parts, g1 = groups * (part + 1) / parts;
  return {std::min(units, g0 * align), std::min(units, g1 * align)};
}

// h[m] = x[m] / rms(x[m]) * weight, for M rows of H (x rows H apart, h rows ld apart).
void rmsnorm(const float* x, int64_t M, int64_t H, const float* weight, float eps, float* h, int64_t ld) {
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x + m * H;
    float ss = 0.f;
    for (int64_t i = 0; i < H; ++i) ss += xr[i] * xr[i];
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(H) + eps);
    for (int64_t i = 0; i < H; ++i) h[m * ld + i] = weight[i] * (xr[i] * inv);
  }
}

const int64_t* opt_order(const at::Tensor& t) { return t.numel() > 0 ? t.data_ptr<int64_t>() : nullptr; }

// M rows of x (ld apart) in a weight's input order (its column j is input channel order[j]), written to
// this thread's scratch (rows ld apart, zero up to the next kPad: the scratch serves inputs of several
// widths); x itself where the weight has no order.
const float* in_order(const float* x, int64_t ld, int64_t M, int64_t K, const int64_t* order, float* scratch) {
  if (order == nullptr) return x;
  const int64_t padded = std::min(ld, (K + kPad - 1) / kPad * kPad);
  for (int64_t m = 0; m < M; ++m) {
    float* row = scratch + m * ld;
    for (int64_t j = 0; j < K; ++j) row[j] = x[m * ld + order[j]];
    std::fill(row + K, row + padded, 0.f);
  }
  return scratch;
}

// One head of D values in place: an optional RMSNorm (q/k norm), then neox RoPE by cos/sin [D/2].
void norm_rope(float* v, int64_t D, const float* norm, float eps, const float* cos, const float* sin) {
  if (norm != nullptr) rmsnorm(v, 1, D, norm, eps, v, D);
  const int64_t half = D / 2;
  for (int64_t d = 0; d < half; ++d) {
    const float a = v[d], b = v[d + half];
    v[d] = a * cos[d] - b * sin[d];
    v[d + half] = b * cos[d] + a * sin[d];
  }
}

struct Shape {
  int64_t M, H, Hq, Hkv, D, I, layers;
  float eps, scale;
};

at::Tensor decode_step(const at::Tensor& x_in, const at::Tensor& cos, const at::Tensor& sin,
                       const std::vector<at::Tensor>& weights, const std::vector<int64_t>& kinds,
                       const std::vector<at::Tensor>& outliers, const std::vector<at::Tensor>& k_caches,
                       const std::vector<at::Tensor>& v_caches,
                       const at::Tensor& page_table, const at::Tensor& seq_lens, const at::Tensor& slots,
                       int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t intermediate_size,
                       double eps, double scale) {
  const int64_t L = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(L > 0 && static_cast<int64_t>(v_caches.size()) == L &&
                  static_cast<int64_t>(weights.size()) == L * kTensorsPerLayer &&
                  static_cast<int64_t>(kinds.size()) == L * kKindsPerLayer,
              "radixserve_cpu::decode_step: ", kTensorsPerLayer, " tensors and ", kKindsPerLayer,
              " kinds per layer");
  TORCH_CHECK(static_cast<int64_t>(outliers.size()) == 2 * L * kKindsPerLayer,
              "radixserve_cpu::decode_step: outlier channels and columns for each weight");
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat && x_in.size(0) >= 1 &&
                  x_in.size(0) <= kMaxRows,
              "radixserve_cpu::decode_step: x must be float32 [1..8, hidden]");
  const int64_t M = x_in.size(0), H = x_in.size(1), D = head_dim, Hq = num_heads, Hkv = num_kv_heads;
  TORCH_CHECK(Hkv > 0 && Hq % Hkv == 0 && Hq / Hkv <= detail::kVecRows && D % 2 == 0,
              "radixserve_cpu::decode_step: unsupported head layout");
  const int64_t q_size = Hq * D, kv_size = Hkv * D, qkv_size = q_size + 2 * kv_size;
  TORCH_CHECK(cos.sizes() == at::IntArrayRef({M, D / 2}) && sin.sizes() == cos.sizes() &&
                  cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous(),
              "radixserve_cpu::decode_step: cos/sin must be float32 [M, head_dim / 2]");
  TORCH_CHECK(page_table.scalar_type() == at::kInt && page_table.dim() == 2 && page_table.size(0) == M &&
                  page_table.is_contiguous() && seq_lens.scalar_type() == at::kInt && seq_lens.numel() == M &&
                  slots.scalar_type() == at::kLong && slots.numel() == M,
              "radixserve_cpu::decode_step: page_table [M, W] int32, seq_lens [M] int32, slots [M] int64");
  const at::Tensor& kc0 = k_caches[0];
  const auto kv_dtype = kc0.scalar_type();
  TORCH_CHECK(kv_dtype == at::kFloat || kv_dtype == at::kBFloat16,
              "radixserve_cpu::decode_step: float32 or bfloat16 K/V pages");
  const KvType kv_type = kv_dtype == at::kFloat ? KvType::kFloat : KvType::kBFloat16;
  const VecKernel attend = detail::vec_kernel(D, kv_type);
  TORCH_CHECK(attend != nullptr, "radixserve_cpu::decode_step: no vector attention for head_dim ", D);
  const int64_t P = kc0.size(0), S = kc0.size(1);
  for (int64_t l = 0; l < L; ++l)
    TORCH_CHECK(k_caches[l].dim() == 4 && k_caches[l].is_contiguous() && v_caches[l].is_contiguous() &&
                    k_caches[l].sizes() == kc0.sizes() && v_caches[l].sizes() == kc0.sizes() &&
                    k_caches[l].scalar_type() == kv_dtype && v_caches[l].scalar_type() == kv_dtype &&
                    kc0.size(2) == Hkv && kc0.size(3) == D,
                "radixserve_cpu::decode_step: every layer's pages [pages, page_size, kv_heads, head_dim]");
  // The pages every row reads and its new token's slot, checked here: nothing inside the thread team
  // may throw.
  const int32_t* table = page_table.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t W = page_table.size(1);
  for (int64_t m = 0; m < M; ++m) {
    TORCH_CHECK(lens[m] >= 1 && (lens[m] + S - 1) / S <= W, "radixserve_cpu::decode_step: row ", m,
                " has ", lens[m], " tokens, more than its page table holds");
    for (int64_t c = 0; c < (lens[m] + S - 1) / S; ++c)
      TORCH_CHECK(table[m * W + c] >= 0 && table[m * W + c] < P, "radixserve_cpu::decode_step: page ",
                  table[m * W + c], " not in [0, ", P, ")");
    TORCH_CHECK(slot[m] >= 0 && slot[m] < P * S && slot[m] / S == table[m * W + (lens[m] - 1) / S],
                "radixserve_cpu::decode_step: row ", m, "'s slot is not its last token's");
  }
  const std::vector<Weight> lin = layer_weights(weights, kinds, outliers, L, H, Hq, Hkv, D, intermediate_size);
  const int64_t I = intermediate_size;

  at::Tensor x = x_in.clone();
  const int64_t ldh = dense::round_up(std::max(H, std::max(q_size, I)), kPad);
  // Shared buffers: q (fp32, the attention reads it), attention out and lse, gate/up, activations.
  std::vector<float> q(M * q_size), attn(M * q_size), lse(M * Hq), act(M * ldh, 0.f);
  std::vector<float> gate_up(M * std::max(2 * I, qkv_size));
  // The attention plan of a decode step: one item per row, all of its context, written directly.
  std::vector<int32_t> items(M * kItemCols), rows(M * kRowCols);
  for (int64_t m = 0; m < M; ++m) {
    int32_t* it = items.data() + m * kItemCols;
    it[kSeg] = static_cast<int32_t>(m);
    it[kRowBegin] = static_cast<int32_t>(m);
    it[kRowEnd] = static_cast<int32_t>(m + 1);
    it[kKvBegin] = 0;
    it[kKvEnd] = lens[m];
    it[kPartial] = -1;
    rows[m * kRowCols + kQRow] = static_cast<int32_t>(m);
    rows[m * kRowCols + kLimit] = lens[m];
  }
  float* xs = x.data_ptr<float>();
  const float* cs = cos.data_ptr<float>();
  const float* sn = sin.data_ptr<float>();
  const float feps = static_cast<float>(eps);
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t kv_elem = kv_type == KvType::kFloat ? 4 : 2;
  // A row's kv heads are attended together where the rows alone share the threads out evenly;
  // otherwise each row's heads are split into runs until they do. A unit per (row, head) made the
  // threads read alternate heads' rows, side by side in the same pages: on the 1B shape (8 kv heads)
  // on Zen 4, a step of 8 x 1,100 tokens took 85.7 ms that way and 62.5 with whole rows
  // (benchmarks/results/native_step-rowunits-1b-zen4.md).
  int64_t head_runs = 1;
  while (head_runs < Hkv && (M * head_runs) % threads != 0) head_runs *= 2;
  head_runs = std::min(head_runs, Hkv);
  const int64_t heads_per_unit = (Hkv + head_runs - 1) / head_runs;
  head_runs = (Hkv + heads_per_unit - 1) / heads_per_unit;

#pragma omp parallel num_threads(threads)
  {
    const int64_t tid = omp_get_thread_num(), nth = omp_get_num_threads();
    std::vector<float> h(M * ldh, 0.f);  // this thread's normalised rows
    std::vector<float> ordered(M * ldh, 0.f);  // a product's input in its weight's order (act-order)
    std::vector<float> head(D);
    for (int64_t l = 0; l < L; ++l) {
      const at::Tensor* lw = weights.data() + l * kTensorsPerLayer;
      const Weight* lk = lin.data() + l * kKindsPerLayer;
      char* kc = static_cast<char*>(k_caches[l].data_ptr());
      char* vc = static_cast<char*>(v_caches[l].data_ptr());
      // -- QKV, whole heads a thread: bias, q/k norm, RoPE, K/V into the pages
      rmsnorm(xs, M, H, lw[kInNorm].data_ptr<float>(), feps, h.data(), ldh);
      const auto [h0, h1] = band(Hq + 2 * Hkv, 1, tid, nth);
      std::vector<float>& qkv = gate_up;  // free until gate/up: [M, qkv_size] here
      const float* bias = lk[kWq].bias;
      const float* hq = in_order(h.data(), ldh, M, H, opt_order(lw[kQkvOrder]), ordered.data());
      // This band's heads of each part: q heads [0, Hq), k heads [Hq, Hq + Hkv), v heads after.
      const int64_t first_head[3] = {0, Hq, Hq + Hkv}, end_head[3] = {Hq, Hq + Hkv, Hq + 2 * Hkv};
      for (int p = 0; p < 3; ++p) {
        const int64_t a = std::max(h0, first_head[p]), b = std::min(h1, end_head[p]);
        const int64_t offset = first_head[p] * D;  // of the part's rows in qkv
        product(M, lk[kWq + p], hq, ldh, (a - first_head[p]) * D, (b - first_head[p]) * D,
                [&](int m, int64_t n, float s) {
                  const int64_t i = offset + n;
                  qkv[m * qkv_size + i] = bias != nullptr ? s + bias[i] : s;
                });
      }
      const float* qn = opt_ptr(lw[kQNorm]);
      const float* kn = opt_ptr(lw[kKNorm]);
      for (int64_t m = 0; m < M; ++m) {
        for (int64_t hd = h0; hd < h1; ++hd) {
          float* v = qkv.data() + m * qkv_size + hd * D;
          const float* c = cs + m * (D / 2);
          const float* s = sn + m * (D / 2);
          if (hd < Hq) {
            norm_rope(v, D, qn, feps, c, s);
            std::copy(v, v + D, q.data() + m * q_size + hd * D);
            continue;
          }
          const bool is_k = hd < Hq + Hkv;
          const int64_t kvh = is_k ? hd - Hq : hd - Hq - Hkv;
          if (is_k) norm_rope(v, D, kn, feps, c, s);
          char* dst = (is_k ? kc : vc) + (slot[m] * Hkv + kvh) * D * kv_elem;
          if (kv_type == KvType::kFloat) {
            std::copy(v, v + D, reinterpret_cast<float*>(dst));
          } else {
            auto* out = reinterpret_cast<c10::BFloat16*>(dst);
            for (int64_t d = 0; d < D; ++d) out[d] = c10::BFloat16(v[d]);  // nearest even, as .to()
          }
        }
      }
#pragma omp barrier
      // -- attention: units (row, a run of kv heads), heads_per_unit a step
      const Ctx c{q.data(), q_size, kc, vc, nullptr, nullptr, kv_type, P, S, Hkv, D, Hq / Hkv, Hq, table, W, W,
                  rows.data(), static_cast<float>(scale), attn.data(), lse.data(), nullptr, nullptr};
      for (int64_t u = tid; u < M * head_runs; u += nth) {
        const int64_t r = u / head_runs, run = u % head_runs;
        attend(c, items.data() + r * kItemCols, run * heads_per_unit, std::min(Hkv, (run + 1) * heads_per_unit));
      }
#pragma omp barrier
      // -- o_proj + residual
      {
        const auto [n0, n1] = band(H, kBandAlign, tid, nth);
        const float* in = in_order(attn.data(), q_size, M, q_size, opt_order(lw[kOOrder]), ordered.data());
        product(M, lk[kWo], in, q_size, n0, n1, [&](int m, int64_t n, float s) { xs[m * H + n] += s; });
      }
#pragma omp barrier
      // -- gate/up with SiLU
      rmsnorm(xs, M, H, lw[kPostNorm].data_ptr<float>(), feps, h.data(), ldh);
      {
        const auto [j0, j1] = band(I, kBandAlign, tid, nth);
        float* gu = gate_up.data();
        const float* in = in_order(h.data(), ldh, M, H, opt_order(lw[kGateUpOrder]), ordered.data());
        product(M, lk[kWgate], in, ldh, j0, j1, [&](int m, int64_t n, float s) { gu[m * 2 * I + n] = s; });
        product(M, lk[kWup], in, ldh, j0, j1, [&](int m, int64_t n, float s) { gu[m * 2 * I + I + n] = s; });
        for (int64_t m = 0; m < M; ++m)
          for (int64_t j = j0; j < j1; ++j) {
            const float g = gu[m * 2 * I + j];
            act[m * ldh + j] = g / (1.f + std::exp(-g)) * gu[m * 2 * I + I + j];
          }
      }
#pragma omp barrier
      // -- down + residual
      {
        const auto [n0, n1] = band(H, kBandAlign, tid, nth);
        const float* in = in_order(act.data(), ldh, M, I, opt_order(lw[kDownOrder]), ordered.data());
        product(M, lk[kWdown], in, ldh, n0, n1, [&](int m, int64_t n, float s) { xs[m * H + n] += s; });
      }
#pragma omp barrier
    }
  }
  return x;
}

}  // namespace
}  // namespace radixserve_cpu

namespace radixserve_cpu {
// Whether decode_step takes bf16 weights here: an AVX-512 build on a CPU with AVX512_BF16.
bool decode_step_bf16() { return step::runs_here(step::kBF16); }
}  // namespace radixserve_cpu

TORCH_LIBRARY_FRAGMENT(radixserve_cpu, m) {
  m.def("decode_step_bf16() -> bool", &radixserve_cpu::decode_step_bf16);  // no tensor: a catch-all kernel
  m.def(
      "decode_step(Tensor x, Tensor cos, Tensor sin, Tensor[] weights, int[] kinds, Tensor[] outliers, "
      "Tensor(a!)[] k_caches, "
      "Tensor(b!)[] v_caches, Tensor page_table, Tensor seq_lens, Tensor slots, int num_heads, "
      "int num_kv_heads, int head_dim, int intermediate_size, float eps, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(radixserve_cpu, CPU, m) { m.impl("decode_step", &radixserve_cpu::decode_step); }
