// The tiles of the int8 block product (gguf_int8.cpp's ops, native_step.cpp's int8 products): weight
// rows decoded 32 at a time into their integer form (block_ints.h) laid out for vpdpbusd, and the
// micro-kernels that multiply them by x's int8 blocks (int8_quant.h). See gguf_int8.cpp for the math
// and the exactness argument.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "block_ints.h"
#include "int8_quant.h"


namespace radixserve_cpu::int8_tiles {

using ints::chunk_values;
using ints::half_min;
using ints::has_min;
using ints::kBlock;
using ints::split;
using ints::takes;
using ints::weight_offset;

constexpr int64_t kGroups = 8;   // 4-byte groups per chunk
constexpr int64_t kTileRows = 32;  // weight rows per tile: two 512-bit registers of int32
// x rows per pass of the VNNI kernel, each with 2 int32 and 2 fp32 accumulators (a split type: a third
// set). It was 6 for the other types, but g++ 12 then kept part of the pass's state on the stack
// (objdump: zmm loads and stores to %rsp in its loop). A 512-token int8 prefill of the 1B shape on
// Zen 4 took 2,216 ms with 6 and 2,072 with 4 (benchmarks/step/build_ab.py, 3 rounds, medians); on the
// default model (K = 576) no difference was measured. The output of a row does not depend on its pass.
constexpr int kMaxRows = 4;

// A tile of 32 weight rows, decoded: u [nb][8][32][4] bytes, dw and mw [nb][32] fp32 (a half_min type's
// mw [nb][2][32]), and a split type's half scales k [nb][2][32] int32 (absent for the others), one after
// the other in tile_bytes(Q, nb) bytes. Rows past the weight's last are zero (their outputs are not
// stored). Decoded per call into a thread's buffer (gguf_int8_linear), or once at load into a weight's
// stored tiles (gguf_int8_pack), which the products then stream as they are.
//
// Types whose u fit in 4 bits (Q4_0, Q4_1, Q4_K, Q3_K, Q2_K) keep two groups a byte: group g in the low
// nibble of slot g % 4 for g < 4, the high nibble for g >= 4 ([nb][4][32][4] bytes), so a stored tile
// of the default model's Q4_1 is 0.75 bytes a weight, not 1.25, and a decode step reads 40% fewer bytes;
// a shift and a mask a 64-byte load give the bytes back.
struct Tile {
  const uint8_t* u;
  const float* dw;
  const float* mw;
  const int32_t* k;
};

constexpr bool nibbles(int64_t q) {
  return q == blocks::kQ4_0 || q == blocks::kQ4_1 || q == blocks::kQ4_K || q == blocks::kQ3_K ||
         q == blocks::kQ2_K;
}

constexpr int64_t kGroupBytes = kTileRows * 4;  // one group's 4 bytes of every row of a tile

// Bytes of one chunk's u in a tile: 8 groups, or 4 slots of two.
constexpr int64_t chunk_u_bytes(int64_t q) { return (nibbles(q) ? kGroups / 2 : kGroups) * kGroupBytes; }

// Minimums per chunk and tile row: one, or a half_min type's two.
constexpr int64_t mins_per_chunk(int64_t q) { return half_min(q) ? 2 : 1; }

constexpr int64_t tile_bytes(int64_t q, int64_t nb) {
  return nb * chunk_u_bytes(q) + (1 + mins_per_chunk(q)) * nb * kTileRows * 4 +
         (split(q) ? 2 * nb * kTileRows * 4 : 0);
}

inline Tile tile_at(const uint8_t* base, int64_t q, int64_t nb) {
  const auto* dw = reinterpret_cast<const float*>(base + nb * chunk_u_bytes(q));
  const float* mw = dw + nb * kTileRows;
  return {base, dw, mw, reinterpret_cast<const int32_t*>(mw + mins_per_chunk(q) * nb * kTileRows)};
}

// Byte j (0-3) of row r's group g in a chunk's u (at u).
template <int64_t Q>
inline uint8_t u_at(const uint8_t* u, int64_t g, int64_t r, int64_t j) {
  if constexpr (nibbles(Q)) return (u[(g % 4) * kGroupBytes + r * 4 + j] >> (g / 4 * 4)) & 15;
  return u[g * kGroupBytes + r * 4 + j];
}

// Weight rows [n0, n0 + rows) of blocks `w` decoded into the tile at `base` (tile_bytes(Q, nb) bytes).
template <int64_t Q>
void decode_tile(const uint8_t* w, int64_t row_bytes, int64_t nb, int64_t n0, int64_t rows, uint8_t* base) {
  constexpr int64_t per = blocks::weights_of(Q) / kBlock, bb = blocks::bytes_of(Q);
  std::memset(base, 0, tile_bytes(Q, nb));  // a short last tile: zero weights, zero scales
  uint8_t* u = base;
  auto* dw = reinterpret_cast<float*>(base + nb * chunk_u_bytes(Q));
  float* mw = dw + nb * kTileRows;
  auto* hk = reinterpret_cast<int32_t*>(mw + mins_per_chunk(Q) * nb * kTileRows);
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* row = w + (n0 + r) * row_bytes;
    for (int64_t b = 0; b < nb; ++b) {
      uint8_t vals[kBlock];  // the chunk's 32 unsigned byte values in K order
      int32_t k[2] = {0, 0};
      float m[2] = {0.f, 0.f};
      chunk_values<Q>(row + b / per * bb, b % per, vals, dw[b * kTileRows + r], m, k);
      for (int64_t h = 0; h < mins_per_chunk(Q); ++h) mw[(mins_per_chunk(Q) * b + h) * kTileRows + r] = m[h];
      if constexpr (split(Q)) {
        hk[(2 * b) * kTileRows + r] = k[0];
        hk[(2 * b + 1) * kTileRows + r] = k[1];
      }
      uint8_t* dst = u + b * chunk_u_bytes(Q) + r * 4;
      for (int64_t g = 0; g < kGroups; ++g) {
        for (int64_t j = 0; j < 4; ++j) {
          if constexpr (nibbles(Q)) {
            dst[(g % 4) * kGroupBytes + j] |= static_cast<uint8_t>(vals[g * 4 + j] << (g / 4 * 4));
          } else {
            dst[g * kGroupBytes + j] = vals[g * 4 + j];
          }
        }
      }
    }
  }
}

struct Out {
  float* out;  // [M, N]
  int64_t N;
  const float* bias;  // [N] or nullptr
  // Outlier channels (radixserve/model/outliers.py): x's values there, xo [M, k], were left out of its
  // quantization; their weight columns wo [k, wo_ld] (transposed: 16 output rows a load) add them in
  // fp32 after the blocks, one fused multiply-add a channel in order. k 0: none.
  const float* xo = nullptr;
  const float* wo = nullptr;
  int64_t k = 0, wo_ld = 0;
};

// The portable path: the same integer sums and the same fp32 operations in the same order (one
// std::fma per block), so its output equals the VNNI kernel's bit for bit.
template <int64_t Q>
void tile_rows_portable(const QuantX& x, const Tile& t, int64_t m0, int64_t m1, int64_t n0, int64_t rows,
                        const Out& o) {
  const int32_t off = weight_offset(Q);
  for (int64_t m = m0; m < m1; ++m) {
    for (int64_t r = 0; r < rows; ++r) {
      float acc = 0.f;
      for (int64_t b = 0; b < x.nb; ++b) {
        const uint8_t* u = t.u + b * chunk_u_bytes(Q);
        const int8_t* q = x.q + m * x.K + b * kBlock;
        // The integer dot of groups [g0, g1) of the chunk, from `start`.
        const auto dot = [&](int64_t g0, int64_t g1, int32_t start) {
          for (int64_t g = g0; g < g1; ++g)
            for (int64_t j = 0; j < 4; ++j) start += static_cast<int32_t>(u_at<Q>(u, g, r, j)) * q[g * 4 + j];
          return start;
        };
        int32_t i;
        if constexpr (split(Q)) {
          const int32_t* s2 = x.s2 + m * 2 * x.nb + 2 * b;
          i = t.k[(2 * b) * kTileRows + r] * dot(0, kGroups / 2, -off * s2[0]) +
              t.k[(2 * b + 1) * kTileRows + r] * dot(kGroups / 2, kGroups, -off * s2[1]);
        } else {
          i = dot(0, kGroups, -off * x.s[m * x.nb + b]);
        }
        const float dx = x.d[m * x.nb + b];
        acc = std::fma(static_cast<float>(i), t.dw[b * kTileRows + r] * dx, acc);
        if constexpr (has_min(Q)) acc = std::fma(t.mw[b * kTileRows + r], x.ds[m * x.nb + b], acc);
        if constexpr (half_min(Q)) {  // each half's minimum times d_x * that half's sum
          const int32_t* s2 = x.s2 + m * 2 * x.nb + 2 * b;
          for (int64_t h = 0; h < 2; ++h)
            acc = std::fma(t.mw[(2 * b + h) * kTileRows + r], dx * static_cast<float>(s2[h]), acc);
        }
      }
      for (int64_t j = 0; j < o.k; ++j) acc = std::fma(o.xo[m * o.k + j], o.wo[j * o.wo_ld + n0 + r], acc);
      o.out[m * o.N + n0 + r] = o.bias != nullptr ? acc + o.bias[n0 + r] : acc;
    }
  }
}

#ifdef RADIXSERVE_HAVE_VNNI_KERNEL

// isum[r] += the integer dots of groups [g0, g1) of a decoded chunk (ub) with x row r's int8 values
// (qb, rows ldq apart): one vpdpbusd per 16 weight rows and 4 x values broadcast.
template <int64_t Q, int R>
VNNI_TARGET inline void dot_groups(__m512i (&isum)[R][2], const int8_t* qb, int64_t ldq, const uint8_t* ub,
                                   int64_t g0, int64_t g1) {
  for (int64_t g = g0; g < g1; ++g) {
    __m512i w0, w1;
    if constexpr (nibbles(Q)) {
      const __m512i mask = _mm512_set1_epi8(15);
      w0 = _mm512_loadu_si512(ub + (g % 4) * kGroupBytes);
      w1 = _mm512_loadu_si512(ub + (g % 4) * kGroupBytes + 64);
      if (g >= 4) {  // the high nibbles
        w0 = _mm512_srli_epi16(w0, 4);
        w1 = _mm512_srli_epi16(w1, 4);
      }
      w0 = _mm512_and_si512(w0, mask);
      w1 = _mm512_and_si512(w1, mask);
    } else {
      w0 = _mm512_loadu_si512(ub + g * kGroupBytes);
      w1 = _mm512_loadu_si512(ub + g * kGroupBytes + 64);
    }
    for (int r = 0; r < R; ++r) {
      int32_t four;
      std::memcpy(&four, qb + r * ldq + g * 4, 4);
      const __m512i xv = _mm512_set1_epi32(four);
      isum[r][0] = _mm512_dpbusd_epi32(isum[r][0], w0, xv);
      isum[r][1] = _mm512_dpbusd_epi32(isum[r][1], w1, xv);
    }
  }
}

// x rows [m0, m0 + R) against one decoded tile: per row, 2 int32 and 2 fp32 accumulators of 16
// weight rows each.
template <int64_t Q, int R>
VNNI_TARGET void tile_rows_vnni(const QuantX& x, const Tile& t, int64_t m0, int64_t n0, int64_t rows,
                                const Out& o) {
  const int32_t off = weight_offset(Q);
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const uint8_t* u = t.u;
  for (int64_t b = 0; b < x.nb; ++b) {
    __m512i isum[R][2];
    const int8_t* qb = x.q + m0 * x.K + b * kBlock;
    const uint8_t* ub = u + b * chunk_u_bytes(Q);
    if constexpr (split(Q)) {
      // Each half's sum times its rows' integer scales, in int32 (exact: |sum| < 2^18, |k| <= 128).
      __m512i whole[R][2];
      for (int h = 0; h < 2; ++h) {
        for (int r = 0; r < R; ++r)
          isum[r][0] = isum[r][1] = _mm512_set1_epi32(-off * x.s2[(m0 + r) * 2 * x.nb + 2 * b + h]);
        dot_groups<Q, R>(isum, qb, x.K, ub, h * kGroups / 2, (h + 1) * kGroups / 2);
        const int32_t* k = t.k + (2 * b + h) * kTileRows;
        const __m512i k0 = _mm512_loadu_si512(k), k1 = _mm512_loadu_si512(k + 16);
        for (int r = 0; r < R; ++r) {
          const __m512i p0 = _mm512_mullo_epi32(isum[r][0], k0), p1 = _mm512_mullo_epi32(isum[r][1], k1);
          whole[r][0] = h == 0 ? p0 : _mm512_add_epi32(whole[r][0], p0);
          whole[r][1] = h == 0 ? p1 : _mm512_add_epi32(whole[r][1], p1);
        }
      }
      for (int r = 0; r < R; ++r) {
        isum[r][0] = whole[r][0];
        isum[r][1] = whole[r][1];
      }
    } else {
      for (int r = 0; r < R; ++r)
        isum[r][0] = isum[r][1] = _mm512_set1_epi32(-off * x.s[(m0 + r) * x.nb + b]);
      dot_groups<Q, R>(isum, qb, x.K, ub, 0, kGroups);
    }
    const __m512 dw0 = _mm512_loadu_ps(t.dw + b * kTileRows);
    const __m512 dw1 = _mm512_loadu_ps(t.dw + b * kTileRows + 16);
    for (int r = 0; r < R; ++r) {
      const __m512 dx = _mm512_set1_ps(x.d[(m0 + r) * x.nb + b]);
      acc[r][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r][0]), _mm512_mul_ps(dw0, dx), acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r][1]), _mm512_mul_ps(dw1, dx), acc[r][1]);
    }
    if constexpr (has_min(Q)) {
      const __m512 mw0 = _mm512_loadu_ps(t.mw + b * kTileRows);
      const __m512 mw1 = _mm512_loadu_ps(t.mw + b * kTileRows + 16);
      for (int r = 0; r < R; ++r) {
        const __m512 ds = _mm512_set1_ps(x.ds[(m0 + r) * x.nb + b]);
        acc[r][0] = _mm512_fmadd_ps(mw0, ds, acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(mw1, ds, acc[r][1]);
      }
    }
    if constexpr (half_min(Q)) {
      for (int h = 0; h < 2; ++h) {
        const __m512 mw0 = _mm512_loadu_ps(t.mw + (2 * b + h) * kTileRows);
        const __m512 mw1 = _mm512_loadu_ps(t.mw + (2 * b + h) * kTileRows + 16);
        for (int r = 0; r < R; ++r) {
          const int64_t m = m0 + r;
          const float sum = static_cast<float>(x.s2[m * 2 * x.nb + 2 * b + h]);
          const __m512 ds = _mm512_set1_ps(x.d[m * x.nb + b] * sum);
          acc[r][0] = _mm512_fmadd_ps(mw0, ds, acc[r][0]);
          acc[r][1] = _mm512_fmadd_ps(mw1, ds, acc[r][1]);
        }
      }
    }
  }
  const auto live_mask = [rows](int h) {
    const int64_t live = std::clamp<int64_t>(rows - 16 * h, 0, 16);
    return static_cast<__mmask16>((1u << live) - 1u);
  };
  for (int64_t j = 0; j < o.k; ++j) {  // the outlier channels: each x value broadcast once for 32 outputs
    const float* wj = o.wo + j * o.wo_ld + n0;
    const __m512 w0 = _mm512_maskz_loadu_ps(live_mask(0), wj), w1 = _mm512_maskz_loadu_ps(live_mask(1), wj + 16);
    for (int r = 0; r < R; ++r) {
      const __m512 xj = _mm512_set1_ps(o.xo[(m0 + r) * o.k + j]);
      acc[r][0] = _mm512_fmadd_ps(xj, w0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(xj, w1, acc[r][1]);
    }
  }
  for (int h = 0; h < 2; ++h) {
    const __mmask16 mask = live_mask(h);
    if (mask == 0) break;
    const float* bias_h = o.bias != nullptr ? o.bias + n0 + 16 * h : nullptr;
    const __m512 bias = bias_h != nullptr ? _mm512_maskz_loadu_ps(mask, bias_h) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) {
      const __m512 v = bias_h != nullptr ? _mm512_add_ps(acc[r][h], bias) : acc[r][h];
      _mm512_mask_storeu_ps(o.out + (m0 + r) * o.N + n0 + 16 * h, mask, v);
    }
  }
}

template <int64_t Q, int R = kMaxRows>
void tile_rows_vnni_dispatch(int rows_x, const QuantX& x, const Tile& t, int64_t m0, int64_t n0, int64_t rows,
                             const Out& o) {
  if constexpr (R > 1) {
    if (rows_x < R) return tile_rows_vnni_dispatch<Q, R - 1>(rows_x, x, t, m0, n0, rows, o);
  }
  tile_rows_vnni<Q, R>(x, t, m0, n0, rows, o);
}

#endif

// x rows [0, M) against one tile (weight rows [n0, n0 + rows)): the VNNI kernel where it runs, else
// the portable path (the same numbers).
template <int64_t Q>
void tile_product(const QuantX& x, const Tile& t, int64_t M, int64_t n0, int64_t rows, const Out& o, bool vnni) {
#ifdef RADIXSERVE_HAVE_VNNI_KERNEL
  if (vnni) {
    for (int64_t m0 = 0; m0 < M; m0 += kMaxRows)
      tile_rows_vnni_dispatch<Q>(static_cast<int>(std::min<int64_t>(kMaxRows, M - m0)), x, t, m0, n0, rows, o);
    return;
  }
#endif
  tile_rows_portable<Q>(x, t, 0, M, n0, rows, o);
}

}  // namespace radixserve_cpu::int8_tiles
