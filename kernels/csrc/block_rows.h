// GGUF blocks (Q4_0, Q4_1, Q8_0) decoded in registers and multiplied against a few fp32 rows, one
// thread: the few-row kernel of gguf_linear.cpp (over threads by at::parallel_for) and native_step.cpp
// (over its own thread team). See gguf_linear.cpp for the exactness argument.
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

namespace radixserve_cpu::blocks {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kVS = Vec::size();
constexpr int64_t kBlock = 32;                // weights per block, every supported type
constexpr int64_t kVecsPerBlock = kBlock / kVS;  // 2 with AVX-512, 4 with AVX2 (and the scalar build)
static_assert(kBlock % kVS == 0, "a block must hold whole vectors");

// GGML type ids (gguf.GGMLQuantizationType).
constexpr int64_t kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8;

inline int64_t block_bytes(int64_t qtype) {
  switch (qtype) {
    case kQ4_0: return 18;  // fp16 d, 16 bytes of nibbles
    case kQ4_1: return 20;  // fp16 d, fp16 m, 16 bytes of nibbles
    case kQ8_0: return 34;  // fp16 d, 32 int8
    default: TORCH_CHECK(false, "radixserve_cpu::gguf_linear: unsupported block type ", qtype,
                         " (supported: Q4_0=2, Q4_1=3, Q8_0=8)");
  }
}

inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return c10::detail::fp16_ieee_to_fp32_value(h);
}

// The 32 weights of one block, as in gguf.quants: nibble blocks hold weight j in the low nibble of
// byte j and weight j + 16 in its high nibble.
template <int64_t Q>
inline void decode_scalar(const uint8_t* b, float* w) {
  const float d = half_at(b);
  if constexpr (Q == kQ8_0) {
    for (int64_t j = 0; j < kBlock; ++j) w[j] = static_cast<float>(static_cast<int8_t>(b[2 + j])) * d;
  } else {
    const uint8_t* qs = b + (Q == kQ4_1 ? 4 : 2);
    const float m = Q == kQ4_1 ? half_at(b + 2) : 0.f;
    for (int64_t j = 0; j < kBlock / 2; ++j) {
      if constexpr (Q == kQ4_1) {
        w[j] = static_cast<float>(qs[j] & 0x0F) * d + m;
        w[j + 16] = static_cast<float>(qs[j] >> 4) * d + m;
      } else {
        w[j] = static_cast<float>((qs[j] & 0x0F) - 8) * d;
        w[j + 16] = static_cast<float>((qs[j] >> 4) - 8) * d;
      }
    }
  }
}

// The block's weights in kVecsPerBlock vectors (weights [v * kVS, (v + 1) * kVS) in w[v]).
template <int64_t Q>
inline void decode(const uint8_t* b, Vec* w) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512 d = _mm512_set1_ps(half_at(b));
  if constexpr (Q == kQ8_0) {
    w[0] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(b + 2)))), d);
    w[1] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(b + 18)))), d);
  } else {
    const __m128i qs = _mm_loadu_si128((const __m128i*)(b + (Q == kQ4_1 ? 4 : 2)));
    const __m128i mask = _mm_set1_epi8(0x0F);
    __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(qs, mask)));
    __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(qs, 4), mask)));
    if constexpr (Q == kQ4_1) {
      const __m512 m = _mm512_set1_ps(half_at(b + 2));
      w[0] = _mm512_fmadd_ps(lo, d, m);
      w[1] = _mm512_fmadd_ps(hi, d, m);
    } else {
      const __m512 eight = _mm512_set1_ps(8.f);
      w[0] = _mm512_mul_ps(_mm512_sub_ps(lo, eight), d);
      w[1] = _mm512_mul_ps(_mm512_sub_ps(hi, eight), d);
    }
  }
#elif defined(CPU_CAPABILITY_AVX2)
  const __m256 d = _mm256_set1_ps(half_at(b));
  if constexpr (Q == kQ8_0) {
    for (int v = 0; v < 4; ++v)
      w[v] = _mm256_mul_ps(
          _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(b + 2 + 8 * v)))), d);
  } else {
    const __m128i qs = _mm_loadu_si128((const __m128i*)(b + (Q == kQ4_1 ? 4 : 2)));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(qs, mask), hi = _mm_and_si128(_mm_srli_epi16(qs, 4), mask);
    const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    for (int v = 0; v < 4; ++v) {
      const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[v]));
      if constexpr (Q == kQ4_1)
        w[v] = _mm256_fmadd_ps(q, d, _mm256_set1_ps(half_at(b + 2)));
      else
        w[v] = _mm256_mul_ps(_mm256_sub_ps(q, _mm256_set1_ps(8.f)), d);
    }
  }
#else
  float tmp[kBlock];
  decode_scalar<Q>(b, tmp);
  for (int64_t v = 0; v < kVecsPerBlock; ++v) w[v] = Vec::loadu(tmp + v * kVS);
#endif
}

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

// out[r, n] for x rows [0, R) (at a.x) and weight rows [n0, n1). Two accumulators per row break the
// chain of dependent FMAs that one would make.
template <int64_t Q, int R>
void few_rows(const Args& a, const float* x, float* out, int64_t n0, int64_t n1) {
  const int64_t nb = a.K / kBlock, bb = block_bytes(Q);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = a.w + n * a.row_bytes;
    Vec acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = Vec(0.f);
    for (int64_t b = 0; b < nb; ++b) {
      Vec w[kVecsPerBlock];
      decode<Q>(row + b * bb, w);
      const float* xb = x + b * kBlock;
      for (int64_t v = 0; v < kVecsPerBlock; ++v)
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
  const int64_t nb = a.K / kBlock, bb = block_bytes(Q);
  int64_t n = n0;
  for (; n + kRowsTogether <= n1; n += kRowsTogether) {
    Vec acc[kRowsTogether][R][2];  // two per row, in few_rows' order: the same sums, bit for bit
    for (int j = 0; j < kRowsTogether; ++j)
      for (int r = 0; r < R; ++r) acc[j][r][0] = acc[j][r][1] = Vec(0.f);
    for (int64_t b = 0; b < nb; ++b) {
      Vec xs[kVecsPerBlock][R];
      for (int64_t v = 0; v < kVecsPerBlock; ++v)
        for (int r = 0; r < R; ++r) xs[v][r] = Vec::loadu(x + r * a.ldx + b * kBlock + v * kVS);
      for (int j = 0; j < kRowsTogether; ++j) {
        Vec w[kVecsPerBlock];
        decode<Q>(a.w + (n + j) * a.row_bytes + b * bb, w);
        for (int64_t v = 0; v < kVecsPerBlock; ++v)
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
