// radixserve_cpu::attend_layer: one layer's attention step on the whole pool: store the new K/V
// rows into their slots, then attend through the page table.
//
// Why the whole pool buffers and a layer index rather than the layer's own views: under
// torch.compile with dynamic shapes (torch 2.13), an opaque op that mutates a select-view of a
// graph input loses the view's storage offset once functionalized and reinplaced, so every layer's
// K/V landed in layer 0 (tests/test_capture.py catches it). A whole input mutated in place is the
// plain case and compiles right; the view is taken here, where the compiler cannot see it.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include "radixserve_cpu.h"

namespace radixserve_cpu {
namespace {

at::Tensor attend_layer(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& k_buffer,
                        at::Tensor& v_buffer, int64_t layer, const at::Tensor& slot_mapping,
                        const at::Tensor& page_table, const at::Tensor& items, const at::Tensor& rows,
                        const at::Tensor& merge_rows, const at::Tensor& merge_offsets,
                        const at::Tensor& merge_slots, double scale) {
  TORCH_CHECK(k_buffer.dim() == 5 && layer >= 0 && layer < k_buffer.size(0),
              "radixserve_cpu: attend_layer needs [layers, pages, page_size, kv_heads, head_dim] buffers");
  at::Tensor k_cache = k_buffer.select(0, layer), v_cache = v_buffer.select(0, layer);
  static const auto store_kv =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("radixserve_cpu::store_kv", "")
          .typed<void(at::Tensor&, at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&)>();
  store_kv.call(k_cache, v_cache, k, v, slot_mapping);
  return std::get<0>(paged_attention(q, k_cache, v_cache, page_table, items, rows, merge_rows, merge_offsets,
                                     merge_slots, scale));
}

}  // namespace
}  // namespace radixserve_cpu

TORCH_LIBRARY_FRAGMENT(radixserve_cpu, m) {
  m.def(
      "attend_layer(Tensor q, Tensor k, Tensor v, Tensor(a!) k_buffer, Tensor(b!) v_buffer, int layer, "
      "Tensor slot_mapping, Tensor page_table, Tensor items, Tensor rows, Tensor merge_rows, "
      "Tensor merge_offsets, Tensor merge_slots, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(radixserve_cpu, CPU, m) { m.impl("attend_layer", &radixserve_cpu::attend_layer); }
