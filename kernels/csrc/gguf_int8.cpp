// radixserve_cpu::gguf_int8_linear: x [M, K] fp32 times a weight held as GGUF blocks, in integer
// arithmetic: the approximate many-rows mode (`--prefill-arithmetic int8` over GGUF weights,
// model/arithmetic.py). gguf_int8_pack decodes a weight's tiles once and gguf_int8_tiles_linear
// streams them (`--decode-arithmetic int8`: every product). The exact product is gguf_linear.cpp's.
//
// Why: prefill is compute-bound, and gguf_linear decodes every block to fp32 and multiplies at the
// fp32 peak. AVX512-VNNI's vpdpbusd does 64 int8 multiply-adds an instruction, four times an fp32 FMA.
//
// Types: those with an integer form (block_ints.h): every block type. The math (llama.cpp's Q8_0 / Q8_1 activations; our own code):
// - x is quantized per row and per 32-block: d = max|x| / 127, q = round-half-even(x / d) in int8
//   (fp32 scale, where llama.cpp stores an fp16 one), and s = sum(q) per block.
// - a chunk of weights is  w = d_w * k_h * (u - offset) + m_w  (block_ints.h), so per weight row n and
//   chunk b the dot is exact in int32:  i = sum_j u[j] * q[j] - offset * s  (a split type: each half's,
//   times its k_h, summed).
// - out[m, n] = sum_b  i * (d_w * d_x)  [+ m_w * (d_x * s) for a type with a minimum; Q2_K:
//   + m_h * (d_x * s_h) for each half h, s_h that half's sum of q],
//   summed over b in order with one fused multiply-add each, then + bias.
// - outlier channels (optional, radixserve/model/outliers.py): zeroed in x before it is quantized and
//   added after the blocks in fp32, x's value times the channel's weight column, one fused multiply-add
//   each, in order (int8_tiles.h's Out).
// So the only rounding besides the activation quantization is fp32 summation over K/32 terms (and a
// split type's dot, which can pass 2^24, rounded to fp32 as the reference rounds it): the
// torch reference (tests/kernels/test_kernel_gguf_int8.py) matches within (2 K/32 + 2) ulp-sized
// multiples of the sum of |terms|, and the portable path below matches the VNNI one bit for bit.
//
// Layout (int8_tiles.h): a tile of 32 weight rows is decoded once into [K/4 groups][32 rows][4 bytes]
// (two groups a byte for the 4-bit types; each group's 4 bytes for 16 rows in one 64-byte register:
// one vpdpbusd multiplies 16 rows by 4 x values broadcast, and each broadcast serves two registers),
// with its d_w (and m_w) per block in [K/32][32] fp32; every x row of the step is then multiplied
// against the tile, 4 rows at a time (8 int32 + 8 fp32 accumulators in registers, 8 more for a split
// type; int8_tiles.h says why not 6).
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

#include "int8_tiles.h"
#include "radixserve_cpu.h"

namespace radixserve_cpu {
namespace {

using int8_tiles::cpu_has_vnni;
using int8_tiles::decode_tile;
using int8_tiles::kTileRows;
using int8_tiles::kBlock;
using int8_tiles::Out;
using int8_tiles::quantize_row;
using int8_tiles::QuantX;
using int8_tiles::tile_at;
using int8_tiles::tile_bytes;
using int8_tiles::tile_product;
using ints::split;
using ints::takes;

// The product over blocks: each thread decodes its tiles into a buffer, one at a time.
template <int64_t Q>
void run(const QuantX& x, const uint8_t* w, int64_t row_bytes, int64_t M, int64_t N, const Out& o, bool vnni) {
  const int64_t tiles = (N + kTileRows - 1) / kTileRows, tb = tile_bytes(Q, x.nb);
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    static thread_local std::vector<uint8_t> buf;
    if (static_cast<int64_t>(buf.size()) < tb) buf.resize(tb);
    for (int64_t ti = t0; ti < t1; ++ti) {
      const int64_t n0 = ti * kTileRows, rows = std::min(kTileRows, N - n0);
      decode_tile<Q>(w, row_bytes, x.nb, n0, rows, buf.data());
      tile_product<Q>(x, tile_at(buf.data(), Q, x.nb), M, n0, rows, o, vnni);
    }
  });
}

// The product over stored tiles (gguf_int8_pack's): nothing decoded per call.
template <int64_t Q>
void run_stored(const QuantX& x, const uint8_t* tiles, int64_t M, int64_t N, const Out& o, bool vnni) {
  const int64_t count = (N + kTileRows - 1) / kTileRows, tb = tile_bytes(Q, x.nb);
  at::parallel_for(0, count, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t ti = t0; ti < t1; ++ti)
      tile_product<Q>(x, tile_at(tiles + ti * tb, Q, x.nb), M, ti * kTileRows, std::min(kTileRows, N - ti * kTileRows),
                      o, vnni);
  });
}

// x's activation blocks; with outlier channels ch [k], those are left out and gathered into xo [M, k].
void quantize(const at::Tensor& x, at::Tensor& q, at::Tensor& d, at::Tensor& s, float* ds, int32_t* s2,
              bool vnni, const int64_t* ch = nullptr, int64_t k = 0, float* xo = nullptr) {
  const int64_t M = x.size(0), K = x.size(1), nb = K / kBlock, ldx = x.stride(0);
  const float* xp = x.data_ptr<float>();
  int8_t* qp = q.data_ptr<int8_t>();
  float* dp = d.data_ptr<float>();
  int32_t* sp = s.data_ptr<int32_t>();
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    std::vector<float> scratch(k > 0 ? K : 0);
    for (int64_t m = m0; m < m1; ++m) {
      if (k > 0) {
        int8_tiles::quantize_row_apart(xp + m * ldx, nb, ch, k, scratch.data(), xo + m * k, qp + m * K, dp + m * nb,
                                       sp + m * nb, ds + m * nb, s2 + m * 2 * nb, vnni);
      } else {
        quantize_row(xp + m * ldx, nb, qp + m * K, dp + m * nb, sp + m * nb, ds + m * nb, s2 + m * 2 * nb, vnni);
      }
    }
  });
}

void check_x(const at::Tensor& x, int64_t K, const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) == K, "radixserve_cpu::", op,
              ": x must be float32 [M, ", K, "], got ", x.sizes(), " ", x.scalar_type());
  TORCH_CHECK(K % kBlock == 0, "radixserve_cpu::", op, ": K (", K, ") must be a multiple of 32");
}

// Outlier channels and columns, both or neither (check_outliers in radixserve_cpu.h).
void check_outlier_pair(const std::optional<at::Tensor>& channels, const std::optional<at::Tensor>& columns,
                        int64_t K, int64_t N, const char* op) {
  TORCH_CHECK(channels.has_value() == columns.has_value(), "radixserve_cpu::", op,
              ": outlier channels and columns come together");
  if (channels.has_value()) check_outliers(*channels, *columns, K, N, op);
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

void check_bias(const std::optional<at::Tensor>& bias_in, int64_t N, at::Tensor& bias, const char* op) {
  if (!bias_in.has_value()) return;
  bias = bias_in->contiguous();
  TORCH_CHECK(bias.dim() == 1 && bias.size(0) == N && bias.scalar_type() == at::kFloat, "radixserve_cpu::", op,
              ": bias must be float32 [", N, "]");
}

// out [M, N] = x times a weight of type `qtype` in the integer arithmetic: x quantized, then multiplied
// by the weight's tiles: stored ones (`stored`: gguf_int8_pack's, at w), or blocks (rows rb bytes apart
// at w) decoded tile by tile.
at::Tensor int8_product(const at::Tensor& x_in, int64_t qtype, int64_t K, int64_t N,
                        const std::optional<at::Tensor>& bias_in, bool portable, const char* op, const uint8_t* w,
                        int64_t rb, bool stored, const std::optional<at::Tensor>& channels,
                        const std::optional<at::Tensor>& columns) {
  check_x(x_in, K, op);
  check_outlier_pair(channels, columns, K, N, op);
  TORCH_CHECK(takes(qtype), "radixserve_cpu::", op, ": unsupported block type ", qtype,
              " (supported: " RADIXSERVE_INT8_TYPES ")");
  at::Tensor bias;
  check_bias(bias_in, N, bias, op);
  const at::Tensor x = x_in.stride(1) == 1 ? x_in : x_in.contiguous();
  const int64_t M = x.size(0), nb = K / kBlock;
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  const bool vnni = cpu_has_vnni() && !portable;
  at::Tensor q = at::empty({M, K}, x.options().dtype(at::kChar));
  at::Tensor d = at::empty({M, nb}, x.options());
  at::Tensor s = at::empty({M, nb}, x.options().dtype(at::kInt));
  std::vector<float> ds(M * nb);
  std::vector<int32_t> s2(2 * M * nb);
  const int64_t k = channels.has_value() ? channels->numel() : 0;
  std::vector<float> xo(M * k);
  quantize(x, q, d, s, ds.data(), s2.data(), vnni, k > 0 ? channels->data_ptr<int64_t>() : nullptr, k, xo.data());
  const QuantX qx{q.data_ptr<int8_t>(), d.data_ptr<float>(), s.data_ptr<int32_t>(), ds.data(), s2.data(), K, nb};
  const Out o{out.data_ptr<float>(), N, bias.defined() ? bias.data_ptr<float>() : nullptr,
              xo.data(), k > 0 ? columns->data_ptr<float>() : nullptr, k, N};
  blocks::with_type(qtype, [&](auto t) {  // takes(qtype) was checked above
    constexpr int64_t Q = decltype(t)::value;
    if constexpr (takes(Q)) {
      if (stored) {
        run_stored<Q>(qx, w, M, N, o, vnni);
      } else {
        run<Q>(qx, w, rb, M, N, o, vnni);
      }
    }
  });
  return out;
}

const at::Tensor& check_blocks(const at::Tensor& blocks, int64_t qtype, int64_t K, const char* op) {
  const int64_t rb = blocks::block_row_bytes(qtype, K);
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte && blocks.size(1) == rb && blocks.is_contiguous(),
              "radixserve_cpu::", op, ": blocks must be uint8 [N, ", rb, "], got ", blocks.sizes(), " ",
              blocks.scalar_type());
  return blocks;
}

at::Tensor gguf_int8_linear(const at::Tensor& x, const at::Tensor& blocks_in, int64_t qtype, int64_t K,
                            const std::optional<at::Tensor>& bias, bool portable,
                            const std::optional<at::Tensor>& channels, const std::optional<at::Tensor>& columns) {
  check_x(x, K, "gguf_int8_linear");
  const at::Tensor blocks = blocks_in.contiguous();
  TORCH_CHECK(takes(qtype), "radixserve_cpu::gguf_int8_linear: unsupported block type ", qtype,
              " (supported: " RADIXSERVE_INT8_TYPES ")");
  check_blocks(blocks, qtype, K, "gguf_int8_linear");
  const uint8_t* w = blocks.data_ptr<uint8_t>();
  const int64_t N = blocks.size(0), rb = blocks.size(1);
  return int8_product(x, qtype, K, N, bias, portable, "gguf_int8_linear", w, rb, false, channels, columns);
}

// A weight's tiles, decoded once: [ceil(N / 32), tile_bytes] uint8, what gguf_int8_tiles_linear and the
// native step's int8 products stream (1 byte a weight, half for the 4-bit types, plus 8 or 16 bytes of
// scales per 32).
at::Tensor gguf_int8_pack(const at::Tensor& blocks_in, int64_t qtype, int64_t K) {
  TORCH_CHECK(takes(qtype) && K % kBlock == 0, "radixserve_cpu::gguf_int8_pack: unsupported block type ", qtype,
              " or K ", K, " (supported: " RADIXSERVE_INT8_TYPES ", K a multiple of 32)");
  const at::Tensor blocks = blocks_in.contiguous();
  check_blocks(blocks, qtype, K, "gguf_int8_pack");
  const int64_t N = blocks.size(0), nb = K / kBlock, count = (N + kTileRows - 1) / kTileRows;
  const int64_t tb = tile_bytes(qtype, nb);
  at::Tensor tiles = at::empty({count, tb}, blocks.options());
  const uint8_t* w = blocks.data_ptr<uint8_t>();
  uint8_t* dst = tiles.data_ptr<uint8_t>();
  blocks::with_type(qtype, [&](auto t) {
    constexpr int64_t Q = decltype(t)::value;
    if constexpr (takes(Q)) {
      at::parallel_for(0, count, 1, [&](int64_t t0, int64_t t1) {
        for (int64_t ti = t0; ti < t1; ++ti)
          decode_tile<Q>(w, blocks.size(1), nb, ti * kTileRows, std::min(kTileRows, N - ti * kTileRows), dst + ti * tb);
      });
    }
  });
  return tiles;
}

at::Tensor gguf_int8_tiles_linear(const at::Tensor& x, const at::Tensor& tiles_in, int64_t qtype, int64_t K,
                                  int64_t N, const std::optional<at::Tensor>& bias, bool portable,
                                  const std::optional<at::Tensor>& channels, const std::optional<at::Tensor>& columns) {
  const at::Tensor tiles = tiles_in.contiguous();
  TORCH_CHECK(takes(qtype) && K % kBlock == 0, "radixserve_cpu::gguf_int8_tiles_linear: unsupported block type ",
              qtype, " or K ", K);
  const int64_t tb = tile_bytes(qtype, K / kBlock);
  TORCH_CHECK(tiles.dim() == 2 && tiles.scalar_type() == at::kByte && tiles.size(0) == (N + kTileRows - 1) / kTileRows &&
                  tiles.size(1) == tb,
              "radixserve_cpu::gguf_int8_tiles_linear: tiles must be gguf_int8_pack's uint8 [",
              (N + kTileRows - 1) / kTileRows, ", ", tb, "], got ", tiles.sizes());
  const uint8_t* w = tiles.data_ptr<uint8_t>();
  return int8_product(x, qtype, K, N, bias, portable, "gguf_int8_tiles_linear", w, tb, true, channels, columns);
}

bool gguf_int8_vnni() { return cpu_has_vnni(); }

}  // namespace

void check_outliers(const at::Tensor& ch, const at::Tensor& columns, int64_t K, int64_t N, const char* op) {
  TORCH_CHECK(ch.scalar_type() == at::kLong && ch.dim() == 1 && ch.is_contiguous() &&
                  columns.scalar_type() == at::kFloat && columns.is_contiguous() &&
                  columns.sizes() == at::IntArrayRef({ch.numel(), N}),
              "radixserve_cpu::", op, ": outliers are int64 channels [k] and float32 columns [k, N]");
  const int64_t* c = ch.data_ptr<int64_t>();
  TORCH_CHECK(std::all_of(c, c + ch.numel(), [K](int64_t i) { return i >= 0 && i < K; }), "radixserve_cpu::", op,
              ": an outlier channel leaves [0, ", K, ")");
}

}  // namespace radixserve_cpu

TORCH_LIBRARY_FRAGMENT(radixserve_cpu, m) {
  // channels/columns: outlier channels left out of x's quantization and added in fp32 (model/outliers.py)
  m.def(
      "gguf_int8_linear(Tensor x, Tensor blocks, int qtype, int K, Tensor? bias, bool portable=False, "
      "Tensor? channels=None, Tensor? columns=None) -> Tensor");
  m.def("quantize_q8_blocks(Tensor x, bool portable=False) -> (Tensor, Tensor, Tensor)");
  m.def("gguf_int8_pack(Tensor blocks, int qtype, int K) -> Tensor");
  m.def(
      "gguf_int8_tiles_linear(Tensor x, Tensor tiles, int qtype, int K, int N, Tensor? bias, bool portable=False, "
      "Tensor? channels=None, Tensor? columns=None) -> Tensor");
  m.def("gguf_int8_vnni() -> bool", &radixserve_cpu::gguf_int8_vnni);  // no tensor: a catch-all kernel
}

TORCH_LIBRARY_IMPL(radixserve_cpu, CPU, m) {
  m.impl("gguf_int8_linear", &radixserve_cpu::gguf_int8_linear);
  m.impl("quantize_q8_blocks", &radixserve_cpu::quantize_q8_blocks);
  m.impl("gguf_int8_pack", &radixserve_cpu::gguf_int8_pack);
  m.impl("gguf_int8_tiles_linear", &radixserve_cpu::gguf_int8_tiles_linear);
}
