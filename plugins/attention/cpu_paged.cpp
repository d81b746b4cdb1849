// Decode attention over the paged KV cache on a CPU, reading each row's pages in place.
//
// For every (row, KV head) pair (OpenMP over the pairs), the row's query heads of that KV head
// score the row's keys, page by page, up to the row's own length (and, with a sliding window,
// from its start); a softmax in float32 turns scores into weights; the weighted values are
// summed. Nothing is gathered into a dense copy and no row reads past its own length, so a
// batch of mixed lengths costs what its rows' tokens cost.
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
#include "cpu_exp.h"
#include "cpu_scalar.h"
#include "cpu_vec.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using brigade_cpu::to_float;

// Scores of `group` query heads against one key vector: out[g * stride] = q_g . key * scale.
template <typename Cache>
inline void score_key(const float* q, const Cache* key, float* out, int64_t stride, int64_t group,
                      int64_t head_dim, float scale) {
  for (int64_t g = 0; g < group; ++g) {
    const float* qg = q + g * head_dim;
    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
    for (int64_t e = 0; e < head_dim; ++e) dot += qg[e] * to_float(key[e]);
    out[g * stride] = dot * scale;
  }
}

// Each of `group` rows of `count` scores -> its softmax, in place; lse (unless null) gets each
// row's log-sum-exp.
inline void softmax_rows(float* s, int64_t group, int64_t count, float* lse) {
  for (int64_t g = 0; g < group; ++g) {
    float* sg = s + g * count;
    float maximum = sg[0];
    for (int64_t t = 1; t < count; ++t) maximum = std::max(maximum, sg[t]);
    float total = 0.0f;
#pragma omp simd reduction(+ : total)
    for (int64_t t = 0; t < count; ++t) {
      sg[t] = brigade_cpu::exp_clamped(sg[t] - maximum);
      total += sg[t];
    }
    const float inverse = 1.0f / total;
#pragma omp simd
    for (int64_t t = 0; t < count; ++t) sg[t] *= inverse;
    if (lse != nullptr) lse[g] = maximum + std::log(total);
  }
}

template <typename Cache>
inline void add_value(const float* weights, const Cache* value, float* accumulator,
                      int64_t stride, int64_t group, int64_t head_dim) {
  for (int64_t g = 0; g < group; ++g) {
    const float weight = weights[g * stride];
    float* acc = accumulator + g * head_dim;
#pragma omp simd
    for (int64_t e = 0; e < head_dim; ++e) acc[e] += weight * to_float(value[e]);
  }
}

// Caches with head_dim a multiple of the vector width (16 floats with AVX-512, else 8: GCC
// vector extensions, so AVX/AVX-512/NEON as the CPU has) take vector loops that walk each row
// page by page (the page and slot arithmetic once per page, not per key), load each key and
// value once for all query heads of its KV head, and widen bfloat16 as it is loaded.
using brigade_cpu::kLanes;
using brigade_cpu::kMaxChunks;
using brigade_cpu::load_vec;
using brigade_cpu::sum_lanes;
using brigade_cpu::vecf;

// Calls visit(offset, next, t0, n) once per page of positions [first, length) of a row whose
// pages are `pages`: the page's keys t0 .. t0 + n - 1 start at element `offset` of the cache,
// and the next page's at `next` (-1 on the last page), for prefetching.
template <typename Visit>
inline void for_each_page(const int64_t* pages, int64_t first, int64_t length, int64_t page_size,
                          int64_t page_stride, int64_t token_stride, Visit visit) {
  int64_t t = 0;
  int64_t page = first / page_size, slot = first % page_size;
  const int64_t last = (length - 1) / page_size;
  for (; page <= last; ++page, slot = 0) {
    const int64_t n = std::min(page_size, length - page * page_size) - slot;
    const int64_t next = page < last ? pages[page + 1] * page_stride : -1;
    visit(pages[page] * page_stride + slot * token_stride, next, t, n);
    t += n;
  }
}

// Pages are scattered over the pool, so the hardware cannot see the next one coming: while a
// page's slot j is read, the same slot of the next page is fetched (the `bytes` of its heads
// this item reads).
inline void prefetch_span(const void* slot, int64_t bytes) {
  const char* line = static_cast<const char*>(slot);
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(line + b);
}

// One row's KV heads [h0, h0 + kv_heads): their query heads q [kv_heads * group, head_dim]
// against the row's keys in [first, length) -> o [kv_heads * group, head_dim] (head_dim =
// C * kLanes); `offset` is h0's element offset within a slot, s holds [kv_heads * group,
// count] scores as scratch. Both passes walk the pages in order, reading each slot's heads
// as one contiguous span; the values pass sums a page's slots for two query heads at a time in
// registers, while the page is hot in L1. lse (unless null) gets each query head's log-sum-exp.
template <int C, typename Cache>
void attend_vec(const float* q, const Cache* key_cache, const Cache* value_cache,
                const int64_t* pages, int64_t first, int64_t length, int64_t offset,
                int64_t kv_heads, int64_t group, int64_t page_size, int64_t page_stride,
                int64_t token_stride, float scale, float* s, float* o, float* lse) {
  constexpr int64_t head_dim = C * kLanes;
  const int64_t count = length - first;
  const int64_t heads = kv_heads * group;
  const int64_t span_bytes = kv_heads * head_dim * static_cast<int64_t>(sizeof(Cache));
  // Pass 1: scores, each key loaded once for all the query heads of its KV head.
  for_each_page(pages, first, length, page_size, page_stride, token_stride,
                [&](int64_t page, int64_t next, int64_t t0, int64_t n) {
                  const Cache* slot = key_cache + page + offset;
                  const Cache* ahead = key_cache + next + offset;
                  for (int64_t j = 0; j < n; ++j, slot += token_stride) {
                    if (next >= 0) prefetch_span(ahead + j * token_stride, span_bytes);
                    for (int64_t h = 0; h < kv_heads; ++h) {
                      vecf k[C];
                      for (int c = 0; c < C; ++c) k[c] = load_vec(slot + h * head_dim + c * kLanes);
                      for (int64_t g = h * group; g < (h + 1) * group; ++g) {
                        const float* qg = q + g * head_dim;
                        vecf acc = k[0] * load_vec(qg);
                        for (int c = 1; c < C; ++c) acc += k[c] * load_vec(qg + c * kLanes);
                        s[g * count + t0 + j] = sum_lanes(acc) * scale;
                      }
                    }
                  }
                });
  softmax_rows(s, heads, count, lse);
  // Pass 2: the weighted values.
  std::fill(o, o + heads * head_dim, 0.0f);
  for_each_page(
      pages, first, length, page_size, page_stride, token_stride,
      [&](int64_t page, int64_t next, int64_t t0, int64_t n) {
        const Cache* base = value_cache + page + offset;
        const Cache* ahead = value_cache + next + offset;
        for (int64_t g0 = 0; g0 < heads; g0 += 2) {
          const int64_t h0 = g0 / group, h1 = std::min(g0 + 1, heads - 1) / group;
          const float* w0 = s + g0 * count + t0;
          const float* w1 = s + std::min(g0 + 1, heads - 1) * count + t0;
          vecf acc0[C] = {}, acc1[C] = {};
          const Cache* slot = base;
          for (int64_t j = 0; j < n; ++j, slot += token_stride) {
            if (g0 == 0 && next >= 0) prefetch_span(ahead + j * token_stride, span_bytes);
            const vecf a = vecf{} + w0[j], b = vecf{} + w1[j];
            for (int c = 0; c < C; ++c) {
              acc0[c] += a * load_vec(slot + h0 * head_dim + c * kLanes);
              acc1[c] += b * load_vec(slot + h1 * head_dim + c * kLanes);
            }
          }
          float* o0 = o + g0 * head_dim;
          for (int c = 0; c < C; ++c) {
            const vecf sum = load_vec(o0 + c * kLanes) + acc0[c];
            std::memcpy(o0 + c * kLanes, &sum, sizeof(sum));
          }
          if (g0 + 1 < heads) {
            float* o1 = o0 + head_dim;
            for (int c = 0; c < C; ++c) {
              const vecf sum = load_vec(o1 + c * kLanes) + acc1[c];
              std::memcpy(o1 + c * kLanes, &sum, sizeof(sum));
            }
          }
        }
      });
}

template <typename Cache>
using AttendVec = void (*)(const float*, const Cache*, const Cache*, const int64_t*, int64_t,
                           int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, float,
                           float*, float*, float*);

// attend_vec for this head_dim, or nullptr when it is not 1..8 vectors or 128.
template <typename Cache>
AttendVec<Cache> attend_vec_for(int64_t head_dim) {
  if (head_dim % kLanes != 0) return nullptr;
  switch (head_dim / kLanes) {
    case 1: return attend_vec<1, Cache>;
    case 2: return attend_vec<2, Cache>;
    case 3: return attend_vec<3, Cache>;
    case 4: return attend_vec<4, Cache>;
    case 5: return attend_vec<5, Cache>;
    case 6: return attend_vec<6, Cache>;
    case 7: return attend_vec<7, Cache>;
    case 8: return attend_vec<8, Cache>;
    default: break;
  }
  return head_dim == 128 ? attend_vec<kMaxChunks, Cache> : nullptr;  // 16 vectors on AVX2
}

// Any head_dim: one key at a time, scores then values (the group's heads side by side);
// the result is left in `accumulator` [group, head_dim], the log-sum-exps in lse (unless null).
template <typename Cache>
void attend_scalar(const float* q, const Cache* key_cache, const Cache* value_cache,
                   const int64_t* pages, int64_t first, int64_t count, int64_t length,
                   int64_t kv_head, int64_t group, int64_t head_dim, int64_t page_size,
                   int64_t page_stride, int64_t token_stride, float scale, float* s,
                   float* accumulator, float* lse) {
  const int64_t last_page = (length - 1) / page_size;
  // Pass 1: scores [group, count] (column t of head g at s[g * count + t]).
  for (int64_t t = 0; t < count; ++t) {
    const int64_t position = first + t;
    const int64_t page = position / page_size;
    if (position % page_size == 0 && page < last_page) {
      // Pages are scattered, so the hardware cannot see the next one coming: start its
      // first cache lines of both K and V now.
      const int64_t next = pages[page + 1] * page_stride + kv_head * head_dim;
      for (int64_t slot = 0; slot < page_size; slot += 4) {
        __builtin_prefetch(key_cache + next + slot * token_stride);
        __builtin_prefetch(value_cache + next + slot * token_stride);
      }
    }
    const Cache* key = key_cache + pages[page] * page_stride +
                       (position % page_size) * token_stride + kv_head * head_dim;
    score_key(q, key, s + t, count, group, head_dim, scale);
  }
  softmax_rows(s, group, count, lse);
  // Pass 2: the weighted sum of the values.
  std::fill(accumulator, accumulator + group * head_dim, 0.0f);
  for (int64_t t = 0; t < count; ++t) {
    const int64_t position = first + t;
    const Cache* value = value_cache + pages[position / page_size] * page_stride +
                         (position % page_size) * token_stride + kv_head * head_dim;
    add_value(s + t, value, accumulator, count, group, head_dim);
  }
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
  // A task is a row's KV heads together (their keys and values are contiguous in a slot),
  // unless there are too few rows to keep every thread busy: then one KV head of a row.
  const int64_t span =
      vectorized != nullptr && num_rows >= 2 * at::get_num_threads() ? num_kv_heads : 1;
  const int64_t spans = num_kv_heads / span;
  const int64_t heads = span * group, width = heads * head_dim;  // a task's query heads
  at::parallel_for(0, num_rows * spans, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(heads * std::max<int64_t>(longest, 1));
    std::vector<float> widened(widen ? width : 0), o(width), lse(heads);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t row = item / spans;
      const int64_t kv_head = (item % spans) * span;
      const int64_t length = seq_lens[row];
      const int64_t first = starts != nullptr ? starts[row]
                            : window > 0      ? std::max<int64_t>(0, length - window)
                                              : 0;
      const int64_t count = length - first;
      const int64_t* pages = block_tables + row * max_pages;
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
                   lse.data());
      } else {
        attend_scalar(q, key_cache, value_cache, pages, first, count, length, kv_head, group,
                      head_dim, page_size, page_stride, token_stride, scale, scores.data(),
                      o.data(), lse.data());
      }
      emit(row, kv_head * group, heads, o.data(), lse.data());
    }
  });
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
      const brigade_cpu::SharedPrefixTask* parts =
          tasks.data() + first_task[row] + kv_head * ranges;
      const int64_t pair = slot[row] * group + g;  // this head's place in its tasks
      float maximum = lse[h];
      for (int64_t k = 0; k < ranges; ++k) maximum = std::max(maximum, parts[k].lse[pair]);
      const float own = brigade_cpu::exp_clamped(lse[h] - maximum);
      float total = own;
      for (int64_t e = 0; e < head_dim; ++e) merged[e] = own * o[e];
      for (int64_t k = 0; k < ranges; ++k) {
        const float w = brigade_cpu::exp_clamped(parts[k].lse[pair] - maximum);
        const float* part = parts[k].out + pair * head_dim;
        total += w;
        for (int64_t e = 0; e < head_dim; ++e) merged[e] += w * part[e];
      }
      const float inverse = 1.0f / total;
      for (int64_t e = 0; e < head_dim; ++e) {
        target[e] = brigade_cpu::from_float<Query>(merged[e] * inverse);
      }
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
