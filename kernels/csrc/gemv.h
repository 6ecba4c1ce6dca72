// Few-row linear products without BLAS (gemv.cpp), used by radixserve_cpu::linear and ::int8_linear.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <tuple>

namespace radixserve_cpu {

// The most activation rows the few-row kernels take (a decode step of up to 8 requests, a small
// verification batch); more rows go to oneDNN (linear.cpp).
constexpr int64_t kGemvMaxRows = 8;

// x [M, K] @ weight [N, K]^T + bias, M in [1, kGemvMaxRows]; fp32 or bf16 (x and weight alike).
at::Tensor gemv(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias);

// quant.int8_linear for M in [1, kGemvMaxRows]: x quantized per row, int8 weights with fp32 scales [N].
at::Tensor int8_gemv(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale,
                     const std::optional<at::Tensor>& bias);

// Whether the CPU multiplies int8 at VNNI speed (avx512vnni or avx_vnni, checked at run time), where
// oneDNN's int8 GEMM (torch._int_mm) is fast. Without VNNI it takes a path ~15x slower than an fp32
// GEMM (measured on an AVX2-only EPYC), so many rows go through int8_gemv 8 rows at a time instead.
bool cpu_has_vnni();

// quant.quantize_rows: (q [M, K] int8, scale [M, 1] fp32), the same values bit for bit.
std::tuple<at::Tensor, at::Tensor> quantize_rows(const at::Tensor& x);

}  // namespace radixserve_cpu
