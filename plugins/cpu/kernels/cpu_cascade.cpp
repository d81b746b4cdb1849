// Cascade decode attention (cpu_cascade.h): which rows share pages (shared_groups, shown by
// torch.ops.brigade_cpu.shared_decode_keys) and the shared part, a block of decode rows
// against keys they all see, with no mask: two small matrix products around an exact softmax.
// cpu_paged.cpp runs each row over its own keys and merges.
//
// A task is up to kSharedRows rows x the query heads of one KV head (its "queries") against a
// range of keys. The queries are transposed once into a float buffer [head_dim][queries];
// scores come kKeyRows keys x up to kQueryVectors vectors of queries at a time, each key's
// elements broadcast from where they lie in the pages (nothing gathered, no horizontal sums),
// into a [keys][queries] buffer kept whole, so the softmax is exact and needs no rescaling and
// runs down the columns in vectors; then the values are summed with R queries' outputs held in
// registers over every key. Arithmetic is float32; results are normalized float32 with each
// query's log-sum-exp.

#include "cpu_cascade.h"

#include <ATen/Parallel.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>
#include <c10/util/BFloat16.h>

#include "cpu_exp.h"
#include "cpu_scalar.h"
#include "cpu_tasks.h"
#include "cpu_vec.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

namespace {

using brigade_cpu::exp_vec;
using brigade_cpu::kLanes;
using brigade_cpu::load_vec;
using brigade_cpu::SharedPrefixTask;
using brigade_cpu::store_vec;
using brigade_cpu::to_float;
using brigade_cpu::vecf;

constexpr int64_t kMostKeys = 512;
// Vector registers for accumulators: all but 4 (for the loads and broadcasts).
constexpr int kRegisters = brigade_cpu::kVectorRegisters - 4;
constexpr int kKeyRows = 3;
constexpr int kQueryVectors = kLanes == 16 ? 6 : 3;

// Queries whose outputs stay in registers while the values are summed, for C vectors a head.
constexpr int value_rows(int c) { return std::max(1, std::min(6, (kRegisters - c) / c)); }

struct Geometry {
  int64_t num_heads, group, page_size, page_stride, token_stride;
  float scale;
};

struct Scratch {
  std::vector<float> query, scores, maxima, totals;
  std::vector<int64_t> slots;
};

inline void prefetch(const void* start, int64_t bytes) {
  const char* line = static_cast<const char*>(start);
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(line + b);
}

// Scores of keys [j0, j0 + kKeyRows) (past `count`: the last key again, not stored) against
// query vectors [v0, v0 + V): scores[j * width + query] = q . key_j, q already scaled.
template <int V, int64_t head_dim, typename Cache>
inline void score_block(const float* q, int64_t width, const Cache* key_cache,
                        const int64_t* slots, int64_t j0, int64_t count, int64_t v0,
                        float* scores) {
  const Cache* key[kKeyRows];
  for (int k = 0; k < kKeyRows; ++k) key[k] = key_cache + slots[std::min(j0 + k, count - 1)];
  if (v0 == 0) {  // the next block's keys lie on other pages: start fetching them now
    for (int64_t j = j0 + kKeyRows; j < std::min(j0 + 2 * kKeyRows, count); ++j) {
      prefetch(key_cache + slots[j], head_dim * sizeof(Cache));
    }
  }
  vecf acc[kKeyRows][V] = {};
  for (int64_t e = 0; e < head_dim; ++e) {
    vecf qv[V];
    for (int v = 0; v < V; ++v) qv[v] = load_vec(q + e * width + (v0 + v) * kLanes);
    for (int k = 0; k < kKeyRows; ++k) {
      const float k_e = to_float(key[k][e]);
      for (int v = 0; v < V; ++v) acc[k][v] += k_e * qv[v];
    }
  }
  for (int k = 0; k < kKeyRows && j0 + k < count; ++k) {
    for (int v = 0; v < V; ++v) store_vec(scores + (j0 + k) * width + (v0 + v) * kLanes, acc[k][v]);
  }
}

template <int C, typename Query, typename Cache>
void shared_task(const SharedPrefixTask& task, const Query* query, const Cache* key_cache,
                 const Cache* value_cache, const int64_t* pages, const Geometry& geo,
                 Scratch& scratch) {
  constexpr int64_t head_dim = C * kLanes;
  constexpr int R = value_rows(C);
  const int64_t queries = task.count * geo.group;
  const int64_t vectors = (queries + kLanes - 1) / kLanes, width = vectors * kLanes;
  const int64_t count = task.key_end - task.key_begin;
  scratch.query.assign(head_dim * width, 0.0f);
  scratch.scores.resize(count * width);
  scratch.slots.resize(count);
  float* q = scratch.query.data();
  float* scores = scratch.scores.data();
  int64_t* slots = scratch.slots.data();
  // Queries transposed and scaled: q[e * width + i * group + g] = query (row i, head g)[e].
  for (int64_t i = 0; i < task.count; ++i) {
    const Query* source = query + (task.rows[i] * geo.num_heads + task.kv_head * geo.group) *
                                      head_dim;
    for (int64_t g = 0; g < geo.group; ++g) {
      for (int64_t e = 0; e < head_dim; ++e) {
        q[e * width + i * geo.group + g] = to_float(source[g * head_dim + e]) * geo.scale;
      }
    }
  }
  for (int64_t j = 0; j < count; ++j) {
    const int64_t position = task.key_begin + j;
    slots[j] = pages[position / geo.page_size] * geo.page_stride +
               (position % geo.page_size) * geo.token_stride + task.kv_head * head_dim;
  }
  // Scores [keys][queries].
  for (int64_t j0 = 0; j0 < count; j0 += kKeyRows) {
    int64_t v0 = 0;
    for (; v0 + kQueryVectors <= vectors; v0 += kQueryVectors) {
      score_block<kQueryVectors, head_dim>(q, width, key_cache, slots, j0, count, v0, scores);
    }
    switch (vectors - v0) {
      case 0: break;
      case 1: score_block<1, head_dim>(q, width, key_cache, slots, j0, count, v0, scores); break;
      case 2: score_block<2, head_dim>(q, width, key_cache, slots, j0, count, v0, scores); break;
      case 3: score_block<3, head_dim>(q, width, key_cache, slots, j0, count, v0, scores); break;
      case 4: score_block<4, head_dim>(q, width, key_cache, slots, j0, count, v0, scores); break;
      default: score_block<5, head_dim>(q, width, key_cache, slots, j0, count, v0, scores); break;
    }
  }
  // Exact softmax weights (unnormalized), down the columns, and each query's log-sum-exp.
  scratch.maxima.assign(width, -std::numeric_limits<float>::infinity());
  scratch.totals.assign(width, 0.0f);
  float* maxima = scratch.maxima.data();
  float* totals = scratch.totals.data();
  for (int64_t j = 0; j < count; ++j) {
    for (int64_t v = 0; v < width; v += kLanes) {
      const vecf s = load_vec(scores + j * width + v), m = load_vec(maxima + v);
      store_vec(maxima + v, s > m ? s : m);
    }
  }
  for (int64_t j = 0; j < count; ++j) {
    for (int64_t v = 0; v < width; v += kLanes) {
      const vecf p = exp_vec(load_vec(scores + j * width + v) - load_vec(maxima + v));
      store_vec(scores + j * width + v, p);
      store_vec(totals + v, load_vec(totals + v) + p);
    }
  }
  for (int64_t r = 0; r < queries; ++r) task.lse[r] = maxima[r] + std::log(totals[r]);
  // Values: R queries' outputs in registers over every key.
  for (int64_t r0 = 0; r0 < queries; r0 += R) {
    int64_t column[R];
    for (int k = 0; k < R; ++k) column[k] = std::min<int64_t>(r0 + k, queries - 1);
    vecf acc[R][C] = {};
    for (int64_t j = 0; j < count; ++j) {
      const Cache* value = value_cache + slots[j];
      if (r0 == 0 && j + kKeyRows < count) {  // the first pass reads the values from memory
        prefetch(value_cache + slots[j + kKeyRows], head_dim * sizeof(Cache));
      }
      const float* w = scores + j * width;
      vecf v[C];
      for (int c = 0; c < C; ++c) v[c] = load_vec(value + c * kLanes);
      for (int k = 0; k < R; ++k) {
        const float weight = w[column[k]];
        for (int c = 0; c < C; ++c) acc[k][c] += weight * v[c];
      }
    }
    for (int k = 0; k < R && r0 + k < queries; ++k) {
      const float inverse = 1.0f / totals[r0 + k];
      for (int c = 0; c < C; ++c) {
        store_vec(task.out + (r0 + k) * head_dim + c * kLanes, acc[k][c] * inverse);
      }
    }
  }
}

template <typename Query, typename Cache>
using TaskFn = void (*)(const SharedPrefixTask&, const Query*, const Cache*, const Cache*,
                        const int64_t*, const Geometry&, Scratch&);

template <typename Query, typename Cache>
TaskFn<Query, Cache> task_fn_for(int64_t head_dim) {
  if (head_dim % kLanes != 0) return nullptr;
  switch (head_dim / kLanes) {
    case 1: return shared_task<1, Query, Cache>;
    case 2: return shared_task<2, Query, Cache>;
    case 3: return shared_task<3, Query, Cache>;
    case 4: return shared_task<4, Query, Cache>;
    case 5: return shared_task<5, Query, Cache>;
    case 6: return shared_task<6, Query, Cache>;
    case 7: return shared_task<7, Query, Cache>;
    case 8: return shared_task<8, Query, Cache>;
    default: break;
  }
  return head_dim == 128 ? shared_task<brigade_cpu::kMaxChunks, Query, Cache> : nullptr;
}

template <typename Query, typename Cache>
void run_tasks(const at::Tensor& query, const at::Tensor& key_cache,
               const at::Tensor& value_cache, const at::Tensor& block_tables,
               std::vector<SharedPrefixTask>& tasks, const Geometry& geo) {
  const TaskFn<Query, Cache> fn = task_fn_for<Query, Cache>(query.size(2));
  TORCH_CHECK(fn != nullptr, "shared_prefix_attention: head_dim ", query.size(2),
              " is neither a multiple of ", kLanes, " up to ", 8 * kLanes, " nor 128");
  const int64_t max_pages = block_tables.size(1);
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const Query* q = query.data_ptr<Query>();
  const Cache* keys = key_cache.data_ptr<Cache>();
  const Cache* values = value_cache.data_ptr<Cache>();
  brigade_cpu::run_tasks(
      static_cast<int64_t>(tasks.size()), [] { return Scratch(); },
      [&](int64_t index, Scratch& scratch) {
        const SharedPrefixTask& task = tasks[index];
        fn(task, q, keys, values, tables + task.leader * max_pages, geo, scratch);
      });
}

}  // namespace

int64_t brigade_cpu::max_shared_keys(int64_t queries) {
  const int64_t keys = 65536 / std::max<int64_t>(queries, 1) / kLanes * kLanes;
  return std::min(kMostKeys, std::max<int64_t>(kLanes, keys));
}

void brigade_cpu::shared_prefix_attention(const at::Tensor& query, const at::Tensor& key_cache,
                                          const at::Tensor& value_cache,
                                          const at::Tensor& block_tables,
                                          std::vector<SharedPrefixTask>& tasks, double scale) {
  const int64_t num_heads = query.size(1), head_dim = query.size(2);
  const int64_t page_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  const Geometry geo{num_heads, num_heads / num_kv_heads, page_size,
                     page_size * num_kv_heads * head_dim, num_kv_heads * head_dim,
                     static_cast<float>(scale)};
  for (const SharedPrefixTask& task : tasks) {
    TORCH_CHECK(task.count > 0 && task.count <= kSharedRows && task.key_end > task.key_begin &&
                    task.key_end - task.key_begin <=
                        max_shared_keys(task.count * geo.group),
                "shared_prefix_attention: a task of ", task.count, " rows and keys [",
                task.key_begin, ", ", task.key_end, ")");
  }
  const bool bf16_query = query.scalar_type() == at::kBFloat16;
  const bool bf16_cache = key_cache.scalar_type() == at::kBFloat16;
  const auto run = [&](auto query_type, auto cache_type) {
    run_tasks<decltype(query_type), decltype(cache_type)>(query, key_cache, value_cache,
                                                          block_tables, tasks, geo);
  };
  using BF16 = c10::BFloat16;
  if (!bf16_query && !bf16_cache) run(float{}, float{});
  if (!bf16_query && bf16_cache) run(float{}, BF16{});
  if (bf16_query && !bf16_cache) run(BF16{}, float{});
  if (bf16_query && bf16_cache) run(BF16{}, BF16{});
}

// Groups rows by their first page; within a group, each row's run of pages equal to the
// leader's (only pages before the one holding its newest token: every row keeps keys of its
// own) decides how many keys can be shared, and the group keeps the rows that maximize rows x
// shared keys (a row that matches less is left to read its pages alone).
std::vector<brigade_cpu::SharedGroup> brigade_cpu::shared_groups(
    const int64_t* tables, const int64_t* seq_lens, int64_t num_rows, int64_t max_pages,
    int64_t page_size) {
  std::vector<int64_t> order;
  const auto own_pages = [&](int64_t row) { return (seq_lens[row] - 1) / page_size; };
  for (int64_t row = 0; row < num_rows; ++row) {
    if (seq_lens[row] > 0 && own_pages(row) * page_size >= kMinSharedKeys) order.push_back(row);
  }
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return tables[a * max_pages] < tables[b * max_pages];
  });
  std::vector<SharedGroup> groups;
  for (size_t begin = 0; begin < order.size();) {
    size_t end = begin + 1;
    while (end < order.size() &&
           tables[order[end] * max_pages] == tables[order[begin] * max_pages]) {
      ++end;
    }
    if (end - begin >= 2) {
      const int64_t* leader = tables + order[begin] * max_pages;
      std::vector<std::pair<int64_t, int64_t>> matches;  // (shared pages, row)
      matches.emplace_back(own_pages(order[begin]), order[begin]);
      for (size_t i = begin + 1; i < end; ++i) {
        const int64_t* pages = tables + order[i] * max_pages;
        const int64_t limit = std::min(own_pages(order[i]), matches[0].first);
        int64_t n = 0;
        while (n < limit && pages[n] == leader[n]) ++n;
        matches.emplace_back(n, order[i]);
      }
      std::stable_sort(matches.begin() + 1, matches.end(),
                       [](const auto& a, const auto& b) { return a.first > b.first; });
      int64_t best = 0, kept = 0;  // rows x shared pages, over the best-matching rows
      for (size_t k = 1; k < matches.size(); ++k) {
        const int64_t value = static_cast<int64_t>(k + 1) * matches[k].first;
        if (value > best) best = value, kept = static_cast<int64_t>(k + 1);
      }
      if (kept >= 2 && matches[kept - 1].first * page_size >= kMinSharedKeys) {
        SharedGroup group{{}, matches[kept - 1].first * page_size};
        for (int64_t k = 0; k < kept; ++k) group.rows.push_back(matches[k].second);
        groups.push_back(std::move(group));
      }
    }
    begin = end;
  }
  return groups;
}

// Keys each decode row would read through cascade attention, shared with other rows (0: none):
// torch.ops.brigade_cpu.shared_decode_keys, so the grouping can be inspected and tested.
at::Tensor shared_decode_keys(at::Tensor block_tables, at::Tensor seq_lens, int64_t page_size) {
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.is_contiguous() &&
                  block_tables.dim() == 2 && seq_lens.scalar_type() == at::kLong &&
                  seq_lens.is_contiguous() && seq_lens.size(0) <= block_tables.size(0),
              "block_tables must be int64 [rows, max_pages] and seq_lens int64 [rows]");
  const int64_t num_rows = seq_lens.size(0);
  auto keys = at::zeros({num_rows}, seq_lens.options());
  for (const brigade_cpu::SharedGroup& group :
       brigade_cpu::shared_groups(block_tables.data_ptr<int64_t>(), seq_lens.data_ptr<int64_t>(),
                                  num_rows, block_tables.size(1), page_size)) {
    for (const int64_t row : group.rows) keys.data_ptr<int64_t>()[row] = group.keys;
  }
  return keys;
}

TORCH_LIBRARY_FRAGMENT(brigade_cpu, m) { m.def("shared_decode_keys", &shared_decode_keys); }
