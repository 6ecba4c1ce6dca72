// Shared pieces of the CPU attention kernels (attention.cpp, decode_kernel.cpp, gemm_kernel.cpp):
// the context of one call, page addressing, K/V loads of each KV dtype, output slots, the online
// softmax step.
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "radixserve_cpu.h"

namespace radixserve_cpu::detail {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kVS = Vec::size();
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int64_t kMaxHeadDim = 256;
constexpr int64_t kVecRows = 8;    // the vector path's most query rows per kv head (tokens x group)
constexpr int64_t kVecBlock = 64;  // context tokens per online-softmax step of the vector path

// How K/V pages are stored (radixserve/kernels/kv_dtype.py): every kernel reads them as fp32 and
// accumulates in fp32. int8 rows are dequantized by one scale per (token, kv head).
enum class KvType { kFloat, kBFloat16, kInt8 };

struct Ctx {
  const float* q;
  int64_t q_stride;  // q[r, head, d] = q[r * q_stride + head * head_dim + d]
  const void* k;     // float, c10::BFloat16 or int8_t, as kv_type says
  const void* v;
  const float* k_scale;  // int8 only: [num_pages, page_size, kv_heads]; the scale of the K/V row at
  const float* v_scale;  // element offset `off` is at `off / head_dim` (see token_offsets)
  KvType kv_type;
  int64_t num_pages, page_size, kv_heads, head_dim, group, q_heads;
  const int32_t* table;
  int64_t table_stride, table_cols;
  const int32_t* rows;  // [R, kRowCols]
  float scale;
  float* out;       // [T, q_heads, head_dim]
  float* lse;       // [T, q_heads]
  float* part_out;  // [P, q_heads, head_dim]
  float* part_lse;  // [P, q_heads]
  bool bf16_dot = false;  // GEMM items over bf16 K/V in bf16 arithmetic (gemm_bf16.cpp)
};

// Element offsets of context tokens [t0, t0 + n) of segment seg, kv head h, inside a layer's cache:
// one page-table lookup per page, no division per token.
inline void token_offsets(const Ctx& c, int64_t seg, int64_t t0, int64_t n, int64_t h, int64_t* off) {
  int64_t col = t0 / c.page_size, in = t0 % c.page_size;
  const int32_t* pages = c.table + seg * c.table_stride;
  const int64_t row = c.kv_heads * c.head_dim;
  int64_t base = 0;
  for (int64_t j = 0; j < n; ++j, ++in) {
    if (j == 0 || in == c.page_size) {
      if (in == c.page_size) {
        ++col;
        in = 0;
      }
      TORCH_CHECK(col < c.table_cols, "radixserve_cpu: token ", t0 + j, " lies past the page table's width");
      const int64_t page = pages[col];
      TORCH_CHECK(page >= 0 && page < c.num_pages, "radixserve_cpu: page ", page, " not in [0, ", c.num_pages,
                  ")");
      base = page * c.page_size * row + h * c.head_dim;
    }
    off[j] = base + in * row;
  }
}

// head_dim values of one K/V row from `p`, as fp32 (kVS of them).
template <typename T>
inline Vec load_kv(const T* p);

template <>
inline Vec load_kv<float>(const float* p) {
  return Vec::loadu(p);
}

// bf16 -> fp32 is the bf16 bits in the high half of a 32-bit word: no bf16 instructions needed.
template <>
inline Vec load_kv<c10::BFloat16>(const c10::BFloat16* p) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return Vec(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16)));
#elif defined(CPU_CAPABILITY_AVX2)
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return Vec(_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16)));
#else
  float tmp[kVS];
  for (int64_t i = 0; i < kVS; ++i) tmp[i] = static_cast<float>(p[i]);
  return Vec::loadu(tmp);
#endif
}

template <>
inline Vec load_kv<int8_t>(const int8_t* p) {
#if defined(CPU_CAPABILITY_AVX512)
  return Vec(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))));
#elif defined(CPU_CAPABILITY_AVX2)
  return Vec(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))));
#else
  float tmp[kVS];
  for (int64_t i = 0; i < kVS; ++i) tmp[i] = static_cast<float>(p[i]);
  return Vec::loadu(tmp);
#endif
}

// bf16 rows in pair order. A widening load (16-bit lanes to 32-bit, a cross-lane shuffle) per vector
// cost more than the bytes bf16 saves (issue 31: whole decode steps at 0.90x fp32 K/V on an EPYC).
// Instead 2 * kVS bf16 values are loaded as kVS 32-bit words, each holding an (even, odd) pair of
// elements; the even elements are the words shifted up 16 bits, the odd ones the words with their
// low 16 bits cleared: exact fp32 values, two plain integer ops, no shuffle. The vectors hold the
// row's elements in "pair order" (per chunk of 2 * kVS: the even ones, then the odd ones), so the
// kernel keeps q and its accumulators in that order too (to_pair_order, from_pair_order): a dot
// product only sums in another order, and P V updates each element where it lies.
template <typename T, int NV>
constexpr bool kPairOrder = std::is_same_v<T, c10::BFloat16> && NV % 2 == 0;

// Vector v (of a row's NV) in the kernel's order: pair order where kPairOrder, else as stored.
template <int NV, typename T>
inline Vec row_vec(const T* row, int64_t v) {
  if constexpr (kPairOrder<T, NV>) {
    const T* base = row + (v >> 1) * 2 * kVS;
#if defined(CPU_CAPABILITY_AVX512)
    const __m512i raw = _mm512_loadu_si512(reinterpret_cast<const void*>(base));
    return Vec(_mm512_castsi512_ps((v & 1) ? _mm512_and_si512(raw, _mm512_set1_epi32(int32_t(0xFFFF0000u)))
                                           : _mm512_slli_epi32(raw, 16)));
#elif defined(CPU_CAPABILITY_AVX2)
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(base));
    return Vec(_mm256_castsi256_ps((v & 1) ? _mm256_and_si256(raw, _mm256_set1_epi32(int32_t(0xFFFF0000u)))
                                           : _mm256_slli_epi32(raw, 16)));
#else
    float tmp[kVS];
    for (int64_t i = 0; i < kVS; ++i) tmp[i] = static_cast<float>(base[2 * i + (v & 1)]);
    return Vec::loadu(tmp);
#endif
  } else {
    return load_kv(row + v * kVS);
  }
}

// Where element e of a row lies in pair order.
inline int64_t pair_slot(int64_t e) {
  const int64_t chunk = e / (2 * kVS), r = e % (2 * kVS);
  return chunk * 2 * kVS + (r & 1) * kVS + r / 2;
}

// x[0, dim) from natural to pair order (to_pair) or back, in place.
inline void reorder_pairs(float* x, int64_t dim, bool to_pair) {
  float tmp[kMaxHeadDim];
  std::copy(x, x + dim, tmp);
  for (int64_t e = 0; e < dim; ++e) {
    if (to_pair) {
      x[pair_slot(e)] = tmp[e];
    } else {
      x[e] = tmp[pair_slot(e)];
    }
  }
}

struct Dest {
  float* out;
  float* lse;
};

// Where row i (a query token of the item) writes head `head`: the output, or its partial slot.
inline Dest dest(const Ctx& c, const int32_t* item, int64_t i, int64_t head) {
  const int64_t partial = item[kPartial];
  if (partial < 0) {
    const int64_t r = c.rows[(item[kRowBegin] + i) * kRowCols + kQRow];
    return {c.out + (r * c.q_heads + head) * c.head_dim, c.lse + r * c.q_heads + head};
  }
  const int64_t slot = partial + i;
  return {c.part_out + (slot * c.q_heads + head) * c.head_dim, c.part_lse + slot * c.q_heads + head};
}

// Normalises an accumulated row and writes it with its log-sum-exp; a row that saw no token
// (padding, or a context chunk wholly past its causal limit) is zeros with lse -inf.
inline void finish_row(const float* acc, float mx, float l, int64_t dim, Dest d) {
  if (l == 0.f) {
    std::fill(d.out, d.out + dim, 0.f);
    *d.lse = kNegInf;
    return;
  }
  const Vec inv(1.f / l);
  for (int64_t x = 0; x < dim; x += kVS) (Vec::loadu(acc + x) * inv).store(d.out + x);
  *d.lse = mx + std::log(l);
}

// One online-softmax step of a row over block scores s[0, n): entries from `valid` on are masked.
// Turns s into probabilities (relative to the new running max), updates max and sum, and returns
// the factor the row's accumulator must be rescaled by.
inline float softmax_step(float* s, int64_t n, int64_t valid, float& mx, float& l) {
  valid = std::clamp<int64_t>(valid, 0, n);
  if (valid > 0) {
    const float block_max = at::vec::reduce_all<float>(
        [](const Vec& a, const Vec& b) { return at::vec::maximum(a, b); }, s, valid);
    const float new_max = std::max(mx, block_max);
    if (new_max != kNegInf) {  // always true for finite scores; kept for safety
      const Vec vmax(new_max);
      Vec vsum(0.f);
      int64_t j = 0;
      for (; j + kVS <= valid; j += kVS) {
        const Vec p = (Vec::loadu(s + j) - vmax).exp_u20();
        p.store(s + j);
        vsum = vsum + p;
      }
      if (j < valid) {
        const int64_t rest = valid - j;
        const Vec p = Vec::set(Vec(0.f), (Vec::loadu(s + j, rest) - vmax).exp_u20(), rest);
        p.store(s + j, rest);
        vsum = vsum + p;
      }
      std::fill(s + valid, s + n, 0.f);
      const float corr = mx == kNegInf ? 0.f : std::exp(mx - new_max);
      l = l * corr + at::vec::vec_reduce_all<float>([](const Vec& a, const Vec& b) { return a + b; }, vsum);
      mx = new_max;
      return corr;
    }
  }
  std::fill(s, s + n, 0.f);
  return 1.f;
}

// softmax_step for M rows of block scores (row m at s + m * lds, its causal limit lim[m] as a float,
// the block starting at context token t0), each row's accumulator (o + m * D) rescaled where needed.
inline void softmax_rows(float* s, int64_t lds, int64_t M, int64_t n, const float* lim, int64_t t0, float* mx,
                         float* l, float* o, int64_t D) {
  for (int64_t m = 0; m < M; ++m) {
    const float corr = softmax_step(s + m * lds, n, static_cast<int64_t>(lim[m]) - t0, mx[m], l[m]);
    if (corr != 1.f) {
      const Vec vc(corr);
      for (int64_t x = 0; x < D; x += kVS) (Vec::loadu(o + m * D + x) * vc).store(o + m * D + x);
    }
  }
}

// Thread-local scratch of at least n floats, grown on demand and kept between calls.
float* scratch(int64_t n);

// The vector path for this head_dim (kv heads [h0, h1) of an item), or nullptr where none is built.
using VecKernel = void (*)(const Ctx&, const int32_t* item, int64_t h0, int64_t h1);
VecKernel vec_kernel(int64_t head_dim, KvType kv_type);

// The GEMM path: kv head h of an item, any number of query rows.
void attend_gemm(const Ctx& c, const int32_t* item, int64_t h);
// The same in bf16 arithmetic (gemm_bf16.cpp): bf16 K/V, only where dense::cpu_has_bf16_dot().
void attend_gemm_bf16(const Ctx& c, const int32_t* item, int64_t h);

}  // namespace radixserve_cpu::detail
