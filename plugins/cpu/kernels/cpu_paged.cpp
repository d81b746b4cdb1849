// Decode attention over the paged KV cache on a CPU, reading each row's pages in place.
//
// For every row (OpenMP over the rows; over ranges of their keys when the rows are fewer than
// twice the threads, merged by log-sum-exp after), the row's query heads score the row's keys,
// page by page, up to the row's own length (and, with a sliding window, from its start); a
// softmax in float32 turns scores into weights; the weighted values are summed. Nothing is
// gathered into a dense copy and no row reads past its own length, so a batch of mixed
// lengths costs what its rows' tokens cost. The per-row kernels, and the read-ahead that keeps
// a thread's next pages on their way into L2, are in cpu_rows.h.
//
// Layouts (contiguous): query [rows, heads, head_dim] float32 or bfloat16; key_cache and
// value_cache [pages, page_size, kv_heads, head_dim] float32 or bfloat16; block_tables
// [rows, max_pages] int64; seq_lens [rows] int64; out [rows, heads, head_dim] in the query's
// dtype. Arithmetic is float32 throughout (a bfloat16 query is widened, the output rounded
// once).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include "cpu_cascade.h"
#include "cpu_rows.h"
#include "cpu_scalar.h"
#include "cpu_tasks.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

using brigade_cpu::AttendVec;
using brigade_cpu::attend_scalar;
using brigade_cpu::attend_vec_for;
using brigade_cpu::to_float;

// Key ranges each (row, KV heads) task is cut into: one, unless the tasks are too few to keep
// every thread busy (a batch of one row has as many as the model has KV heads: 3 for SmolLM2,
// so one of two threads would read twice what the other reads, and 13 of 16 would idle). Then
// the fewest ranges that give every thread as many tasks as the next (or at least one each),
// each of at least kMinSplitKeys keys; the ranges' results are merged by their log-sum-exps.
constexpr int64_t kMinSplitKeys = 64;

int64_t key_splits(int64_t tasks, int64_t longest, int64_t threads) {
  if (tasks >= 2 * threads) return 1;
  const int64_t most = std::max<int64_t>(1, longest / kMinSplitKeys);
  int64_t splits = 1;
  while (splits < most && (tasks * splits < threads || tasks * splits % threads != 0)) ++splits;
  return splits;
}

// Bounds of `threads` runs of consecutive tasks [runs[t], runs[t + 1]) with about equal
// work: a task's keys, plus a page's worth for what it does once (its query, its output).
std::vector<int64_t> balanced_runs(const brigade_cpu::DecodeTasks& tasks, int64_t num_tasks,
                                   int64_t threads, int64_t page_size) {
  threads = std::max<int64_t>(1, std::min(threads, num_tasks));
  std::vector<int64_t> cost(num_tasks + 1, 0);  // cost[i]: the work of tasks [0, i)
  for (int64_t item = 0; item < num_tasks; ++item) {
    const auto [first, length] = tasks.range(item);
    cost[item + 1] = cost[item] + std::max<int64_t>(0, length - first) + page_size;
  }
  std::vector<int64_t> runs(threads + 1, num_tasks);
  runs[0] = 0;
  for (int64_t t = 1; t < threads; ++t) {
    const int64_t target = cost[num_tasks] * t / threads;  // the first task past it starts run t
    runs[t] = std::lower_bound(cost.begin(), cost.end(), target) - cost.begin();
    // The task boundary nearest the target: the first past it gave the first run ~5% more keys
    // than the second on the small Llama's mixed workload, and its thread finished last 92% of
    // the time.
    if (runs[t] > 0 && target - cost[runs[t] - 1] < cost[runs[t]] - target) --runs[t];
    runs[t] = std::clamp(runs[t], runs[t - 1], num_tasks);
  }
  return runs;
}

// Each row's decode attention over its keys [first, length) (first: starts[row] when starts is
// given, else 0 or the sliding window's start), handed over as it is done:
// emit(row, head, heads, o, lse) gets query heads [head, head + heads) of the row, o [heads,
// head_dim] in float32 and lse [heads] their log-sum-exps.
template <typename Query, typename Cache, typename Emit>
void decode_rows(const Query* query, const Cache* key_cache, const Cache* value_cache,
                 const int64_t* block_tables, const int64_t* seq_lens, const int64_t* starts,
                 int64_t num_rows, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                 int64_t page_size, int64_t max_pages, int64_t window, float scale,
                 const Emit& emit) {
  constexpr bool widen = !std::is_same_v<Query, float>;
  const int64_t group = num_heads / num_kv_heads;
  const int64_t token_stride = num_kv_heads * head_dim;  // between slots of one page
  const int64_t page_stride = page_size * token_stride;
  int64_t longest = 0;
  for (int64_t row = 0; row < num_rows; ++row) longest = std::max(longest, seq_lens[row]);
  const AttendVec<Cache> vectorized = attend_vec_for<Cache>(head_dim);
  // A task is a row's KV heads together (their keys and values are contiguous in a slot;
  // the scalar loops take one KV head at a time), over a range of the row's keys when there
  // are too few rows to keep every thread busy.
  const int64_t threads = at::get_num_threads();
  const int64_t span = vectorized != nullptr ? num_kv_heads : 1;
  const int64_t spans = num_kv_heads / span;
  const int64_t splits = key_splits(num_rows * spans, longest, threads);
  const int64_t heads = span * group, width = heads * head_dim;  // a task's query heads
  const brigade_cpu::DecodeTasks tasks{block_tables, seq_lens, starts, max_pages, page_size,
                                       window,       spans,    span,   splits};
  const int64_t num_tasks = num_rows * spans * splits;
  // With ranges, each task's o and lse go here, to be merged once every range is done.
  std::vector<float> parts(splits > 1 ? num_tasks * (width + heads) : 0);
  constexpr int64_t element = sizeof(Cache);
  // The most keys one task reads: a row, or a range of whole pages of the longest row.
  const int64_t pages = (longest + page_size - 1) / page_size;
  const int64_t reach = std::min(longest, ((pages + splits - 1) / splits + 1) * page_size);
  // Each thread takes a run of consecutive tasks (so that its read-ahead walks them in order)
  // of about an equal share of the keys (rows of mixed lengths in runs of equal counts left a
  // thread idle ~4% of a 112-row step, 13% of a 13-row one, on average), and a thread done
  // with its own takes the last tasks of the other's (cpu_tasks.h).
  const std::vector<int64_t> runs = balanced_runs(tasks, num_tasks, threads, page_size);
  // Tasks [begin, end) in order, as long as next_item() hands them over (-1: the rest is
  // another thread's).
  const auto run_tasks = [&](int64_t begin, int64_t end, const auto& next_item) {
    std::vector<float> scores(heads * std::max<int64_t>(reach, 1));
    std::vector<float> widened(widen ? width : 0), o(width), lse(heads);
    brigade_cpu::ReadAhead ahead(reinterpret_cast<const char*>(key_cache),
                                 reinterpret_cast<const char*>(value_cache), tasks, begin,
                                 vectorized != nullptr ? end : begin, token_stride * element,
                                 head_dim * element, span * head_dim * element);
    for (int64_t item = next_item(); item >= 0; item = next_item()) {
      const int64_t row = tasks.row(item), kv_head = tasks.kv_head(item);
      const auto [first, length] = tasks.range(item);
      const int64_t count = length - first;
      const int64_t* pages = tasks.pages(row);
      const int64_t head_offset = (row * num_heads + kv_head * group) * head_dim;
      const float* q;
      if constexpr (widen) {
        for (int64_t e = 0; e < width; ++e) widened[e] = to_float(query[head_offset + e]);
        q = widened.data();
      } else {
        q = query + head_offset;
      }
      if (count <= 0) {  // nothing to attend to (not a decode row): zeros, never garbage
        std::fill(o.begin(), o.end(), 0.0f);
        std::fill(lse.begin(), lse.end(), -std::numeric_limits<float>::infinity());
      } else if (vectorized != nullptr) {
        vectorized(q, key_cache, value_cache, pages, first, length, kv_head * head_dim, span,
                   group, page_size, page_stride, token_stride, scale, scores.data(), o.data(),
                   lse.data(), ahead);
      } else {
        attend_scalar(q, key_cache, value_cache, pages, first, count, length, kv_head, group,
                      head_dim, page_size, page_stride, token_stride, scale, scores.data(),
                      o.data(), lse.data());
      }
      if (splits == 1) {
        emit(row, kv_head * group, heads, o.data(), lse.data());
      } else {
        float* part = parts.data() + item * (width + heads);
        std::copy(o.begin(), o.end(), part);
        std::copy(lse.begin(), lse.end(), part + width);
      }
    }
  };
  brigade_cpu::run_stealing(
      runs,
      [&](brigade_cpu::StealableRuns& own, int64_t run) {
        run_tasks(runs[run], runs[run + 1], [&] { return own.take_front(run); });
      },
      [&](int64_t begin, int64_t end) {
        int64_t item = begin;
        run_tasks(begin, end, [&] { return item < end ? item++ : -1; });
      });
  if (splits == 1) return;
  std::vector<float> o(width), lse(heads);
  for (int64_t task = 0; task < num_rows * spans; ++task) {
    const float* first_part = parts.data() + task * splits * (width + heads);
    for (int64_t h = 0; h < heads; ++h) {
      const auto part = [&](int64_t k) -> std::pair<const float*, float> {
        const float* range = first_part + k * (width + heads);
        return {range + h * head_dim, range[width + h]};
      };
      lse[h] = brigade_cpu::merge_parts(splits, head_dim, part, o.data() + h * head_dim);
    }
    const int64_t row = task / spans, kv_head = task % spans * span;
    emit(row, kv_head * group, heads, o.data(), lse.data());
  }
}

// Writes emitted float32 results into out [rows, heads, head_dim] as Query.
template <typename Query>
inline void store_heads(Query* out, int64_t num_heads, int64_t head_dim, int64_t row,
                        int64_t head, int64_t heads, const float* o) {
  Query* target = out + (row * num_heads + head) * head_dim;
  for (int64_t e = 0; e < heads * head_dim; ++e) target[e] = brigade_cpu::from_float<Query>(o[e]);
}

// Decode attention with the shared keys of each group read once for all its rows: shared
// tasks (each group's rows in blocks of kSharedRows, per KV head, the keys split in ranges so
// that every thread has work) on cpu_cascade.cpp's kernel, then every row over its own keys,
// merged with its shared parts by their log-sum-exps.
template <typename Query, typename Cache>
void cascade_rows(const at::Tensor& query, const at::Tensor& key_cache,
                  const at::Tensor& value_cache, const at::Tensor& block_tables,
                  const int64_t* seq_lens, const std::vector<brigade_cpu::SharedGroup>& groups,
                  at::Tensor& out, float scale) {
  const int64_t num_rows = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t num_kv_heads = key_cache.size(2), group = num_heads / num_kv_heads;
  int64_t blocks = 0;
  for (const brigade_cpu::SharedGroup& g : groups) {
    blocks += (static_cast<int64_t>(g.rows.size()) + brigade_cpu::kSharedRows - 1) /
              brigade_cpu::kSharedRows;
  }
  const int64_t wanted = 4 * at::get_num_threads();  // tasks, for balance
  const int64_t split = std::max<int64_t>(1, (wanted + blocks * num_kv_heads - 1) /
                                                 (blocks * num_kv_heads));
  // Where a row's partials are: its block's first task (KV head 0, range 0), its slot in it,
  // and how many ranges its group's keys were split into.
  std::vector<int64_t> first_task(num_rows, -1), slot(num_rows, 0), ranges_of(num_rows, 0);
  std::vector<int64_t> starts(num_rows, 0);
  std::vector<brigade_cpu::SharedPrefixTask> tasks;
  std::vector<int64_t> offsets;  // each task's first float in the partial buffers
  int64_t floats = 0;
  for (const brigade_cpu::SharedGroup& g : groups) {
    for (size_t b = 0; b < g.rows.size(); b += brigade_cpu::kSharedRows) {
      const int64_t count =
          std::min<int64_t>(brigade_cpu::kSharedRows, static_cast<int64_t>(g.rows.size() - b));
      const int64_t most = brigade_cpu::max_shared_keys(count * group);
      const int64_t ranges = std::max(std::min(split, g.keys / brigade_cpu::kMinSharedKeys),
                                      (g.keys + most - 1) / most);
      const int64_t range = (g.keys + ranges - 1) / ranges;
      for (int64_t i = 0; i < count; ++i) {
        const int64_t row = g.rows[b + i];
        first_task[row] = static_cast<int64_t>(tasks.size());
        slot[row] = i;
        ranges_of[row] = ranges;
        starts[row] = g.keys;
      }
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        for (int64_t k = 0; k < ranges; ++k) {
          tasks.push_back({g.rows[0], h, g.rows.data() + b, count, k * range,
                           std::min(g.keys, (k + 1) * range), nullptr, nullptr});
          offsets.push_back(floats);
          floats += count * group * (head_dim + 1);
        }
      }
    }
  }
  std::vector<float> partials(floats);
  for (size_t t = 0; t < tasks.size(); ++t) {
    tasks[t].out = partials.data() + offsets[t];
    tasks[t].lse = tasks[t].out + tasks[t].count * group * head_dim;
  }
  brigade_cpu::shared_prefix_attention(query, key_cache, value_cache, block_tables, tasks, scale);
  // Every row over its own keys, merged with its shared parts by their log-sum-exps.
  Query* result = out.data_ptr<Query>();
  const auto merge = [&](int64_t row, int64_t head, int64_t heads, const float* o,
                         const float* lse) {
    const int64_t ranges = ranges_of[row];
    if (ranges == 0) {  // a row sharing nothing: its own result, as it is
      store_heads(result, num_heads, head_dim, row, head, heads, o);
      return;
    }
    thread_local std::vector<float> merged;
    merged.resize(head_dim);
    for (int64_t h = 0; h < heads; ++h, o += head_dim) {
      Query* target = result + (row * num_heads + head + h) * head_dim;
      const int64_t kv_head = (head + h) / group, g = (head + h) % group;
      const brigade_cpu::SharedPrefixTask* shared =
          tasks.data() + first_task[row] + kv_head * ranges;
      const int64_t pair = slot[row] * group + g;  // this head's place in its tasks
      const auto part = [&](int64_t k) -> std::pair<const float*, float> {
        if (k == 0) return {o, lse[h]};  // the row's own keys, then the shared ranges
        return {shared[k - 1].out + pair * head_dim, shared[k - 1].lse[pair]};
      };
      brigade_cpu::merge_parts(ranges + 1, head_dim, part, merged.data());
      for (int64_t e = 0; e < head_dim; ++e) target[e] = brigade_cpu::from_float<Query>(merged[e]);
    }
  };
  decode_rows(query.data_ptr<Query>(), key_cache.data_ptr<Cache>(),
              value_cache.data_ptr<Cache>(), block_tables.data_ptr<int64_t>(), seq_lens,
              starts.data(), num_rows, num_heads, num_kv_heads, head_dim, key_cache.size(1),
              block_tables.size(1), 0, scale, merge);
}

}  // namespace

// cascade: rows that share their first pages (at least kMinSharedKeys keys) read them once.
at::Tensor paged_decode(at::Tensor query, at::Tensor key_cache, at::Tensor value_cache,
                        at::Tensor block_tables, at::Tensor seq_lens, int64_t window,
                        double scale, bool cascade) {
  TORCH_CHECK(query.dim() == 3 && query.is_contiguous() &&
                  (query.scalar_type() == at::kFloat || query.scalar_type() == at::kBFloat16),
              "query must be a contiguous float32 or bfloat16 [rows, heads, head_dim] tensor");
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.is_contiguous() && value_cache.is_contiguous() &&
                  key_cache.sizes() == value_cache.sizes() &&
                  key_cache.scalar_type() == value_cache.scalar_type(),
              "key_cache and value_cache must be contiguous [pages, page_size, kv_heads, "
              "head_dim] tensors of one dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.is_contiguous() &&
                  seq_lens.scalar_type() == at::kLong && seq_lens.is_contiguous(),
              "block_tables and seq_lens must be contiguous int64 tensors");
  const int64_t num_rows = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t page_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  TORCH_CHECK(key_cache.size(3) == head_dim && num_heads % num_kv_heads == 0,
              "query and cache head sizes disagree");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) >= num_rows &&
                  seq_lens.size(0) >= num_rows,
              "block_tables and seq_lens need a row per query row");
  const int64_t capacity = block_tables.size(1) * page_size;
  for (int64_t row = 0; row < num_rows; ++row) {
    const int64_t length = seq_lens.data_ptr<int64_t>()[row];
    TORCH_CHECK(length >= 0 && length <= capacity, "row ", row, " has ", length,
                " tokens but its block table holds ", capacity);
  }
  auto out = at::empty_like(query);
  const int64_t* lengths = seq_lens.data_ptr<int64_t>();
  // Rows sharing pages read them once (cascade); not with a sliding window, whose rows start
  // at their own positions.
  std::vector<brigade_cpu::SharedGroup> groups;
  if (cascade && window <= 0 && num_rows >= 2 && attend_vec_for<float>(head_dim) != nullptr) {
    groups = brigade_cpu::shared_groups(block_tables.data_ptr<int64_t>(), lengths, num_rows,
                           block_tables.size(1), page_size);
  }
  const auto run = [&](auto query_type, auto cache_type) {
    using Query = decltype(query_type);
    using Cache = decltype(cache_type);
    if (!groups.empty()) {
      cascade_rows<Query, Cache>(query, key_cache, value_cache, block_tables, lengths, groups,
                                 out, static_cast<float>(scale));
      return;
    }
    Query* result = out.data_ptr<Query>();
    const auto store = [&](int64_t row, int64_t head, int64_t heads, const float* o,
                           const float*) {
      store_heads(result, num_heads, head_dim, row, head, heads, o);
    };
    decode_rows(query.data_ptr<Query>(), key_cache.data_ptr<Cache>(),
                value_cache.data_ptr<Cache>(), block_tables.data_ptr<int64_t>(), lengths,
                static_cast<const int64_t*>(nullptr), num_rows, num_heads, num_kv_heads,
                head_dim, page_size, block_tables.size(1), window, static_cast<float>(scale),
                store);
  };
  const bool bf16_query = query.scalar_type() == at::kBFloat16;
  if (key_cache.scalar_type() == at::kFloat) {
    bf16_query ? run(c10::BFloat16{}, float{}) : run(float{}, float{});
  } else if (key_cache.scalar_type() == at::kBFloat16) {
    bf16_query ? run(c10::BFloat16{}, c10::BFloat16{}) : run(float{}, c10::BFloat16{});
  } else {
    TORCH_CHECK(false, "the KV cache must be float32 or bfloat16");
  }
  return out;
}

// torch.ops.brigade_cpu.paged_decode (no pybind11: the build needs only ATen's headers).
TORCH_LIBRARY(brigade_cpu, m) {
  m.def(
      "paged_decode(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
      "Tensor seq_lens, int window, float scale, bool cascade=True) -> Tensor",
      &paged_decode);
}
