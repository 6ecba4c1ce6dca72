// bf16_rows_bench's "before": registers a base commit's few-row kernel (its gemv.cpp, built beside this
// file with -Dradixserve_cpu=radixserve_base) as radixserve_base::gemv, so it loads beside today's ops.
#include <torch/library.h>

#include "gemv.h"

TORCH_LIBRARY(radixserve_cpu, m) { m.def("gemv(Tensor x, Tensor weight, Tensor? bias) -> Tensor"); }
TORCH_LIBRARY_IMPL(radixserve_cpu, CPU, m) { m.impl("gemv", &radixserve_cpu::gemv); }
