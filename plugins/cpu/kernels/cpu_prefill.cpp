// Prefill attention over the paged KV cache on a CPU: each query token of a row's chunk attends
// causally (and within a sliding window, if any) to the row's keys, the cached prefix and the
// chunk itself (already written to the pages), read where they lie. No keys are gathered into a
// dense copy and no mask tensor is built.
//
// A task is a block of up to kQueryBlock query tokens of one row and one KV head: its rows are
// (token, query head of that KV head) pairs, taken up to kRowVectors vectors of them at a time
// with the rows in the vector lanes. The queries are transposed once per task into [head_dim]
// vectors of rows; then, kStep keys at a time, every key's scores for all the rows come from
// head_dim FMAs of those vectors by the key's elements (broadcast, read in place from the
// pages: no key is transposed or copied), the running softmax (flash attention's rescaling) is
// kept per lane, and the weighted values are summed the same way, the value's elements
// broadcast against vectors of the rows' weights. No horizontal reduction anywhere: a row's
// maximum, total and sums stay in its lane. Tasks run on the threads by a shared counter, the
// costliest (most keys) first, so a causal triangle's long rows do not all land on one thread.
//
// Layouts (contiguous): query [tokens, heads, head_dim] float32 or bfloat16; key_cache and
// value_cache [pages, page_size, kv_heads, head_dim] float32 or bfloat16; block_tables
// [rows, max_pages] int64; chunks [n, 4] int64 rows of (row, first token, end token, seq_len):
// the chunk's tokens are query[first:end], the last of them at position seq_len - 1. Returns
// [end of the last chunk - first of the first, heads, head_dim] in the query's dtype: the
// chunks' tokens, in order (they are contiguous in query).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "cpu_scalar.h"
#include "cpu_tasks.h"
#include "cpu_vec.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

namespace {

using brigade_cpu::exp_vec;
using brigade_cpu::kLanes;
using brigade_cpu::load_vec;
using brigade_cpu::store_vec;
using brigade_cpu::to_float;
using brigade_cpu::vecf;

constexpr int64_t kQueryBlock = 32;  // query tokens per task
// Row vectors per pass, keys scored together and value elements summed together: kRowVectors
// x kKeys (or x kDims) sums, kRowVectors operands and a broadcast fit the vector registers (32
// with AVX-512, 16 with AVX2 or NEON). Measured on AVX-512 (SmolLM2's heads, 512 tokens): 4 x
// 6 ran 1.3x as fast as 6 x 4, which GCC compiles with the row vectors re-read from memory
// by every FMA.
#if defined(__AVX512F__)
constexpr int kRowVectors = 4;
#else
constexpr int kRowVectors = 2;
#endif
constexpr int kKeys = 6;
constexpr int kDims = 4;
constexpr int64_t kStep = 96;  // keys per softmax step
static_assert(kStep % kKeys == 0, "a step holds whole groups of keys");

// Keeps v in a register: GCC otherwise folds its load into each FMA that uses it (one load
// per FMA instead of one per vector), which measured 1.15x slower in the values loop. Only
// where a vector fits one register (AVX: 8 floats; SSE alone would need two).
inline void in_register(vecf& v) {
#if defined(__x86_64__) && defined(__AVX__)
  asm("" : "+v"(v));
#else
  (void)v;
#endif
}

const vecf kMinusInfinity = vecf{} - std::numeric_limits<float>::infinity();

struct Geometry {
  int64_t num_heads, group, head_dim, page_size, page_stride, token_stride, window;
  float scale;
};

using Task = brigade_cpu::PrefillTask;

// Per-thread buffers: vectors of rows (kRowVectors of them per head_dim element or key).
struct Scratch {
  std::vector<float> query, sums, weights;
  std::vector<int64_t> slots;
  explicit Scratch(int64_t head_dim)
      : query(head_dim * kRowVectors * kLanes), sums(head_dim * kRowVectors * kLanes),
        weights(kStep * kRowVectors * kLanes), slots(kStep) {}
};

// Rows [r0, r0 + nr) of a task (nr <= V * kLanes): row r is token r / group of the task and
// query head r % group of its KV head, lane r - r0 of the V row vectors.
template <int V, typename Query, typename Cache>
void attend_rows(const Task& task, int64_t r0, int64_t nr, const Query* query, Query* out,
                 int64_t out_first, const Cache* key_cache, const Cache* value_cache,
                 const int64_t* pages, const Geometry& geo, Scratch& scratch) {
  const int64_t head_dim = geo.head_dim, group = geo.group;
  float* q = scratch.query.data();      // [head_dim][V vectors]: scaled queries, transposed
  float* sums = scratch.sums.data();    // [head_dim][V vectors]: the weighted values
  float* p = scratch.weights.data();    // [kStep][V vectors]: a step's scores, then weights
  int64_t* slots = scratch.slots.data();
  constexpr int64_t width = V * kLanes;  // floats per element or key
  std::fill(q, q + head_dim * width, 0.0f);
  for (int64_t r = 0; r < nr; ++r) {
    const int64_t i = (r0 + r) / group, g = (r0 + r) % group;
    const Query* source =
        query + ((task.token + i) * geo.num_heads + task.kv_head * group + g) * head_dim;
    for (int64_t e = 0; e < head_dim; ++e) q[e * width + r] = to_float(source[e]) * geo.scale;
  }
  std::fill(sums, sums + head_dim * width, 0.0f);
  // Each lane's position (rows past nr: -1, which sees no key), running maximum and total.
  vecf position[V], maximum[V], total[V];
  for (int v = 0; v < V; ++v) {
    for (int lane = 0; lane < kLanes; ++lane) {
      const int64_t r = v * kLanes + lane;
      position[v][lane] = r < nr ? static_cast<float>(task.position + (r0 + r) / group) : -1.0f;
    }
    maximum[v] = kMinusInfinity;
    total[v] = vecf{};
  }
  const int64_t lowest = task.position + r0 / group;  // the first and last rows' positions
  const int64_t highest = task.position + (r0 + nr - 1) / group;
  const int64_t window = geo.window;
  const int64_t first = window > 0 ? std::max<int64_t>(0, lowest - window + 1) : 0;
  const int64_t head_offset = task.kv_head * head_dim;
  for (int64_t k0 = first; k0 <= highest; k0 += kStep) {
    const int64_t n = std::min(kStep, highest + 1 - k0);
    for (int64_t j = 0; j < n; ++j) {
      const int64_t at = k0 + j;
      slots[j] = pages[at / geo.page_size] * geo.page_stride +
                 (at % geo.page_size) * geo.token_stride + head_offset;
    }
    // Scores, kKeys keys at a time (past n: the last key again, its scores never read).
    for (int64_t j0 = 0; j0 < n; j0 += kKeys) {
      const Cache* key[kKeys];
      for (int u = 0; u < kKeys; ++u) key[u] = key_cache + slots[std::min(j0 + u, n - 1)];
      vecf s[kKeys][V] = {};
      for (int64_t e = 0; e < head_dim; ++e) {
        vecf qe[V];
        for (int v = 0; v < V; ++v) qe[v] = load_vec(q + e * width + v * kLanes);
        for (int u = 0; u < kKeys; ++u) {
          const float k_e = to_float(key[u][e]);
          for (int v = 0; v < V; ++v) s[u][v] += qe[v] * k_e;
        }
      }
      for (int u = 0; u < kKeys; ++u) {
        for (int v = 0; v < V; ++v) store_vec(p + (j0 + u) * width + v * kLanes, s[u][v]);
      }
    }
    // Keys a lane may not see (after its position, or before its window): -infinity. A step
    // every lane sees whole needs no masks.
    const bool whole = k0 + n - 1 <= lowest && (window <= 0 || k0 > highest - window);
    if (!whole) {
      for (int64_t j = 0; j < n; ++j) {
        const float at = static_cast<float>(k0 + j);
        for (int v = 0; v < V; ++v) {
          auto hidden = at > position[v];
          if (window > 0) hidden |= at <= position[v] - static_cast<float>(window);
          const vecf score = load_vec(p + j * width + v * kLanes);
          store_vec(p + j * width + v * kLanes, hidden ? kMinusInfinity : score);
        }
      }
    }
    // The running softmax: new maxima, the old sums' correction, this step's weights.
    vecf correction[V];
    for (int v = 0; v < V; ++v) {
      vecf step_max = kMinusInfinity;
      for (int64_t j = 0; j < n; ++j) {
        const vecf score = load_vec(p + j * width + v * kLanes);
        step_max = score > step_max ? score : step_max;
      }
      const vecf updated = step_max > maximum[v] ? step_max : maximum[v];
      const auto none = updated == kMinusInfinity;  // a lane that has seen no key yet
      correction[v] = none ? vecf{} + 1.0f : exp_vec(maximum[v] - updated);
      vecf added = {};
      for (int64_t j = 0; j < n; ++j) {
        const vecf score = load_vec(p + j * width + v * kLanes);
        const vecf weight = score == kMinusInfinity ? vecf{} : exp_vec(score - updated);
        added += weight;
        store_vec(p + j * width + v * kLanes, weight);
      }
      total[v] = total[v] * correction[v] + added;
      maximum[v] = updated;
    }
    // The weighted values, kDims elements of head_dim at a time.
    for (int64_t e0 = 0; e0 < head_dim; e0 += kDims) {
      vecf acc[kDims][V];
      for (int u = 0; u < kDims; ++u) {
        for (int v = 0; v < V; ++v) {
          acc[u][v] = load_vec(sums + (e0 + u) * width + v * kLanes) * correction[v];
        }
      }
      for (int64_t j = 0; j < n; ++j) {
        const Cache* value = value_cache + slots[j] + e0;
        vecf w[V];
        for (int v = 0; v < V; ++v) {
          w[v] = load_vec(p + j * width + v * kLanes);
          in_register(w[v]);
        }
        for (int u = 0; u < kDims; ++u) {
          const float v_e = to_float(value[u]);
          for (int v = 0; v < V; ++v) acc[u][v] += w[v] * v_e;
        }
      }
      for (int u = 0; u < kDims; ++u) {
        for (int v = 0; v < V; ++v) store_vec(sums + (e0 + u) * width + v * kLanes, acc[u][v]);
      }
    }
  }
  // Each row's sums over its total, out of its lane.
  float totals[V * kLanes];
  for (int v = 0; v < V; ++v) store_vec(totals + v * kLanes, total[v]);
  for (int64_t r = 0; r < nr; ++r) {
    const int64_t i = (r0 + r) / group, g = (r0 + r) % group;
    const float inverse = totals[r] > 0.0f ? 1.0f / totals[r] : 0.0f;
    Query* o = out + ((task.token + i - out_first) * geo.num_heads + task.kv_head * group + g) *
                         head_dim;
    for (int64_t e = 0; e < head_dim; ++e) {
      o[e] = brigade_cpu::from_float<Query>(sums[e * width + r] * inverse);
    }
  }
}

template <typename Query, typename Cache>
using RowsFn = void (*)(const Task&, int64_t, int64_t, const Query*, Query*, int64_t,
                        const Cache*, const Cache*, const int64_t*, const Geometry&, Scratch&);

// attend_rows for 1 .. kRowVectors row vectors: kRows<Query, Cache>[V - 1]
template <typename Query, typename Cache, int... V>
constexpr std::array<RowsFn<Query, Cache>, sizeof...(V)> rows_table(
    std::integer_sequence<int, V...>) {
  return {&attend_rows<V + 1, Query, Cache>...};
}

template <typename Query, typename Cache>
constexpr auto kRows = rows_table<Query, Cache>(std::make_integer_sequence<int, kRowVectors>{});

// One task: its rows kRowVectors vectors at a time, the last pass as few vectors as it needs.
template <typename Query, typename Cache>
void attend_task(const Task& task, const Query* query, Query* out, int64_t out_first,
                 const Cache* key_cache, const Cache* value_cache, const int64_t* pages,
                 const Geometry& geo, Scratch& scratch) {
  const int64_t rows = task.count * geo.group;
  constexpr int64_t most = kRowVectors * kLanes;
  for (int64_t r0 = 0; r0 < rows; r0 += most) {
    const int64_t nr = std::min(most, rows - r0);
    kRows<Query, Cache>[(nr + kLanes - 1) / kLanes - 1](task, r0, nr, query, out, out_first,
                                                         key_cache, value_cache, pages, geo,
                                                         scratch);
  }
}

template <typename Query, typename Cache>
void prefill(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
             const at::Tensor& block_tables, const std::vector<Task>& tasks, int64_t out_first,
             at::Tensor& out, const Geometry& geo) {
  const int64_t max_pages = block_tables.size(1);
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const Query* q = query.data_ptr<Query>();
  Query* o = out.data_ptr<Query>();
  const Cache* keys = key_cache.data_ptr<Cache>();
  const Cache* values = value_cache.data_ptr<Cache>();
  brigade_cpu::run_tasks(
      static_cast<int64_t>(tasks.size()), [&] { return Scratch(geo.head_dim); },
      [&](int64_t index, Scratch& scratch) {
        const Task& task = tasks[index];
        attend_task(task, q, o, out_first, keys, values, tables + task.row * max_pages, geo,
                    scratch);
      });
}

}  // namespace

at::Tensor paged_prefill(at::Tensor query, at::Tensor key_cache, at::Tensor value_cache,
                         at::Tensor block_tables, at::Tensor chunks, int64_t window,
                         double scale) {
  brigade_cpu::check_prefill_inputs("paged_prefill", query, key_cache, value_cache, false, kDims);
  const int64_t num_heads = query.size(1), head_dim = query.size(2);
  const int64_t page_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  const Geometry geo{num_heads,    num_heads / num_kv_heads,     head_dim, page_size,
                     page_size * num_kv_heads * head_dim, num_kv_heads * head_dim, window,
                     static_cast<float>(scale)};
  int64_t out_first = 0, out_end = 0;
  const std::vector<Task> tasks =
      brigade_cpu::prefill_tasks(chunks, block_tables, query.size(0), page_size, num_kv_heads,
                                 kQueryBlock, window, out_first, out_end);
  auto out = at::empty({out_end - out_first, num_heads, head_dim}, query.options());
  const auto run = [&](auto query_type, auto cache_type) {
    using Query = decltype(query_type);
    using Cache = decltype(cache_type);
    prefill<Query, Cache>(query, key_cache, value_cache, block_tables, tasks, out_first, out,
                          geo);
  };
  const bool bf16_query = query.scalar_type() == at::kBFloat16;
  const bool bf16_cache = key_cache.scalar_type() == at::kBFloat16;
  if (!bf16_query && !bf16_cache) run(float{}, float{});
  if (!bf16_query && bf16_cache) run(float{}, c10::BFloat16{});
  if (bf16_query && !bf16_cache) run(c10::BFloat16{}, float{});
  if (bf16_query && bf16_cache) run(c10::BFloat16{}, c10::BFloat16{});
  return out;
}

// The number of floats in this build's vectors: the decode kernels take head sizes that are a
// multiple of it, up to 8 of them, or 128 (paged_prefill takes any multiple of kDims).
int64_t vector_lanes() { return kLanes; }

TORCH_LIBRARY_FRAGMENT(brigade_cpu, m) {
  m.def("paged_prefill", &paged_prefill);
  m.def("vector_lanes", &vector_lanes);
}
