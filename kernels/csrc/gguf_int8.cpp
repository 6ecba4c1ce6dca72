// radixserve_cpu::gguf_int8_linear: x [M, K] fp32 times a weight held as GGUF blocks, in integer
// arithmetic: the approximate many-rows mode (`--prefill-arithmetic int8` over GGUF weights,
// model/arithmetic.py). The exact product is gguf_linear.cpp's.
//
// Why: prefill is compute-bound, and gguf_linear decodes every block to fp32 and multiplies at the
// fp32 peak. AVX512-VNNI's vpdpbusd does 64 int8 multiply-adds an instruction, four times an fp32 FMA.
//
// Types: those with an integer form (block_ints.h): every type but Q2_K, whose min per 16 weights
// stays on the exact kernel. The math (llama.cpp's Q8_0 / Q8_1 activations; our own code):
// - x is quantized per row and per 32-block: d = max|x| / 127, q = round-half-even(x / d) in int8
//   (fp32 scale, where llama.cpp stores an fp16 one), and s = sum(q) per block.
// - a chunk of weights is  w = d_w * k_h * (u - offset) + m_w  (block_ints.h), so per weight row n and
//   chunk b the dot is exact in int32:  i = sum_j u[j] * q[j] - offset * s  (a split type: each half's,
//   times its k_h, summed).
// - out[m, n] = sum_b  i * (d_w * d_x)  [+ m_w * (d_x * s) for a type with a minimum],
//   summed over b in order with one fused multiply-add each, then + bias.
// So the only rounding besides the activation quantization is fp32 summation over K/32 terms (and a
// split type's dot, which can pass 2^24, rounded to fp32 as the reference rounds it): the
// torch reference (tests/kernels/test_kernel_gguf_int8.py) matches within (2 K/32 + 2) ulp-sized
// multiples of the sum of |terms|, and the portable path below matches the VNNI one bit for bit.
//
// Layout: a tile of 32 weight rows is decoded once into [K/4 groups][32 rows][4 bytes] (each group's
// 4 bytes for 16 rows in one 64-byte register: one vpdpbusd multiplies 16 rows by 4 x values
// broadcast, and each broadcast serves two registers), with its d_w (and m_w) per block in
// [K/32][32] fp32; every x row of the step is then multiplied against the tile, 6 rows at a time
// (12 int32 + 12 fp32 accumulators in registers; 4 rows for a split type, which needs 8 more).
// Threads take tiles (at::parallel_for). No fp32 copy of the weights is made.
//
// Dispatch: the VNNI kernel is compiled with a function-level target (the rest of the library keeps
// its ISA flags, so no VNNI instruction leaks into other code) and runs only where the CPU reports
// avx512vnni (and avx512bw/vl); elsewhere the portable path (plain C++, slow) computes the same
// numbers, and model/arithmetic.py does not choose this mode (it logs why once).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "block_ints.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define RADIXSERVE_HAVE_VNNI_KERNEL 1
#define VNNI_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma")))
#endif

namespace radixserve_cpu {
namespace {

using ints::chunk_values;
using ints::has_min;
using ints::kBlock;
using ints::split;
using ints::takes;
using ints::weight_offset;

constexpr int64_t kGroups = 8;   // 4-byte groups per chunk
constexpr int64_t kTileRows = 32;  // weight rows per tile: two 512-bit registers of int32
constexpr int kMaxRows = 6;      // x rows per micro-kernel pass: 4 accumulators each, in registers

// x rows a pass of the VNNI kernel: a split type keeps a third set of accumulators in registers.
constexpr int max_rows(int64_t q) { return split(q) ? 4 : kMaxRows; }

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

// A tile of weight rows [n0, n0 + rows), decoded: u [nb][8][32][4] bytes, dw and mw [nb][32], and a
// split type's half scales k [nb][2][32] (empty for the others). Rows past `rows` are zero (their
// outputs are not stored).
struct Tile {
  std::vector<uint8_t> u;
  std::vector<float> dw, mw;
  std::vector<int32_t> k;
  void size_for(int64_t nb, bool halves) {
    u.assign(nb * kGroups * kTileRows * 4, 0);
    dw.assign(nb * kTileRows, 0.f);
    mw.assign(nb * kTileRows, 0.f);
    k.assign(halves ? nb * 2 * kTileRows : 0, 0);
  }
};

template <int64_t Q>
void decode_tile(const uint8_t* w, int64_t row_bytes, int64_t nb, int64_t n0, int64_t rows, Tile& t) {
  constexpr int64_t per = blocks::weights_of(Q) / kBlock, bb = blocks::bytes_of(Q);
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* row = w + (n0 + r) * row_bytes;
    for (int64_t b = 0; b < nb; ++b) {
      uint8_t vals[kBlock];  // the chunk's 32 unsigned byte values in K order
      int32_t k[2] = {0, 0};
      chunk_values<Q>(row + b / per * bb, b % per, vals, t.dw[b * kTileRows + r], t.mw[b * kTileRows + r], k);
      if constexpr (split(Q)) {
        t.k[(2 * b) * kTileRows + r] = k[0];
        t.k[(2 * b + 1) * kTileRows + r] = k[1];
      }
      uint8_t* dst = t.u.data() + b * kGroups * kTileRows * 4 + r * 4;
      for (int64_t g = 0; g < kGroups; ++g) std::memcpy(dst + g * kTileRows * 4, vals + g * 4, 4);
    }
  }
  for (int64_t r = rows; r < kTileRows; ++r)  // a short last tile: zero weights, zero scales
    for (int64_t b = 0; b < nb; ++b) {
      t.dw[b * kTileRows + r] = 0.f;
      t.mw[b * kTileRows + r] = 0.f;
      if constexpr (split(Q)) t.k[(2 * b) * kTileRows + r] = t.k[(2 * b + 1) * kTileRows + r] = 0;
      uint8_t* dst = t.u.data() + b * kGroups * kTileRows * 4 + r * 4;
      for (int64_t g = 0; g < kGroups; ++g) std::memset(dst + g * kTileRows * 4, 0, 4);
    }
}

struct Out {
  float* out;  // [M, N]
  int64_t N;
  const float* bias;  // [N] or nullptr
};

// The portable path: the same integer sums and the same fp32 operations in the same order (one
// std::fma per block), so its output equals the VNNI kernel's bit for bit.
template <int64_t Q>
void tile_rows_portable(const QuantX& x, const Tile& t, int64_t m0, int64_t m1, int64_t n0, int64_t rows,
                        const Out& o) {
  const int32_t off = weight_offset(Q);
  for (int64_t m = m0; m < m1; ++m) {
    for (int64_t r = 0; r < rows; ++r) {
      float acc = 0.f;
      for (int64_t b = 0; b < x.nb; ++b) {
        const uint8_t* u = t.u.data() + b * kGroups * kTileRows * 4 + r * 4;
        const int8_t* q = x.q + m * x.K + b * kBlock;
        // The integer dot of groups [g0, g1) of the chunk, from `start`.
        const auto dot = [&](int64_t g0, int64_t g1, int32_t start) {
          for (int64_t g = g0; g < g1; ++g)
            for (int64_t j = 0; j < 4; ++j) start += static_cast<int32_t>(u[g * kTileRows * 4 + j]) * q[g * 4 + j];
          return start;
        };
        int32_t i;
        if constexpr (split(Q)) {
          const int32_t* s2 = x.s2 + m * 2 * x.nb + 2 * b;
          i = t.k[(2 * b) * kTileRows + r] * dot(0, kGroups / 2, -off * s2[0]) +
              t.k[(2 * b + 1) * kTileRows + r] * dot(kGroups / 2, kGroups, -off * s2[1]);
        } else {
          i = dot(0, kGroups, -off * x.s[m * x.nb + b]);
        }
        const float dx = x.d[m * x.nb + b];
        acc = std::fma(static_cast<float>(i), t.dw[b * kTileRows + r] * dx, acc);
        if constexpr (has_min(Q)) acc = std::fma(t.mw[b * kTileRows + r], x.ds[m * x.nb + b], acc);
      }
      o.out[m * o.N + n0 + r] = o.bias != nullptr ? acc + o.bias[n0 + r] : acc;
    }
  }
}

#ifdef RADIXSERVE_HAVE_VNNI_KERNEL

VNNI_TARGET void quantize_row_vnni(const float* x, int64_t nb, int8_t* q, float* d, int32_t* s, float* ds,
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

// isum[r] += the integer dots of groups [g0, g1) of a decoded chunk (ub) with x row r's int8 values
// (qb, rows ldq apart): one vpdpbusd per 16 weight rows and 4 x values broadcast.
template <int R>
VNNI_TARGET inline void dot_groups(__m512i (&isum)[R][2], const int8_t* qb, int64_t ldq, const uint8_t* ub,
                                   int64_t g0, int64_t g1) {
  for (int64_t g = g0; g < g1; ++g) {
    const __m512i w0 = _mm512_loadu_si512(ub + g * kTileRows * 4);
    const __m512i w1 = _mm512_loadu_si512(ub + g * kTileRows * 4 + 64);
    for (int r = 0; r < R; ++r) {
      int32_t four;
      std::memcpy(&four, qb + r * ldq + g * 4, 4);
      const __m512i xv = _mm512_set1_epi32(four);
      isum[r][0] = _mm512_dpbusd_epi32(isum[r][0], w0, xv);
      isum[r][1] = _mm512_dpbusd_epi32(isum[r][1], w1, xv);
    }
  }
}

// x rows [m0, m0 + R) against one decoded tile: per row, 2 int32 and 2 fp32 accumulators of 16
// weight rows each.
template <int64_t Q, int R>
VNNI_TARGET void tile_rows_vnni(const QuantX& x, const Tile& t, int64_t m0, int64_t n0, int64_t rows,
                                const Out& o) {
  const int32_t off = weight_offset(Q);
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const uint8_t* u = t.u.data();
  for (int64_t b = 0; b < x.nb; ++b) {
    __m512i isum[R][2];
    const int8_t* qb = x.q + m0 * x.K + b * kBlock;
    const uint8_t* ub = u + b * kGroups * kTileRows * 4;
    if constexpr (split(Q)) {
      // Each half's sum times its rows' integer scales, in int32 (exact: |sum| < 2^18, |k| <= 128).
      __m512i whole[R][2];
      for (int h = 0; h < 2; ++h) {
        for (int r = 0; r < R; ++r)
          isum[r][0] = isum[r][1] = _mm512_set1_epi32(-off * x.s2[(m0 + r) * 2 * x.nb + 2 * b + h]);
        dot_groups<R>(isum, qb, x.K, ub, h * kGroups / 2, (h + 1) * kGroups / 2);
        const int32_t* k = t.k.data() + (2 * b + h) * kTileRows;
        const __m512i k0 = _mm512_loadu_si512(k), k1 = _mm512_loadu_si512(k + 16);
        for (int r = 0; r < R; ++r) {
          const __m512i p0 = _mm512_mullo_epi32(isum[r][0], k0), p1 = _mm512_mullo_epi32(isum[r][1], k1);
          whole[r][0] = h == 0 ? p0 : _mm512_add_epi32(whole[r][0], p0);
          whole[r][1] = h == 0 ? p1 : _mm512_add_epi32(whole[r][1], p1);
        }
      }
      for (int r = 0; r < R; ++r) {
        isum[r][0] = whole[r][0];
        isum[r][1] = whole[r][1];
      }
    } else {
      for (int r = 0; r < R; ++r)
        isum[r][0] = isum[r][1] = _mm512_set1_epi32(-off * x.s[(m0 + r) * x.nb + b]);
      dot_groups<R>(isum, qb, x.K, ub, 0, kGroups);
    }
    const __m512 dw0 = _mm512_loadu_ps(t.dw.data() + b * kTileRows);
    const __m512 dw1 = _mm512_loadu_ps(t.dw.data() + b * kTileRows + 16);
    for (int r = 0; r < R; ++r) {
      const __m512 dx = _mm512_set1_ps(x.d[(m0 + r) * x.nb + b]);
      acc[r][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r][0]), _mm512_mul_ps(dw0, dx), acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r][1]), _mm512_mul_ps(dw1, dx), acc[r][1]);
    }
    if constexpr (has_min(Q)) {
      const __m512 mw0 = _mm512_loadu_ps(t.mw.data() + b * kTileRows);
      const __m512 mw1 = _mm512_loadu_ps(t.mw.data() + b * kTileRows + 16);
      for (int r = 0; r < R; ++r) {
        const __m512 ds = _mm512_set1_ps(x.ds[(m0 + r) * x.nb + b]);
        acc[r][0] = _mm512_fmadd_ps(mw0, ds, acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(mw1, ds, acc[r][1]);
      }
    }
  }
  for (int h = 0; h < 2; ++h) {
    const int64_t live = std::clamp<int64_t>(rows - 16 * h, 0, 16);
    if (live == 0) break;
    const __mmask16 mask = static_cast<__mmask16>((1u << live) - 1u);
    const float* bias_h = o.bias != nullptr ? o.bias + n0 + 16 * h : nullptr;
    const __m512 bias = bias_h != nullptr ? _mm512_maskz_loadu_ps(mask, bias_h) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) {
      const __m512 v = bias_h != nullptr ? _mm512_add_ps(acc[r][h], bias) : acc[r][h];
      _mm512_mask_storeu_ps(o.out + (m0 + r) * o.N + n0 + 16 * h, mask, v);
    }
  }
}

template <int64_t Q, int R = max_rows(Q)>
void tile_rows_vnni_dispatch(int rows_x, const QuantX& x, const Tile& t, int64_t m0, int64_t n0, int64_t rows,
                             const Out& o) {
  if constexpr (R > 1) {
    if (rows_x < R) return tile_rows_vnni_dispatch<Q, R - 1>(rows_x, x, t, m0, n0, rows, o);
  }
  tile_rows_vnni<Q, R>(x, t, m0, n0, rows, o);
}

bool cpu_has_vnni() {
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("avx512vnni");
  }();
  return has;
}

#else
bool cpu_has_vnni() { return false; }
#endif

template <int64_t Q>
void run(const QuantX& x, const uint8_t* w, int64_t row_bytes, int64_t M, int64_t N, const Out& o, bool vnni) {
  const int64_t tiles = (N + kTileRows - 1) / kTileRows;
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    static thread_local Tile tile;
    tile.size_for(x.nb, split(Q));
    for (int64_t ti = t0; ti < t1; ++ti) {
      const int64_t n0 = ti * kTileRows, rows = std::min(kTileRows, N - n0);
      decode_tile<Q>(w, row_bytes, x.nb, n0, rows, tile);
#ifdef RADIXSERVE_HAVE_VNNI_KERNEL
      if (vnni) {
        for (int64_t m0 = 0; m0 < M; m0 += max_rows(Q))
          tile_rows_vnni_dispatch<Q>(static_cast<int>(std::min<int64_t>(max_rows(Q), M - m0)), x, tile, m0, n0, rows, o);
        continue;
      }
#endif
      tile_rows_portable<Q>(x, tile, 0, M, n0, rows, o);
    }
  });
}

void quantize(const at::Tensor& x, at::Tensor& q, at::Tensor& d, at::Tensor& s, float* ds, int32_t* s2,
              bool vnni) {
  const int64_t M = x.size(0), K = x.size(1), nb = K / kBlock, ldx = x.stride(0);
  const float* xp = x.data_ptr<float>();
  int8_t* qp = q.data_ptr<int8_t>();
  float* dp = d.data_ptr<float>();
  int32_t* sp = s.data_ptr<int32_t>();
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
#ifdef RADIXSERVE_HAVE_VNNI_KERNEL
      if (vnni) {
        quantize_row_vnni(xp + m * ldx, nb, qp + m * K, dp + m * nb, sp + m * nb, ds + m * nb, s2 + m * 2 * nb);
        continue;
      }
#endif
      for (int64_t b = 0; b < nb; ++b) {
        quantize_block_portable(xp + m * ldx + b * kBlock, qp + m * K + b * kBlock, dp + m * nb + b, sp + m * nb + b,
                                s2 + m * 2 * nb + 2 * b);
        ds[m * nb + b] = dp[m * nb + b] * static_cast<float>(sp[m * nb + b]);
      }
    }
  });
}

void check_x(const at::Tensor& x, int64_t K, const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) == K, "radixserve_cpu::", op,
              ": x must be float32 [M, ", K, "], got ", x.sizes(), " ", x.scalar_type());
  TORCH_CHECK(K % kBlock == 0, "radixserve_cpu::", op, ": K (", K, ") must be a multiple of 32");
}

// (q int8 [M, K], d fp32 [M, K/32], s int32 [M, K/32]): x's activation blocks, as the product uses them.
std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_q8_blocks(const at::Tensor& x_in, bool portable) {
  check_x(x_in, x_in.size(-1), "quantize_q8_blocks");
  const at::Tensor x = x_in.stride(1) == 1 ? x_in : x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  at::Tensor q = at::empty({M, K}, x.options().dtype(at::kChar));
  at::Tensor d = at::empty({M, K / kBlock}, x.options());
  at::Tensor s = at::empty({M, K / kBlock}, x.options().dtype(at::kInt));
  std::vector<float> ds(M * (K / kBlock));
  std::vector<int32_t> s2(2 * M * (K / kBlock));
  if (M > 0) quantize(x, q, d, s, ds.data(), s2.data(), cpu_has_vnni() && !portable);
  return {q, d, s};
}

at::Tensor gguf_int8_linear(const at::Tensor& x_in, const at::Tensor& blocks_in, int64_t qtype, int64_t K,
                            const std::optional<at::Tensor>& bias_in, bool portable) {
  check_x(x_in, K, "gguf_int8_linear");
  TORCH_CHECK(takes(qtype), "radixserve_cpu::gguf_int8_linear: unsupported block type ", qtype,
              " (supported: " RADIXSERVE_INT8_TYPES ")");
  const int64_t rb = blocks::block_row_bytes(qtype, K);
  TORCH_CHECK(blocks_in.dim() == 2 && blocks_in.scalar_type() == at::kByte && blocks_in.size(1) == rb,
              "radixserve_cpu::gguf_int8_linear: blocks must be uint8 [N, ", rb, "], got ", blocks_in.sizes(), " ",
              blocks_in.scalar_type());
  const at::Tensor x = x_in.stride(1) == 1 ? x_in : x_in.contiguous();
  const at::Tensor blocks = blocks_in.contiguous();
  const int64_t M = x.size(0), N = blocks.size(0), nb = K / kBlock;
  at::Tensor bias;
  if (bias_in.has_value()) {
    bias = bias_in->contiguous();
    TORCH_CHECK(bias.dim() == 1 && bias.size(0) == N && bias.scalar_type() == at::kFloat,
                "radixserve_cpu::gguf_int8_linear: bias must be float32 [", N, "]");
  }
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  const bool vnni = cpu_has_vnni() && !portable;
  at::Tensor q = at::empty({M, K}, x.options().dtype(at::kChar));
  at::Tensor d = at::empty({M, nb}, x.options());
  at::Tensor s = at::empty({M, nb}, x.options().dtype(at::kInt));
  std::vector<float> ds(M * nb);
  std::vector<int32_t> s2(2 * M * nb);
  quantize(x, q, d, s, ds.data(), s2.data(), vnni);
  const QuantX qx{q.data_ptr<int8_t>(), d.data_ptr<float>(), s.data_ptr<int32_t>(), ds.data(), s2.data(), K, nb};
  const Out o{out.data_ptr<float>(), N, bias.defined() ? bias.data_ptr<float>() : nullptr};
  const uint8_t* w = blocks.data_ptr<uint8_t>();
  blocks::with_type(qtype, [&](auto q) {  // takes(qtype) was checked above
    if constexpr (takes(decltype(q)::value)) run<decltype(q)::value>(qx, w, rb, M, N, o, vnni);
  });
  return out;
}

bool gguf_int8_vnni() { return cpu_has_vnni(); }

}  // namespace
}  // namespace radixserve_cpu

TORCH_LIBRARY_FRAGMENT(radixserve_cpu, m) {
  m.def("gguf_int8_linear(Tensor x, Tensor blocks, int qtype, int K, Tensor? bias, bool portable=False) -> Tensor");
  m.def("quantize_q8_blocks(Tensor x, bool portable=False) -> (Tensor, Tensor, Tensor)");
  m.def("gguf_int8_vnni() -> bool", &radixserve_cpu::gguf_int8_vnni);  // no tensor: a catch-all kernel
}

TORCH_LIBRARY_IMPL(radixserve_cpu, CPU, m) {
  m.impl("gguf_int8_linear", &radixserve_cpu::gguf_int8_linear);
  m.impl("quantize_q8_blocks", &radixserve_cpu::quantize_q8_blocks);
}
