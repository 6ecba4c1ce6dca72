// radixserve_cpu::gguf_linear: x [M, K] fp32 times a weight held as GGUF blocks, out [M, N] fp32.
//
// The weight stays in the file's own block format (uint8 [N, bytes_per_row]: row n is K / B blocks
// of B weights, B = 32, or 256 for a k-quant); each block is decoded, 32 weights at a time
// (block_decode.h), into fp32 registers where it is used and multiplied in fp32. Why: a decode step on
// CPU is bound by reading the weights, and a Q4_K block is 144 bytes for 256 weights, a seventh of
// fp32's 1024.
//
// Exactness: a decoded weight equals the reference dequantization bit for bit (q * d, (q - 8) * d,
// (d * sc) * q are exact products of small integers and an fp16 scale, so q * d + m or d * sc * q - dm
// rounds once, fused or not), so the product equals the fp32 model's up to the order of its sums.
//
// Two paths, split by the rows M:
// - few rows (a decode step): each weight row's blocks are decoded in registers and multiplied
//   against every x row at once, so the weights are read once (at 1-2 rows, several weight rows a
//   pass; every x row's sums keep one order, so up to 8 rows a row does not depend on its batchmates,
//   AVX2 included, in passes of 4);
// - many rows (prefill): a tile of 16-64 weight rows is decoded once into a thread-local fp32
//   buffer (L2-sized) and every x row is multiplied against it by sgemm, so a block is decoded once
//   per step, not once per x row.
// Both parallelise over output rows (at::parallel_for), and every ISA shares them through
// at::vec::Vectorized<float>; only the block decoding has AVX-512 and AVX2 intrinsics.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

// Fortran BLAS, column-major (LP64 MKL inside libtorch_cpu).
extern "C" void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k,
                       const float* alpha, const float* a, const int* lda, const float* b, const int* ldb,
                       const float* beta, float* c, const int* ldc);

#include "block_rows.h"

namespace radixserve_cpu {
namespace {

using namespace blocks;


template <int64_t Q>
void run_few_rows(const Args& a, int64_t M) {
  // Rows per task: enough that a task's weights (>= 16 rows of blocks) dwarf its scheduling.
  at::parallel_for(0, a.N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t m0 = 0; m0 < M; m0 += kMaxFewRows) {
      const int rows = static_cast<int>(std::min<int64_t>(kMaxFewRows, M - m0));
      few_rows_dispatch<Q>(rows, a, a.x + m0 * a.ldx, a.out + m0 * a.N, n0, n1);
    }
  });
}

// ---- many rows: decode a tile once, multiply every x row against it ------------------------------

// Most weight rows a tile holds: 64 rows of K <= 1536 are <= 384 KiB of fp32, in L2.
constexpr int64_t kMaxTileRows = 64;

float* tile_buffer(int64_t n) {
  static thread_local std::vector<float> buf;
  if (static_cast<int64_t>(buf.size()) < n) buf.resize(n);
  return buf.data();
}

// Weight rows [n0, n0 + rows) decoded into tile [rows, K].
template <int64_t Q>
void decode_tile(const Args& a, int64_t n0, int64_t rows, float* tile) {
  constexpr int64_t per = weights_of(Q) / kChunk, bb = bytes_of(Q);
  const int64_t nc = a.K / kChunk;
  for (int64_t j = 0; j < rows; ++j) {
    const uint8_t* row = a.w + (n0 + j) * a.row_bytes;
    float* dst = tile + j * a.K;
    for (int64_t c = 0; c < nc; ++c) {
      Vec v[kVecsPerChunk];
      decode<Q>(row + c / per * bb, c % per, v);
      for (int64_t i = 0; i < kVecsPerChunk; ++i) v[i].store(dst + c * kChunk + i * kVS);
    }
  }
}

// Many rows are compute-bound: a decoded tile goes through the BLAS sgemm (single-threaded inside
// this parallel region, as the attention's GEMM path calls it), whose micro-kernels run near the
// FMA peak; decoding a tile costs ~1/M of its product.
template <int64_t Q>
void run_many_rows(const Args& a, int64_t M) {
  // Tiles of 16-64 rows, at least four per thread where N allows, so threads end together.
  const int64_t per_thread = a.N / (4 * at::get_num_threads());
  const int64_t tile_rows = std::clamp<int64_t>(per_thread / 16 * 16, 16, kMaxTileRows);
  const int64_t tiles = (a.N + tile_rows - 1) / tile_rows;
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    float* tile = tile_buffer(a.K * tile_rows);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * tile_rows, rows = std::min(tile_rows, a.N - n0);
      decode_tile<Q>(a, n0, rows, tile);
      // Column-major: out^T[n0 : n0 + rows, :M] = tile (K x rows)^T * x^T (K x M).
      const char ta = 'T', tb = 'N';
      const int m = static_cast<int>(rows), n = static_cast<int>(M), k = static_cast<int>(a.K);
      const int lda = k, ldb = static_cast<int>(a.ldx), ldc = static_cast<int>(a.N);
      const float one = 1.f, zero = 0.f;
      sgemm_(&ta, &tb, &m, &n, &k, &one, tile, &lda, a.x, &ldb, &zero, a.out + n0, &ldc);
      if (a.bias != nullptr)
        for (int64_t r = 0; r < M; ++r)
          for (int64_t j = 0; j < rows; ++j) a.out[r * a.N + n0 + j] += a.bias[n0 + j];
    }
  });
}

template <int64_t Q>
void run(const Args& a, int64_t M) {
  if (M <= kFewRowsLimit)
    run_few_rows<Q>(a, M);
  else
    run_many_rows<Q>(a, M);
}

at::Tensor gguf_linear(const at::Tensor& x_in, const at::Tensor& blocks_in, int64_t qtype, int64_t K,
                       const std::optional<at::Tensor>& bias_in) {
  const blocks::Operands o = checked_operands("gguf_linear", x_in, blocks_in, qtype, K, bias_in);
  const at::Tensor &x = o.x, &blocks = o.blocks, &bias = o.bias;
  const int64_t M = x.size(0), N = blocks.size(0), rb = blocks.size(1);
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  const Args a{x.data_ptr<float>(), x.stride(0), blocks.data_ptr<uint8_t>(), rb, K, N,
               bias.defined() ? bias.data_ptr<float>() : nullptr, out.data_ptr<float>()};
  with_type(qtype, [&](auto q) { run<decltype(q)::value>(a, M); });
  return out;
}

}  // namespace
}  // namespace radixserve_cpu

TORCH_LIBRARY_FRAGMENT(radixserve_cpu, m) {
  m.def("gguf_linear(Tensor x, Tensor blocks, int qtype, int K, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(radixserve_cpu, CPU, m) { m.impl("gguf_linear", &radixserve_cpu::gguf_linear); }
