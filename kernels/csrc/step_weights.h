// The native decode step's per-layer tensors (native_step.cpp's `weights`, `kinds` and `outliers`):
// their order, and every one checked and turned into a step::Weight before the thread team starts
// (nothing inside it may throw).
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "radixserve_cpu.h"
#include "step_products.h"

namespace radixserve_cpu {

// Bands of output rows start at multiples of this: an int8 tile's rows (step_products.h). QKV bands are
// whole heads, so int8 tiles there need head_dim a multiple of it (model/native_step.py checks).
constexpr int64_t kBandAlign = int8_tiles::kTileRows;
// Tensors per layer in `weights`, in this order (an absent one is an empty tensor).
enum LayerTensor : int {
  kInNorm = 0,
  kQ,
  kK,
  kV,
  kQkvBias,
  kQNorm,
  kKNorm,
  kO,
  kPostNorm,
  kGate,
  kUp,
  kDown,
  // Input orders (GPTQ act-order on GGUF blocks): int64 [K], the weight's column j is input channel
  // order[j]; empty where the weight takes its input as it is. q/k/v share one, gate/up another.
  kQkvOrder,
  kOOrder,
  kGateUpOrder,
  kDownOrder,
  kTensorsPerLayer
};
// Weight kinds per layer in `kinds`, one per weight tensor above, in its order.
enum LayerWeight : int { kWq = 0, kWk, kWv, kWo, kWgate, kWup, kWdown, kKindsPerLayer };

inline const float* opt_ptr(const at::Tensor& t) { return t.numel() > 0 ? t.data_ptr<float>() : nullptr; }

// The L layers' weights (kKindsPerLayer each, in LayerWeight order) for hidden size H, Hq and Hkv heads of
// D and intermediate size I, each checked against its kind (shape, dtype, and that it runs on this CPU),
// with its outlier channels; the q part carries the qkv bias. The norms, biases and input orders are
// checked too.
inline std::vector<step::Weight> layer_weights(const std::vector<at::Tensor>& weights, const std::vector<int64_t>& kinds,
                                         const std::vector<at::Tensor>& outliers, int64_t L, int64_t H, int64_t Hq,
                                         int64_t Hkv, int64_t D, int64_t I) {
  std::vector<step::Weight> lin(L * kKindsPerLayer);
  const int64_t q_size = Hq * D, qkv_size = q_size + 2 * Hkv * D;
  const int64_t kv_rows = Hkv * D;
  const int64_t shapes[kKindsPerLayer][2] = {{q_size, H}, {kv_rows, H}, {kv_rows, H}, {H, q_size},
                                             {I, H},      {I, H},       {H, I}};
  const int tensor_of[kKindsPerLayer] = {kQ, kK, kV, kO, kGate, kUp, kDown};
  for (int64_t l = 0; l < L; ++l) {
    for (int j = 0; j < kKindsPerLayer; ++j) {
      const at::Tensor& t = weights[l * kTensorsPerLayer + tensor_of[j]];
      const int64_t kind = kinds[l * kKindsPerLayer + j], N = shapes[j][0], K = shapes[j][1];
      TORCH_CHECK(t.is_contiguous() && t.dim() == 2 && (t.size(0) == N || step::is_tiles(kind)),
                  "radixserve_cpu::decode_step: weight ", j, " of layer ", l, " has shape ", t.sizes());
      if (kind == step::kF32) {
        TORCH_CHECK(t.scalar_type() == at::kFloat && t.size(1) == K, "radixserve_cpu::decode_step: fp32 weight");
      } else if (kind == step::kBF16) {
        TORCH_CHECK(t.scalar_type() == at::kBFloat16 && t.size(1) == K, "radixserve_cpu::decode_step: bf16 weight");
        TORCH_CHECK(step::runs_here(kind), "radixserve_cpu::decode_step: bf16 weights need AVX512_BF16 ",
                    "(vdpbf16ps), which this CPU or build lacks");
      } else if (step::is_tiles(kind)) {
        const int64_t q = kind - step::kTiles;
        TORCH_CHECK(step::runs_here(kind), "radixserve_cpu::decode_step: int8 tiles of type ", q,
                    " need AVX512-VNNI, which this CPU or build lacks");
        TORCH_CHECK(K % int8_tiles::kBlock == 0 && t.scalar_type() == at::kByte &&
                        t.size(0) == (N + int8_tiles::kTileRows - 1) / int8_tiles::kTileRows &&
                        t.size(1) == int8_tiles::tile_bytes(q, K / int8_tiles::kBlock),
                    "radixserve_cpu::decode_step: int8 tiles of type ", q, " must be gguf_int8_pack's [",
                    (N + int8_tiles::kTileRows - 1) / int8_tiles::kTileRows, ", ",
                    int8_tiles::tile_bytes(q, K / int8_tiles::kBlock), "] uint8, got ", t.sizes());
        TORCH_CHECK(j > kWv || D % kBandAlign == 0, "radixserve_cpu::decode_step: int8 tiles in QKV need head_dim a "
                    "multiple of ", kBandAlign, " (its bands are whole heads)");
      } else {
        TORCH_CHECK(t.scalar_type() == at::kByte && t.size(1) == blocks::block_row_bytes(kind, K),
                    "radixserve_cpu::decode_step: GGUF block weight of type ", kind);
      }
      lin[l * kKindsPerLayer + j] = {kind, t.data_ptr(), N, K, t.size(1) * t.element_size(), nullptr};
      const at::Tensor& ch = outliers[2 * (l * kKindsPerLayer + j)];
      const at::Tensor& cw = outliers[2 * (l * kKindsPerLayer + j) + 1];
      if (ch.numel() == 0) continue;
      TORCH_CHECK(step::is_tiles(kind), "radixserve_cpu::decode_step: outlier channels need int8 tiles");
      check_outliers(ch, cw, K, N, "decode_step");
      step::Weight& wl = lin[l * kKindsPerLayer + j];
      wl.out_ch = ch.data_ptr<int64_t>();
      wl.out_w = cw.data_ptr<float>();
      wl.n_out = ch.numel();
    }
    lin[l * kKindsPerLayer + kWq].bias = opt_ptr(weights[l * kTensorsPerLayer + kQkvBias]);  // of all qkv rows
    for (int j : {kQkvOrder, kOOrder, kGateUpOrder, kDownOrder}) {
      const at::Tensor& t = weights[l * kTensorsPerLayer + j];
      if (t.numel() == 0) continue;
      const int64_t K = j == kOOrder ? q_size : (j == kDownOrder ? I : H);
      TORCH_CHECK(t.scalar_type() == at::kLong && t.is_contiguous() && t.numel() == K,
                  "radixserve_cpu::decode_step: input order ", j, " of layer ", l, " must be int64 [", K, "]");
      const int64_t* o = t.data_ptr<int64_t>();
      TORCH_CHECK(std::all_of(o, o + K, [K](int64_t c) { return c >= 0 && c < K; }),
                  "radixserve_cpu::decode_step: input order ", j, " of layer ", l, " leaves [0, ", K, ")");
    }
    for (int j : {kInNorm, kPostNorm, kQkvBias, kQNorm, kKNorm}) {
      const at::Tensor& t = weights[l * kTensorsPerLayer + j];
      const int64_t want = j == kQkvBias ? qkv_size : (j == kQNorm || j == kKNorm ? D : H);
      TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() &&
                      (t.numel() == want || (t.numel() == 0 && j != kInNorm && j != kPostNorm)),
                  "radixserve_cpu::decode_step: norm or bias ", j, " of layer ", l, " must be float32 [", want, "]");
    }
  }
  return lin;
}

}  // namespace radixserve_cpu
