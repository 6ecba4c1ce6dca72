// radixserve_cpu::linear and ::int8_linear: a Linear layer on CPU, the product chosen by row count.
//
// Why an op of our own: the choice depends on the step's row count, which a captured graph only knows
// at run time; as one opaque op taking every weight copy as an input, the graph keeps all the paths
// and a graph the inductor cache can hold (weights are inputs, not frozen constants).
//
// - 1 to kGemvMaxRows rows (decode, small verification batches): gemv.cpp, which streams the weight
//   once at near the memory bandwidth on Intel and AMD alike; MKL's small-row sgemm does not on AMD,
//   and oneDNN's packed product pays a per-call setup (issue 21).
// - More rows: the weight prepacked for oneDNN (`packed`, made once at load time), which multiplies
//   many rows faster than MKL's plain sgemm; without it, at::linear.
// - More than `many_rows` rows (> 0; prefill, extend, long verification) with a cheaper copy of the
//   weight: `qweight`/`qscale` (int8 per channel: activations quantized per row, torch._int_mm where
//   the CPU has VNNI, else the few-row int8 kernel 8 rows a pass: the same numbers) or
//   `fast_weight` (bf16: x rounded to bf16, oneDNN's bf16 product, fp32 out). Fewer rows stay exact.
// - Every product above kGemvMaxRows rows runs on rows padded with zeros to one of a few counts
//   (padded_rows): oneDNN keeps a primitive (its JIT code and plan) per distinct shape, up to 1024 of
//   them, and a prefill's row count takes any value, so the engine's memory grew by hundreds of MB
//   over a soak as that cache filled and then churned. A row's result does not depend on how many
//   rows share the product (tests/kernels/test_kernel_gemv.py checks it bit for bit).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <algorithm>

#include "gemv.h"

namespace radixserve_cpu {

// M rounded up to a multiple of 8, and above 64 rows to 8 counts per doubling (at most 1/8 more rows):
// under 60 counts per weight shape up to 4096 rows. An op too, so that a test keeps the Python copy
// (model/layers.py, for when these kernels do not load) the same rule.
int64_t padded_rows(int64_t M) {
  if (M <= 8) return M;
  const int top = 63 - __builtin_clzll(static_cast<uint64_t>(M));  // floor(log2 M) >= 3
  const int64_t step = std::max<int64_t>(8, int64_t{1} << (top - 3));
  return (M + step - 1) / step * step;
}

namespace {

// quant.int8_linear for any row count: the same quantization, exact int32 sums, the same roundings.
at::Tensor int8_matmul(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale,
                       const std::optional<at::Tensor>& bias) {
  const int64_t M = x.size(0);
  if (M <= kGemvMaxRows) return int8_gemv(x, qweight, scale, bias);
  if (!cpu_has_vnni()) {  // the same numbers, 8 rows a pass: ~24x faster than torch._int_mm there
    at::Tensor out = at::empty({M, qweight.size(0)}, x.options());
    for (int64_t m = 0; m < M; m += kGemvMaxRows) {
      const int64_t rows = std::min(kGemvMaxRows, M - m);
      out.narrow(0, m, rows).copy_(int8_gemv(x.narrow(0, m, rows).contiguous(), qweight, scale, bias));
    }
    return out;
  }
  auto [q, xs] = quantize_rows(x);
  at::Tensor out = at::_int_mm(q, qweight.t()).to(at::kFloat) * xs * scale;
  return bias.has_value() ? out + *bias : out;
}

at::Tensor packed_matmul(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  // mkldnn::_linear_pointwise(Tensor X, Tensor W, Tensor? B, str attr, Scalar?[] scalars, str? algorithm)
  torch::jit::Stack stack{x, packed, bias, std::string("none"), c10::List<std::optional<at::Scalar>>(),
                          std::optional<std::string>(std::string(""))};
  op.callBoxed(&stack);
  return stack.back().toTensor();
}

// f(x with padded_rows(M) rows, the extra ones zero), cut back to M rows.
template <typename F>
at::Tensor on_padded_rows(const at::Tensor& x, F f) {
  const int64_t M = x.size(0), padded = padded_rows(M);
  if (padded == M) return f(x);
  at::Tensor xp = at::empty({padded, x.size(1)}, x.options());
  xp.narrow(0, 0, M).copy_(x);
  xp.narrow(0, M, padded - M).zero_();
  return f(xp).narrow(0, 0, M);
}

at::Tensor linear_2d(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& packed,
                     const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& qweight,
                     const std::optional<at::Tensor>& qscale, const std::optional<at::Tensor>& fast_weight,
                     int64_t many_rows) {
  const int64_t M = x.size(0);
  const auto dtype = weight.scalar_type();
  const bool plain = weight.is_contiguous() && x.scalar_type() == dtype &&
                     (dtype == at::kFloat || dtype == at::kBFloat16);
  if (M >= 1 && M <= kGemvMaxRows && plain) return gemv(x, weight, bias);
  if (M == 0) return at::linear(x, weight, bias);
  const bool cheaper = many_rows > 0 && M > many_rows;  // decided on the real rows, not the padded
  return on_padded_rows(x, [&](const at::Tensor& xp) {
    if (cheaper && qweight.has_value() && qscale.has_value()) return int8_matmul(xp, *qweight, *qscale, bias);
    if (cheaper && fast_weight.has_value()) {
      at::Tensor out = at::linear(xp.to(fast_weight->scalar_type()), *fast_weight).to(xp.scalar_type());
      return bias.has_value() ? out + *bias : out;
    }
    if (packed.has_value()) return packed_matmul(xp, *packed, bias);
    return at::linear(xp, weight, bias);
  });
}

template <typename F>
at::Tensor on_rows(const at::Tensor& x, int64_t out_features, F f) {
  if (x.dim() == 2) return f(x);
  at::Tensor out = f(x.reshape({-1, x.size(-1)}));
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = out_features;
  return out.view(shape);
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& packed,
                  const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& qweight,
                  const std::optional<at::Tensor>& qscale, const std::optional<at::Tensor>& fast_weight,
                  int64_t many_rows) {
  return on_rows(x, weight.size(0), [&](const at::Tensor& x2) {
    return linear_2d(x2, weight, packed, bias, qweight, qscale, fast_weight, many_rows);
  });
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale,
                       const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "radixserve_cpu: int8_linear wants fp32 activations");
  return on_rows(x, qweight.size(0), [&](const at::Tensor& x2) {
    if (x2.size(0) == 0) return at::empty({0, qweight.size(0)}, x2.options());
    return on_padded_rows(x2, [&](const at::Tensor& xp) { return int8_matmul(xp, qweight, scale, bias); });
  });
}

}  // namespace
}  // namespace radixserve_cpu

TORCH_LIBRARY_FRAGMENT(radixserve_cpu, m) {
  m.def(
      "linear(Tensor x, Tensor weight, Tensor? packed, Tensor? bias, Tensor? qweight=None, "
      "Tensor? qscale=None, Tensor? fast_weight=None, int many_rows=0) -> Tensor");
  m.def("int8_linear(Tensor x, Tensor qweight, Tensor scale, Tensor? bias) -> Tensor");
  m.def("gemv(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("int8_gemv(Tensor x, Tensor qweight, Tensor scale, Tensor? bias) -> Tensor");
  m.def("quantize_rows(Tensor x) -> (Tensor, Tensor)");
  m.def("padded_rows(int rows) -> int", &radixserve_cpu::padded_rows);  // no tensor: a catch-all kernel
}

// The packed weight is a oneDNN (MkldnnCPU) tensor, which decides the dispatch key: the same kernel
// serves both keys.
TORCH_LIBRARY_IMPL(radixserve_cpu, CPU, m) {
  m.impl("linear", &radixserve_cpu::linear);
  m.impl("int8_linear", &radixserve_cpu::int8_linear);
  m.impl("gemv", &radixserve_cpu::gemv);
  m.impl("int8_gemv", &radixserve_cpu::int8_gemv);
  m.impl("quantize_rows", &radixserve_cpu::quantize_rows);
}
TORCH_LIBRARY_IMPL(radixserve_cpu, MkldnnCPU, m) { m.impl("linear", &radixserve_cpu::linear); }
