// Few dense rows against a band of weight rows, one thread: the register tile of the few-row fp32 and
// bf16 products (gemv.cpp, over threads by at::parallel_for; native_step.cpp, over its own thread team).
//
// out(m, n) = sum_k x[m, k] * w[n, k] for M <= 8 activation rows and weight rows [n0, n1): each weight
// row is loaded once for all M rows, the tile of R weight rows x M rows of accumulators sized by M to
// the register file. The summation order of an output depends on neither M nor its batchmates.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

namespace radixserve_cpu::dense {

// ---- fp32 vectors of this build --------------------------------------------------------------------
#if defined(CPU_CAPABILITY_AVX512)
using FVec = __m512;
constexpr int64_t kW = 16;
constexpr int kRegs = 32;
inline FVec fzero() { return _mm512_setzero_ps(); }
inline FVec fload(const float* p) { return _mm512_loadu_ps(p); }
inline FVec fmadd(FVec a, FVec b, FVec c) { return _mm512_fmadd_ps(a, b, c); }
inline float fsum(FVec v) { return _mm512_reduce_add_ps(v); }
inline FVec bf16_load(const uint16_t* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
#elif defined(CPU_CAPABILITY_AVX2)
using FVec = __m256;
constexpr int64_t kW = 8;
constexpr int kRegs = 16;
inline FVec fzero() { return _mm256_setzero_ps(); }
inline FVec fload(const float* p) { return _mm256_loadu_ps(p); }
inline FVec fmadd(FVec a, FVec b, FVec c) { return _mm256_fmadd_ps(a, b, c); }
inline float fsum(FVec v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}
inline FVec bf16_load(const uint16_t* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
#else
using FVec = float;
constexpr int64_t kW = 1;
constexpr int kRegs = 16;
inline FVec fzero() { return 0.f; }
inline FVec fload(const float* p) { return *p; }
inline FVec fmadd(FVec a, FVec b, FVec c) { return a * b + c; }
inline float fsum(FVec v) { return v; }
inline FVec bf16_load(const uint16_t* p) {
  const uint32_t bits = static_cast<uint32_t>(*p) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
#endif

inline FVec wload(const float* p) { return fload(p); }
inline FVec wload(const uint16_t* p) { return bf16_load(p); }

// Weight rows a tile takes: as many as keep R x M accumulators, R weight vectors and one x vector in
// the register file (R (M + 1) < kRegs), at most 8, so at 1-2 rows there are 8 independent FMA chains
// and at 8 rows each x vector is used 3 times per load (a tile of 2 left the 8-row product load-bound).
constexpr int tile_rows(int M) { return std::min(8, std::max(1, (kRegs - 1) / (M + 1))); }

inline int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

// Output rows [n0, n1) of an fp32-accumulating product; xp holds M rows of Kp (a multiple of kW) floats,
// zero beyond K. TW is float or uint16_t (bf16 bits); out(m, n, sum) stores one result.
template <int M, typename TW, typename Store>
void dot_rows(const float* xp, int64_t Kp, const TW* w, int64_t K, int64_t n0, int64_t n1, Store store) {
  constexpr int R = tile_rows(M);
  const int64_t full = K / kW * kW;
  alignas(64) TW tail[R][kW];
  for (int64_t n = n0; n < n1; n += R) {
    const int rows = static_cast<int>(std::min<int64_t>(R, n1 - n));
    const TW* wr[R];
    for (int r = 0; r < R; ++r) wr[r] = w + (n + std::min(r, rows - 1)) * K;  // a short tile repeats its last row
    FVec acc[M][R];
    for (int m = 0; m < M; ++m)
      for (int r = 0; r < R; ++r) acc[m][r] = fzero();
    for (int64_t k = 0; k < full; k += kW) {
      FVec wv[R];
      for (int r = 0; r < R; ++r) wv[r] = wload(wr[r] + k);
      for (int m = 0; m < M; ++m) {
        const FVec xv = fload(xp + m * Kp + k);
        for (int r = 0; r < R; ++r) acc[m][r] = fmadd(wv[r], xv, acc[m][r]);
      }
    }
    if (full < K) {
      FVec wv[R];
      for (int r = 0; r < R; ++r) {
        std::memset(tail[r], 0, sizeof tail[r]);
        std::memcpy(tail[r], wr[r] + full, (K - full) * sizeof(TW));
        wv[r] = wload(tail[r]);
      }
      for (int m = 0; m < M; ++m) {
        const FVec xv = fload(xp + m * Kp + full);
        for (int r = 0; r < R; ++r) acc[m][r] = fmadd(wv[r], xv, acc[m][r]);
      }
    }
    for (int m = 0; m < M; ++m)
      for (int r = 0; r < rows; ++r) store(m, n + r, fsum(acc[m][r]));
  }
}

}  // namespace radixserve_cpu::dense
