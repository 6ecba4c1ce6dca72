// Few dense rows against a band of weight rows, one thread: the register tile of the few-row fp32 and
// bf16 products (gemv.cpp, over threads by at::parallel_for; native_step.cpp, over its own thread team).
//
// out(m, n) = sum_k x[m, k] * w[n, k] for M <= 8 activation rows and weight rows [n0, n1): each weight
// row is loaded once for all M rows, the tile of R weight rows x M rows of accumulators sized by M to
// the register file. The summation order of an output depends on neither M nor its batchmates.
//
// bf16 weights (TW = uint16_t) read half the bytes, so their widening to fp32 must cost less than the
// load it saves. On AVX-512 a load takes 32 words and widens them with no shuffle: a 32-bit lane holds
// the words k (low half) and k + 1 (high half), so `lane << 16` is weight k as fp32 and
// `lane & 0xffff0000` is weight k + 1, both exact. x is laid out to match once per call (bf16_x_layout:
// each block of 32 columns as its 16 even then its 16 odd columns). Against the fp32 tile's way (a
// zero-extending, cross-lane vpmovzxwd per 16 weights) this ran the 1B layer's bf16 products 1.05-1.3x
// faster at 1 and 8 rows on a Zen 4 EPYC (benchmarks/results/bf16_rows.md).
//
// bf16 weights times bf16 activations (the native step's bf16 mode, native_step.cpp): AVX512_BF16's
// vdpbf16ps multiplies a lane's (even, odd) word pair of x and of the weight, both exact in fp32, and
// adds them into the lane's fp32 sum: one instruction for the 32 columns the widening tile spends two
// FMAs and a shift or mask on. The weight's natural word order is already the pairs, and x is its row
// rounded to bf16 in the same order. The build targets plain AVX-512, so this tile is compiled for
// avx512bf16 on its own and runs only where the CPU reports it (cpu_has_bf16_dot, at run time).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

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

// f(std::integral_constant<int, M>{}) for a row count M in [1, 8] (the caller checks the range; more
// runs as 8): the one switch that turns a step's row count into the tiles' template argument.
template <typename F>
decltype(auto) with_rows(int64_t M, F&& f) {
  switch (M) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 3: return f(std::integral_constant<int, 3>{});
    case 4: return f(std::integral_constant<int, 4>{});
    case 5: return f(std::integral_constant<int, 5>{});
    case 6: return f(std::integral_constant<int, 6>{});
    case 7: return f(std::integral_constant<int, 7>{});
    default: return f(std::integral_constant<int, 8>{});
  }
}

// ---- bf16 weights -----------------------------------------------------------------------------------
#if defined(CPU_CAPABILITY_AVX512)
constexpr int64_t kBW = 32;  // bf16 columns a load: one 64-byte line, two fp32 vectors
// A tile of R rows keeps R x M accumulators and 2R widened weight vectors (R (M + 2) < kRegs).
constexpr int bf16_tile_rows(int M) { return std::min(8, std::max(1, (kRegs - 1) / (M + 2))); }
#else
constexpr int64_t kBW = kW;
constexpr int bf16_tile_rows(int M) { return tile_rows(M); }
#endif

// Weight rows a tile of M activation rows takes, by weight element type.
template <typename TW>
constexpr int rows_per_tile(int M) {
  return std::is_same_v<TW, uint16_t> ? bf16_tile_rows(M) : tile_rows(M);
}

// The padded width (columns) of an x row for weights of element type TW.
template <typename TW>
inline int64_t x_cols(int64_t K) {
  return round_up(K, std::is_same_v<TW, uint16_t> ? kBW : kW);
}

// One x row of K floats into the layout dot_rows<M, TW> reads, x_cols<TW>(K) floats, zero beyond K: a
// plain copy, except for bf16 weights on AVX-512, where each 32-column block is its 16 even columns
// then its 16 odd ones (the order the widened weight vectors come in).
template <typename TW>
inline void x_layout(const float* x, int64_t K, float* out) {
  const int64_t Kp = x_cols<TW>(K);
  if (!std::is_same_v<TW, uint16_t> || kBW == kW) {
    std::memcpy(out, x, K * sizeof(float));
    std::fill(out + K, out + Kp, 0.f);
    return;
  }
  for (int64_t b = 0; b < Kp; b += kBW)
    for (int64_t j = 0; j < kBW / 2; ++j) {
      const int64_t even = b + 2 * j, odd = even + 1;
      out[b + j] = even < K ? x[even] : 0.f;
      out[b + kBW / 2 + j] = odd < K ? x[odd] : 0.f;
    }
}

#if defined(CPU_CAPABILITY_AVX512)
// Output rows [n0, n1) for bf16 weights; xp holds M rows of Kp = x_cols<uint16_t>(K) floats in
// x_layout's order. Output (m, n) sums lane j over the columns 32 b + 2 j and 32 b + 2 j + 1 in order
// of b, then the lanes in a fixed tree: independent of M and of the batchmates.
template <int M, typename Store>
void bf16_dot_rows(const float* xp, int64_t Kp, const uint16_t* w, int64_t K, int64_t n0, int64_t n1,
                   Store store) {
  constexpr int R = bf16_tile_rows(M);
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  for (int64_t n = n0; n < n1; n += R) {
    const int rows = static_cast<int>(std::min<int64_t>(R, n1 - n));
    const uint16_t* wr[R];
    for (int r = 0; r < R; ++r) wr[r] = w + (n + std::min(r, rows - 1)) * K;  // a short tile repeats its last row
    FVec acc[M][R];
    for (int m = 0; m < M; ++m)
      for (int r = 0; r < R; ++r) acc[m][r] = fzero();
    // The next tile's rows are fetched into L2 as this tile's are read, a line for a line: a tile of
    // 3 rows (8 activation rows) is too few streams for the hardware prefetchers to keep up with.
    const char* next = reinterpret_cast<const char*>(w + (n + R) * K);
    const bool fetch = n + R < n1;
    // One block of 32 columns: its words widened, times the x block, into the accumulators.
    auto block = [&](int64_t k, auto load) {
      FVec even[R], odd[R];
      if (fetch)
        for (int r = 0; r < R; ++r) _mm_prefetch(next + (r * K + k) * 2, _MM_HINT_T1);
      for (int r = 0; r < R; ++r) {
        const __m512i words = load(wr[r] + k);
        even[r] = _mm512_castsi512_ps(_mm512_slli_epi32(words, 16));
        odd[r] = _mm512_castsi512_ps(_mm512_and_si512(words, high));
      }
      for (int m = 0; m < M; ++m) {
        const FVec xe = fload(xp + m * Kp + k), xo = fload(xp + m * Kp + k + kBW / 2);
        for (int r = 0; r < R; ++r) acc[m][r] = fmadd(odd[r], xo, fmadd(even[r], xe, acc[m][r]));
      }
    };
    const int64_t full = K / kBW * kBW;
    for (int64_t k = 0; k < full; k += kBW) block(k, [](const uint16_t* p) { return _mm512_loadu_si512(p); });
    if (full < K) {
      // a masked load reads nothing past a row's end (zeros there, against x's zero padding)
      const __mmask32 mask = (__mmask32(1) << (K - full)) - 1;
      block(full, [mask](const uint16_t* p) { return _mm512_maskz_loadu_epi16(mask, p); });
    }
    for (int m = 0; m < M; ++m)
      for (int r = 0; r < rows; ++r) store(m, n + r, fsum(acc[m][r]));
  }
}
#endif

// Output rows [n0, n1) of an fp32-accumulating product; xp holds M rows of Kp = x_cols<TW>(K) floats
// laid out by x_layout<TW>. TW is float or uint16_t (bf16 bits); out(m, n, sum) stores one result.
template <int M, typename TW, typename Store>
void dot_rows(const float* xp, int64_t Kp, const TW* w, int64_t K, int64_t n0, int64_t n1, Store store) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<TW, uint16_t>) return bf16_dot_rows<M>(xp, Kp, w, K, n0, n1, store);
#endif
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

// ---- bf16 weights x bf16 activations (vdpbf16ps) ------------------------------------------------------
#if defined(CPU_CAPABILITY_AVX512)
#define RADIXSERVE_BF16_DOT __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")))

// Whether this CPU runs vdpbf16ps (AVX512_BF16): checked once, at run time.
inline bool cpu_has_bf16_dot() {
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512bf16");
  }();
  return has;
}

inline __mmask16 first_lanes(int64_t n) {
  return n <= 0 ? __mmask16(0) : (n >= 16 ? __mmask16(0xffff) : __mmask16((1u << n) - 1));
}

// M rows of K floats (ld apart) rounded to bf16, nearest even (torch's .to(torch.bfloat16)), into rows
// of Kp = round_up(K, kBW) words, zeros past K. Only where cpu_has_bf16_dot().
RADIXSERVE_BF16_DOT inline void bf16_rows(const float* x, int64_t ld, int M, int64_t K, uint16_t* out,
                                          int64_t Kp) {
  for (int m = 0; m < M; ++m)
    for (int64_t k = 0; k < Kp; k += kBW) {
      const __m512 lo = _mm512_maskz_loadu_ps(first_lanes(K - k), x + m * ld + k);
      const __m512 hi = _mm512_maskz_loadu_ps(first_lanes(K - k - 16), x + m * ld + k + 16);
      _mm512_storeu_si512(out + m * Kp + k, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
}

// Output rows [n0, n1) of bf16 weights [N, K] against M rows of bf16 x (bf16_rows, Kp words apart).
// Output (m, n) sums lane j's pair products over the 32-column blocks in order, then the lanes in a
// fixed tree: independent of M and of the batchmates. Only where cpu_has_bf16_dot().
template <int M, typename Store>
RADIXSERVE_BF16_DOT void bf16_dot_rows_dp(const uint16_t* xb, int64_t Kp, const uint16_t* w, int64_t K,
                                          int64_t n0, int64_t n1, Store store) {
  constexpr int R = tile_rows(M);  // R weight vectors, R x M sums and one x vector in the 32 registers
  const int64_t full = K / kBW * kBW;
  const __mmask32 tail = full < K ? (__mmask32(1) << (K - full)) - 1 : __mmask32(0);
  for (int64_t n = n0; n < n1; n += R) {
    const int rows = static_cast<int>(std::min<int64_t>(R, n1 - n));
    const uint16_t* wr[R];
    for (int r = 0; r < R; ++r) wr[r] = w + (n + std::min(r, rows - 1)) * K;  // a short tile repeats its last row
    __m512 acc[M][R];
    for (int m = 0; m < M; ++m)
      for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
    // The next tile's rows into L2 as this tile's are read, a line for a line (as bf16_dot_rows).
    const char* next = reinterpret_cast<const char*>(w + (n + R) * K);
    const bool fetch = n + R < n1;
    for (int64_t k = 0; k < Kp; k += kBW) {
      __m512i wv[R];
      if (fetch)
        for (int r = 0; r < R; ++r) _mm_prefetch(next + (r * K + k) * 2, _MM_HINT_T1);
      if (k < full) {
        for (int r = 0; r < R; ++r) wv[r] = _mm512_loadu_si512(wr[r] + k);
      } else {  // a masked load reads nothing past a row's end
        for (int r = 0; r < R; ++r) wv[r] = _mm512_maskz_loadu_epi16(tail, wr[r] + k);
      }
      for (int m = 0; m < M; ++m) {
        const __m512bh xv = (__m512bh)_mm512_loadu_si512(xb + m * Kp + k);
        for (int r = 0; r < R; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], xv, (__m512bh)wv[r]);
      }
    }
    for (int m = 0; m < M; ++m)
      for (int r = 0; r < rows; ++r) store(m, n + r, _mm512_reduce_add_ps(acc[m][r]));
  }
}
#else
inline bool cpu_has_bf16_dot() { return false; }
#endif

}  // namespace radixserve_cpu::dense
