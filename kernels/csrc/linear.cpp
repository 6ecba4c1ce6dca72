// radixserve_cpu::linear: a Linear layer on CPU, the weight prepacked for oneDNN.
//
// Why an op of our own: oneDNN multiplies few-row products (a decode step: one row per running
// request) ~1.3x faster than MKL's plain sgemm when the weight is reordered into its blocked
// layout once, at load time. Inductor only uses such a packed weight for graphs whose weights are
// frozen constants, and frozen graphs bypass its on-disk graph cache, so every restart would
// recompile. As an opaque op taking the packed weight as an input, the captured graph keeps both:
// the packed product and a graph the cache can hold. One or two rows keep the plain weight, where
// MKL's matrix-vector product is faster than oneDNN's (measured at this model's shapes: 2 rows
// 21.8 ms plain vs 26-28 ms packed per 120 layers; 3 rows and more favour the packed weight).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

namespace radixserve_cpu {
namespace {

at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& packed,
                  const std::optional<at::Tensor>& bias) {
  if (!packed.has_value() || x.dim() != 2 || x.size(0) <= 2) return at::linear(x, weight, bias);
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  // mkldnn::_linear_pointwise(Tensor X, Tensor W, Tensor? B, str attr, Scalar?[] scalars, str? algorithm)
  torch::jit::Stack stack{x, *packed, bias, std::string("none"), c10::List<std::optional<at::Scalar>>(),
                          std::optional<std::string>(std::string(""))};
  op.callBoxed(&stack);
  return stack.back().toTensor();
}

}  // namespace
}  // namespace radixserve_cpu

TORCH_LIBRARY_FRAGMENT(radixserve_cpu, m) {
  m.def("linear(Tensor x, Tensor weight, Tensor? packed, Tensor? bias) -> Tensor");
}

// The packed weight is a oneDNN (MkldnnCPU) tensor, which decides the dispatch key: the same kernel
// serves both keys.
TORCH_LIBRARY_IMPL(radixserve_cpu, CPU, m) { m.impl("linear", &radixserve_cpu::linear); }
TORCH_LIBRARY_IMPL(radixserve_cpu, MkldnnCPU, m) { m.impl("linear", &radixserve_cpu::linear); }
