// The native decode step's products by weight format (native_step.cpp): a band of a weight's output
// rows against the step's M activation rows, one thread, each weight read once for all M rows.
//
// Formats (a weight's kind is its GGML type id):
// - fp32 [N, K] (kind 0): dense::dot_rows, exact fp32 (gemv.cpp's order);
// - bf16 [N, K] (kind 30, the --dtype bfloat16 model's own weights): the x rows rounded to bf16 once
//   per product (as the torch bf16 model's activations are), then vdpbf16ps pairs summed in fp32
//   (dense::bf16_dot_rows_dp); only where the CPU reports AVX512_BF16 (native_step.py checks, and
//   decode_step refuses the kind elsewhere);
// - GGUF blocks of any type block_decode.h reads [N, row bytes]: block_rows.h's few-row kernels, exact fp32;
// - int8 tiles of a GGUF weight (kind kTiles + its type: gguf_int8_pack's [ceil(N / 32), tile bytes],
//   the --decode-arithmetic int8 model's, an approximate mode): x rows quantized per 32-block by each
//   thread, then int8_tiles.h's VNNI kernel over the band's tiles (bands start at multiples of 32); a
//   weight's outlier channels (if any) are left out of the quantization and added in fp32.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "block_rows.h"
#include "dense_rows.h"
#include "int8_tiles.h"

namespace radixserve_cpu::step {

constexpr int64_t kF32 = 0;   // a dense fp32 weight (GGML_TYPE_F32)
constexpr int64_t kBF16 = 30;  // a dense bf16 weight (GGML_TYPE_BF16)
constexpr int64_t kPad = 32;  // activation rows are padded to whole blocks (and vectors) of this
constexpr int64_t kTiles = 256;  // + a GGML type id (all below 256): that type's int8 tiles

inline bool is_tiles(int64_t kind) { return kind >= kTiles; }

struct Weight {
  int64_t kind;
  const void* data;
  int64_t N, K, row_bytes;
  const float* bias;
  // int8 tiles only: input channels left out of x's quantization and multiplied in fp32 by their
  // columns out_w [n_out, N] (radixserve/model/outliers.py); n_out 0 where none.
  const int64_t* out_ch = nullptr;
  const float* out_w = nullptr;
  int64_t n_out = 0;
};

// out [M, n1 - n0] for weight rows [n0, n1) (n0 a multiple of 32) of int8 tiles against M rows of x,
// which this thread quantizes (M x K: cheaper than a barrier, as the bf16 rounding below).
template <int M>
void tile_rows(const Weight& w, const float* x, int64_t ld, int64_t n0, int64_t n1, float* out) {
  using namespace int8_tiles;
  const int64_t nb = w.K / kBlock;
  thread_local std::vector<int8_t> q;
  thread_local std::vector<float> d, ds;
  thread_local std::vector<int32_t> s, s2;
  if (static_cast<int64_t>(q.size()) < M * w.K) q.resize(M * w.K);
  if (static_cast<int64_t>(d.size()) < M * nb) {
    d.resize(M * nb);
    ds.resize(M * nb);
    s.resize(M * nb);
    s2.resize(2 * M * nb);
  }
  const bool vnni = cpu_has_vnni();
  thread_local std::vector<float> scratch, xo;
  if (w.n_out > 0 && static_cast<int64_t>(scratch.size()) < w.K) scratch.resize(w.K);
  if (static_cast<int64_t>(xo.size()) < M * w.n_out) xo.resize(M * w.n_out);
  for (int m = 0; m < M; ++m) {
    int8_t* qm = q.data() + m * w.K;
    if (w.n_out > 0) {  // the outlier channels leave the quantization (added in fp32 by the tile kernel)
      quantize_row_apart(x + m * ld, nb, w.out_ch, w.n_out, scratch.data(), xo.data() + m * w.n_out, qm,
                         d.data() + m * nb, s.data() + m * nb, ds.data() + m * nb, s2.data() + 2 * m * nb, vnni);
    } else {
      quantize_row(x + m * ld, nb, qm, d.data() + m * nb, s.data() + m * nb, ds.data() + m * nb,
                   s2.data() + 2 * m * nb, vnni);
    }
  }
  const QuantX qx{q.data(), d.data(), s.data(), ds.data(), s2.data(), w.K, nb};
  // wo: this band's columns of the outliers' [k, N] weight
  const Out o{out, n1 - n0, nullptr, xo.data(), w.n_out > 0 ? w.out_w + n0 : nullptr, w.n_out, w.N};
  const auto* tiles = static_cast<const uint8_t*>(w.data);
  blocks::with_type(w.kind - kTiles, [&](auto t) {
    constexpr int64_t Q = decltype(t)::value;
    if constexpr (ints::takes(Q)) {
      for (int64_t t0 = n0; t0 < n1; t0 += kTileRows)
        tile_product<Q>(qx, tile_at(tiles + t0 / kTileRows * w.row_bytes, Q, nb), M, t0 - n0,
                        std::min(kTileRows, n1 - t0), o, vnni);
    }
  });
}

// out(m, n) for rows [n0, n1) of w against M rows of x (kPad-padded, ld apart); store(m, n, value).
template <int M, typename Store>
void product_m(const Weight& w, const float* x, int64_t ld, int64_t n0, int64_t n1, Store store) {
  if (n0 >= n1) return;
  if (w.kind == kF32) {
    dense::dot_rows<M>(x, ld, static_cast<const float*>(w.data), w.K, n0, n1, store);
    return;
  }
#if defined(CPU_CAPABILITY_AVX512)
  if (w.kind == kBF16) {
    // Each thread rounds the M rows itself (M x K words, against its band's share of the weight):
    // cheaper than one more barrier.
    thread_local std::vector<uint16_t> xb;
    const int64_t Kp = dense::round_up(w.K, dense::kBW);
    if (static_cast<int64_t>(xb.size()) < M * Kp) xb.resize(M * Kp);
    dense::bf16_rows(x, ld, M, w.K, xb.data(), Kp);
    dense::bf16_dot_rows_dp<M>(xb.data(), Kp, static_cast<const uint16_t*>(w.data), w.K, n0, n1, store);
    return;
  }
#endif
  // The block and tile kernels write out[r * N + n]: a small buffer of this band, then stored.
  thread_local std::vector<float> buf;
  const int64_t width = n1 - n0;
  if (static_cast<int64_t>(buf.size()) < M * width) buf.resize(M * width);
  if (is_tiles(w.kind)) {
    tile_rows<M>(w, x, ld, n0, n1, buf.data());
    for (int m = 0; m < M; ++m)
      for (int64_t n = 0; n < width; ++n) store(m, n0 + n, buf[m * width + n]);
    return;
  }
  const blocks::Args a{x, ld, static_cast<const uint8_t*>(w.data) + n0 * w.row_bytes, w.row_bytes, w.K, width,
                       nullptr, buf.data()};
  for (int m0 = 0; m0 < M; m0 += blocks::kMaxFewRows) {  // AVX2 takes 4 rows a pass
    const int rows = std::min<int>(M - m0, blocks::kMaxFewRows);
    const float* xm = x + m0 * ld;
    float* om = buf.data() + m0 * width;
    blocks::with_type(w.kind, [&](auto q) { blocks::few_rows_dispatch<decltype(q)::value>(rows, a, xm, om, 0, width); });
  }
  for (int m = 0; m < M; ++m)
    for (int64_t n = 0; n < width; ++n) store(m, n0 + n, buf[m * width + n]);
}

template <typename Store>
void product(int64_t M, const Weight& w, const float* x, int64_t ld, int64_t n0, int64_t n1, Store store) {
  dense::with_rows(M, [&](auto rows) { product_m<decltype(rows)::value>(w, x, ld, n0, n1, store); });
}

// Whether a weight of `kind` runs here (bf16: the build and the CPU have vdpbf16ps; int8 tiles: VNNI).
inline bool runs_here(int64_t kind) {
  if (is_tiles(kind)) return int8_tiles::cpu_has_vnni() && ints::takes(kind - kTiles);
  return kind != kBF16 || dense::cpu_has_bf16_dot();
}

}  // namespace radixserve_cpu::step
