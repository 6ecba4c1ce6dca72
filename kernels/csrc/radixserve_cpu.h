// CPU paged attention for radixserve: shared declarations of the ops in this folder.
//
// Layout (the same as radixserve.kernels.reference): one layer's cache is
// [num_pages, page_size, kv_heads, head_dim]; page_table[s, i] is the i-th page of segment s.
//
// A plan (plan.cpp) turns page tables and lengths into a list of work items; the attention op
// (attention.cpp) runs every (item, kv head) pair on a thread pool and reads K/V in place from the
// pages. Both decode (one query row per segment) and extend (many rows, causal) use the same op.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <tuple>

namespace radixserve_cpu {

// Columns of the plan's `items` tensor [N, kItemCols] int32. An item is a run of query rows (a range
// of the plan's `rows` entries) against the context tokens [kv_begin, kv_end) of segment `seg`'s
// pages. `partial` is -1 when the item is the only one covering its rows (it writes the output
// directly), else the first of its (row_end - row_begin) partial-result slots, merged afterwards.
enum ItemCol : int { kSeg = 0, kRowBegin, kRowEnd, kKvBegin, kKvEnd, kPartial, kItemCols };

// Columns of the plan's `rows` tensor [R, 2] int32: a query row and how many context tokens it sees
// (its causal limit: token j is visible iff j < limit).
enum RowCol : int { kQRow = 0, kLimit, kRowCols };

using PlanTensors = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// items, rows, merge_rows, merge_offsets, merge_slots (see plan.cpp).
PlanTensors plan(const at::Tensor& page_table, const at::Tensor& cu_q_lens, const at::Tensor& kv_lens,
                 int64_t page_size, int64_t num_threads, int64_t cascade_min_tokens);

// (out [T, q_heads, head_dim], lse [T, q_heads]) for q [T, q_heads, head_dim] float32, over caches
// of float32, bfloat16 or int8 (then with k_scale/v_scale [pages, page_size, kv_heads] float32).
std::tuple<at::Tensor, at::Tensor> paged_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                                   const at::Tensor& v_cache, const at::Tensor& page_table,
                                                   const at::Tensor& items, const at::Tensor& rows,
                                                   const at::Tensor& merge_rows,
                                                   const at::Tensor& merge_offsets,
                                                   const at::Tensor& merge_slots, double scale,
                                                   const std::optional<at::Tensor>& k_scale,
                                                   const std::optional<at::Tensor>& v_scale,
                                                   bool bf16_dot);

// Outlier channels of an int8 product (radixserve/model/outliers.py), checked: int64 [k], each in
// [0, K), and their weight columns float32 [k, N] (gguf_int8.cpp).
void check_outliers(const at::Tensor& channels, const at::Tensor& columns, int64_t K, int64_t N, const char* op);

}  // namespace radixserve_cpu
