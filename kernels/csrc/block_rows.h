// GGUF blocks decoded in registers and multiplied against a few fp32 rows, one thread: the few-row
// kernel of gguf_linear.cpp (over threads by at::parallel_for) and native_step.cpp (over its own
// thread team). See gguf_linear.cpp for the exactness argument, block_decode.h for the decoding.
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cstdint>

#include "block_decode.h"

namespace radixserve_cpu::blocks {

struct Args {
  const float* x;  // [M, K], rows ldx apart
  int64_t ldx;
  const uint8_t* w;  // [N, row_bytes]
  int64_t row_bytes, K, N;
  const float* bias;  // [N] or nullptr
  float* out;         // [M, N]
};

// ---- few rows: decode in registers ---------------------------------------------------------------

// Most x rows one pass of the few-rows path takes: its accumulators (two per row) must stay in
// registers, 32 vector registers with AVX-512, 16 with AVX2.
constexpr int64_t kMaxFewRows = kVS == 16 ? 8 : 4;
// Most x rows that take the few-rows path at all, on every ISA (AVX2 in passes of kMaxFewRows): up to
// here a row's sums do not depend on its batchmates, so a speculative verify step of up to 8 rows gives
// each row what a 1-row decode step gives it (greedy speculation stays token-identical).
constexpr int64_t kFewRowsLimit = 8;

// out[r, n] for x rows [0, R) (at a.x) and weight rows [n0, n1). Two accumulators per row break the
// chain of dependent FMAs that one would make.
template <int64_t Q, int R>
void few_rows(const Args& a, const float* x, float* out, int64_t n0, int64_t n1) {
  constexpr int64_t per = weights_of(Q) / kChunk, bb = bytes_of(Q);
  const int64_t nc = a.K / kChunk;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = a.w + n * a.row_bytes;
    Vec acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = Vec(0.f);
    for (int64_t c = 0; c < nc; ++c) {
      Vec w[kVecsPerChunk];
      decode<Q>(row + c / per * bb, c % per, w);
      const float* xb = x + c * kChunk;
      for (int64_t v = 0; v < kVecsPerChunk; ++v)
        for (int r = 0; r < R; ++r)
          acc[r][v & 1] = at::vec::fmadd(w[v], Vec::loadu(xb + r * a.ldx + v * kVS), acc[r][v & 1]);
    }
    const float bias = a.bias != nullptr ? a.bias[n] : 0.f;
    for (int r = 0; r < R; ++r)
      out[r * a.N + n] =
          at::vec::vec_reduce_all<float>([](const Vec& p, const Vec& q) { return p + q; }, acc[r][0] + acc[r][1]) +
          bias;
  }
}

// Weight rows decoded together when x has at most kMaxPairRows rows: one row's FMAs form one
// dependent chain per x row, so at 1-2 rows several weight rows keep the FMA units busy, and each
// block of x is loaded once for all of them.
constexpr int kRowsTogether = kVS == 16 ? 4 : 2;
constexpr int kMaxPairRows = 2;

template <int64_t Q, int R>
void few_rows_together(const Args& a, const float* x, float* out, int64_t n0, int64_t n1) {
  constexpr int64_t per = weights_of(Q) / kChunk, bb = bytes_of(Q);
  const int64_t nc = a.K / kChunk;
  int64_t n = n0;
  for (; n + kRowsTogether <= n1; n += kRowsTogether) {
    Vec acc[kRowsTogether][R][2];  // two per row, in few_rows' order: the same sums, bit for bit
    for (int j = 0; j < kRowsTogether; ++j)
      for (int r = 0; r < R; ++r) acc[j][r][0] = acc[j][r][1] = Vec(0.f);
    for (int64_t c = 0; c < nc; ++c) {
      Vec xs[kVecsPerChunk][R];
      for (int64_t v = 0; v < kVecsPerChunk; ++v)
        for (int r = 0; r < R; ++r) xs[v][r] = Vec::loadu(x + r * a.ldx + c * kChunk + v * kVS);
      for (int j = 0; j < kRowsTogether; ++j) {
        Vec w[kVecsPerChunk];
        decode<Q>(a.w + (n + j) * a.row_bytes + c / per * bb, c % per, w);
        for (int64_t v = 0; v < kVecsPerChunk; ++v)
          for (int r = 0; r < R; ++r) acc[j][r][v & 1] = at::vec::fmadd(w[v], xs[v][r], acc[j][r][v & 1]);
      }
    }
    for (int j = 0; j < kRowsTogether; ++j) {
      const float bias = a.bias != nullptr ? a.bias[n + j] : 0.f;
      for (int r = 0; r < R; ++r)
        out[r * a.N + n + j] =
            at::vec::vec_reduce_all<float>([](const Vec& p, const Vec& q) { return p + q; },
                                           acc[j][r][0] + acc[j][r][1]) +
            bias;
    }
  }
  if (n < n1) few_rows<Q, R>(a, x, out, n, n1);
}

template <int64_t Q, int R = kMaxFewRows>
void few_rows_dispatch(int rows, const Args& a, const float* x, float* out, int64_t n0, int64_t n1) {
  if constexpr (R > 1) {
    if (rows < R) return few_rows_dispatch<Q, R - 1>(rows, a, x, out, n0, n1);
  }
  if constexpr (R <= kMaxPairRows)
    few_rows_together<Q, R>(a, x, out, n0, n1);
  else
    few_rows<Q, R>(a, x, out, n0, n1);
}

}  // namespace radixserve_cpu::blocks
