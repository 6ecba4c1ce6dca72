// Few-row linear products without BLAS: out[M, N] = x[M, K] @ W[N, K]^T (+ bias), M <= kGemvMaxRows.
//
// Why: a decode step multiplies one activation row per running request by every weight, so it is
// bound by reading the weights once. MKL's small-row sgemm reads this model's weights at a third of
// the copy bandwidth on AMD EPYC (issue 21: 12.2 GB/s at 1 row, 5.3 GB/s at 3 rows, 34.6 GB/s copy),
// and oneDNN's packed product pays a per-call setup at few rows. Here every thread streams a
// contiguous band of weight rows exactly once for all M activation rows, which stay in L1/L2.
//
// - Layout: the weight's own row-major [N, K]. A thread's band of rows is one contiguous stream, which
//   the hardware prefetchers follow; a blocked copy would cost memory and buy nothing for a stream.
// - Register tile: R weight rows x M activation rows of vector accumulators (R chosen by M so the tile
//   fits the register file: 32 zmm with AVX-512, 16 ymm with AVX2); x is copied once, zero-padded to a
//   whole number of vectors, and a weight row's tail is copied into a zeroed vector, so no load reads
//   past an end.
// - Summation order: output (m, n) sums lane j over k = j mod W in order, then the lanes in a fixed
//   tree. It depends on neither M nor the other rows, so a row's result is the same whatever its
//   batchmates (fp32 differs from MKL only by this order).
// - int8 weights (model/quant.py's scheme, per-channel scales): the activations are quantized per row
//   exactly as quant.quantize_rows does (amax / 127, round half to even, clamp), and int8 x int8 sums
//   are exact in int32 (VNNI where the CPU has it, checked at run time; else AVX2's maddubs, whose
//   16-bit pair sums cannot saturate as |q| <= 127). So this path computes what torch._int_mm computes,
//   and the int8 mode's numerics do not change with the row count.
// - bf16 weights and activations: converted to fp32 in registers, exactly (AVX-512: 32 words a load,
//   widened by a shift and a mask, dense_rows.h), fp32 sums, the output rounded to bf16.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

#include "dense_rows.h"
#include "gemv.h"

namespace radixserve_cpu {
namespace {

using namespace dense;

// Splits the N output rows over the threads in bands of whole tiles and runs dot_rows<M> on each.
template <int M, typename TW, typename Store>
void run_bands(const float* xp, int64_t Kp, const TW* w, int64_t K, int64_t N, Store store) {
  constexpr int R = rows_per_tile<TW>(M);
  const int64_t tiles = (N + R - 1) / R;
  // Grain: ~64 KiB of weights a task, so a small layer does not fork more threads than it feeds.
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(1, R * K * int64_t(sizeof(TW))));
  at::parallel_for(0, tiles, grain, [&](int64_t t0, int64_t t1) {
    dot_rows<M>(xp, Kp, w, K, t0 * R, std::min(N, t1 * R), store);
  });
}

template <typename TW, typename Store>
void dispatch_rows(int64_t M, const float* xp, int64_t Kp, const TW* w, int64_t K, int64_t N, Store store) {
  TORCH_CHECK(M >= 1 && M <= kGemvMaxRows, "radixserve_cpu: gemv takes 1 to ", kGemvMaxRows, " rows, got ", M);
  with_rows(M, [&](auto rows) { run_bands<decltype(rows)::value>(xp, Kp, w, K, N, store); });
}

void check_args(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2, "radixserve_cpu: gemv wants x as [M, K], got ", x.sizes());
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= kGemvMaxRows, "radixserve_cpu: gemv takes 1 to ",
              kGemvMaxRows, " rows, got ", x.size(0));
  TORCH_CHECK(weight.dim() == 2 && weight.size(1) == x.size(1) && weight.is_contiguous(),
              "radixserve_cpu: gemv wants a contiguous weight [N, K] with K = ", x.size(1), ", got ",
              weight.sizes());
  if (bias.has_value())
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == weight.size(0), "radixserve_cpu: gemv wants a bias [N]");
}

// The bias as contiguous fp32 (a bf16 model's bias is bf16), or an undefined tensor.
at::Tensor fp32_bias(const std::optional<at::Tensor>& bias) {
  return bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
}

// x rows as fp32 in the layout dot_rows reads for weights of element type TW (x_layout), Kp apart.
template <typename TW>
std::vector<float> padded_rows(const at::Tensor& x, int64_t Kp) {
  const int64_t M = x.size(0), K = x.size(1);
  std::vector<float> xp(M * Kp, 0.f);
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  for (int64_t m = 0; m < M; ++m) x_layout<TW>(xf.data_ptr<float>() + m * K, K, xp.data() + m * Kp);
  return xp;
}

// ---- int8 --------------------------------------------------------------------------------------------

constexpr int kQMax = 127;

// quant.quantize_rows of one row, exactly: scale = amax / 127 (1 for a zero row), q = round(x / scale).
float quantize_row(const float* x, int64_t K, int8_t* q) {
  float amax = 0.f;
  for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(x[k]));
  const float scale = amax > 0.f ? amax / static_cast<float>(kQMax) : 1.f;
  for (int64_t k = 0; k < K; ++k) {
    const float v = std::nearbyint(x[k] / scale);  // half to even, as torch.round
    q[k] = static_cast<int8_t>(std::clamp(v, -static_cast<float>(kQMax), static_cast<float>(kQMax)));
  }
  return scale;
}

constexpr int64_t kQB = 64;  // int8 column blocking: the padding unit of quantized rows (both ISAs)

// Exact int32 sums sum_k q[m, k] * w[n, k] for a tile of R weight rows; q rows hold Kp columns.
using Int8Tile = void (*)(const int8_t* q, int64_t Kp, int M, const int8_t* const* w, int R, int64_t K,
                          int32_t* acc /* [M][R] */);

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
inline int32_t hsum_epi32(__m256i v) {
  const __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  const __m128i t = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  return _mm_cvtsi128_si32(_mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1)));
}

// AVX2: |q| (u8) x sign(w, q) (s8) pairs into int16 (<= 2 * 127 * 127, no saturation), then int32.
template <int M, int R>
void int8_tile_avx2(const int8_t* q, int64_t Kp, const int8_t* const* w, int64_t K, int32_t* out) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i acc[M][R];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm256_setzero_si256();
  alignas(32) int8_t tail[R][32];
  for (int64_t k = 0; k < Kp; k += 32) {
    __m256i wv[R];
    for (int r = 0; r < R; ++r) {
      if (k + 32 <= K) {
        wv[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[r] + k));
      } else {
        std::memset(tail[r], 0, 32);
        if (k < K) std::memcpy(tail[r], w[r] + k, K - k);
        wv[r] = _mm256_load_si256(reinterpret_cast<const __m256i*>(tail[r]));
      }
    }
    for (int m = 0; m < M; ++m) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + m * Kp + k));
      const __m256i ax = _mm256_abs_epi8(xv);
      for (int r = 0; r < R; ++r) {
        const __m256i pairs = _mm256_maddubs_epi16(ax, _mm256_sign_epi8(wv[r], xv));
        acc[m][r] = _mm256_add_epi32(acc[m][r], _mm256_madd_epi16(pairs, ones));
      }
    }
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) out[m * R + r] = hsum_epi32(acc[m][r]);
}
#endif

#if defined(CPU_CAPABILITY_AVX512)
// AVX512-VNNI: (q + 128) as u8 times w as s8, four products a lane a step; 128 * sum(w) is taken off.
template <int M, int R>
__attribute__((target("avx512vnni"))) void int8_tile_vnni(const int8_t* q, int64_t Kp,
                                                          const int8_t* const* w, int64_t K, int32_t* out) {
  const __m512i bias = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512i acc[M][R], comp[R];
  for (int r = 0; r < R; ++r) comp[r] = _mm512_setzero_si512();
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_si512();
  for (int64_t k = 0; k < Kp; k += 64) {
    const __mmask64 mask = k + 64 <= K ? ~__mmask64(0) : (k < K ? (__mmask64(1) << (K - k)) - 1 : 0);
    __m512i wv[R];
    for (int r = 0; r < R; ++r) {
      wv[r] = _mm512_maskz_loadu_epi8(mask, w[r] + k);
      comp[r] = _mm512_dpbusd_epi32(comp[r], bias, wv[r]);
    }
    for (int m = 0; m < M; ++m) {
      // x ^ 0x80 is x + 128 as an unsigned byte
      const __m512i xv = _mm512_xor_si512(_mm512_loadu_si512(q + m * Kp + k), bias);
      for (int r = 0; r < R; ++r) acc[m][r] = _mm512_dpbusd_epi32(acc[m][r], xv, wv[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    const int32_t c = _mm512_reduce_add_epi32(comp[r]);
    for (int m = 0; m < M; ++m) out[m * R + r] = _mm512_reduce_add_epi32(acc[m][r]) - c;
  }
}

bool has_vnni() {
  static const bool yes = __builtin_cpu_supports("avx512vnni");
  return yes;
}
#endif

template <int M, int R>
void int8_tile(const int8_t* q, int64_t Kp, const int8_t* const* w, int64_t K, int32_t* out) {
#if defined(CPU_CAPABILITY_AVX512)
  if (has_vnni()) return int8_tile_vnni<M, R>(q, Kp, w, K, out);
#endif
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  return int8_tile_avx2<M, R>(q, Kp, w, K, out);
#else
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) {
      int32_t s = 0;
      for (int64_t k = 0; k < K; ++k) s += int32_t(q[m * Kp + k]) * int32_t(w[r][k]);
      out[m * R + r] = s;
    }
#endif
}

template <int M>
void int8_rows(const int8_t* q, int64_t Kp, const float* xs, const int8_t* w, const float* ws, const float* b,
               int64_t K, int64_t N, float* out) {
  constexpr int R = M <= 2 ? 4 : 2;
  const int64_t tiles = (N + R - 1) / R;
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(1, R * K));
  at::parallel_for(0, tiles, grain, [&](int64_t t0, int64_t t1) {
    int32_t acc[M * R];
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n = t * R;
      const int rows = static_cast<int>(std::min<int64_t>(R, N - n));
      const int8_t* wr[R];
      for (int r = 0; r < R; ++r) wr[r] = w + (n + std::min(r, rows - 1)) * K;
      int8_tile<M, R>(q, Kp, wr, K, acc);
      for (int m = 0; m < M; ++m)
        for (int r = 0; r < rows; ++r) {
          // The order of torch's `_int_mm(...).float() * x_scale * scale + bias`.
          // volatile: each product is rounded on its own, never contracted into an fma with the next.
          volatile float v = static_cast<float>(acc[m * R + r]) * xs[m];
          v = v * ws[n + r];
          out[m * N + n + r] = b != nullptr ? v + b[n + r] : v;
        }
    }
  });
}

}  // namespace

at::Tensor gemv(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  check_args(x, weight, bias);
  const auto dtype = weight.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "radixserve_cpu: gemv takes fp32 or bf16 weights");
  TORCH_CHECK(x.scalar_type() == dtype, "radixserve_cpu: gemv wants x of the weight's dtype");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  const at::Tensor bf = fp32_bias(bias);
  const float* b = bf.defined() ? bf.data_ptr<float>() : nullptr;
  if (dtype == at::kFloat) {
    const int64_t Kp = x_cols<float>(K);
    const std::vector<float> xp = padded_rows<float>(x, Kp);
    at::Tensor out = at::empty({M, N}, x.options());
    float* o = out.data_ptr<float>();
    dispatch_rows(M, xp.data(), Kp, weight.data_ptr<float>(), K, N,
                  [&](int m, int64_t n, float s) { o[m * N + n] = b != nullptr ? s + b[n] : s; });
    return out;
  }
  const int64_t Kp = x_cols<uint16_t>(K);
  const std::vector<float> xp = padded_rows<uint16_t>(x, Kp);
  at::Tensor out = at::empty({M, N}, x.options());
  auto* o = out.data_ptr<at::BFloat16>();
  const auto* w = reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>());
  dispatch_rows(M, xp.data(), Kp, w, K, N, [&](int m, int64_t n, float s) {
    o[m * N + n] = at::BFloat16(b != nullptr ? s + b[n] : s);  // rounds to nearest even
  });
  return out;
}

at::Tensor int8_gemv(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale,
                     const std::optional<at::Tensor>& bias) {
  check_args(x, qweight, bias);
  TORCH_CHECK(qweight.scalar_type() == at::kChar, "radixserve_cpu: int8_gemv wants int8 weights");
  TORCH_CHECK(x.scalar_type() == at::kFloat, "radixserve_cpu: int8_gemv wants fp32 activations");
  TORCH_CHECK(scale.dim() == 1 && scale.size(0) == qweight.size(0) && scale.scalar_type() == at::kFloat &&
                  scale.is_contiguous(),
              "radixserve_cpu: int8_gemv wants an fp32 scale per output channel");
  const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0);
  const int64_t Kp = round_up(K, kQB);
  std::vector<int8_t> q(M * Kp, 0);
  float xs[kGemvMaxRows];
  const at::Tensor xc = x.contiguous();
  for (int64_t m = 0; m < M; ++m) xs[m] = quantize_row(xc.data_ptr<float>() + m * K, K, q.data() + m * Kp);
  at::Tensor out = at::empty({M, N}, x.options());
  const at::Tensor bf = fp32_bias(bias);
  const float* b = bf.defined() ? bf.data_ptr<float>() : nullptr;
  const int8_t* w = qweight.data_ptr<int8_t>();
  const float* ws = scale.data_ptr<float>();
  float* o = out.data_ptr<float>();
  with_rows(M, [&](auto rows) { int8_rows<decltype(rows)::value>(q.data(), Kp, xs, w, ws, b, K, N, o); });
  return out;
}

std::tuple<at::Tensor, at::Tensor> quantize_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "radixserve_cpu: quantize_rows wants fp32 [M, K]");
  const at::Tensor xc = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  at::Tensor q = at::empty({M, K}, x.options().dtype(at::kChar));
  at::Tensor s = at::empty({M, 1}, x.options());
  const float* xp = xc.data_ptr<float>();
  int8_t* qp = q.data_ptr<int8_t>();
  float* sp = s.data_ptr<float>();
  at::parallel_for(0, M, std::max<int64_t>(1, 16384 / std::max<int64_t>(1, K)), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) sp[m] = quantize_row(xp + m * K, K, qp + m * K);
  });
  return {q, s};
}

bool cpu_has_vnni() {
  static const bool yes = __builtin_cpu_supports("avx512vnni") || __builtin_cpu_supports("avxvnni");
  return yes;
}

}  // namespace radixserve_cpu
