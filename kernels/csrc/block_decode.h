// GGUF block formats decoded in fp32, 32 weights (a chunk) at a time: the decoding that every block
// kernel shares (block_rows.h, gguf_linear.cpp, native_step.cpp).
//
// Every type is decoded a chunk of 32 weights at a time: a legacy block (Q4_0, Q4_1, Q5_0, Q5_1,
// Q8_0, IQ4_NL) is one chunk, a k-quant super-block (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K: 256 weights) eight,
// each with its own sub-block scales. So the products' loops are the same for every type (a chunk of
// x times a chunk of weights), and a type is only its decoding. The layouts are gguf.quants' (and
// radixserve/model/gguf_blocks.py's, their torch reference).
#pragma once

#include <ATen/ATen.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

namespace radixserve_cpu::blocks {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kVS = Vec::size();
constexpr int64_t kChunk = 32;                   // weights decoded at a time, every type
constexpr int64_t kVecsPerChunk = kChunk / kVS;  // 2 with AVX-512, 4 with AVX2 (and the scalar build)
static_assert(kChunk % kVS == 0, "a chunk must hold whole vectors");

// GGML type ids (gguf.GGMLQuantizationType).
constexpr int64_t kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ2_K = 10, kQ3_K = 11,
                  kQ4_K = 12, kQ5_K = 13, kQ6_K = 14, kIQ4_NL = 20;

// Bytes of one block of type q, 0 for a type this file does not decode.
constexpr int64_t bytes_of(int64_t q) {
  switch (q) {
    case kQ4_0: return 18;    // fp16 d, 16 bytes of nibbles
    case kQ4_1: return 20;    // fp16 d, fp16 m, 16 bytes of nibbles
    case kQ5_0: return 22;    // fp16 d, 4 bytes of high bits, 16 bytes of nibbles
    case kQ5_1: return 24;    // fp16 d, fp16 m, 4 bytes of high bits, 16 bytes of nibbles
    case kQ8_0: return 34;    // fp16 d, 32 int8
    case kIQ4_NL: return 18;  // fp16 d, 16 bytes of nibbles indexing 16 levels
    case kQ2_K: return 84;    // 16 scale/min nibble pairs, 64 bytes of 2-bit values, fp16 d, dmin
    case kQ3_K: return 110;   // 32 bytes of high bits, 64 of 2-bit values, 12 of 6-bit scales, fp16 d
    case kQ4_K: return 144;   // fp16 d, dmin, 12 bytes of 6-bit scales and mins, 128 of nibbles
    case kQ5_K: return 176;   // as Q4_K, with 32 bytes of high bits before the nibbles
    case kQ6_K: return 210;   // 128 bytes of nibbles, 64 of 2-bit highs, 16 int8 scales, fp16 d
    default: return 0;
  }
}

// Weights per block: 256 for a k-quant super-block, 32 for the others.
constexpr int64_t weights_of(int64_t q) { return q >= kQ2_K && q <= kQ6_K ? 256 : 32; }

#define RADIXSERVE_BLOCK_TYPES "Q4_0=2, Q4_1=3, Q5_0=6, Q5_1=7, Q8_0=8, Q2_K=10, Q3_K=11, Q4_K=12, Q5_K=13, Q6_K=14, IQ4_NL=20"

inline int64_t block_bytes(int64_t qtype) {
  const int64_t b = bytes_of(qtype);
  TORCH_CHECK(b > 0, "radixserve_cpu: unsupported GGUF block type ", qtype, " (supported: " RADIXSERVE_BLOCK_TYPES ")");
  return b;
}

// Bytes of a row of K weights of type qtype (K whole blocks, checked).
inline int64_t block_row_bytes(int64_t qtype, int64_t K) {
  const int64_t bb = block_bytes(qtype);
  TORCH_CHECK(K % weights_of(qtype) == 0, "radixserve_cpu: K (", K, ") is not whole blocks of ",
              weights_of(qtype), " weights of GGUF type ", qtype);
  return K / weights_of(qtype) * bb;
}

// The checked operands of a product over block rows (gguf_linear, gguf_bf16_linear): x float32 [M, K]
// (its rows may be strided), blocks uint8 [N, block_row_bytes(qtype, K)] made contiguous, bias float32
// [N] or undefined. `op` names the op in the errors.
struct Operands {
  at::Tensor x, blocks, bias;
};

inline Operands checked_operands(const char* op, const at::Tensor& x_in, const at::Tensor& blocks_in, int64_t qtype,
                                 int64_t K, const std::optional<at::Tensor>& bias_in) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat && x_in.size(1) == K, "radixserve_cpu::", op,
              ": x must be float32 [M, ", K, "], got ", x_in.sizes(), " ", x_in.scalar_type());
  const int64_t rb = block_row_bytes(qtype, K);
  TORCH_CHECK(blocks_in.dim() == 2 && blocks_in.scalar_type() == at::kByte && blocks_in.size(1) == rb,
              "radixserve_cpu::", op, ": blocks must be uint8 [N, ", rb, "], got ", blocks_in.sizes(), " ",
              blocks_in.scalar_type());
  Operands o{x_in.stride(1) == 1 ? x_in : x_in.contiguous(), blocks_in.contiguous(), at::Tensor()};
  if (bias_in.has_value()) {
    o.bias = bias_in->contiguous();
    TORCH_CHECK(o.bias.dim() == 1 && o.bias.size(0) == o.blocks.size(0) && o.bias.scalar_type() == at::kFloat,
                "radixserve_cpu::", op, ": bias must be float32 [", o.blocks.size(0), "]");
  }
  return o;
}

inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return c10::detail::fp16_ieee_to_fp32_value(h);
}

constexpr int8_t kIQ4NLLevels[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

// Q4_K/Q5_K's 6-bit scale and min of sub-block j from their 12 packed bytes s (llama.cpp's layout).
inline void k_scale_min(const uint8_t* s, int64_t j, int& sc, int& mn) {
  if (j < 4) {
    sc = s[j] & 63;
    mn = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
    mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// Where chunk c of a Q6_K block lies: half g = c / 4 of the block; within it chunk t = c % 4 takes
// nibbles (low for t < 2, shift sl) of its 32 bytes at ql and 2 bits (shift sh) of the high bytes at
// qh; its two int8 scales (one per 16 weights) at scales.
struct Q6KChunk {
  const uint8_t* ql;
  const uint8_t* qh;
  const int8_t* scales;
  float d;
  int sl, sh;
  Q6KChunk(const uint8_t* b, int64_t c)
      : ql(b + c / 4 * 64 + c % 2 * 32),
        qh(b + 128 + c / 4 * 32),
        scales(reinterpret_cast<const int8_t*>(b + 192) + 2 * c),
        d(half_at(b + 208)),
        sl(static_cast<int>(c % 4 / 2) * 4),
        sh(static_cast<int>(c % 4) * 2) {}
};

// Weights [32 c, 32 c + 32) of the block at b, in fp32, as gguf.quants computes them: each is an exact
// product of an fp16 scale and small integers, plus or minus at most one value, so one rounding.
template <int64_t Q>
inline void decode_scalar(const uint8_t* b, int64_t c, float* w) {
  if constexpr (Q == kQ8_0) {
    const float d = half_at(b);
    for (int64_t j = 0; j < kChunk; ++j) w[j] = static_cast<float>(static_cast<int8_t>(b[2 + j])) * d;
  } else if constexpr (Q == kQ4_0 || Q == kQ4_1 || Q == kIQ4_NL) {
    // Weight j is byte j's low nibble, weight j + 16 its high nibble.
    const float d = half_at(b);
    const uint8_t* qs = b + (Q == kQ4_1 ? 4 : 2);
    const float m = Q == kQ4_1 ? half_at(b + 2) : 0.f;
    for (int64_t j = 0; j < kChunk / 2; ++j) {
      if constexpr (Q == kQ4_1) {
        w[j] = static_cast<float>(qs[j] & 0x0F) * d + m;
        w[j + 16] = static_cast<float>(qs[j] >> 4) * d + m;
      } else if constexpr (Q == kIQ4_NL) {
        w[j] = d * static_cast<float>(kIQ4NLLevels[qs[j] & 0x0F]);
        w[j + 16] = d * static_cast<float>(kIQ4NLLevels[qs[j] >> 4]);
      } else {
        w[j] = static_cast<float>((qs[j] & 0x0F) - 8) * d;
        w[j + 16] = static_cast<float>((qs[j] >> 4) - 8) * d;
      }
    }
  } else if constexpr (Q == kQ5_0 || Q == kQ5_1) {
    // As Q4_0/Q4_1, with weight j's fifth bit bit j of a little-endian uint32.
    const float d = half_at(b);
    const float m = Q == kQ5_1 ? half_at(b + 2) : 0.f;
    uint32_t qh;
    std::memcpy(&qh, b + (Q == kQ5_1 ? 4 : 2), 4);
    const uint8_t* qs = b + (Q == kQ5_1 ? 8 : 6);
    for (int64_t j = 0; j < kChunk / 2; ++j) {
      const int lo = (qs[j] & 0x0F) | (((qh >> j) & 1) << 4), hi = (qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
      if constexpr (Q == kQ5_1) {
        w[j] = d * static_cast<float>(lo) + m;
        w[j + 16] = d * static_cast<float>(hi) + m;
      } else {
        w[j] = d * static_cast<float>(lo - 16);
        w[j + 16] = d * static_cast<float>(hi - 16);
      }
    }
  } else if constexpr (Q == kQ4_K || Q == kQ5_K) {
    // Sub-block c: its scale and min, and nibbles (low for even c, high for odd) of bytes 32 (c / 2)..;
    // Q5_K's fifth bit of weight j is bit c of its j-th high-bit byte.
    int sc, mn;
    k_scale_min(b + 4, c, sc, mn);
    const float ds = half_at(b) * static_cast<float>(sc), dm = half_at(b + 2) * static_cast<float>(mn);
    const uint8_t* qs = b + (Q == kQ5_K ? 48 : 16) + (c / 2) * 32;
    const int shift = (c % 2) * 4;
    for (int64_t j = 0; j < kChunk; ++j) {
      int q = (qs[j] >> shift) & 0x0F;
      if constexpr (Q == kQ5_K) q |= ((b[16 + j] >> c) & 1) << 4;
      w[j] = ds * static_cast<float>(q) - dm;
    }
  } else if constexpr (Q == kQ6_K) {
    const Q6KChunk k(b, c);
    for (int64_t j = 0; j < kChunk; ++j) {
      const int q = (((k.ql[j] >> k.sl) & 0x0F) | (((k.qh[j] >> k.sh) & 3) << 4)) - 32;
      w[j] = k.d * static_cast<float>(k.scales[j / 16]) * static_cast<float>(q);
    }
  } else if constexpr (Q == kQ2_K) {
    // Chunk c: bits 2 (c % 4) of bytes 32 (c / 4)..; a 4-bit scale and min per 16 weights.
    const uint8_t* qs = b + 16 + (c / 4) * 32;
    const int shift = static_cast<int>(c % 4) * 2;
    const float d = half_at(b + 80), dmin = half_at(b + 82);
    for (int64_t j = 0; j < kChunk; ++j) {
      const uint8_t s = b[2 * c + j / 16];
      const float dl = d * static_cast<float>(s & 0x0F), ml = dmin * static_cast<float>(s >> 4);
      w[j] = dl * static_cast<float>((qs[j] >> shift) & 3) - ml;
    }
  } else if constexpr (Q == kQ3_K) {
    // Chunk c: bits 2 (c % 4) of bytes 32 (c / 4).. of the low values, bit c of the high-bit bytes (a
    // clear bit subtracts 4), a 6-bit signed scale per 16 weights.
    const uint8_t* qs = b + 32 + (c / 4) * 32;
    const uint8_t* s = b + 96;
    const int shift = static_cast<int>(c % 4) * 2;
    const float d = half_at(b + 108);
    for (int64_t j = 0; j < kChunk; ++j) {
      const int64_t i = 2 * c + j / 16;
      const int lo = i < 8 ? (s[i] & 0x0F) : (s[i - 8] >> 4), hi = (s[8 + i % 4] >> (2 * (i / 4))) & 3;
      const float dl = d * static_cast<float>(static_cast<int8_t>(lo | (hi << 4)) - 32);
      const int q = ((qs[j] >> shift) & 3) - (((b[j] >> c) & 1) ? 0 : 4);
      w[j] = dl * static_cast<float>(q);
    }
  }
}

// Through a buffer: the types without intrinsics of their own here (and every type in the scalar build).
template <int64_t Q>
inline void decode_via_scalar(const uint8_t* b, int64_t c, Vec* w) {
  float tmp[kChunk];
  decode_scalar<Q>(b, c, tmp);
  for (int64_t v = 0; v < kVecsPerChunk; ++v) w[v] = Vec::loadu(tmp + v * kVS);
}

#if defined(CPU_CAPABILITY_AVX512)
// 16 unsigned bytes as 16 fp32.
inline __m512 u8_ps(__m128i q) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q)); }
#endif

// Chunk c of the block at b (weights [32 c, 32 c + 32)) in kVecsPerChunk vectors (weights
// [v * kVS, (v + 1) * kVS) of the chunk in w[v]), equal to decode_scalar's bit for bit: the same exact
// products, and a fused multiply-add rounds once as the separate subtraction does.
template <int64_t Q>
inline void decode(const uint8_t* b, int64_t c, Vec* w) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m128i mask = _mm_set1_epi8(0x0F);
  if constexpr (Q == kQ8_0) {
    const __m512 d = _mm512_set1_ps(half_at(b));
    w[0] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(b + 2)))), d);
    w[1] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(b + 18)))), d);
  } else if constexpr (Q == kQ4_0 || Q == kQ4_1) {
    const __m512 d = _mm512_set1_ps(half_at(b));
    const __m128i qs = _mm_loadu_si128((const __m128i*)(b + (Q == kQ4_1 ? 4 : 2)));
    __m512 lo = u8_ps(_mm_and_si128(qs, mask));
    __m512 hi = u8_ps(_mm_and_si128(_mm_srli_epi16(qs, 4), mask));
    if constexpr (Q == kQ4_1) {
      const __m512 m = _mm512_set1_ps(half_at(b + 2));
      w[0] = _mm512_fmadd_ps(lo, d, m);
      w[1] = _mm512_fmadd_ps(hi, d, m);
    } else {
      const __m512 eight = _mm512_set1_ps(8.f);
      w[0] = _mm512_mul_ps(_mm512_sub_ps(lo, eight), d);
      w[1] = _mm512_mul_ps(_mm512_sub_ps(hi, eight), d);
    }
  } else if constexpr (Q == kQ5_0 || Q == kQ5_1) {
    // The nibbles as Q4_0/Q4_1's, 16 added where the weight's bit of qh is set.
    const __m512 d = _mm512_set1_ps(half_at(b));
    uint32_t qh;
    std::memcpy(&qh, b + (Q == kQ5_1 ? 4 : 2), 4);
    const __m128i qs = _mm_loadu_si128((const __m128i*)(b + (Q == kQ5_1 ? 8 : 6)));
    const __m512i sixteen = _mm512_set1_epi32(16);
    __m512i lo = _mm512_cvtepu8_epi32(_mm_and_si128(qs, mask));
    __m512i hi = _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(qs, 4), mask));
    lo = _mm512_mask_add_epi32(lo, static_cast<__mmask16>(qh & 0xFFFF), lo, sixteen);
    hi = _mm512_mask_add_epi32(hi, static_cast<__mmask16>(qh >> 16), hi, sixteen);
    if constexpr (Q == kQ5_1) {
      const __m512 m = _mm512_set1_ps(half_at(b + 2));
      w[0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo), d, m);
      w[1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), d, m);
    } else {
      w[0] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_sub_epi32(lo, sixteen)));
      w[1] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_sub_epi32(hi, sixteen)));
    }
  } else if constexpr (Q == kQ4_K || Q == kQ5_K) {
    int sc, mn;
    k_scale_min(b + 4, c, sc, mn);
    const __m512 ds = _mm512_set1_ps(half_at(b) * static_cast<float>(sc));
    const __m512 dm = _mm512_set1_ps(half_at(b + 2) * static_cast<float>(mn));
    const uint8_t* qs = b + (Q == kQ5_K ? 48 : 16) + (c / 2) * 32;
    const int shift = static_cast<int>(c % 2) * 4;
    for (int v = 0; v < 2; ++v) {
      const __m128i raw = _mm_loadu_si128((const __m128i*)(qs + 16 * v));
      __m512i q = _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srl_epi16(raw, _mm_cvtsi32_si128(shift)), mask));
      if constexpr (Q == kQ5_K) {
        const __m128i high = _mm_loadu_si128((const __m128i*)(b + 16 + 16 * v));
        const __mmask16 set = _mm_test_epi8_mask(high, _mm_set1_epi8(static_cast<char>(1 << c)));
        q = _mm512_mask_add_epi32(q, set, q, _mm512_set1_epi32(16));
      }
      w[v] = _mm512_fmsub_ps(ds, _mm512_cvtepi32_ps(q), dm);
    }
  } else if constexpr (Q == kQ6_K) {
    const Q6KChunk k(b, c);
    const __m128i sl = _mm_cvtsi32_si128(k.sl), sh = _mm_cvtsi32_si128(k.sh);
    for (int v = 0; v < 2; ++v) {
      const __m128i low = _mm_and_si128(_mm_srl_epi16(_mm_loadu_si128((const __m128i*)(k.ql + 16 * v)), sl), mask);
      const __m128i high = _mm_and_si128(_mm_srl_epi16(_mm_loadu_si128((const __m128i*)(k.qh + 16 * v)), sh),
                                         _mm_set1_epi8(3));
      const __m512i q = _mm512_sub_epi32(_mm512_cvtepu8_epi32(_mm_or_si128(low, _mm_slli_epi16(high, 4))),
                                         _mm512_set1_epi32(32));
      const __m512 dl = _mm512_set1_ps(k.d * static_cast<float>(k.scales[v]));
      w[v] = _mm512_mul_ps(dl, _mm512_cvtepi32_ps(q));
    }
  } else {
    decode_via_scalar<Q>(b, c, w);
  }
#elif defined(CPU_CAPABILITY_AVX2)
  if constexpr (Q == kQ8_0) {
    const __m256 d = _mm256_set1_ps(half_at(b));
    for (int v = 0; v < 4; ++v)
      w[v] = _mm256_mul_ps(
          _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(b + 2 + 8 * v)))), d);
  } else if constexpr (Q == kQ4_0 || Q == kQ4_1) {
    const __m256 d = _mm256_set1_ps(half_at(b));
    const __m128i qs = _mm_loadu_si128((const __m128i*)(b + (Q == kQ4_1 ? 4 : 2)));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(qs, mask), hi = _mm_and_si128(_mm_srli_epi16(qs, 4), mask);
    const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    for (int v = 0; v < 4; ++v) {
      const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[v]));
      if constexpr (Q == kQ4_1)
        w[v] = _mm256_fmadd_ps(q, d, _mm256_set1_ps(half_at(b + 2)));
      else
        w[v] = _mm256_mul_ps(_mm256_sub_ps(q, _mm256_set1_ps(8.f)), d);
    }
  } else {
    decode_via_scalar<Q>(b, c, w);
  }
#else
  decode_via_scalar<Q>(b, c, w);
#endif
}

// f(std::integral_constant<int64_t, Q>{}) for the block type qtype (checked): one switch over the
// types for every kernel that instantiates per type.
template <typename F>
void with_type(int64_t qtype, F&& f) {
  switch (qtype) {
    case kQ4_0: return f(std::integral_constant<int64_t, kQ4_0>{});
    case kQ4_1: return f(std::integral_constant<int64_t, kQ4_1>{});
    case kQ5_0: return f(std::integral_constant<int64_t, kQ5_0>{});
    case kQ5_1: return f(std::integral_constant<int64_t, kQ5_1>{});
    case kQ8_0: return f(std::integral_constant<int64_t, kQ8_0>{});
    case kIQ4_NL: return f(std::integral_constant<int64_t, kIQ4_NL>{});
    case kQ2_K: return f(std::integral_constant<int64_t, kQ2_K>{});
    case kQ3_K: return f(std::integral_constant<int64_t, kQ3_K>{});
    case kQ4_K: return f(std::integral_constant<int64_t, kQ4_K>{});
    case kQ5_K: return f(std::integral_constant<int64_t, kQ5_K>{});
    case kQ6_K: return f(std::integral_constant<int64_t, kQ6_K>{});
    default: block_bytes(qtype);  // raises, naming the supported types
  }
}

}  // namespace radixserve_cpu::blocks
