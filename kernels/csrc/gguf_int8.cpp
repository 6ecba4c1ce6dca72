// radixserve_cpu::gguf_int8_linear: x [M, K] fp32 times a weight held as GGUF blocks, in integer
// arithmetic: the approximate many-rows mode (`--prefill-arithmetic int8` over GGUF weights,
// model/arithmetic.py). The exact product is gguf_linear.cpp's.
//
// Why: prefill is compute-bound, and gguf_linear decodes every block to fp32 and multiplies at the
// fp32 peak. AVX512-VNNI's vpdpbusd does 64 int8 multiply-adds an instruction, four times an fp32 FMA.
//
// Types: every one whose weights are, per chunk of 32, one fp32 scale times small integers plus at
// most one fp32 minimum: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, and the k-quants Q4_K and Q5_K (a
// sub-block of 32 has one 6-bit scale and min). Q2_K, Q3_K and Q6_K scale every 16 weights: they stay
// on the exact kernel (model/gguf.py), which a llama.cpp Q4_K_M file uses for its Q6_K tensors only.
//
// The math (llama.cpp's Q8_0 / Q8_1 activations; our own code):
// - x is quantized per row and per 32-block: d = max|x| / 127, q = round-half-even(x / d) in int8
//   (fp32 scale, where llama.cpp stores an fp16 one), and s = sum(q) per block.
// - a chunk of weights is  w = d_w * (u - offset) + m_w  (chunk_values below): u the unsigned byte
//   values (a nibble, 5 bits, int8 + 128, IQ4_NL's level + 128), d_w and m_w exact fp32 (an fp16 scale
//   times a 6-bit integer at most), m_w only for the types with a minimum.
// - per weight row n and chunk b, an exact int32 dot  i = sum_j u[j] * q[j] - offset * s.
// - out[m, n] = sum_b  i * (d_w * d_x)  [+ m_w * (d_x * s) for a type with a minimum],
//   summed over b in order with one fused multiply-add each, then + bias.
// So the only rounding besides the activation quantization is fp32 summation over K/32 terms: the
// torch reference (tests/kernels/test_kernel_gguf_int8.py) matches within (2 K/32 + 2) ulp-sized
// multiples of the sum of |terms|, and the portable path below matches the VNNI one bit for bit.
//
// Layout: a tile of 32 weight rows is decoded once into [K/4 groups][32 rows][4 bytes] (each group's
// 4 bytes for 16 rows in one 64-byte register: one vpdpbusd multiplies 16 rows by 4 x values
// broadcast, and each broadcast serves two registers), with its d_w (and m_w) per block in
// [K/32][32] fp32; every x row of the step is then multiplied against the tile, 6 rows at a time
// (12 int32 + 12 fp32 accumulators in registers).
// Threads take tiles (at::parallel_for). No fp32 copy of the weights is made.
//
// Dispatch: the VNNI kernel is compiled with a function-level target (the rest of the library keeps
// its ISA flags, so no VNNI instruction leaks into other code) and runs only where the CPU reports
// avx512vnni (and avx512bw/vl); elsewhere the portable path (plain C++, slow) computes the same
// numbers, and model/arithmetic.py does not choose this mode (it logs why once).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "block_decode.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define RADIXSERVE_HAVE_VNNI_KERNEL 1
#define VNNI_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma")))
#endif

namespace radixserve_cpu {
namespace {

using blocks::half_at;
using blocks::kIQ4_NL;
using blocks::kQ4_0;
using blocks::kQ4_1;
using blocks::kQ4_K;
using blocks::kQ5_0;
using blocks::kQ5_1;
using blocks::kQ5_K;
using blocks::kQ8_0;

constexpr int64_t kBlock = 32;   // weights per chunk (a legacy block, an eighth of a k-quant one)
constexpr int64_t kGroups = 8;   // 4-byte groups per chunk
constexpr int64_t kTileRows = 32;  // weight rows per tile: two 512-bit registers of int32
constexpr int kMaxRows = 6;      // x rows per micro-kernel pass: 4 accumulators each, in registers

#define RADIXSERVE_INT8_TYPES "Q4_0=2, Q4_1=3, Q5_0=6, Q5_1=7, Q8_0=8, Q4_K=12, Q5_K=13, IQ4_NL=20"

constexpr bool takes(int64_t qtype) {
  switch (qtype) {
    case kQ4_0: case kQ4_1: case kQ5_0: case kQ5_1: case kQ8_0: case kQ4_K: case kQ5_K: case kIQ4_NL: return true;
    default: return false;
  }
}

// f(std::integral_constant<int64_t, Q>{}) for a type this kernel takes (checked).
template <typename F>
void with_int8_type(int64_t qtype, F&& f) {
  TORCH_CHECK(takes(qtype), "radixserve_cpu::gguf_int8_linear: unsupported block type ", qtype,
              " (supported: " RADIXSERVE_INT8_TYPES ")");
  blocks::with_type(qtype, [&](auto q) {
    if constexpr (takes(decltype(q)::value)) f(q);
  });
}

// What a type's unsigned byte values u stand for: weight = d_w * (u - offset) + m_w.
constexpr int32_t weight_offset(int64_t q) {
  return q == kQ4_0 ? 8 : q == kQ5_0 ? 16 : (q == kQ8_0 || q == kIQ4_NL) ? 128 : 0;
}
constexpr bool has_min(int64_t q) { return q == kQ4_1 || q == kQ5_1 || q == kQ4_K || q == kQ5_K; }

// Chunk c of the block at b (weights [32 c, 32 c + 32)) as its 32 unsigned values u in K order, its
// scale d_w and minimum m_w (0 for a type without one). The layouts are block_decode.h's.
template <int64_t Q>
void chunk_values(const uint8_t* b, int64_t c, uint8_t* u, float& dw, float& mw) {
  mw = 0.f;
  if constexpr (Q == kQ8_0) {
    dw = half_at(b);
    for (int64_t j = 0; j < kBlock; ++j) u[j] = b[2 + j] ^ 0x80;  // int8 + 128
  } else if constexpr (Q == kQ4_K || Q == kQ5_K) {
    // Sub-block c: w = (d * sc) * q - dmin * mn, both products exact in fp32.
    int sc, mn;
    blocks::k_scale_min(b + 4, c, sc, mn);
    dw = half_at(b) * static_cast<float>(sc);
    mw = -(half_at(b + 2) * static_cast<float>(mn));
    const uint8_t* qs = b + (Q == kQ5_K ? 48 : 16) + (c / 2) * 32;
    const int shift = static_cast<int>(c % 2) * 4;
    for (int64_t j = 0; j < kBlock; ++j) {
      int q = (qs[j] >> shift) & 0x0F;
      if constexpr (Q == kQ5_K) q |= ((b[16 + j] >> c) & 1) << 4;
      u[j] = static_cast<uint8_t>(q);
    }
  } else {
    // A legacy block: weight j is byte j's low nibble, weight j + 16 its high one (Q5_0/Q5_1: with
    // bit j of a little-endian uint32 as the fifth bit).
    constexpr bool five = Q == kQ5_0 || Q == kQ5_1;
    dw = half_at(b);
    if constexpr (has_min(Q)) mw = half_at(b + 2);
    uint32_t qh = 0;
    if constexpr (five) std::memcpy(&qh, b + (Q == kQ5_1 ? 4 : 2), 4);
    const uint8_t* qs = b + (Q == kQ4_1 ? 4 : Q == kQ5_0 ? 6 : Q == kQ5_1 ? 8 : 2);
    for (int64_t j = 0; j < kBlock / 2; ++j) {
      int lo = qs[j] & 0x0F, hi = qs[j] >> 4;
      if constexpr (five) {
        lo |= static_cast<int>((qh >> j) & 1) << 4;
        hi |= static_cast<int>((qh >> (j + 16)) & 1) << 4;
      }
      if constexpr (Q == kIQ4_NL) {
        lo = blocks::kIQ4NLLevels[lo] + 128;
        hi = blocks::kIQ4NLLevels[hi] + 128;
      }
      u[j] = static_cast<uint8_t>(lo);
      u[j + 16] = static_cast<uint8_t>(hi);
    }
  }
}

// x quantized per 32-block: q [M, K] int8, d [M, K/32] fp32, s [M, K/32] int32 (sum of q), and
// ds = d * s in fp32 (Q4_1's min term).
struct QuantX {
  const int8_t* q;
  const float* d;
  const int32_t* s;
  const float* ds;
  int64_t K, nb;
};

// One block of x: the scale and round-half-even as torch.round (the reference's) does it.
inline void quantize_block_portable(const float* x, int8_t* q, float* d_out, int32_t* s_out) {
  float amax = 0.f;
  for (int64_t j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(x[j]));
  const float d = amax / 127.f;
  const float id = d != 0.f ? 1.f / d : 0.f;
  int32_t s = 0;
  for (int64_t j = 0; j < kBlock; ++j) {
    const auto v = static_cast<int32_t>(std::nearbyint(x[j] * id));
    q[j] = static_cast<int8_t>(v);
    s += v;
  }
  *d_out = d;
  *s_out = s;
}

// A tile of weight rows [n0, n0 + rows), decoded: u [nb][8][16][4] bytes, dw and mw [nb][16].
// Rows past `rows` are zero (their outputs are not stored).
struct Tile {
  std::vector<uint8_t> u;
  std::vector<float> dw, mw;
  void size_for(int64_t nb) {
    u.assign(nb * kGroups * kTileRows * 4, 0);
    dw.assign(nb * kTileRows, 0.f);
    mw.assign(nb * kTileRows, 0.f);
  }
};

template <int64_t Q>
void decode_tile(const uint8_t* w, int64_t row_bytes, int64_t nb, int64_t n0, int64_t rows, Tile& t) {
  constexpr int64_t per = blocks::weights_of(Q) / kBlock, bb = blocks::bytes_of(Q);
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* row = w + (n0 + r) * row_bytes;
    for (int64_t b = 0; b < nb; ++b) {
      uint8_t vals[kBlock];  // the chunk's 32 unsigned byte values in K order
      chunk_values<Q>(row + b / per * bb, b % per, vals, t.dw[b * kTileRows + r], t.mw[b * kTileRows + r]);
      uint8_t* dst = t.u.data() + b * kGroups * kTileRows * 4 + r * 4;
      for (int64_t g = 0; g < kGroups; ++g) std::memcpy(dst + g * kTileRows * 4, vals + g * 4, 4);
    }
  }
  for (int64_t r = rows; r < kTileRows; ++r)  // a short last tile: zero weights, zero scales
    for (int64_t b = 0; b < nb; ++b) {
      t.dw[b * kTileRows + r] = 0.f;
      t.mw[b * kTileRows + r] = 0.f;
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
        const int32_t s = x.s[m * x.nb + b];
        int32_t i = -off * s;
        const uint8_t* u = t.u.data() + b * kGroups * kTileRows * 4 + r * 4;
        const int8_t* q = x.q + m * x.K + b * kBlock;
        for (int64_t g = 0; g < kGroups; ++g)
          for (int64_t j = 0; j < 4; ++j) i += static_cast<int32_t>(u[g * kTileRows * 4 + j]) * q[g * 4 + j];
        const float dx = x.d[m * x.nb + b];
        acc = std::fma(static_cast<float>(i), t.dw[b * kTileRows + r] * dx, acc);
        if constexpr (has_min(Q)) acc = std::fma(t.mw[b * kTileRows + r], x.ds[m * x.nb + b], acc);
      }
      o.out[m * o.N + n0 + r] = o.bias != nullptr ? acc + o.bias[n0 + r] : acc;
    }
  }
}

#ifdef RADIXSERVE_HAVE_VNNI_KERNEL

VNNI_TARGET void quantize_row_vnni(const float* x, int64_t nb, int8_t* q, float* d, int32_t* s, float* ds) {
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
    s[b] = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
    ds[b] = db * static_cast<float>(s[b]);
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
    for (int r = 0; r < R; ++r)
      isum[r][0] = isum[r][1] = _mm512_set1_epi32(-off * x.s[(m0 + r) * x.nb + b]);
    const int8_t* qb = x.q + m0 * x.K + b * kBlock;
    const uint8_t* ub = u + b * kGroups * kTileRows * 4;
    for (int64_t g = 0; g < kGroups; ++g) {
      const __m512i w0 = _mm512_loadu_si512(ub + g * kTileRows * 4);
      const __m512i w1 = _mm512_loadu_si512(ub + g * kTileRows * 4 + 64);
      for (int r = 0; r < R; ++r) {
        int32_t four;
        std::memcpy(&four, qb + r * x.K + g * 4, 4);
        const __m512i xv = _mm512_set1_epi32(four);
        isum[r][0] = _mm512_dpbusd_epi32(isum[r][0], w0, xv);
        isum[r][1] = _mm512_dpbusd_epi32(isum[r][1], w1, xv);
      }
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

template <int64_t Q, int R = kMaxRows>
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
    tile.size_for(x.nb);
    for (int64_t ti = t0; ti < t1; ++ti) {
      const int64_t n0 = ti * kTileRows, rows = std::min(kTileRows, N - n0);
      decode_tile<Q>(w, row_bytes, x.nb, n0, rows, tile);
#ifdef RADIXSERVE_HAVE_VNNI_KERNEL
      if (vnni) {
        for (int64_t m0 = 0; m0 < M; m0 += kMaxRows)
          tile_rows_vnni_dispatch<Q>(static_cast<int>(std::min<int64_t>(kMaxRows, M - m0)), x, tile, m0, n0, rows, o);
        continue;
      }
#endif
      tile_rows_portable<Q>(x, tile, 0, M, n0, rows, o);
    }
  });
}

void quantize(const at::Tensor& x, at::Tensor& q, at::Tensor& d, at::Tensor& s, float* ds, bool vnni) {
  const int64_t M = x.size(0), K = x.size(1), nb = K / kBlock, ldx = x.stride(0);
  const float* xp = x.data_ptr<float>();
  int8_t* qp = q.data_ptr<int8_t>();
  float* dp = d.data_ptr<float>();
  int32_t* sp = s.data_ptr<int32_t>();
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
#ifdef RADIXSERVE_HAVE_VNNI_KERNEL
      if (vnni) {
        quantize_row_vnni(xp + m * ldx, nb, qp + m * K, dp + m * nb, sp + m * nb, ds + m * nb);
        continue;
      }
#endif
      for (int64_t b = 0; b < nb; ++b) {
        quantize_block_portable(xp + m * ldx + b * kBlock, qp + m * K + b * kBlock, dp + m * nb + b, sp + m * nb + b);
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
  if (M > 0) quantize(x, q, d, s, ds.data(), cpu_has_vnni() && !portable);
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
  quantize(x, q, d, s, ds.data(), vnni);
  const QuantX qx{q.data_ptr<int8_t>(), d.data_ptr<float>(), s.data_ptr<int32_t>(), ds.data(), K, nb};
  const Out o{out.data_ptr<float>(), N, bias.defined() ? bias.data_ptr<float>() : nullptr};
  const uint8_t* w = blocks.data_ptr<uint8_t>();
  with_int8_type(qtype, [&](auto q) { run<decltype(q)::value>(qx, w, rb, M, N, o, vnni); });
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
