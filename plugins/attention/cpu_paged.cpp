// Decode attention over the paged KV cache on a CPU, reading each row's pages in place.
//
// For every (row, KV head) pair (OpenMP over the pairs), the row's query heads of that KV head
// score the row's keys, page by page, up to the row's own length (and, with a sliding window,
// from its start); a softmax in float32 turns scores into weights; the weighted values are
// summed. Nothing is gathered into a dense copy and no row reads past its own length, so a
// batch of mixed lengths costs what its rows' tokens cost.
//
// Layouts (contiguous): query [rows, heads, head_dim] float32; key_cache and value_cache
// [pages, page_size, kv_heads, head_dim] float32 or bfloat16; block_tables [rows, max_pages]
// int64; seq_lens [rows] int64; out [rows, heads, head_dim] float32.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include "cpu_exp.h"
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

inline float to_float(float value) { return value; }
inline float to_float(c10::BFloat16 value) { return static_cast<float>(value); }

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

// Each of `group` rows of `count` scores -> its softmax, in place.
inline void softmax_rows(float* s, int64_t group, int64_t count) {
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

// Float32 caches with head_dim a multiple of 8 take blocked loops on 8-float vectors (GCC
// vector extensions: AVX/AVX-512/NEON as the CPU has): eight keys' dot products at a time with
// eight independent accumulators instead of one dependent reduction chain per key, and the
// weighted value sum of one head held in registers across all of a row's keys.
typedef float vec8 __attribute__((vector_size(32)));

inline vec8 load8(const float* p) {
  vec8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline float sum8(vec8 v) {
  return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

// Scores s[t] = q . key(t) * scale for t in [0, count); key(t) is at keys(t).
template <typename KeyAt>
inline void score_block8(const float* q, KeyAt keys, float* s, int64_t count, int64_t head_dim,
                         float scale) {
  int64_t t = 0;
  for (; t + 8 <= count; t += 8) {
    const float* k[8];
    for (int j = 0; j < 8; ++j) k[j] = keys(t + j);
    vec8 acc[8] = {};
    for (int64_t e = 0; e < head_dim; e += 8) {
      const vec8 qv = load8(q + e);
      for (int j = 0; j < 8; ++j) acc[j] += qv * load8(k[j] + e);
    }
    for (int j = 0; j < 8; ++j) s[t + j] = sum8(acc[j]) * scale;
  }
  for (; t < count; ++t) {
    const float* key = keys(t);
    vec8 acc = {};
    for (int64_t e = 0; e < head_dim; e += 8) acc += load8(q + e) * load8(key + e);
    s[t] = sum8(acc) * scale;
  }
}

// out[0:head_dim] = sum over t of w[t] * value(t), 64 floats (8 vectors in registers) at a time.
template <typename ValueAt>
inline void weighted_sum8(const float* w, ValueAt values, float* out, int64_t count,
                          int64_t head_dim) {
  for (int64_t base = 0; base < head_dim; base += 64) {
    const int64_t width = std::min<int64_t>(64, head_dim - base) / 8;
    vec8 acc[8] = {};
    for (int64_t t = 0; t < count; ++t) {
      const float* v = values(t) + base;
      const vec8 weight = vec8{} + w[t];
      for (int64_t i = 0; i < width; ++i) acc[i] += weight * load8(v + 8 * i);
    }
    for (int64_t i = 0; i < width; ++i) std::memcpy(out + base + 8 * i, &acc[i], sizeof(vec8));
  }
}

template <typename Cache>
void decode_rows(const float* query, const Cache* key_cache, const Cache* value_cache,
                 const int64_t* block_tables, const int64_t* seq_lens, float* out,
                 int64_t num_rows, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                 int64_t page_size, int64_t max_pages, int64_t window, float scale) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t token_stride = num_kv_heads * head_dim;  // between slots of one page
  const int64_t page_stride = page_size * token_stride;
  int64_t longest = 0;
  for (int64_t row = 0; row < num_rows; ++row) longest = std::max(longest, seq_lens[row]);
  at::parallel_for(0, num_rows * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(group * std::max<int64_t>(longest, 1));
    std::vector<float> accumulator(group * head_dim);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t row = item / num_kv_heads;
      const int64_t kv_head = item % num_kv_heads;
      const int64_t length = seq_lens[row];
      const int64_t first = window > 0 ? std::max<int64_t>(0, length - window) : 0;
      const int64_t count = length - first;
      const int64_t* pages = block_tables + row * max_pages;
      const float* q = query + (row * num_heads + kv_head * group) * head_dim;
      float* o = out + (row * num_heads + kv_head * group) * head_dim;
      if (count <= 0) {  // nothing to attend to (not a decode row): zeros, never garbage
        std::fill(o, o + group * head_dim, 0.0f);
        continue;
      }
      float* s = scores.data();
      if constexpr (std::is_same_v<Cache, float>) {
        if (head_dim % 8 == 0) {
          const int64_t offset = kv_head * head_dim;
          const auto at = [&](const float* cache) {
            return [=](int64_t t) {
              const int64_t position = first + t;
              return cache + pages[position / page_size] * page_stride +
                     (position % page_size) * token_stride + offset;
            };
          };
          for (int64_t g = 0; g < group; ++g) {
            score_block8(q + g * head_dim, at(key_cache), s + g * count, count, head_dim, scale);
          }
          softmax_rows(s, group, count);
          for (int64_t g = 0; g < group; ++g) {
            weighted_sum8(s + g * count, at(value_cache), o + g * head_dim, count, head_dim);
          }
          continue;
        }
      }
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
      softmax_rows(s, group, count);
      // Pass 2: the weighted sum of the values.
      std::fill(accumulator.begin(), accumulator.end(), 0.0f);
      for (int64_t t = 0; t < count; ++t) {
        const int64_t position = first + t;
        const Cache* value = value_cache + pages[position / page_size] * page_stride +
                             (position % page_size) * token_stride + kv_head * head_dim;
        add_value(s + t, value, accumulator.data(), count, group, head_dim);
      }
      std::copy(accumulator.begin(), accumulator.end(), o);
    }
  });
}

}  // namespace

at::Tensor paged_decode(at::Tensor query, at::Tensor key_cache, at::Tensor value_cache,
                           at::Tensor block_tables, at::Tensor seq_lens, int64_t window,
                           double scale) {
  TORCH_CHECK(query.dim() == 3 && query.scalar_type() == at::kFloat && query.is_contiguous(),
              "query must be a contiguous float32 [rows, heads, head_dim] tensor");
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
  const auto common = [&](auto* keys, auto* values) {
    decode_rows(query.data_ptr<float>(), keys, values, block_tables.data_ptr<int64_t>(),
                seq_lens.data_ptr<int64_t>(), out.data_ptr<float>(), num_rows, num_heads,
                num_kv_heads, head_dim, page_size, block_tables.size(1), window,
                static_cast<float>(scale));
  };
  if (key_cache.scalar_type() == at::kFloat) {
    common(key_cache.data_ptr<float>(), value_cache.data_ptr<float>());
  } else if (key_cache.scalar_type() == at::kBFloat16) {
    common(key_cache.data_ptr<c10::BFloat16>(), value_cache.data_ptr<c10::BFloat16>());
  } else {
    TORCH_CHECK(false, "the KV cache must be float32 or bfloat16");
  }
  return out;
}

// torch.ops.brigade_cpu.paged_decode (no pybind11: the build needs only ATen's headers).
TORCH_LIBRARY(brigade_cpu, m) { m.def("paged_decode", &paged_decode); }
