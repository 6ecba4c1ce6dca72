// The GEMM path of the CPU attention (extend, prefill, cascade groups): flash-attention blocks like
// torch's CPU kernel, with each block of K/V rows gathered from the pages into a thread-local buffer
// (as fp32, whatever the KV dtype: the GEMMs run in fp32).
#include <cstring>
#include <type_traits>

#include "kernel_common.h"

// Fortran BLAS, column-major (LP64 MKL inside libtorch_cpu).
extern "C" void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k,
                       const float* alpha, const float* a, const int* lda, const float* b, const int* ldb,
                       const float* beta, float* c, const int* ldc);

namespace radixserve_cpu::detail {
namespace {

// Context tokens per K/V block of the GEMM path. With head_dim 64 and 64 query tokens x 3 heads, a
// thread's scratch (Q, O, a K and a V block, the 192 x 256 scores) is about 400 KiB, in L2; 128 was
// about 5% slower, 512 no faster.
constexpr int64_t kGemmBlock = 256;

void gemm(char ta, char tb, int m, int n, int k, const float* a, int lda, const float* b, int ldb, float beta,
          float* out, int ldc) {
  const float one = 1.f;
  sgemm_(&ta, &tb, &m, &n, &k, &one, a, &lda, b, &ldb, &beta, out, &ldc);
}

// Copies the block's K/V rows (element offsets off[0, n)) into kb/vb as fp32, dequantizing int8 rows.
template <typename T>
void gather_block(const Ctx& c, const int64_t* off, int64_t n, float* kb, float* vb) {
  const int64_t D = c.head_dim;
  const T* k = static_cast<const T*>(c.k);
  const T* v = static_cast<const T*>(c.v);
  for (int64_t j = 0; j < n; ++j) {
    if constexpr (std::is_same_v<T, float>) {
      std::memcpy(kb + j * D, k + off[j], D * sizeof(float));
      std::memcpy(vb + j * D, v + off[j], D * sizeof(float));
    } else {
      Vec sk(1.f), sv(1.f);
      if constexpr (std::is_same_v<T, int8_t>) {
        sk = Vec(c.k_scale[off[j] / D]);
        sv = Vec(c.v_scale[off[j] / D]);
      }
      for (int64_t x = 0; x < D; x += kVS) {
        (load_kv(k + off[j] + x) * sk).store(kb + j * D + x);
        (load_kv(v + off[j] + x) * sv).store(vb + j * D + x);
      }
    }
  }
}

}  // namespace

// Kernel for kv head h of an item: any number of query rows, any head_dim. Per K/V block: gather
// the rows, S = Q K^T, online softmax, O += P V.
void attend_gemm(const Ctx& c, const int32_t* item, int64_t h) {
  if (c.bf16_dot) return attend_gemm_bf16(c, item, h);
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
    switch (c.kv_type) {  // gather this block's K/V rows (L1/L2-sized)
      case KvType::kBFloat16:
        gather_block<c10::BFloat16>(c, off, n, kb, vb);
        break;
      case KvType::kInt8:
        gather_block<int8_t>(c, off, n, kb, vb);
        break;
      default:
        gather_block<float>(c, off, n, kb, vb);
    }

    // S[M, n] = Q K^T (row-major S is column-major S^T [n, M], leading dimension kGemmBlock).
    gemm('T', 'N', n, M, D, kb, D, qb, D, 0.f, s, kGemmBlock);
    softmax_rows(s, kGemmBlock, M, n, lim, t0, mx, l, ob, D);
    // O[M, D] += P V
    gemm('N', 'N', D, M, n, vb, D, s, kGemmBlock, 1.f, ob, D);
  }
  for (int64_t m = 0; m < M; ++m) finish_row(ob + m * D, mx[m], l[m], D, dest(c, item, m / G, h * G + m % G));
}

}  // namespace radixserve_cpu::detail
