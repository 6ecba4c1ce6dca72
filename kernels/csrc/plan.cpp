// The plan of one step's attention: which query rows read which context, as work items.
//
// Done once per step on the host (every layer reuses it), from the page table and the lengths:
// - every query row gets its causal limit (row i of a segment of T rows over L context tokens
//   sees the tokens before L - T + i + 1);
// - each segment is cut into items of at most kQBlock query rows (decode: one row);
// - decode rows whose page tables start with the same pages (a prefix shared through the radix
//   tree) form a cascade group when they share at least `cascade_min_tokens` tokens: one item
//   attends the group's stacked rows over the shared pages (a GEMM of rows x heads-per-group query
//   rows), then each row attends its own pages alone; the two merge through their log-sum-exps.
//   Chosen by measurement (benchmarks/kernels/attention_cpu.py and side-by-side runs, 9 q / 3 kv heads):
//   simply running the rows that share pages back to back already keeps those pages in L2, so the
//   cascade saves little memory traffic; what it saves is compute, the per-token dot products of
//   every row, which on CPU is what decode over a cached prefix costs. It pays off with the group:
//   32 rows over 1,000 shared tokens run 1.5-1.7x faster with it (one layer or a 30-layer step, 1
//   or 2 threads), 16 rows over 512 about 1.15x, 8 rows over 1,000 0.95-1.3x, and 4 rows over 192
//   15% slower (short GEMMs, an extra merge), hence the minimum prefix (256 tokens, cpu.py).
// - where the threads would otherwise be unevenly busy, items whose context is long relative to
//   the step's work are split along the context, so a batch-1 decode (one unit of work for all its
//   kv heads) still keeps every thread busy (flash-decoding); the pieces merge through their
//   log-sum-exps too;
// - items are sorted by decreasing cost: the attention op hands them out longest first.
#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <vector>

#include "radixserve_cpu.h"

namespace radixserve_cpu {
namespace {

// Query tokens per item: GEMMs of kQBlock x group rows (192 for the default model). 64 measured
// about 10% faster than 32 for extend and prefill; larger blocks leave fewer items to share out.
constexpr int64_t kQBlock = 64;
constexpr int64_t kMinChunk = 128;      // the shortest context piece a split leaves
constexpr int64_t kUnitsPerThread = 4;  // split until the step has about this many items per thread
constexpr double kMaxImbalance = 1.3;   // ... unless no thread would work 30% more than the average
constexpr int64_t kAlign = 16;          // split points fall on multiples of this many tokens
// A (query row, context token) pair costs this much in a many-row GEMM item relative to a context
// token of a single-row (vector path) item; measured at head_dim 64 with three heads per group.
constexpr double kGemmPairCost = 0.2;
constexpr double kItemOverhead = 16.0;

struct Item {
  int32_t seg, row_begin, row_end, kv_begin, kv_end;
  int32_t partial = -1;
  double cost = 0.0;
};

double cost_of(const Item& it) {
  const double tokens = std::max(0, it.kv_end - it.kv_begin);
  const int32_t nrow = it.row_end - it.row_begin;
  return (nrow == 1 ? tokens : tokens * nrow * kGemmPairCost) + kItemOverhead;
}

at::Tensor to_tensor(const std::vector<int32_t>& v, int64_t cols) {
  const int64_t n = cols > 0 ? static_cast<int64_t>(v.size()) / cols : static_cast<int64_t>(v.size());
  at::Tensor t = cols > 0 ? at::empty({n, cols}, at::kInt) : at::empty({n}, at::kInt);
  std::copy(v.begin(), v.end(), t.data_ptr<int32_t>());
  return t;
}

// The busiest thread's work over the average when items go longest first to the least busy thread.
double imbalance(const std::vector<Item>& items, int64_t num_threads, double total) {
  std::vector<double> costs, load(num_threads, 0.0);
  for (const Item& it : items) costs.push_back(it.cost);
  std::sort(costs.begin(), costs.end(), std::greater<>());
  for (double c : costs) *std::min_element(load.begin(), load.end()) += c;
  return *std::max_element(load.begin(), load.end()) * static_cast<double>(num_threads) / total;
}

// Splits items whose context is long for this step's work, so every thread gets several, unless
// the threads are busy alike without (each item counted as one unit of work, though a GEMM item is
// one per kv head: splits cost partial results and merges, and measured slower for a prefill of
// 512 or an extend of 100 over 500 with 3 kv heads).
std::vector<Item> split_long(const std::vector<Item>& items, int64_t num_threads) {
  if (num_threads <= 1) return items;
  double total = 0.0;
  for (const Item& it : items) total += it.cost;
  if (total <= 0.0 || imbalance(items, num_threads, total) <= kMaxImbalance) return items;
  const double target = total / static_cast<double>(kUnitsPerThread * num_threads);
  std::vector<Item> out;
  out.reserve(items.size());
  for (const Item& it : items) {
    const int64_t tokens = it.kv_end - it.kv_begin;
    int64_t pieces = std::min<int64_t>(static_cast<int64_t>(std::ceil(it.cost / target)), tokens / kMinChunk);
    if (pieces <= 1) {
      out.push_back(it);
      continue;
    }
    int64_t begin = it.kv_begin;
    for (int64_t p = 1; p <= pieces; ++p) {
      int64_t end = it.kv_begin + tokens * p / pieces;
      if (p < pieces) end = it.kv_begin + (end - it.kv_begin) / kAlign * kAlign;
      Item piece = it;
      piece.kv_begin = static_cast<int32_t>(begin);
      piece.kv_end = static_cast<int32_t>(end);
      piece.cost = cost_of(piece);
      out.push_back(piece);
      begin = end;
    }
  }
  return out;
}

}  // namespace

PlanTensors plan(const at::Tensor& page_table_in, const at::Tensor& cu_q_lens_in,
                 const at::Tensor& kv_lens_in, int64_t page_size, int64_t num_threads,
                 int64_t cascade_min_tokens) {
  const at::Tensor table_t = page_table_in.to(at::kInt).contiguous();
  const at::Tensor cu_t = cu_q_lens_in.to(at::kInt).contiguous();
  const at::Tensor lens_t = kv_lens_in.to(at::kInt).contiguous();
  TORCH_CHECK(page_size >= 1, "radixserve_cpu: page_size must be positive");
  const int64_t B = lens_t.numel();
  TORCH_CHECK(table_t.dim() == 2 && table_t.size(0) == B && cu_t.numel() == B + 1,
              "radixserve_cpu: plan needs page_table [B, W], cu_q_lens [B + 1], kv_lens [B]");
  const int64_t W = table_t.size(1);
  const int32_t* table = table_t.data_ptr<int32_t>();
  const int32_t* cu = cu_t.data_ptr<int32_t>();
  const int32_t* lens = lens_t.data_ptr<int32_t>();

  // Every query row once, in order, with its causal limit.
  std::vector<int32_t> rows;
  std::vector<int32_t> first_entry(B);
  for (int64_t s = 0; s < B; ++s) {
    TORCH_CHECK(cu[s] <= cu[s + 1] && cu[s] >= 0, "radixserve_cpu: cu_q_lens must be non-decreasing");
    first_entry[s] = static_cast<int32_t>(rows.size() / kRowCols);
    for (int32_t r = cu[s]; r < cu[s + 1]; ++r) {
      rows.push_back(r);
      rows.push_back(std::clamp(lens[s] - (cu[s + 1] - r) + 1, 0, std::max(lens[s], 0)));
    }
  }

  // Cascade groups: decode rows (one query row) with the same first page share their common
  // leading pages; only whole pages before every row's newest token count (that one is private).
  std::vector<int32_t> shared(B, 0);
  std::vector<std::vector<int32_t>> groups;
  if (cascade_min_tokens > 0 && W > 0) {
    std::map<int32_t, std::vector<int32_t>> by_first;
    for (int64_t s = 0; s < B; ++s) {
      if (cu[s + 1] - cu[s] == 1 && lens[s] > page_size)
        by_first[table[s * W]].push_back(static_cast<int32_t>(s));
    }
    for (auto& [first, members] : by_first) {
      if (members.size() < 2) continue;
      int32_t min_len = lens[members[0]];
      for (int32_t m : members) min_len = std::min(min_len, lens[m]);
      const int64_t limit = std::min<int64_t>((min_len - 1) / page_size, W);
      int64_t n = 0;
      for (; n < limit; ++n) {
        const int32_t page = table[members[0] * W + n];
        bool same = true;
        for (int32_t m : members) same = same && table[m * W + n] == page;
        if (!same) break;
      }
      if (n * page_size < cascade_min_tokens) continue;
      for (int32_t m : members) shared[m] = static_cast<int32_t>(n * page_size);
      groups.push_back(members);
    }
  }

  std::vector<Item> items;
  for (int64_t s = 0; s < B; ++s) {
    const int32_t qlen = cu[s + 1] - cu[s];
    const int32_t e0 = first_entry[s];
    if (qlen <= 0) continue;
    if (shared[s] > 0) {  // the row's own pages, after the group's shared ones
      items.push_back({static_cast<int32_t>(s), e0, e0 + 1, shared[s], lens[s]});
      continue;
    }
    for (int32_t b0 = 0; b0 < qlen; b0 += kQBlock) {
      const int32_t b1 = std::min<int32_t>(b0 + kQBlock, qlen);
      const int32_t last_limit = rows[(e0 + b1 - 1) * kRowCols + kLimit];
      items.push_back({static_cast<int32_t>(s), e0 + b0, e0 + b1, 0, last_limit});
    }
  }
  for (const auto& members : groups) {  // the group's rows again, stacked, over the shared pages
    const int32_t e0 = static_cast<int32_t>(rows.size() / kRowCols);
    for (int32_t m : members) {
      rows.push_back(cu[m]);
      rows.push_back(lens[m]);
    }
    const int32_t n = static_cast<int32_t>(members.size());
    for (int32_t b0 = 0; b0 < n; b0 += kQBlock) {
      items.push_back({members[0], e0 + b0, e0 + std::min<int32_t>(b0 + kQBlock, n), 0, shared[members[0]]});
    }
  }
  for (Item& it : items) it.cost = cost_of(it);
  items = split_long(items, num_threads);

  // Rows covered by more than one item get partial slots, merged afterwards.
  const int32_t num_rows = B > 0 ? cu[B] : 0;
  std::vector<int32_t> count(num_rows, 0);
  for (const Item& it : items)
    for (int32_t e = it.row_begin; e < it.row_end; ++e) ++count[rows[e * kRowCols + kQRow]];
  std::vector<std::vector<int32_t>> slots_of(num_rows);
  int32_t num_slots = 0;
  for (Item& it : items) {
    if (count[rows[it.row_begin * kRowCols + kQRow]] <= 1) continue;
    it.partial = num_slots;
    for (int32_t e = it.row_begin; e < it.row_end; ++e)
      slots_of[rows[e * kRowCols + kQRow]].push_back(num_slots++);
  }
  std::vector<int32_t> merge_rows, merge_offsets{0}, merge_slots;
  for (int32_t r = 0; r < num_rows; ++r) {
    if (slots_of[r].empty()) continue;
    merge_rows.push_back(r);
    merge_slots.insert(merge_slots.end(), slots_of[r].begin(), slots_of[r].end());
    merge_offsets.push_back(static_cast<int32_t>(merge_slots.size()));
  }

  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  std::vector<int32_t> flat;
  flat.reserve(items.size() * kItemCols);
  for (const Item& it : items)
    flat.insert(flat.end(), {it.seg, it.row_begin, it.row_end, it.kv_begin, it.kv_end, it.partial});
  return {to_tensor(flat, kItemCols), to_tensor(rows, kRowCols), to_tensor(merge_rows, 0),
          to_tensor(merge_offsets, 0), to_tensor(merge_slots, 0)};
}

}  // namespace radixserve_cpu
