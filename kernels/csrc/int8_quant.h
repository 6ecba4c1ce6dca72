// x's side of the int8 block product (int8_tiles.h, gguf_int8.cpp, native_step.cpp): each row quantized
// per 32-block to int8 with an fp32 scale (llama.cpp's Q8_0/Q8_1 activations), optionally without its
// outlier channels (radixserve/model/outliers.py), and the run-time check that the VNNI kernels may run.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "block_ints.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define RADIXSERVE_HAVE_VNNI_KERNEL 1
#define VNNI_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma")))
#endif

namespace radixserve_cpu::int8_tiles {

using ints::kBlock;

// x quantized per 32-block: q [M, K] int8, d [M, K/32] fp32, s [M, K/32] int32 (sum of q), ds = d * s
// in fp32 (a minimum's term), and s2 [M, K/16] the halves' sums of q (a split type's offset).
struct QuantX {
  const int8_t* q;
  const float* d;
  const int32_t* s;
  const float* ds;
  const int32_t* s2;
  int64_t K, nb;
};

// One block of x: the scale and round-half-even as torch.round (the reference's) does it.
inline void quantize_block_portable(const float* x, int8_t* q, float* d_out, int32_t* s_out, int32_t* s2) {
  float amax = 0.f;
  for (int64_t j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(x[j]));
  const float d = amax / 127.f;
  const float id = d != 0.f ? 1.f / d : 0.f;
  s2[0] = s2[1] = 0;
  for (int64_t j = 0; j < kBlock; ++j) {
    const auto v = static_cast<int32_t>(std::nearbyint(x[j] * id));
    q[j] = static_cast<int8_t>(v);
    s2[j / 16] += v;
  }
  *d_out = d;
  *s_out = s2[0] + s2[1];
}

#ifdef RADIXSERVE_HAVE_VNNI_KERNEL

VNNI_TARGET inline void quantize_row_vnni(const float* x, int64_t nb, int8_t* q, float* d, int32_t* s, float* ds,
                                   int32_t* s2) {
  const __m512 sign = _mm512_set1_ps(-0.f);
  for (int64_t b = 0; b < nb; ++b) {
    const __m512 v0 = _mm512_loadu_ps(x + b * kBlock), v1 = _mm512_loadu_ps(x + b * kBlock + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, v0), _mm512_andnot_ps(sign, v1)));
    const float db = amax / 127.f;
    const __m512 id = _mm512_set1_ps(db != 0.f ? 1.f / db : 0.f);
    // cvtps_epi32 rounds to nearest even (the default MXCSR mode), as std::nearbyint and torch.round.
    const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, id)), q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, id));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * kBlock), _mm512_cvtepi32_epi8(q0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * kBlock + 16), _mm512_cvtepi32_epi8(q1));
    d[b] = db;
    s2[2 * b] = _mm512_reduce_add_epi32(q0);
    s2[2 * b + 1] = _mm512_reduce_add_epi32(q1);
    s[b] = s2[2 * b] + s2[2 * b + 1];
    ds[b] = db * static_cast<float>(s[b]);
  }
}

inline bool cpu_has_vnni() {
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("avx512vnni");
  }();
  return has;
}

#else
inline bool cpu_has_vnni() { return false; }
#endif

// One row of x quantized (QuantX's arrays at that row: q [K], d, s, ds [nb], s2 [2 nb]).
inline void quantize_row(const float* x, int64_t nb, int8_t* q, float* d, int32_t* s, float* ds, int32_t* s2,
                         bool vnni) {
#ifdef RADIXSERVE_HAVE_VNNI_KERNEL
  if (vnni) return quantize_row_vnni(x, nb, q, d, s, ds, s2);
#endif
  for (int64_t b = 0; b < nb; ++b) {
    quantize_block_portable(x + b * kBlock, q + b * kBlock, d + b, s + b, s2 + 2 * b);
    ds[b] = d[b] * static_cast<float>(s[b]);
  }
}

// One row of x quantized without its outlier channels ch [k] (zeroed in `scratch` [K]), their values
// gathered into xo [k]; quantize_row's arrays as there.
inline void quantize_row_apart(const float* x, int64_t nb, const int64_t* ch, int64_t k, float* scratch, float* xo,
                               int8_t* q, float* d, int32_t* s, float* ds, int32_t* s2, bool vnni) {
  std::copy(x, x + nb * kBlock, scratch);
  for (int64_t j = 0; j < k; ++j) {
    xo[j] = x[ch[j]];
    scratch[ch[j]] = 0.f;
  }
  quantize_row(scratch, nb, q, d, s, ds, s2, vnni);
}

}  // namespace radixserve_cpu::int8_tiles
