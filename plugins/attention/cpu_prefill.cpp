// Prefill attention over the paged KV cache on a CPU: each query token of a row's chunk attends
// causally (and within a sliding window, if any) to the row's keys, the cached prefix and the
// chunk itself (already written to the pages), read where they lie. No keys are gathered into a
// dense copy and no mask tensor is built.
//
// A task is a block of up to kQueryBlock query tokens of one row and one KV head: its
// rows are (token, query head of that KV head) pairs. Keys are taken kKeyBlock at a time (blocks
// aligned to multiples of kKeyBlock positions), each block transposed into float [head_dim][keys]
// once per call, before the tasks, and shared by every task of its row and KV head; then
// R rows at a time score kLanes keys per vector (head_dim broadcast FMAs, no horizontal sums),
// fold them into a running softmax (flash attention's rescaling), and add the weighted values
// with the rows' sums held in registers. Tasks run on the threads by a shared counter, the
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

#include "cpu_exp.h"
#include "cpu_scalar.h"
#include "cpu_tasks.h"
#include "cpu_vec.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using brigade_cpu::exp_vec;
using brigade_cpu::kLanes;
using brigade_cpu::kMaxChunks;
using brigade_cpu::load_vec;
using brigade_cpu::max_lanes;
using brigade_cpu::store_vec;
using brigade_cpu::sum_lanes;
using brigade_cpu::to_float;
using brigade_cpu::vecf;

constexpr int64_t kQueryBlock = 32;
constexpr int kVectors = 2;  // key vectors scored per step (independent FMA chains)
constexpr int64_t kKeyBlock = 256;
static_assert(kKeyBlock % (kVectors * 16) == 0, "key blocks hold whole steps");
// Row stride of the transposed keys: not a power of two, or the rows of a block would all fall
// in a few L1 sets and evict each other.
constexpr int64_t kKeyStride = kKeyBlock + 16;

// 0, 1, ..., kLanes - 1
inline vecf iota() {
  vecf v;
  for (int lane = 0; lane < kLanes; ++lane) v[lane] = static_cast<float>(lane);
  return v;
}
const vecf kIota = iota();

struct Geometry {
  int64_t num_heads, group, head_dim, page_size, page_stride, token_stride, window;
  float scale;
};

struct Task {
  int64_t row, chunk, token, count, position, kv_head;
  // query tokens [token, token + count) at positions [position, position + count)
};

// Per-thread buffers, sized for the largest task.
struct Scratch {
  std::vector<float> query, sums, maxima, totals, weights;
  std::vector<int64_t> slots;
  Scratch(int64_t rows, int64_t head_dim, int64_t r)
      : query(rows * head_dim), sums(rows * head_dim), maxima(rows), totals(rows),
        weights(r * kVectors * kLanes), slots(kKeyBlock) {}
};

// Every chunk's key blocks, per KV head, transposed: block b (positions [b * kKeyBlock, (b + 1)
// * kKeyBlock)) of chunk c and KV head h is floats [head_dim][kKeyStride] at
// at(c, b, h); chunk c holds blocks [first[c], first[c] + count[c]), those its tasks read.
// Positions past the chunk's sequence are zeros.
struct KeyBlocks {
  std::vector<int64_t> first, count, base;  // per chunk; base: its first block's index
  float* data = nullptr;                    // written whole by transpose_block
  int64_t kv_heads = 0, block_floats = 0;

  float* at(int64_t chunk, int64_t block, int64_t kv_head) const {
    return data + ((base[chunk] + block - first[chunk]) * kv_heads + kv_head) * block_floats;
  }
};

// Block `block` of one row's keys of one KV head -> keys [head_dim][kKeyStride] (float).
template <typename Cache>
void transpose_block(const Cache* key_cache, const int64_t* pages, const Geometry& geo,
                     int64_t kv_head, int64_t block, int64_t seq_len, float* keys) {
  const int64_t head_dim = geo.head_dim, start = block * kKeyBlock;
  const int64_t n = std::max<int64_t>(0, std::min(kKeyBlock, seq_len - start));
  for (int64_t j = 0; j < n; ++j) {
    const int64_t position = start + j;
    const Cache* key = key_cache + pages[position / geo.page_size] * geo.page_stride +
                       (position % geo.page_size) * geo.token_stride + kv_head * head_dim;
    for (int64_t e = 0; e < head_dim; ++e) keys[e * kKeyStride + j] = to_float(key[e]);
  }
  for (int64_t e = 0; e < head_dim; ++e) {
    std::fill(keys + e * kKeyStride + n, keys + (e + 1) * kKeyStride, 0.0f);
  }
}

// One task. C = head_dim / kLanes vectors per head, R rows at a time.
template <int C, int R, typename Query, typename Cache>
void attend_task(const Task& task, const Query* query, Query* out, int64_t out_first,
                 const KeyBlocks& key_blocks, const Cache* value_cache, const int64_t* pages,
                 const Geometry& geo, Scratch& scratch) {
  constexpr int64_t head_dim = C * kLanes;
  const int64_t group = geo.group, rows = task.count * group;
  float* q = scratch.query.data();
  float* sums = scratch.sums.data();
  float* maxima = scratch.maxima.data();
  float* totals = scratch.totals.data();
  // Rows r = i * group + g: token i of the task, query head g of its KV head; scaled queries.
  for (int64_t i = 0; i < task.count; ++i) {
    const Query* source =
        query + ((task.token + i) * geo.num_heads + task.kv_head * group) * head_dim;
    for (int64_t e = 0; e < group * head_dim; ++e) {
      q[i * group * head_dim + e] = to_float(source[e]) * geo.scale;
    }
  }
  std::fill(sums, sums + rows * head_dim, 0.0f);
  std::fill(maxima, maxima + rows, -std::numeric_limits<float>::infinity());
  std::fill(totals, totals + rows, 0.0f);
  const int64_t last = task.position + task.count;  // keys [first, last)
  const int64_t first = geo.window > 0 ? std::max<int64_t>(0, task.position - geo.window + 1) : 0;
  const int64_t head_offset = task.kv_head * head_dim;
  for (int64_t block = first / kKeyBlock * kKeyBlock; block < last; block += kKeyBlock) {
    const int64_t n = std::min(kKeyBlock, last - block);
    const int64_t padded = (n + kVectors * kLanes - 1) / (kVectors * kLanes) * (kVectors * kLanes);
    // The block's keys, transposed (keys[e * kKeyStride + j] = key(block + j)[e]; keys past
    // this task's last are masked below), and its values' slots.
    const float* keys = key_blocks.at(task.chunk, block / kKeyBlock, task.kv_head);
    int64_t* slots = scratch.slots.data();
    for (int64_t j = 0; j < n; ++j) {
      const int64_t position = block + j;
      slots[j] = pages[position / geo.page_size] * geo.page_stride +
                 (position % geo.page_size) * geo.token_stride + head_offset;
    }
    for (int64_t r0 = 0; r0 < rows; r0 += R) {
      // Rows past the task's end read its last row and see no keys: nothing of theirs is kept.
      int64_t row[R], low[R], high[R];  // keys [low, high) of each row
      for (int k = 0; k < R; ++k) {
        row[k] = std::min(r0 + k, rows - 1);
        const int64_t position = task.position + row[k] / group;
        high[k] = r0 + k < rows ? position + 1 : 0;
        low[k] = geo.window > 0 ? position - geo.window + 1 : 0;
      }
      const int64_t block_end = std::min(block + padded, *std::max_element(high, high + R));
      if (block_end <= block) continue;  // every row of these ends before this block
      float correction[R];
      float* weights = scratch.weights.data();
      constexpr int64_t step = kVectors * kLanes;  // keys scored per step
      for (int64_t j0 = 0; block + j0 < block_end; j0 += step) {
        vecf s[R][kVectors] = {};
        for (int64_t e = 0; e < head_dim; ++e) {
          vecf k_e[kVectors];
          for (int u = 0; u < kVectors; ++u) k_e[u] = load_vec(keys + e * kKeyStride + j0 + u * kLanes);
          for (int k = 0; k < R; ++k) {
            const float q_e = q[row[k] * head_dim + e];
            for (int u = 0; u < kVectors; ++u) s[k][u] += q_e * k_e[u];
          }
        }
        bool any = false;
        for (int k = 0; k < R; ++k) {
          const vecf lo = vecf{} + static_cast<float>(low[k] - block - j0);
          const vecf hi = vecf{} + static_cast<float>(std::min(high[k], block + n) - block - j0);
          decltype(lo < hi) valid[kVectors];
          vecf masked[kVectors];
          float step_max = -std::numeric_limits<float>::infinity();
          for (int u = 0; u < kVectors; ++u) {
            const vecf index = kIota + static_cast<float>(u * kLanes);
            valid[u] = (index >= lo) & (index < hi);
            masked[u] = valid[u] ? s[k][u] : vecf{} - std::numeric_limits<float>::infinity();
            step_max = std::max(step_max, max_lanes(masked[u]));
          }
          correction[k] = 1.0f;
          if (step_max == -std::numeric_limits<float>::infinity()) {
            for (int u = 0; u < kVectors; ++u) store_vec(weights + (k * kVectors + u) * kLanes, vecf{});
            continue;
          }
          any = true;
          float& maximum = maxima[row[k]];
          const float updated = std::max(maximum, step_max);
          if (updated != maximum) correction[k] = brigade_cpu::exp_clamped(maximum - updated);
          vecf total = {};
          for (int u = 0; u < kVectors; ++u) {
            const vecf p = valid[u] ? exp_vec(masked[u] - updated) : vecf{};
            total += p;
            store_vec(weights + (k * kVectors + u) * kLanes, p);
          }
          totals[row[k]] = totals[row[k]] * correction[k] + sum_lanes(total);
          maximum = updated;
        }
        if (!any) continue;
        // The rows' running sums, rescaled to the new maxima, then this step's values added.
        vecf acc[R][C];
        for (int k = 0; k < R; ++k) {
          for (int c = 0; c < C; ++c) {
            acc[k][c] = load_vec(sums + row[k] * head_dim + c * kLanes) * correction[k];
          }
        }
        const int64_t keys_here = std::min<int64_t>(step, n - j0);
        for (int64_t t = 0; t < keys_here; ++t) {
          const Cache* value = value_cache + slots[j0 + t];
          vecf v[C];
          for (int c = 0; c < C; ++c) v[c] = load_vec(value + c * kLanes);
          for (int k = 0; k < R; ++k) {
            const float w = weights[k * step + t];
            for (int c = 0; c < C; ++c) acc[k][c] += w * v[c];
          }
        }
        for (int k = 0; k < R && r0 + k < rows; ++k) {
          for (int c = 0; c < C; ++c) store_vec(sums + row[k] * head_dim + c * kLanes, acc[k][c]);
        }
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t i = r / group, g = r % group;
    const float inverse = totals[r] > 0.0f ? 1.0f / totals[r] : 0.0f;
    Query* o = out + ((task.token + i - out_first) * geo.num_heads + task.kv_head * group + g) *
                         head_dim;
    for (int64_t e = 0; e < head_dim; ++e) {
      o[e] = brigade_cpu::from_float<Query>(sums[r * head_dim + e] * inverse);
    }
  }
}

template <typename Query, typename Cache>
using TaskFn = void (*)(const Task&, const Query*, Query*, int64_t, const KeyBlocks&,
                        const Cache*, const int64_t*, const Geometry&, Scratch&);

template <typename Query, typename Cache>
TaskFn<Query, Cache> task_fn_for(int64_t head_dim) {
  if (head_dim % kLanes != 0) return nullptr;
  switch (head_dim / kLanes) {
    case 1: return attend_task<1, 4, Query, Cache>;
    case 2: return attend_task<2, 4, Query, Cache>;
    case 3: return attend_task<3, 4, Query, Cache>;
    case 4: return attend_task<4, 4, Query, Cache>;
    case 5: return attend_task<5, 3, Query, Cache>;
    case 6: return attend_task<6, 2, Query, Cache>;
    case 7: return attend_task<7, 2, Query, Cache>;
    case 8: return attend_task<8, 2, Query, Cache>;
    default: break;
  }
  // 128 on AVX2: 16 vectors a row, one row at a time (two would not fit the 16 registers)
  return head_dim == 128 ? attend_task<kMaxChunks, 1, Query, Cache> : nullptr;
}

template <typename Query, typename Cache>
void prefill(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
             const at::Tensor& block_tables, const int64_t* chunks, const std::vector<Task>& tasks,
             KeyBlocks& key_blocks, int64_t out_first, at::Tensor& out, const Geometry& geo) {
  const TaskFn<Query, Cache> fn = task_fn_for<Query, Cache>(geo.head_dim);
  TORCH_CHECK(fn != nullptr, "paged_prefill: head_dim ", geo.head_dim,
              " is neither a multiple of ", kLanes, " up to ", 8 * kLanes, " nor 128");
  const int64_t max_pages = block_tables.size(1);
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const Query* q = query.data_ptr<Query>();
  Query* o = out.data_ptr<Query>();
  const Cache* keys = key_cache.data_ptr<Cache>();
  const Cache* values = value_cache.data_ptr<Cache>();
  // First every key block of every chunk and KV head, transposed once for all its tasks.
  const int64_t num_chunks = static_cast<int64_t>(key_blocks.first.size());
  const int64_t kv_heads = key_blocks.kv_heads;
  std::vector<int64_t> block_chunk;  // the chunk of each block, by index
  for (int64_t c = 0; c < num_chunks; ++c) {
    block_chunk.insert(block_chunk.end(), key_blocks.count[c], c);
  }
  const int64_t num_blocks = static_cast<int64_t>(block_chunk.size());
  at::parallel_for(0, num_blocks * kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t c = block_chunk[item / kv_heads], h = item % kv_heads;
      const int64_t block = item / kv_heads - key_blocks.base[c] + key_blocks.first[c];
      const int64_t row = chunks[4 * c];
      transpose_block(keys, tables + row * max_pages, geo, h, block, chunks[4 * c + 3],
                      key_blocks.at(c, block, h));
    }
  });
  brigade_cpu::run_tasks(
      static_cast<int64_t>(tasks.size()),
      [&] { return Scratch(kQueryBlock * geo.group, geo.head_dim, 4); },
      [&](int64_t index, Scratch& scratch) {
        const Task& task = tasks[index];
        fn(task, q, o, out_first, key_blocks, values, tables + task.row * max_pages, geo,
           scratch);
      });
}

}  // namespace

at::Tensor paged_prefill(at::Tensor query, at::Tensor key_cache, at::Tensor value_cache,
                         at::Tensor block_tables, at::Tensor chunks, int64_t window,
                         double scale) {
  TORCH_CHECK(query.dim() == 3 && query.is_contiguous() &&
                  (query.scalar_type() == at::kFloat || query.scalar_type() == at::kBFloat16),
              "query must be a contiguous float32 or bfloat16 [tokens, heads, head_dim] tensor");
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.is_contiguous() && value_cache.is_contiguous() &&
                  key_cache.sizes() == value_cache.sizes() &&
                  key_cache.scalar_type() == value_cache.scalar_type() &&
                  (key_cache.scalar_type() == at::kFloat ||
                   key_cache.scalar_type() == at::kBFloat16),
              "key_cache and value_cache must be contiguous float32 or bfloat16 [pages, "
              "page_size, kv_heads, head_dim] tensors of one dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.is_contiguous() &&
                  block_tables.dim() == 2 && chunks.scalar_type() == at::kLong &&
                  chunks.is_contiguous() && chunks.dim() == 2 && chunks.size(1) == 4,
              "block_tables must be int64 [rows, max_pages], chunks int64 [n, 4]");
  const int64_t num_heads = query.size(1), head_dim = query.size(2);
  const int64_t page_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  TORCH_CHECK(key_cache.size(3) == head_dim && num_heads % num_kv_heads == 0,
              "query and cache head sizes disagree");
  const Geometry geo{num_heads,    num_heads / num_kv_heads,     head_dim, page_size,
                     page_size * num_kv_heads * head_dim, num_kv_heads * head_dim, window,
                     static_cast<float>(scale)};
  const int64_t* spec = chunks.data_ptr<int64_t>();
  const int64_t num_chunks = chunks.size(0);
  const int64_t capacity = block_tables.size(1) * page_size;
  std::vector<Task> tasks;
  int64_t out_first = num_chunks ? spec[1] : 0, out_end = out_first;
  for (int64_t c = 0; c < num_chunks; ++c) {
    const int64_t row = spec[4 * c], first = spec[4 * c + 1], end = spec[4 * c + 2];
    const int64_t seq_len = spec[4 * c + 3];
    TORCH_CHECK(row >= 0 && row < block_tables.size(0) && first == out_end && end > first &&
                    end <= query.size(0) && seq_len >= end - first && seq_len <= capacity,
                "chunk ", c, " is not a contiguous run of tokens inside its row's block table");
    out_end = end;
    const int64_t start_position = seq_len - (end - first);
    for (int64_t token = first; token < end; token += kQueryBlock) {
      const int64_t count = std::min(kQueryBlock, end - token);
      for (int64_t kv_head = 0; kv_head < num_kv_heads; ++kv_head) {
        tasks.push_back({row, c, token, count, start_position + (token - first), kv_head});
      }
    }
  }
  // Costliest first: a task's work grows with the keys its last token sees.
  std::stable_sort(tasks.begin(), tasks.end(), [&](const Task& a, const Task& b) {
    const auto keys = [&](const Task& t) {
      const int64_t last = t.position + t.count;
      return window > 0 ? std::min(window + t.count, last) : last;
    };
    return keys(a) * a.count > keys(b) * b.count;
  });
  // Each chunk's key blocks: from the block of its first token's first key to its last key's.
  KeyBlocks key_blocks;
  key_blocks.kv_heads = num_kv_heads;
  key_blocks.block_floats = head_dim * kKeyStride;
  int64_t total_blocks = 0;
  for (int64_t c = 0; c < num_chunks; ++c) {
    const int64_t seq_len = spec[4 * c + 3];
    const int64_t start = seq_len - (spec[4 * c + 2] - spec[4 * c + 1]);  // its first token's
    const int64_t first_key = window > 0 ? std::max<int64_t>(0, start - window + 1) : 0;
    const int64_t first = first_key / kKeyBlock, count = (seq_len - 1) / kKeyBlock + 1 - first;
    key_blocks.first.push_back(first);
    key_blocks.count.push_back(count);
    key_blocks.base.push_back(total_blocks);
    total_blocks += count;
  }
  // One buffer per calling thread, kept from call to call (the layers of a step, the steps),
  // so that its memory is faulted in once, not on every call; it holds the largest call's.
  thread_local std::vector<float> transposed;
  const auto floats = static_cast<size_t>(total_blocks * num_kv_heads * key_blocks.block_floats);
  if (transposed.size() < floats) transposed.resize(floats);
  key_blocks.data = transposed.data();
  auto out = at::empty({out_end - out_first, num_heads, head_dim}, query.options());
  const auto run = [&](auto query_type, auto cache_type) {
    using Query = decltype(query_type);
    using Cache = decltype(cache_type);
    prefill<Query, Cache>(query, key_cache, value_cache, block_tables, spec, tasks, key_blocks,
                          out_first, out, geo);
  };
  const bool bf16_query = query.scalar_type() == at::kBFloat16;
  const bool bf16_cache = key_cache.scalar_type() == at::kBFloat16;
  if (!bf16_query && !bf16_cache) run(float{}, float{});
  if (!bf16_query && bf16_cache) run(float{}, c10::BFloat16{});
  if (bf16_query && !bf16_cache) run(c10::BFloat16{}, float{});
  if (bf16_query && bf16_cache) run(c10::BFloat16{}, c10::BFloat16{});
  return out;
}

// The number of floats in this build's vectors: paged_prefill takes head sizes that are a
// multiple of it, up to 8 of them.
int64_t vector_lanes() { return kLanes; }

TORCH_LIBRARY_FRAGMENT(brigade_cpu, m) {
  m.def("paged_prefill", &paged_prefill);
  m.def("vector_lanes", &vector_lanes);
}
