// Ragged paged attention on CPU, reading K/V in place from the pages.
//
// The plan (plan.cpp) lists work items: a run of query rows against a range of one segment's
// context. Units of work are handed out to threads from an atomic counter (the plan sorts items by
// decreasing cost, so this is longest-first scheduling). An item takes one of two paths, by how
// many query rows share each K/V row (tokens x heads of a GQA group, "M"):
// - few rows (decode, M <= kVecRows): one unit for all kv heads, a vectorised loop over the
//   context tokens straight from the pages: each K/V row is loaded once and used by every query
//   row of its head;
// - many rows (extend, prefill, cascade groups): one unit per kv head, flash-attention blocks like
//   torch's CPU kernel: a block of K/V rows is copied from the pages into a small thread-local
//   buffer, then two GEMMs (Q K^T and P V, MKL's sgemm exported by libtorch_cpu) with an online
//   softmax in between.
// Rows covered by several items (a context split across threads, or a shared prefix attended
// apart from each row's own pages) write partial results with their log-sum-exps; a final pass
// merges them. This file holds the op (checks, scheduling, merge); decode_kernel.cpp and
// gemm_kernel.cpp the two paths, kernel_common.h what they share.
#include <ATen/Parallel.h>

#include <atomic>
#include <utility>
#include <vector>

#include "dense_rows.h"
#include "kernel_common.h"

namespace radixserve_cpu {
namespace detail {

// Thread-local scratch, grown on demand and kept between calls.
float* scratch(int64_t n) {
  static thread_local std::vector<float> buf;
  if (static_cast<int64_t>(buf.size()) < n) buf.resize(n);
  return buf.data();
}

}  // namespace detail

using namespace detail;

namespace {

// Combines merged row i's partial results (every q head) through their log-sum-exps.
void merge_row(const Ctx& c, int64_t row, const int32_t* slots, int64_t num_slots) {
  const int64_t H = c.q_heads, D = c.head_dim;
  for (int64_t head = 0; head < H; ++head) {
    float* out = c.out + (row * H + head) * D;
    float mx = kNegInf;
    for (int64_t k = 0; k < num_slots; ++k) mx = std::max(mx, c.part_lse[slots[k] * H + head]);
    std::fill(out, out + D, 0.f);
    if (mx == kNegInf) {
      c.lse[row * H + head] = kNegInf;
      continue;
    }
    float total = 0.f;
    for (int64_t k = 0; k < num_slots; ++k) {
      const float w = std::exp(c.part_lse[slots[k] * H + head] - mx);
      if (w == 0.f) continue;
      total += w;
      const float* src = c.part_out + (slots[k] * H + head) * D;
      for (int64_t x = 0; x < D; x += kVS)
        at::vec::fmadd(Vec(w), Vec::loadu(src + x), Vec::loadu(out + x)).store(out + x);
    }
    const Vec inv(1.f / total);
    for (int64_t x = 0; x < D; x += kVS) (Vec::loadu(out + x) * inv).store(out + x);
    c.lse[row * H + head] = mx + std::log(total);
  }
}

void check_index(const at::Tensor& t, int64_t dim, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kInt && t.dim() == dim && t.is_contiguous(), "radixserve_cpu: ", name,
              " must be a contiguous ", dim, "-D int32 tensor");
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> paged_attention(const at::Tensor& q_in, const at::Tensor& k_cache,
                                                   const at::Tensor& v_cache, const at::Tensor& page_table,
                                                   const at::Tensor& items, const at::Tensor& rows,
                                                   const at::Tensor& merge_rows,
                                                   const at::Tensor& merge_offsets,
                                                   const at::Tensor& merge_slots, double scale,
                                                   const std::optional<at::Tensor>& k_scale,
                                                   const std::optional<at::Tensor>& v_scale, bool bf16_dot) {
  TORCH_CHECK(q_in.dim() == 3 && q_in.scalar_type() == at::kFloat,
              "radixserve_cpu: q must be [T, heads, dim] float32");
  const auto dtype = k_cache.scalar_type();
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes() &&
                  v_cache.scalar_type() == dtype && v_cache.is_contiguous() &&
                  (dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kChar),
              "radixserve_cpu: caches must be contiguous [pages, page_size, kv_heads, dim] of one dtype: "
              "float32, bfloat16 or int8");
  const KvType kv_type =
      dtype == at::kBFloat16 ? KvType::kBFloat16 : (dtype == at::kChar ? KvType::kInt8 : KvType::kFloat);
  const float* ks = nullptr;
  const float* vs = nullptr;
  if (kv_type == KvType::kInt8) {
    const auto scales_ok = [&](const std::optional<at::Tensor>& s) {
      return s.has_value() && s->scalar_type() == at::kFloat && s->is_contiguous() && s->dim() == 3 &&
             s->size(0) == k_cache.size(0) && s->size(1) == k_cache.size(1) && s->size(2) == k_cache.size(2);
    };
    TORCH_CHECK(scales_ok(k_scale) && scales_ok(v_scale),
                "radixserve_cpu: int8 caches need contiguous float32 scales [pages, page_size, kv_heads]");
    ks = k_scale->data_ptr<float>();
    vs = v_scale->data_ptr<float>();
  }
  const int64_t T = q_in.size(0), Hq = q_in.size(1), D = q_in.size(2), Hkv = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && Hkv > 0 && Hq % Hkv == 0,
              "radixserve_cpu: q and cache shapes disagree");
  TORCH_CHECK(D % kVS == 0 && D <= kMaxHeadDim, "radixserve_cpu: head_dim must be a multiple of ", kVS,
              " and at most ", kMaxHeadDim);
  TORCH_CHECK(page_table.scalar_type() == at::kInt && page_table.dim() == 2 && page_table.stride(1) == 1,
              "radixserve_cpu: page_table must be [B, max_pages] int32 with contiguous rows");
  check_index(items, 2, "items");
  check_index(rows, 2, "rows");
  check_index(merge_rows, 1, "merge_rows");
  check_index(merge_offsets, 1, "merge_offsets");
  check_index(merge_slots, 1, "merge_slots");
  TORCH_CHECK(items.size(1) == kItemCols && rows.size(1) == kRowCols, "radixserve_cpu: malformed plan");
  TORCH_CHECK(merge_offsets.numel() == merge_rows.numel() + 1, "radixserve_cpu: malformed merge lists");
  const at::Tensor q = (q_in.stride(2) == 1 && q_in.stride(1) == D) ? q_in : q_in.contiguous();
  const int64_t P = merge_slots.numel(), N = items.size(0), R = rows.size(0), B = page_table.size(0);

  // Validate the plan once, so the threads need not (pages are checked as they are read).
  const int32_t* it = items.data_ptr<int32_t>();
  const int32_t* rw = rows.data_ptr<int32_t>();
  for (int64_t i = 0; i < N; ++i) {
    const int32_t* x = it + i * kItemCols;
    TORCH_CHECK(x[kSeg] >= 0 && x[kSeg] < B && x[kRowBegin] >= 0 && x[kRowBegin] <= x[kRowEnd] &&
                    x[kRowEnd] <= R && x[kKvBegin] >= 0 &&
                    (x[kPartial] < 0 || x[kPartial] + x[kRowEnd] - x[kRowBegin] <= P),
                "radixserve_cpu: malformed plan item ", i);
  }
  std::vector<char> covered(T, 0);
  for (int64_t r = 0; r < R; ++r) {
    TORCH_CHECK(rw[r * kRowCols] >= 0 && rw[r * kRowCols] < T, "radixserve_cpu: plan row out of range");
    covered[rw[r * kRowCols]] = 1;
  }
  const int32_t* mr = merge_rows.data_ptr<int32_t>();
  for (int64_t i = 0; i < merge_rows.numel(); ++i)
    TORCH_CHECK(mr[i] >= 0 && mr[i] < T, "radixserve_cpu: bad merge row");
  const int32_t* ms = merge_slots.data_ptr<int32_t>();
  for (int64_t i = 0; i < P; ++i) TORCH_CHECK(ms[i] >= 0 && ms[i] < P, "radixserve_cpu: bad merge slot");
  const int32_t* offs = merge_offsets.data_ptr<int32_t>();
  TORCH_CHECK(offs[0] == 0 && offs[merge_rows.numel()] == P, "radixserve_cpu: malformed merge offsets");
  for (int64_t i = 0; i < merge_rows.numel(); ++i)
    TORCH_CHECK(offs[i] <= offs[i + 1], "radixserve_cpu: malformed merge offsets");

  at::Tensor out = at::empty({T, Hq, D}, q.options());
  at::Tensor lse = at::empty({T, Hq}, q.options());
  at::Tensor part_out = at::empty({P, Hq, D}, q.options());
  at::Tensor part_lse = at::full({P, Hq}, kNegInf, q.options());  // a slot never written weighs 0
  const Ctx c{q.data_ptr<float>(),
              q.stride(0),
              k_cache.data_ptr(),
              v_cache.data_ptr(),
              ks,
              vs,
              kv_type,
              k_cache.size(0),
              k_cache.size(1),
              Hkv,
              D,
              Hq / Hkv,
              Hq,
              page_table.data_ptr<int32_t>(),
              page_table.stride(0),
              page_table.size(1),
              rw,
              static_cast<float>(scale),
              out.data_ptr<float>(),
              lse.data_ptr<float>(),
              part_out.data_ptr<float>(),
              part_lse.data_ptr<float>(),
              // bf16 arithmetic only over bf16 pages (no rounding of K/V), where the CPU has it.
              bf16_dot && kv_type == KvType::kBFloat16 && dense::cpu_has_bf16_dot()};

  // Units of work: a vector-path item takes every kv head at once (its pages are read whole); a
  // GEMM item is one unit per kv head (each is plenty of work).
  const VecKernel vec = vec_kernel(D, kv_type);
  std::vector<std::pair<int32_t, int32_t>> units;  // (item, kv head or -1 for all)
  units.reserve(N * Hkv);
  for (int64_t i = 0; i < N; ++i) {
    const int32_t* x = it + i * kItemCols;
    if (vec != nullptr && (x[kRowEnd] - x[kRowBegin]) * c.group <= kVecRows) {
      units.emplace_back(static_cast<int32_t>(i), -1);
    } else {
      for (int64_t h = 0; h < Hkv; ++h) units.emplace_back(static_cast<int32_t>(i), static_cast<int32_t>(h));
    }
  }
  const int64_t num_units = static_cast<int64_t>(units.size());

  // A merged row is combined by whichever thread finishes the last unit writing to it, so one
  // parallel region does the whole call (on a busy machine every extra fork-join costs a wait for
  // the other threads to be scheduled).
  const int64_t num_merged = merge_rows.numel();
  std::vector<int32_t> merge_of(T, -1);
  for (int64_t m = 0; m < num_merged; ++m) merge_of[mr[m]] = static_cast<int32_t>(m);
  std::vector<std::atomic<int32_t>> pending(num_merged);
  for (auto& p : pending) p.store(0, std::memory_order_relaxed);
  const auto for_merged_rows = [&](const int32_t* x, auto&& fn) {
    if (x[kPartial] < 0) return;
    for (int32_t e = x[kRowBegin]; e < x[kRowEnd]; ++e) {
      const int32_t m = merge_of[rw[e * kRowCols + kQRow]];
      if (m >= 0) fn(m);
    }
  };
  for (const auto& [i, h] : units)
    for_merged_rows(it + static_cast<int64_t>(i) * kItemCols, [&](int32_t m) { pending[m].fetch_add(1); });
  for (int64_t m = 0; m < num_merged; ++m) {  // only in a malformed plan: a merged row no item writes
    if (pending[m].load(std::memory_order_relaxed) == 0) merge_row(c, mr[m], ms + offs[m], 0);
  }

  std::atomic<int64_t> next{0};
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), num_units));
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t u = next.fetch_add(1, std::memory_order_relaxed); u < num_units;
         u = next.fetch_add(1, std::memory_order_relaxed)) {
      const auto [i, h] = units[u];
      const int32_t* x = it + static_cast<int64_t>(i) * kItemCols;
      if (h < 0) {
        vec(c, x, 0, Hkv);
      } else {
        attend_gemm(c, x, h);
      }
      for_merged_rows(x, [&](int32_t m) {
        if (pending[m].fetch_sub(1, std::memory_order_acq_rel) == 1)
          merge_row(c, mr[m], ms + offs[m], offs[m + 1] - offs[m]);
      });
    }
  });
  for (int64_t r = 0; r < T; ++r) {  // rows in no segment (batch padding): zeros
    if (!covered[r]) {
      out[r].zero_();
      lse[r].fill_(kNegInf);
    }
  }
  return {out, lse};
}

}  // namespace radixserve_cpu
