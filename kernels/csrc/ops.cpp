// Operator registration for radixserve's CPU attention (torch.ops.radixserve_cpu.*), plus the
// small ops: store_kv (any dtype, as given), store_kv_int8 (quantizing) and the build's vector width.
//
// The ops are real torch operators with schemas (mutated arguments annotated), so a compiled graph
// can call them as opaque nodes; their fake (meta) implementations are registered from Python
// (radixserve/kernels/cpu_build.py).
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "radixserve_cpu.h"

namespace radixserve_cpu {
namespace {

// Writes new K/V rows [T, kv_heads, head_dim] into their slots (slot = page * page_size + offset);
// a negative slot is skipped (the padding rows of a batch bucket).
void store_kv(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& k_in, const at::Tensor& v_in,
              const at::Tensor& slot_mapping) {
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == k_cache.scalar_type(),
              "radixserve_cpu: caches must be contiguous [pages, page_size, kv_heads, dim] of one dtype");
  const int64_t H = k_cache.size(2), D = k_cache.size(3);
  TORCH_CHECK(k_in.dim() == 3 && k_in.size(1) == H && k_in.size(2) == D && v_in.sizes() == k_in.sizes(),
              "radixserve_cpu: k and v must be [T, kv_heads, head_dim] like the cache");
  TORCH_CHECK(k_in.scalar_type() == k_cache.scalar_type() && v_in.scalar_type() == k_cache.scalar_type(),
              "radixserve_cpu: k and v must have the cache's dtype");
  const int64_t T = k_in.size(0);
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.numel() == T, "radixserve_cpu: one slot per new token");
  // Rows may be strided (q, k and v come out of one fused projection); a row itself must be dense.
  const auto dense_rows = [&](const at::Tensor& t) {
    return (t.stride(2) == 1 && t.stride(1) == D) ? t : t.contiguous();
  };
  const at::Tensor k = dense_rows(k_in), v = dense_rows(v_in);
  const at::Tensor slots = slot_mapping.to(at::kLong).contiguous();
  const int64_t capacity = k_cache.size(0) * k_cache.size(1);
  const int64_t row_bytes = H * D * k.element_size();
  const int64_t* s = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(s[t] < capacity, "radixserve_cpu: slot ", s[t], " out of range");
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  const char* kp = static_cast<const char*>(k.data_ptr());
  const char* vp = static_cast<const char*>(v.data_ptr());
  const int64_t k_stride = k.stride(0) * k.element_size(), v_stride = v.stride(0) * v.element_size();
  // A step's rows copy in microseconds: threads only for big ones (a fork-join costs more).
  at::parallel_for(0, T, 4096, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (s[t] < 0) continue;
      std::memcpy(kc + s[t] * row_bytes, kp + t * k_stride, row_bytes);
      std::memcpy(vc + s[t] * row_bytes, vp + t * v_stride, row_bytes);
    }
  });
}

// Quantizes new K/V rows [T, kv_heads, head_dim] (float32) into int8 caches with one scale per (token,
// head): scale = amax / 127, q = round-half-even(x / scale), as radixserve/kernels/kv_dtype.py does,
// so both store the same bytes. A row of zeros gets scale 0. Negative slots are skipped.
void store_kv_int8(at::Tensor& k_cache, at::Tensor& v_cache, at::Tensor& k_scale, at::Tensor& v_scale,
                   const at::Tensor& k_in, const at::Tensor& v_in, const at::Tensor& slot_mapping) {
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes() && k_cache.scalar_type() == at::kChar &&
                  v_cache.scalar_type() == at::kChar,
              "radixserve_cpu: int8 caches must be contiguous [pages, page_size, kv_heads, dim]");
  const int64_t P = k_cache.size(0), S = k_cache.size(1), H = k_cache.size(2), D = k_cache.size(3);
  for (const at::Tensor* t : {&k_scale, &v_scale})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 3 && t->size(0) == P &&
                    t->size(1) == S && t->size(2) == H,
                "radixserve_cpu: scales must be contiguous float32 [pages, page_size, kv_heads]");
  TORCH_CHECK(k_in.dim() == 3 && k_in.size(1) == H && k_in.size(2) == D && v_in.sizes() == k_in.sizes() &&
                  k_in.scalar_type() == at::kFloat && v_in.scalar_type() == at::kFloat,
              "radixserve_cpu: k and v must be float32 [T, kv_heads, head_dim] like the cache");
  const int64_t T = k_in.size(0);
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.numel() == T, "radixserve_cpu: one slot per new token");
  const auto dense_rows = [&](const at::Tensor& t) {
    return (t.stride(2) == 1 && t.stride(1) == D) ? t : t.contiguous();
  };
  const at::Tensor k = dense_rows(k_in), v = dense_rows(v_in);
  const at::Tensor slots = slot_mapping.to(at::kLong).contiguous();
  const int64_t* s = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(s[t] < P * S, "radixserve_cpu: slot ", s[t], " out of range");
  const auto quantize = [&](const float* src, int8_t* dst, float* scale) {
    float amax = 0.f;
    for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(src[d]));
    const float sc = amax / 127.f;
    const float safe = sc > 0.f ? sc : 1.f;
    for (int64_t d = 0; d < D; ++d)  // nearbyint rounds half to even in the default rounding mode
      dst[d] = static_cast<int8_t>(std::clamp(std::nearbyint(src[d] / safe), -127.f, 127.f));
    *scale = sc;
  };
  int8_t* kc = k_cache.data_ptr<int8_t>();
  int8_t* vc = v_cache.data_ptr<int8_t>();
  float* ksc = k_scale.data_ptr<float>();
  float* vsc = v_scale.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  at::parallel_for(0, T, 256, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (s[t] < 0) continue;
      for (int64_t h = 0; h < H; ++h) {
        quantize(kp + t * k.stride(0) + h * D, kc + (s[t] * H + h) * D, ksc + s[t] * H + h);
        quantize(vp + t * v.stride(0) + h * D, vc + (s[t] * H + h) * D, vsc + s[t] * H + h);
      }
    }
  });
}

// Floats per at::vec::Vectorized<float> in this build: 16 with AVX-512, 8 with AVX2.
int64_t vec_size() { return at::vec::Vectorized<float>::size(); }

// The instruction set this build was compiled for.
std::string build_isa() {
#if defined(CPU_CAPABILITY_AVX512)
  return "AVX512";
#elif defined(CPU_CAPABILITY_AVX2)
  return "AVX2";
#else
  return "DEFAULT";
#endif
}

}  // namespace
}  // namespace radixserve_cpu

TORCH_LIBRARY(radixserve_cpu, m) {
  m.def("store_kv(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor k, Tensor v, Tensor slot_mapping) -> ()");
  m.def(
      "store_kv_int8(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor(c!) k_scale, Tensor(d!) v_scale, "
      "Tensor k, Tensor v, Tensor slot_mapping) -> ()");
  m.def(
      "paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor page_table, Tensor items, "
      "Tensor rows, Tensor merge_rows, Tensor merge_offsets, Tensor merge_slots, float scale, "
      "Tensor? k_scale=None, Tensor? v_scale=None, bool bf16_dot=False) -> (Tensor out, Tensor lse)");
  m.def(
      "plan(Tensor page_table, Tensor cu_q_lens, Tensor kv_lens, int page_size, int num_threads, "
      "int cascade_min_tokens) -> (Tensor items, Tensor rows, Tensor merge_rows, Tensor merge_offsets, "
      "Tensor merge_slots)");
  m.def("vec_size() -> int", &radixserve_cpu::vec_size);
  m.def("build_isa() -> str", &radixserve_cpu::build_isa);
}

TORCH_LIBRARY_IMPL(radixserve_cpu, CPU, m) {
  m.impl("store_kv", &radixserve_cpu::store_kv);
  m.impl("store_kv_int8", &radixserve_cpu::store_kv_int8);
  m.impl("paged_attention", &radixserve_cpu::paged_attention);
  m.impl("plan", &radixserve_cpu::plan);
}
