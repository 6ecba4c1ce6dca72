// Ragged paged attention on CPU, reading K/V in place from the pages.
//
// The plan (plan.cpp) lists work items: a run of query rows against a range of one segment's
// context. Units of work are handed out to threads from an atomic counter (the plan sorts items by
// decreasing cost, so this is longest-first scheduling). An item takes one of two paths, by how
// many query rows share each K/V row (tokens x heads of a GQA group, "M"):
// - few rows (decode, M <= kVecRows): one unit for all kv heads, a vectorised loop over the
//   context tokens straight from the pages: each K/V row is loaded once and used by every query
//   row of its head;
// - many rows (extend, prefill, cascade groups): one unit per kv head, flash-attention blocks like
//   torch's CPU kernel: a block of K/V rows is copied from the pages into a small thread-local
//   buffer, then two GEMMs (Q K^T and P V, MKL's sgemm exported by libtorch_cpu) with an online
//   softmax in between.
// Rows covered by several items (a context split across threads, or a shared prefix attended
// apart from each row's own pages) write partial results with their log-sum-exps; a final pass
// merges them.
#include "radixserve_cpu.h"

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

// Fortran BLAS, column-major (LP64 MKL inside libtorch_cpu).
extern "C" void sgemm_(
    const char* transa, const char* transb, const int* m, const int* n, const int* k, const float* alpha,
    const float* a, const int* lda, const float* b, const int* ldb, const float* beta, float* c,
    const int* ldc);

namespace radixserve_cpu {
namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kVS = Vec::size();
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int64_t kMaxHeadDim = 256;
constexpr int64_t kVecRows = 8;      // the vector path's most query rows per unit
constexpr int64_t kVecBlock = 64;    // context tokens per online-softmax step of the vector path
// Context tokens per K/V block of the GEMM path. With head_dim 64 and 64 query tokens x 3 heads, a
// thread's scratch (Q, O, a K and a V block, the 192 x 256 scores) is about 400 KiB, in L2; 128 was
// about 5% slower, 512 no faster.
constexpr int64_t kGemmBlock = 256;

struct Ctx {
  const float* q;
  int64_t q_stride;  // q[r, head, d] = q[r * q_stride + head * head_dim + d]
  const float* k;
  const float* v;
  int64_t num_pages, page_size, kv_heads, head_dim, group, q_heads;
  const int32_t* table;
  int64_t table_stride, table_cols;
  const int32_t* rows;  // [R, kRowCols]
  float scale;
  float* out;  // [T, q_heads, head_dim]
  float* lse;  // [T, q_heads]
  float* part_out;  // [P, q_heads, head_dim]
  float* part_lse;  // [P, q_heads]
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
      TORCH_CHECK(page >= 0 && page < c.num_pages, "radixserve_cpu: page ", page, " not in [0, ", c.num_pages, ")");
      base = page * c.page_size * row + h * c.head_dim;
    }
    off[j] = base + in * row;
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

template <int NV>
inline Vec dot(const float* q, const float* k) {
  Vec acc = Vec::loadu(q) * Vec::loadu(k);
  for (int64_t v = 1; v < NV; ++v) acc = at::vec::fmadd(Vec::loadu(q + v * kVS), Vec::loadu(k + v * kVS), acc);
  return acc;
}

// Thread-local scratch, grown on demand and kept between calls.
float* scratch(int64_t n) {
  static thread_local std::vector<float> buf;
  if (static_cast<int64_t>(buf.size()) < n) buf.resize(n);
  return buf.data();
}

// acc[r] = acc[r] * corr[r] + sum_j p[r][j] V[j] for R rows at once: R x NV accumulators in
// registers, each V row loaded once for the R rows, and R x NV independent FMA chains (one or two
// chains would leave the loop waiting on FMA latency).
template <int NV, int R>
inline void pv_rows(float* acc, const float* p, const float* corr, const float* vh, const int64_t* off, int64_t n) {
  constexpr int64_t D = NV * kVS;
  Vec a[R][NV];
  for (int r = 0; r < R; ++r) {
    const Vec c(corr[r]);
    for (int64_t v = 0; v < NV; ++v) a[r][v] = Vec::loadu(acc + r * D + v * kVS) * c;
  }
  for (int64_t j = 0; j < n; ++j) {
    const float* vr = vh + off[j];
    Vec pr[R];
    for (int r = 0; r < R; ++r) pr[r] = Vec(p[r * kVecBlock + j]);
    for (int64_t v = 0; v < NV; ++v) {
      const Vec x = Vec::loadu(vr + v * kVS);
      for (int r = 0; r < R; ++r) a[r][v] = at::vec::fmadd(pr[r], x, a[r][v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int64_t v = 0; v < NV; ++v) a[r][v].store(acc + r * D + v * kVS);
}

// P V for M rows (accumulators acc[M][D], probabilities p[M][kVecBlock]), up to 16 registers of
// accumulators at a time.
template <int NV>
inline void pv(float* acc, const float* p, const float* corr, int64_t M, const float* vh, const int64_t* off, int64_t n) {
  constexpr int64_t D = NV * kVS;
  constexpr int kMaxRows = NV >= 16 ? 1 : (NV >= 8 ? 2 : 4);
  for (int64_t m = 0; m < M;) {
    const int64_t rest = M - m;
    float* a = acc + m * D;
    const float* pm = p + m * kVecBlock;
    if (kMaxRows >= 4 && rest >= 4) {
      pv_rows<NV, (kMaxRows >= 4 ? 4 : 1)>(a, pm, corr + m, vh, off, n);
      m += 4;
    } else if (kMaxRows >= 4 && rest == 3) {
      pv_rows<NV, (kMaxRows >= 4 ? 3 : 1)>(a, pm, corr + m, vh, off, n);
      m += 3;
    } else if (kMaxRows >= 2 && rest >= 2) {
      pv_rows<NV, (kMaxRows >= 2 ? 2 : 1)>(a, pm, corr + m, vh, off, n);
      m += 2;
    } else {
      pv_rows<NV, 1>(a, pm, corr + m, vh, off, n);
      m += 1;
    }
  }
}

// The vector path: NV vectors per head_dim row, at most kVecRows query rows per kv head, kv heads
// [h0, h1) together. K/V rows are read from the pages where they lie. Taking every kv head of the
// item in one unit reads each block of pages whole (a page holds all heads of a token side by
// side) and makes one unit of the item's work, not one per head. (Measured: no faster than a unit
// per head, and neither was prefetching the next block in software; decode is bound by memory
// bandwidth once the K/V of a 30-layer step leaves the caches, and reads each byte once.)
template <int NV>
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
  int64_t max_lim = 0;
  const Vec vscale(c.scale);
  for (int64_t i = 0; i < nrow; ++i) {
    const int32_t* row = c.rows + (item[kRowBegin] + i) * kRowCols;
    for (int64_t h = h0; h < h1; ++h) {
      for (int64_t g = 0; g < G; ++g) {
        const int64_t r = (h - h0) * M + i * G + g;
        const float* src = c.q + row[kQRow] * c.q_stride + (h * G + g) * D;
        for (int64_t v = 0; v < NV; ++v) (Vec::loadu(src + v * kVS) * vscale).store(qv + r * D + v * kVS);
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
  for (int64_t t0 = item[kKvBegin]; t0 < end; t0 += kVecBlock) {
    const int64_t n = std::min(kVecBlock, end - t0);
    token_offsets(c, seg, t0, n, 0, off);  // head 0; head h is h * D further
    for (int64_t h = h0; h < h1; ++h) {
      const float* kh = c.k + h * D;
      const float* vh = c.v + h * D;
      float* const q_h = qv + (h - h0) * M * D;
      float* const acc_h = acc + (h - h0) * M * D;
      float* const s_h = s + (h - h0) * M * kVecBlock;
      int64_t j = 0;
      for (; j + 4 <= n; j += 4) {
        const float *k0 = kh + off[j], *k1 = kh + off[j + 1], *k2 = kh + off[j + 2], *k3 = kh + off[j + 3];
        if constexpr (NV <= 4) {  // the 4 K rows fit in registers: load them once for all M rows
          Vec kr[4][NV];
          for (int64_t v = 0; v < NV; ++v) {
            kr[0][v] = Vec::loadu(k0 + v * kVS);
            kr[1][v] = Vec::loadu(k1 + v * kVS);
            kr[2][v] = Vec::loadu(k2 + v * kVS);
            kr[3][v] = Vec::loadu(k3 + v * kVS);
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
      for (int64_t m = 0; m < M; ++m) {
        const int64_t r = (h - h0) * M + m;
        corr[r] = softmax_step(s_h + m * kVecBlock, n, lim[m] - t0, mx[r], l[r]);
      }
      pv<NV>(acc_h, s_h, corr + (h - h0) * M, M, vh, off, n);
    }
  }
  for (int64_t h = h0; h < h1; ++h) {
    for (int64_t m = 0; m < M; ++m) {
      const int64_t r = (h - h0) * M + m;
      finish_row(acc + r * D, mx[r], l[r], D, dest(c, item, m / G, h * G + m % G));
    }
  }
}

void gemm(char ta, char tb, int m, int n, int k, const float* a, int lda, const float* b, int ldb, float beta,
          float* out, int ldc) {
  const float one = 1.f;
  sgemm_(&ta, &tb, &m, &n, &k, &one, a, &lda, b, &ldb, &beta, out, &ldc);
}

// The GEMM path: any number of query rows, any head_dim.
void attend_gemm(const Ctx& c, const int32_t* item, int64_t h) {
  const int64_t D = c.head_dim, G = c.group;
  const int64_t nrow = item[kRowEnd] - item[kRowBegin], M = nrow * G;
  float* qb = scratch(M * D * 2 + 2 * kGemmBlock * D + M * kGemmBlock + 3 * M);
  float* ob = qb + M * D;
  float* kb = ob + M * D;
  float* vb = kb + kGemmBlock * D;
  float* s = vb + kGemmBlock * D;
  float* mx = s + M * kGemmBlock;
  float* l = mx + M;
  float* lim = l + M;  // row limits, as floats (exact below 2^24 tokens)
  int64_t max_lim = 0, off[kGemmBlock];
  for (int64_t i = 0; i < nrow; ++i) {
    const int32_t* row = c.rows + (item[kRowBegin] + i) * kRowCols;
    for (int64_t g = 0; g < G; ++g) {
      const int64_t m = i * G + g;
      const float* src = c.q + row[kQRow] * c.q_stride + (h * G + g) * D;
      for (int64_t x = 0; x < D; x += kVS) (Vec::loadu(src + x) * Vec(c.scale)).store(qb + m * D + x);
      mx[m] = kNegInf;
      l[m] = 0.f;
      lim[m] = static_cast<float>(row[kLimit]);
    }
    max_lim = std::max<int64_t>(max_lim, row[kLimit]);
  }
  std::fill(ob, ob + M * D, 0.f);
  const int64_t seg = item[kSeg];
  const int64_t end = std::min<int64_t>(item[kKvEnd], max_lim);
  for (int64_t t0 = item[kKvBegin]; t0 < end; t0 += kGemmBlock) {
    const int64_t n = std::min(kGemmBlock, end - t0);
    token_offsets(c, seg, t0, n, h, off);
    for (int64_t j = 0; j < n; ++j) {  // gather this block's K/V rows (L1/L2-sized)
      std::memcpy(kb + j * D, c.k + off[j], D * sizeof(float));
      std::memcpy(vb + j * D, c.v + off[j], D * sizeof(float));
    }

    // S[M, n] = Q K^T (row-major S is column-major S^T [n, M], leading dimension kGemmBlock).
    gemm('T', 'N', n, M, D, kb, D, qb, D, 0.f, s, kGemmBlock);
    for (int64_t m = 0; m < M; ++m) {
      const float corr = softmax_step(s + m * kGemmBlock, n, static_cast<int64_t>(lim[m]) - t0, mx[m], l[m]);
      if (corr != 1.f) {
        float* o = ob + m * D;
        const Vec vc(corr);
        for (int64_t x = 0; x < D; x += kVS) (Vec::loadu(o + x) * vc).store(o + x);
      }
    }
    // O[M, D] += P V
    gemm('N', 'N', D, M, n, vb, D, s, kGemmBlock, 1.f, ob, D);
  }
  for (int64_t m = 0; m < M; ++m) finish_row(ob + m * D, mx[m], l[m], D, dest(c, item, m / G, h * G + m % G));
}

using UnitFn = void (*)(const Ctx&, const int32_t*, int64_t, int64_t);

UnitFn vec_kernel(int64_t head_dim) {
  if (head_dim % kVS != 0) return nullptr;
  switch (head_dim / kVS) {
    case 1: return &attend_vec<1>;
    case 2: return &attend_vec<2>;
    case 4: return &attend_vec<4>;
    case 8: return &attend_vec<8>;
    case 16: return &attend_vec<16>;
    default: return nullptr;
  }
}

// Combines each merged row's partial results through their log-sum-exps.
void merge_partials(const Ctx& c, const at::Tensor& merge_rows, const at::Tensor& merge_offsets,
                    const at::Tensor& merge_slots) {
  const int64_t n = merge_rows.numel(), H = c.q_heads, D = c.head_dim;
  const int32_t* rows = merge_rows.data_ptr<int32_t>();
  const int32_t* offs = merge_offsets.data_ptr<int32_t>();
  const int32_t* slots = merge_slots.data_ptr<int32_t>();
  at::parallel_for(0, n * H, 64, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) {
      const int64_t i = u / H, head = u % H;
      float* out = c.out + (rows[i] * H + head) * D;
      float mx = kNegInf;
      for (int64_t k = offs[i]; k < offs[i + 1]; ++k) mx = std::max(mx, c.part_lse[slots[k] * H + head]);
      std::fill(out, out + D, 0.f);
      if (mx == kNegInf) {
        c.lse[rows[i] * H + head] = kNegInf;
        continue;
      }
      float total = 0.f;
      for (int64_t k = offs[i]; k < offs[i + 1]; ++k) {
        const float w = std::exp(c.part_lse[slots[k] * H + head] - mx);
        if (w == 0.f) continue;
        total += w;
        const float* src = c.part_out + (slots[k] * H + head) * D;
        for (int64_t x = 0; x < D; x += kVS) at::vec::fmadd(Vec(w), Vec::loadu(src + x), Vec::loadu(out + x)).store(out + x);
      }
      const Vec inv(1.f / total);
      for (int64_t x = 0; x < D; x += kVS) (Vec::loadu(out + x) * inv).store(out + x);
      c.lse[rows[i] * H + head] = mx + std::log(total);
    }
  });
}

void check_index(const at::Tensor& t, int64_t dim, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kInt && t.dim() == dim && t.is_contiguous(), "radixserve_cpu: ", name,
              " must be a contiguous ", dim, "-D int32 tensor");
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> paged_attention(
    const at::Tensor& q_in, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& page_table,
    const at::Tensor& items, const at::Tensor& rows, const at::Tensor& merge_rows,
    const at::Tensor& merge_offsets, const at::Tensor& merge_slots, double scale) {
  TORCH_CHECK(q_in.dim() == 3 && q_in.scalar_type() == at::kFloat, "radixserve_cpu: q must be [T, heads, dim] float32");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.scalar_type() == at::kFloat && k_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == at::kFloat && v_cache.is_contiguous(),
              "radixserve_cpu: caches must be contiguous float32 [pages, page_size, kv_heads, dim]");
  const int64_t T = q_in.size(0), Hq = q_in.size(1), D = q_in.size(2), Hkv = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && Hkv > 0 && Hq % Hkv == 0, "radixserve_cpu: q and cache shapes disagree");
  TORCH_CHECK(D % kVS == 0 && D <= kMaxHeadDim, "radixserve_cpu: head_dim must be a multiple of ", kVS,
              " and at most ", kMaxHeadDim);
  TORCH_CHECK(page_table.scalar_type() == at::kInt && page_table.dim() == 2 && page_table.stride(1) == 1,
              "radixserve_cpu: page_table must be [B, max_pages] int32 with contiguous rows");
  check_index(items, 2, "items");
  check_index(rows, 2, "rows");
  check_index(merge_rows, 1, "merge_rows");
  check_index(merge_offsets, 1, "merge_offsets");
  check_index(merge_slots, 1, "merge_slots");
  TORCH_CHECK(items.size(1) == kItemCols && rows.size(1) == kRowCols, "radixserve_cpu: malformed plan");
  TORCH_CHECK(merge_offsets.numel() == merge_rows.numel() + 1, "radixserve_cpu: malformed merge lists");
  const at::Tensor q = (q_in.stride(2) == 1 && q_in.stride(1) == D) ? q_in : q_in.contiguous();
  const int64_t P = merge_slots.numel(), N = items.size(0), R = rows.size(0), B = page_table.size(0);

  // Validate the plan once, so the threads need not (pages are checked as they are read).
  const int32_t* it = items.data_ptr<int32_t>();
  const int32_t* rw = rows.data_ptr<int32_t>();
  for (int64_t i = 0; i < N; ++i) {
    const int32_t* x = it + i * kItemCols;
    TORCH_CHECK(x[kSeg] >= 0 && x[kSeg] < B && x[kRowBegin] >= 0 && x[kRowBegin] <= x[kRowEnd] && x[kRowEnd] <= R &&
                    x[kKvBegin] >= 0 && (x[kPartial] < 0 || x[kPartial] + x[kRowEnd] - x[kRowBegin] <= P),
                "radixserve_cpu: malformed plan item ", i);
  }
  std::vector<char> covered(T, 0);
  for (int64_t r = 0; r < R; ++r) {
    TORCH_CHECK(rw[r * kRowCols] >= 0 && rw[r * kRowCols] < T, "radixserve_cpu: plan row out of range");
    covered[rw[r * kRowCols]] = 1;
  }
  const int32_t* mr = merge_rows.data_ptr<int32_t>();
  for (int64_t i = 0; i < merge_rows.numel(); ++i) TORCH_CHECK(mr[i] >= 0 && mr[i] < T, "radixserve_cpu: bad merge row");
  const int32_t* ms = merge_slots.data_ptr<int32_t>();
  for (int64_t i = 0; i < P; ++i) TORCH_CHECK(ms[i] >= 0 && ms[i] < P, "radixserve_cpu: bad merge slot");

  at::Tensor out = at::empty({T, Hq, D}, q.options());
  at::Tensor lse = at::empty({T, Hq}, q.options());
  at::Tensor part_out = at::empty({P, Hq, D}, q.options());
  at::Tensor part_lse = at::empty({P, Hq}, q.options());
  const Ctx c{q.data_ptr<float>(), q.stride(0), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(),
              k_cache.size(0), k_cache.size(1), Hkv, D, Hq / Hkv, Hq,
              page_table.data_ptr<int32_t>(), page_table.stride(0), page_table.size(1),
              rw, static_cast<float>(scale), out.data_ptr<float>(), lse.data_ptr<float>(),
              part_out.data_ptr<float>(), part_lse.data_ptr<float>()};

  // Units of work: a vector-path item takes every kv head at once (its pages are read whole); a
  // GEMM item is one unit per kv head (each is plenty of work).
  const UnitFn vec = vec_kernel(D);
  std::vector<std::pair<int32_t, int32_t>> units;  // (item, kv head or -1 for all)
  units.reserve(N * Hkv);
  for (int64_t i = 0; i < N; ++i) {
    const int32_t* x = it + i * kItemCols;
    if (vec != nullptr && (x[kRowEnd] - x[kRowBegin]) * c.group <= kVecRows) {
      units.emplace_back(static_cast<int32_t>(i), -1);
    } else {
      for (int64_t h = 0; h < Hkv; ++h) units.emplace_back(static_cast<int32_t>(i), static_cast<int32_t>(h));
    }
  }
  const int64_t num_units = static_cast<int64_t>(units.size());
  std::atomic<int64_t> next{0};
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), num_units));
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t u = next.fetch_add(1, std::memory_order_relaxed); u < num_units;
         u = next.fetch_add(1, std::memory_order_relaxed)) {
      const auto [i, h] = units[u];
      const int32_t* x = it + static_cast<int64_t>(i) * kItemCols;
      if (h < 0) {
        vec(c, x, 0, Hkv);
      } else {
        attend_gemm(c, x, h);
      }
    }
  });
  if (merge_rows.numel() > 0) merge_partials(c, merge_rows, merge_offsets, merge_slots);
  for (int64_t r = 0; r < T; ++r) {  // rows in no segment (batch padding): zeros
    if (!covered[r]) {
      out[r].zero_();
      lse[r].fill_(kNegInf);
    }
  }
  return {out, lse};
}

}  // namespace radixserve_cpu
