// The vector path of the CPU attention (decode: a few query rows per kv head), reading K/V rows
// where they lie in the pages.
#include <type_traits>

#include "kernel_common.h"

namespace radixserve_cpu::detail {
namespace {

// out[0..3] = the sums of a, b, c and d's lanes. Four dot products reduce together with about half
// the shuffles of four separate horizontal sums (which dominate decode otherwise).
inline void sum4(const Vec& a, const Vec& b, const Vec& c, const Vec& d, float* out) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  // per 128-bit lane: [a, b, c, d] partial sums
  const __m512 abcd = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                                    _mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
  const __m256 half = _mm256_add_ps(_mm512_castps512_ps256(abcd), _mm512_extractf32x8_ps(abcd, 1));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1)));
#elif defined(CPU_CAPABILITY_AVX2)
  const __m256 ab = _mm256_add_ps(_mm256_unpacklo_ps(a, b), _mm256_unpackhi_ps(a, b));
  const __m256 cd = _mm256_add_ps(_mm256_unpacklo_ps(c, d), _mm256_unpackhi_ps(c, d));
  const __m256 abcd = _mm256_add_ps(_mm256_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                                    _mm256_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1)));
#else
  const auto add = [](const Vec& x, const Vec& y) { return x + y; };
  out[0] = at::vec::vec_reduce_all<float>(add, a);
  out[1] = at::vec::vec_reduce_all<float>(add, b);
  out[2] = at::vec::vec_reduce_all<float>(add, c);
  out[3] = at::vec::vec_reduce_all<float>(add, d);
#endif
}

// Requests one K row and one V row of `bytes` into L2.
template <int64_t bytes>
inline void prefetch_row(const void* k, const void* v) {
  for (int64_t b = 0; b < bytes; b += 64) {
    _mm_prefetch(static_cast<const char*>(k) + b, _MM_HINT_T1);
    _mm_prefetch(static_cast<const char*>(v) + b, _MM_HINT_T1);
  }
}

template <int NV, typename T>
inline Vec dot(const float* q, const T* k) {
  Vec acc = Vec::loadu(q) * row_vec<NV>(k, 0);
  for (int64_t v = 1; v < NV; ++v) acc = at::vec::fmadd(Vec::loadu(q + v * kVS), row_vec<NV>(k, v), acc);
  return acc;
}

// acc[r] = acc[r] * corr[r] + sum_j p[r][j] V[j] for R rows at once: R x NV accumulators in
// registers, each V row loaded once for the R rows, and R x NV independent FMA chains (one or two
// chains would leave the loop waiting on FMA latency).
template <int NV, int R, typename T>
inline void pv_rows(float* acc, const float* p, const float* corr, const T* vh, const int64_t* off, int64_t n) {
  constexpr int64_t D = NV * kVS;
  Vec a[R][NV];
  for (int r = 0; r < R; ++r) {
    const Vec c(corr[r]);
    for (int64_t v = 0; v < NV; ++v) a[r][v] = Vec::loadu(acc + r * D + v * kVS) * c;
  }
  for (int64_t j = 0; j < n; ++j) {
    const T* vr = vh + off[j];
    Vec pr[R];
    for (int r = 0; r < R; ++r) pr[r] = Vec(p[r * kVecBlock + j]);
    for (int64_t v = 0; v < NV; ++v) {
      const Vec x = row_vec<NV>(vr, v);
      for (int r = 0; r < R; ++r) a[r][v] = at::vec::fmadd(pr[r], x, a[r][v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int64_t v = 0; v < NV; ++v) a[r][v].store(acc + r * D + v * kVS);
}

// P V for M rows (accumulators acc[M][D], probabilities p[M][kVecBlock]), up to 16 registers of
// accumulators at a time.
template <int NV, typename T>
inline void pv(float* acc, const float* p, const float* corr, int64_t M, const T* vh, const int64_t* off,
               int64_t n) {
  constexpr int64_t D = NV * kVS;
  constexpr int kMaxRows = NV >= 16 ? 1 : (NV >= 8 ? 2 : 4);
  for (int64_t m = 0; m < M;) {
    const int64_t rest = M - m;
    float* a = acc + m * D;
    const float* pm = p + m * kVecBlock;
    if (kMaxRows >= 4 && rest >= 4) {
      pv_rows<NV, (kMaxRows >= 4 ? 4 : 1), T>(a, pm, corr + m, vh, off, n);
      m += 4;
    } else if (kMaxRows >= 4 && rest == 3) {
      pv_rows<NV, (kMaxRows >= 4 ? 3 : 1), T>(a, pm, corr + m, vh, off, n);
      m += 3;
    } else if (kMaxRows >= 2 && rest >= 2) {
      pv_rows<NV, (kMaxRows >= 2 ? 2 : 1), T>(a, pm, corr + m, vh, off, n);
      m += 2;
    } else {
      pv_rows<NV, 1, T>(a, pm, corr + m, vh, off, n);
      m += 1;
    }
  }
}

// The vector path: NV vectors per head_dim row, at most kVecRows query rows per kv head, kv heads
// [h0, h1) together. K/V rows are read from the pages where they lie. Taking every kv head of the
// item in one unit reads each block of pages whole (a page holds all heads of a token side by
// side) and makes one unit of the item's work, not one per head. (Measured: no faster than a unit
// per head. Decode is bound by memory once the K/V of a 30-layer step leaves the caches, and reads
// each byte once: hence the narrower KV dtypes, and the next block's rows requested ahead.) T is the KV element type; int8 rows fold their scales into the scores
// (K) and the probabilities (V), so the inner loops are the same for every dtype; bf16 rows are
// read in pair order (kernel_common.h), q and the accumulators kept in it.
template <int NV, typename T>
void attend_vec(const Ctx& c, const int32_t* item, int64_t h0, int64_t h1) {
  constexpr int64_t D = NV * kVS;
  const int64_t nrow = item[kRowEnd] - item[kRowBegin];
  const int64_t G = c.group, M = nrow * G, R = (h1 - h0) * M;  // rows r = (h - h0) * M + i * G + g
  float* qv = scratch(R * (2 * D + kVecBlock + 3));
  float* acc = qv + R * D;
  float* s = acc + R * D;
  float* mx = s + R * kVecBlock;
  float* l = mx + R;
  float* corr = l + R;
  int64_t lim[kVecRows], off[kVecBlock];
  float ks[kVecBlock], vs[kVecBlock];  // int8: the block's K and V scales of one head
  constexpr bool kScaled = std::is_same_v<T, int8_t>;
  int64_t max_lim = 0;
  const Vec vscale(c.scale);
  for (int64_t i = 0; i < nrow; ++i) {
    const int32_t* row = c.rows + (item[kRowBegin] + i) * kRowCols;
    for (int64_t h = h0; h < h1; ++h) {
      for (int64_t g = 0; g < G; ++g) {
        const int64_t r = (h - h0) * M + i * G + g;
        const float* src = c.q + row[kQRow] * c.q_stride + (h * G + g) * D;
        for (int64_t v = 0; v < NV; ++v) (Vec::loadu(src + v * kVS) * vscale).store(qv + r * D + v * kVS);
        if constexpr (kPairOrder<T, NV>) reorder_pairs(qv + r * D, D, true);  // the K/V rows' order
      }
    }
    for (int64_t g = 0; g < G; ++g) lim[i * G + g] = row[kLimit];
    max_lim = std::max<int64_t>(max_lim, row[kLimit]);
  }
  std::fill(acc, acc + R * D, 0.f);
  std::fill(mx, mx + R, kNegInf);
  std::fill(l, l + R, 0.f);
  const int64_t seg = item[kSeg];
  const int64_t end = std::min<int64_t>(item[kKvEnd], max_lim);
  int64_t next_off[kVecBlock];
  int64_t t0 = item[kKvBegin];
  if (t0 < end) token_offsets(c, seg, t0, std::min(kVecBlock, end - t0), 0, next_off);
  for (; t0 < end; t0 += kVecBlock) {
    const int64_t n = std::min(kVecBlock, end - t0);
    std::copy(next_off, next_off + n, off);  // head 0; head h is h * D further
    const int64_t n_next = std::min(kVecBlock, std::max<int64_t>(0, end - t0 - kVecBlock));
    if (n_next > 0) token_offsets(c, seg, t0 + kVecBlock, n_next, 0, next_off);
    for (int64_t h = h0; h < h1; ++h) {
      const T* kh = static_cast<const T*>(c.k) + h * D;
      const T* vh = static_cast<const T*>(c.v) + h * D;
      if constexpr (kScaled) {
        for (int64_t j = 0; j < n; ++j) {
          ks[j] = c.k_scale[off[j] / D + h];
          vs[j] = c.v_scale[off[j] / D + h];
        }
      }
      float* const q_h = qv + (h - h0) * M * D;
      float* const acc_h = acc + (h - h0) * M * D;
      float* const s_h = s + (h - h0) * M * kVecBlock;
      int64_t j = 0;
      for (; j + 4 <= n; j += 4) {
        // The next block's K and V rows of this head, requested into L2 while this block's are used:
        // a block's pages lie apart and its rows of one head are strided, so the hardware prefetchers
        // lose the stream, and decode waited on the first load of each row (perf, Zen 4). Measured in
        // turns on Zen 4: 8 x 512 over 30 layers 12.7 -> 9.9 ms. Into L1 it gained nothing (a block
        // of one head's K and V is as large as L1), as a burst at the block's start it lost.
        for (int64_t t = j; t < std::min(j + 4, n_next); ++t) prefetch_row<D * sizeof(T)>(kh + next_off[t], vh + next_off[t]);
        const T *k0 = kh + off[j], *k1 = kh + off[j + 1], *k2 = kh + off[j + 2], *k3 = kh + off[j + 3];
        if constexpr (NV <= 4) {  // the 4 K rows fit in registers: load them once for all M rows
          Vec kr[4][NV];
          for (int64_t v = 0; v < NV; ++v) {
            kr[0][v] = row_vec<NV>(k0, v);
            kr[1][v] = row_vec<NV>(k1, v);
            kr[2][v] = row_vec<NV>(k2, v);
            kr[3][v] = row_vec<NV>(k3, v);
          }
          for (int64_t m = 0; m < M; ++m) {
            const float* q = q_h + m * D;
            Vec d[4];
            const Vec q0 = Vec::loadu(q);
            for (int t = 0; t < 4; ++t) d[t] = q0 * kr[t][0];
            for (int64_t v = 1; v < NV; ++v) {
              const Vec qv_ = Vec::loadu(q + v * kVS);
              for (int t = 0; t < 4; ++t) d[t] = at::vec::fmadd(qv_, kr[t][v], d[t]);
            }
            sum4(d[0], d[1], d[2], d[3], s_h + m * kVecBlock + j);
          }
        } else {
          for (int64_t m = 0; m < M; ++m) {
            const float* q = q_h + m * D;
            sum4(dot<NV>(q, k0), dot<NV>(q, k1), dot<NV>(q, k2), dot<NV>(q, k3), s_h + m * kVecBlock + j);
          }
        }
      }
      for (; j < n; ++j) {
        for (int64_t m = 0; m < M; ++m)
          s_h[m * kVecBlock + j] = at::vec::vec_reduce_all<float>(
              [](const Vec& x, const Vec& y) { return x + y; }, dot<NV>(q_h + m * D, kh + off[j]));
      }
      if constexpr (kScaled) {
        for (int64_t m = 0; m < M; ++m)
          for (int64_t x = 0; x < n; ++x) s_h[m * kVecBlock + x] *= ks[x];
      }
      for (int64_t m = 0; m < M; ++m) {
        const int64_t r = (h - h0) * M + m;
        corr[r] = softmax_step(s_h + m * kVecBlock, n, lim[m] - t0, mx[r], l[r]);
        if constexpr (kScaled) {  // after the row's sum: the V scales weigh the values, not the softmax
          for (int64_t x = 0; x < n; ++x) s_h[m * kVecBlock + x] *= vs[x];
        }
      }
      pv<NV, T>(acc_h, s_h, corr + (h - h0) * M, M, vh, off, n);
    }
  }
  for (int64_t h = h0; h < h1; ++h) {
    for (int64_t m = 0; m < M; ++m) {
      const int64_t r = (h - h0) * M + m;
      if constexpr (kPairOrder<T, NV>) reorder_pairs(acc + r * D, D, false);
      finish_row(acc + r * D, mx[r], l[r], D, dest(c, item, m / G, h * G + m % G));
    }
  }
}

template <typename T>
VecKernel vec_kernel_of(int64_t head_dim) {
  if (head_dim % kVS != 0) return nullptr;
  switch (head_dim / kVS) {
    case 1:
      return &attend_vec<1, T>;
    case 2:
      return &attend_vec<2, T>;
    case 4:
      return &attend_vec<4, T>;
    case 8:
      return &attend_vec<8, T>;
    case 16:
      return &attend_vec<16, T>;
    default:
      return nullptr;
  }
}

}  // namespace

VecKernel vec_kernel(int64_t head_dim, KvType kv_type) {
  switch (kv_type) {
    case KvType::kBFloat16:
      return vec_kernel_of<c10::BFloat16>(head_dim);
    case KvType::kInt8:
      return vec_kernel_of<int8_t>(head_dim);
    default:
      return vec_kernel_of<float>(head_dim);
  }
}

}  // namespace radixserve_cpu::detail
