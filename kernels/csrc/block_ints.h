// The integer form of GGUF blocks, for the int8 block kernel (gguf_int8.cpp): which types have one,
// and each chunk of 32 weights as  w = d_w * k_h * (u - offset) + m_w, with u unsigned bytes (the
// vpdpbusd operand), d_w and m_w exact fp32, and k_h an integer scale per half for the "split" types
// (Q2_K, Q3_K, Q6_K); Q2_K's m_w is per half too (m_h). Its torch twin is
// radixserve/model/gguf_blocks.py's chunk_integers; the layouts are block_decode.h's.
//
// - u: a nibble (Q4_0, Q4_1, Q4_K), 5 bits (Q5_0, Q5_1, Q5_K), 6 bits (Q6_K), 3 bits (Q3_K), 2 bits
//   (Q2_K), the int8 + 128 (Q8_0), IQ4_NL's level + 128; offset 8, 16, 32, 4, 128 where the values
//   are signed.
// - d_w: the fp16 scale, times a k-quant's 6-bit sub-block scale for Q4_K/Q5_K (exact in fp32); m_w:
//   Q4_1's and Q5_1's fp16 min, Q4_K's and Q5_K's -dmin * min (exact); Q2_K's -dmin * min of each 16
//   weights (m_h, exact).
// - k_h (split types): Q6_K's int8 scale of each 16 weights, Q3_K's 6-bit scale - 32, Q2_K's 4-bit
//   scale. Folding it into the integers rounds as gguf's (d * k_h) * (u - offset) does: d * k_h is
//   exact, so both are one rounding of the same product (only a zero weight's sign can differ).
#pragma once

#include <c10/util/Exception.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "block_decode.h"

namespace radixserve_cpu::ints {

using blocks::half_at;
using blocks::kIQ4_NL;
using blocks::kQ2_K;
using blocks::kQ3_K;
using blocks::kQ4_0;
using blocks::kQ4_1;
using blocks::kQ4_K;
using blocks::kQ5_0;
using blocks::kQ5_1;
using blocks::kQ5_K;
using blocks::kQ6_K;
using blocks::kQ8_0;

constexpr int64_t kBlock = blocks::kChunk;  // weights per chunk (a legacy block, an eighth of a k-quant one)

#define RADIXSERVE_INT8_TYPES \
  "Q4_0=2, Q4_1=3, Q5_0=6, Q5_1=7, Q8_0=8, Q2_K=10, Q3_K=11, Q4_K=12, Q5_K=13, Q6_K=14, IQ4_NL=20"

constexpr bool takes(int64_t qtype) {
  switch (qtype) {
    case kQ4_0: case kQ4_1: case kQ5_0: case kQ5_1: case kQ8_0: case kQ2_K: case kQ3_K: case kQ4_K: case kQ5_K:
    case kQ6_K: case kIQ4_NL: return true;
    default: return false;
  }
}

// What a type's unsigned byte values u stand for: weight = d_w * (u - offset) + m_w.
constexpr int32_t weight_offset(int64_t q) {
  return q == kQ4_0 ? 8 : q == kQ5_0 ? 16 : q == kQ6_K ? 32 : q == kQ3_K ? 4 : (q == kQ8_0 || q == kIQ4_NL) ? 128 : 0;
}
constexpr bool has_min(int64_t q) { return q == kQ4_1 || q == kQ5_1 || q == kQ4_K || q == kQ5_K; }
// An integer scale per 16 weights (two per chunk): the halves' integer sums are scaled apart.
constexpr bool split(int64_t q) { return q == kQ2_K || q == kQ3_K || q == kQ6_K; }
// A minimum per 16 weights (Q2_K): each half's minimum times that half's sum of x.
constexpr bool half_min(int64_t q) { return q == kQ2_K; }

// Chunk c of the block at b (weights [32 c, 32 c + 32)) as its 32 unsigned values u in K order, its
// scale d_w, minimum mw[0] (0 for a type without one; a half_min type's halves' mw[0], mw[1]) and, for
// a split type, its halves' integer scales k[0], k[1]. The layouts are block_decode.h's.
template <int64_t Q>
void chunk_values(const uint8_t* b, int64_t c, uint8_t* u, float& dw, float* mw, int32_t* k) {
  mw[0] = 0.f;
  if constexpr (Q == kQ2_K) {
    // Half h: w = (d * sc_h) * q - dmin * m_h, q 2 bits; d * sc_h and dmin * m_h are exact, so
    // d * (sc_h * q) + (-(dmin * m_h)) rounds as gguf's dequantization does.
    const uint8_t* qs = b + 16 + (c / 4) * 32;
    const int shift = static_cast<int>(c % 4) * 2;
    dw = half_at(b + 80);
    const float dmin = half_at(b + 82);
    for (int h = 0; h < 2; ++h) {
      const uint8_t s = b[2 * c + h];
      k[h] = s & 0x0F;
      mw[h] = -(dmin * static_cast<float>(s >> 4));
    }
    for (int64_t j = 0; j < kBlock; ++j) u[j] = static_cast<uint8_t>((qs[j] >> shift) & 3);
  } else if constexpr (Q == kQ6_K) {
    // w = (d * scale_h) * (q - 32): d * scale_h is exact, so d * (scale_h * (q - 32)) rounds the same.
    const blocks::Q6KChunk ch(b, c);
    dw = ch.d;
    k[0] = ch.scales[0];
    k[1] = ch.scales[1];
    for (int64_t j = 0; j < kBlock; ++j)
      u[j] = static_cast<uint8_t>(((ch.ql[j] >> ch.sl) & 0x0F) | (((ch.qh[j] >> ch.sh) & 3) << 4));
  } else if constexpr (Q == kQ3_K) {
    // w = (d * (scale_h - 32)) * q, q = 2 bits minus 4 where the high bit is clear: u = q + 4.
    const uint8_t* qs = b + 32 + (c / 4) * 32;
    const uint8_t* s = b + 96;
    const int shift = static_cast<int>(c % 4) * 2;
    dw = half_at(b + 108);
    for (int h = 0; h < 2; ++h) {
      const int64_t i = 2 * c + h;
      const int lo = i < 8 ? (s[i] & 0x0F) : (s[i - 8] >> 4), hi = (s[8 + i % 4] >> (2 * (i / 4))) & 3;
      k[h] = static_cast<int8_t>(lo | (hi << 4)) - 32;
    }
    for (int64_t j = 0; j < kBlock; ++j)
      u[j] = static_cast<uint8_t>(((qs[j] >> shift) & 3) + (((b[j] >> c) & 1) ? 4 : 0));
  } else if constexpr (Q == kQ8_0) {
    dw = half_at(b);
    for (int64_t j = 0; j < kBlock; ++j) u[j] = b[2 + j] ^ 0x80;  // int8 + 128
  } else if constexpr (Q == kQ4_K || Q == kQ5_K) {
    // Sub-block c: w = (d * sc) * q - dmin * mn, both products exact in fp32.
    int sc, mn;
    blocks::k_scale_min(b + 4, c, sc, mn);
    dw = half_at(b) * static_cast<float>(sc);
    mw[0] = -(half_at(b + 2) * static_cast<float>(mn));
    const uint8_t* qs = b + (Q == kQ5_K ? 48 : 16) + (c / 2) * 32;
    const int shift = static_cast<int>(c % 2) * 4;
    for (int64_t j = 0; j < kBlock; ++j) {
      int q = (qs[j] >> shift) & 0x0F;
      if constexpr (Q == kQ5_K) q |= ((b[16 + j] >> c) & 1) << 4;
      u[j] = static_cast<uint8_t>(q);
    }
  } else {
    // A legacy block: weight j is byte j's low nibble, weight j + 16 its high one (Q5_0/Q5_1: with
    // bit j of a little-endian uint32 as the fifth bit).
    constexpr bool five = Q == kQ5_0 || Q == kQ5_1;
    dw = half_at(b);
    if constexpr (has_min(Q)) mw[0] = half_at(b + 2);
    uint32_t qh = 0;
    if constexpr (five) std::memcpy(&qh, b + (Q == kQ5_1 ? 4 : 2), 4);
    const uint8_t* qs = b + (Q == kQ4_1 ? 4 : Q == kQ5_0 ? 6 : Q == kQ5_1 ? 8 : 2);
    for (int64_t j = 0; j < kBlock / 2; ++j) {
      int lo = qs[j] & 0x0F, hi = qs[j] >> 4;
      if constexpr (five) {
        lo |= static_cast<int>((qh >> j) & 1) << 4;
        hi |= static_cast<int>((qh >> (j + 16)) & 1) << 4;
      }
      if constexpr (Q == kIQ4_NL) {
        lo = blocks::kIQ4NLLevels[lo] + 128;
        hi = blocks::kIQ4NLLevels[hi] + 128;
      }
      u[j] = static_cast<uint8_t>(lo);
      u[j + 16] = static_cast<uint8_t>(hi);
    }
  }
}

}  // namespace radixserve_cpu::ints
