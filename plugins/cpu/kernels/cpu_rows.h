// One decode row's attention over its own pages, for cpu_paged.cpp's decode_rows: a vector
// kernel (head_dim a whole number of vectors) and a scalar one (any head_dim), both two passes
// over the row's pages (scores, then the weighted values), and ReadAhead, which keeps the pages
// a thread will read next on their way into L2.
#pragma once

#include "cpu_exp.h"
#include "cpu_scalar.h"
#include "cpu_vec.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

namespace brigade_cpu {

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

// The largest of s[0, count), count >= 1 (a NaN is passed over, as std::max passes it over),
// kLanes at a time: GCC does not vectorize a float maximum without -ffast-math.
inline float max_of(const float* s, int64_t count) {
  float maximum = s[0];
  int64_t t = 0;
  if (count >= kLanes) {
    vecf most = load_vec(s);
    for (t = kLanes; t + kLanes <= count; t += kLanes) {
      const vecf v = load_vec(s + t);
      most = v > most ? v : most;
    }
    for (int lane = 0; lane < kLanes; ++lane) maximum = std::max(maximum, most[lane]);
  }
  for (; t < count; ++t) maximum = std::max(maximum, s[t]);
  return maximum;
}

// Each of `group` rows of `count` scores -> its softmax, in place; lse (unless null) gets each
// row's log-sum-exp.
inline void softmax_rows(float* s, int64_t group, int64_t count, float* lse) {
  for (int64_t g = 0; g < group; ++g) {
    float* sg = s + g * count;
    const float maximum = max_of(sg, count);
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

// The positions [first, length) a decode row attends to.
struct RowRange {
  int64_t first, length;
};

// Where decode_rows' tasks read: task `item` is part item % splits of row item / (spans *
// splits), over the KV heads from ((item / splits) % spans) * span; the row's keys [first,
// length) (from starts[row] when starts is given, else from 0 or the sliding window's start)
// are cut into `splits` parts of whole pages, the last ones possibly empty.
struct DecodeTasks {
  const int64_t* block_tables;  // [rows, max_pages]
  const int64_t* seq_lens;
  const int64_t* starts;  // or nullptr
  int64_t max_pages, page_size, window, spans, span, splits;

  int64_t row(int64_t item) const { return item / (spans * splits); }
  int64_t kv_head(int64_t item) const { return (item / splits) % spans * span; }
  const int64_t* pages(int64_t row) const { return block_tables + row * max_pages; }
  RowRange range(int64_t item) const {
    const int64_t row = this->row(item), length = seq_lens[row];
    const int64_t first = starts != nullptr ? starts[row]
                          : window > 0      ? std::max<int64_t>(0, length - window)
                                            : 0;
    if (splits == 1 || length <= first) return {first, length};
    // Parts of whole pages, so that no page is read by two tasks.
    const int64_t first_page = first / page_size, last_page = (length - 1) / page_size;
    const int64_t part = (last_page - first_page + splits) / splits, k = item % splits;
    const int64_t begin = (first_page + k * part) * page_size;
    return {std::min(length, std::max(first, begin)), std::min(length, begin + part * page_size)};
  }
};

// Attention over disjoint key ranges of one query head, merged: part(k) gives the k-th
// range's result o_k [head_dim] (normalized over its own keys) and its log-sum-exp lse_k; out
// gets sum_k w_k o_k / sum_k w_k with w_k = exp(lse_k - the largest lse), and the merged
// log-sum-exp is returned. A range without keys (lse -inf) weighs nothing; with none at all,
// out is zeros and the result -inf.
template <typename Part>
inline float merge_parts(int64_t parts, int64_t head_dim, const Part& part, float* out) {
  float maximum = -std::numeric_limits<float>::infinity();
  for (int64_t k = 0; k < parts; ++k) maximum = std::max(maximum, part(k).second);
  std::fill(out, out + head_dim, 0.0f);
  if (maximum == -std::numeric_limits<float>::infinity()) return maximum;
  float total = 0.0f;
  for (int64_t k = 0; k < parts; ++k) {
    const auto [o, lse] = part(k);
    const float w = exp_clamped(lse - maximum);
    total += w;
    for (int64_t e = 0; e < head_dim; ++e) out[e] += w * o[e];
  }
  const float inverse = 1.0f / total;
  for (int64_t e = 0; e < head_dim; ++e) out[e] *= inverse;
  return maximum + std::log(total);
}

// Pages are scattered over the pool, so the hardware cannot see the next one coming: while a
// page's slot j is read, the same slot of the next page is fetched into L1 (the `bytes` of its
// heads this task reads) ...
inline void prefetch_span(const void* slot, int64_t bytes) {
  const char* line = static_cast<const char*>(slot);
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(line + b);
}

// Into L2. An assembler statement on x86: GCC deletes a loop nest that only prefetches, as a
// loop without effects.
inline void prefetch_span_l2(const void* slot, int64_t bytes) {
  const char* line = static_cast<const char*>(slot);
  for (int64_t b = 0; b < bytes; b += 64) {
#if defined(__x86_64__)
    asm volatile("prefetcht2 %0" : : "m"(line[b]));
#else
    __builtin_prefetch(line + b, 0, 1);
#endif
  }
}

// ... but one page is read in a few hundred nanoseconds, about a memory access's latency, so
// the next page alone arrives late and a thread keeps too few reads in flight. ReadAhead
// walks the pages a thread's tasks read, in the order they read them (each task's key pages,
// then its value pages, then the next task's), a few pages in front of the reader, and fetches
// them into L2: the reader calls next() as it starts each page and prefetches the slots of the
// page it gets back as it reads its own. Across tasks too, so a row's first pages are on their
// way before the thread gets to it.
class ReadAhead {
 public:
  static constexpr int64_t kBytes = 48 * 1024;  // 4 of SmolLM2's pages (16 slots of 768 bytes)

  ReadAhead(const char* keys, const char* values, const DecodeTasks& tasks, int64_t item,
            int64_t end, int64_t token_bytes, int64_t head_bytes, int64_t span_bytes)
      : keys_(keys), values_(values), tasks_(tasks), item_(item - 1), end_(end),
        token_bytes_(token_bytes), head_bytes_(head_bytes), span_bytes_(span_bytes) {
    enter_next_task();
    const int64_t page_bytes = tasks.page_size * span_bytes;
    for (int64_t ahead = std::max<int64_t>(2, kBytes / page_bytes); ahead > 0; --ahead) {
      prefetch_page(next(), tasks.page_size);
    }
  }

  // The page the cursor is at (nullptr past the last task's), then one page on.
  const char* next() {
    if (item_ >= end_) return nullptr;
    const char* page = (values_pass_ ? values_ : keys_) + pages_[page_] * page_bytes() + offset_;
    if (++page_ > last_) {
      if (!values_pass_) {
        values_pass_ = true;
        page_ = first_;
      } else {
        enter_next_task();
      }
    }
    return page;
  }

  // Slots [from, to) of a page next() returned (nullptr: nothing).
  void prefetch_slots(const char* page, int64_t from, int64_t to) const {
    if (page == nullptr) return;
    for (int64_t j = from; j < to; ++j) prefetch_span_l2(page + j * token_bytes_, span_bytes_);
  }

  void prefetch_page(const char* page, int64_t slots) const { prefetch_slots(page, 0, slots); }

 private:
  int64_t page_bytes() const { return tasks_.page_size * token_bytes_; }

  void enter_next_task() {
    for (++item_; item_ < end_; ++item_) {
      const RowRange range = tasks_.range(item_);
      if (range.length <= range.first) continue;  // a task that reads nothing
      pages_ = tasks_.pages(tasks_.row(item_));
      first_ = range.first / tasks_.page_size;
      last_ = (range.length - 1) / tasks_.page_size;
      page_ = first_;
      values_pass_ = false;
      offset_ = tasks_.kv_head(item_) * head_bytes_;
      return;
    }
  }

  const char* keys_;
  const char* values_;
  const DecodeTasks& tasks_;
  int64_t item_, end_, token_bytes_, head_bytes_, span_bytes_;
  const int64_t* pages_ = nullptr;
  int64_t first_ = 0, last_ = -1, page_ = 0, offset_ = 0;
  bool values_pass_ = false;
};

// Caches with head_dim a multiple of the vector width (16 floats with AVX-512, else 8: GCC
// vector extensions, so AVX/AVX-512/NEON as the CPU has) take vector loops that walk each row
// page by page (the page and slot arithmetic once per page, not per key), read each page from
// memory once for all query heads of its KV heads (again from L1 per head), and widen bfloat16
// as it is loaded.

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

// Query heads of one KV head the values pass sums at once: their C accumulators and a
// broadcast weight each, and a slot's values widened two vectors at a time, within the vector
// registers.
constexpr int value_heads(int c) {
  return std::max(1, std::min(4, (kVectorRegisters - 2) / (c + 1)));
}

// The values pass for U query heads of one KV head over a page's slots [0, n): acc[i] +=
// w[i][j] * value_j for each slot j (value_j at value + j * token_stride), widening each slot's
// values once for all U heads; then o[i] += acc[i]. before(j) runs as slot j starts (the
// caller's prefetches).
template <int C, int U, typename Cache, typename Before>
inline void sum_values(const float* const (&w)[U], const Cache* value, int64_t n,
                       int64_t token_stride, float* const (&o)[U], const Before& before) {
  constexpr bool pairs = std::is_same_v<Cache, c10::BFloat16> && C % 2 == 0;
  vecf acc[U][C] = {};
  for (int64_t j = 0; j < n; ++j, value += token_stride) {
    before(j);
    vecf weight[U];
    for (int i = 0; i < U; ++i) weight[i] = vecf{} + w[i][j];
    if constexpr (pairs) {
      for (int c = 0; c < C; c += 2) {
        vecf even, odd;
        load_pairs(value + c * kLanes, even, odd);
        for (int i = 0; i < U; ++i) {
          acc[i][c] += weight[i] * even;
          acc[i][c + 1] += weight[i] * odd;
        }
      }
    } else {
      for (int c = 0; c < C; ++c) {
        const vecf v = load_vec(value + c * kLanes);
        for (int i = 0; i < U; ++i) acc[i][c] += weight[i] * v;
      }
    }
  }
  for (int i = 0; i < U; ++i) {
    for (int c = 0; c < C; ++c) {
      store_vec(o[i] + c * kLanes, load_vec(o[i] + c * kLanes) + acc[i][c]);
    }
  }
}

// out[0, m) = the sums of acc[0, m)'s lanes, times scale (all kLanes summed at once).
inline void store_scores(vecf (&acc)[kLanes], int64_t m, float scale, float* out) {
  const vecf scores = sum_each(acc) * scale;
  if (m == kLanes) {
    store_vec(out, scores);
  } else {
    std::memcpy(out, &scores, m * sizeof(float));
  }
}

// Scores of query head qg against the keys of a block, key[0, m) (m <= kLanes; the caller
// repeats the last key in key[m, kLanes)): out[j] = qg . key_j * scale. Each key's products
// stay in its own vector, and sum_each adds up all kLanes of them at once (no horizontal sum
// per key); lanes past m are not stored.
template <int C, typename Cache>
inline void score_block(const float* qg, const Cache* const (&key)[kLanes], int64_t m,
                        float scale, float* out) {
  vecf acc[kLanes];
  const vecf q0 = load_vec(qg);
  for (int j = 0; j < kLanes; ++j) acc[j] = load_vec(key[j]) * q0;
  for (int c = 1; c < C; ++c) {
    const vecf qc = load_vec(qg + c * kLanes);
    for (int j = 0; j < kLanes; ++j) acc[j] += load_vec(key[j] + c * kLanes) * qc;
  }
  store_scores(acc, m, scale, out);
}

// score_block for bfloat16 keys read in pairs (load_pairs): qs is the query head split the
// same way (split_pairs), so each key's products pair the same elements.
template <int C>
inline void score_block_pairs(const float* qs, const c10::BFloat16* const (&key)[kLanes],
                              int64_t m, float scale, float* out) {
  vecf acc[kLanes];
  for (int j = 0; j < kLanes; ++j) acc[j] = vecf{};
  for (int c = 0; c < C; c += 2) {
    const vecf qe = load_vec(qs + c * kLanes), qo = load_vec(qs + (c + 1) * kLanes);
    for (int j = 0; j < kLanes; ++j) {
      vecf even, odd;
      load_pairs(key[j] + c * kLanes, even, odd);
      acc[j] += even * qe;
      acc[j] += odd * qo;
    }
  }
  store_scores(acc, m, scale, out);
}

// Each of `heads` vectors of C * kLanes floats, from its natural order to load_pairs' (per
// 2 * kLanes elements: the even ones, then the odd ones), or back (`back`).
template <int C>
inline void split_pairs(float* v, int64_t heads, bool back) {
  float copy[C * kLanes];
  for (int64_t g = 0; g < heads; ++g, v += C * kLanes) {
    std::memcpy(copy, v, sizeof(copy));
    for (int c = 0; c < C; c += 2) {
      for (int l = 0; l < kLanes; ++l) {
        const int natural = c * kLanes + 2 * l, split = c * kLanes + l;
        if (back) {
          v[natural] = copy[split];
          v[natural + 1] = copy[split + kLanes];
        } else {
          v[split] = copy[natural];
          v[split + kLanes] = copy[natural + 1];
        }
      }
    }
  }
}

// One row's KV heads [h0, h0 + kv_heads): their query heads q [kv_heads * group, head_dim]
// against the row's keys in [first, length) -> o [kv_heads * group, head_dim] (head_dim =
// C * kLanes); `offset` is h0's element offset within a slot, s holds [kv_heads * group,
// count] scores as scratch. Both passes walk the pages in order, reading each slot's heads
// as one contiguous span; the scores pass takes a page's keys kLanes at a time (score_block),
// the values pass sums a page's slots in registers for each KV head's query heads, up to
// value_heads(C) of them at a time, while the page is hot in L1. lse (unless null) gets each
// query head's log-sum-exp.
template <int C, typename Cache>
void attend_vec(const float* q, const Cache* key_cache, const Cache* value_cache,
                const int64_t* pages, int64_t first, int64_t length, int64_t offset,
                int64_t kv_heads, int64_t group, int64_t page_size, int64_t page_stride,
                int64_t token_stride, float scale, float* s, float* o, float* lse,
                ReadAhead& ahead) {
  constexpr int64_t head_dim = C * kLanes;
  const int64_t count = length - first;
  const int64_t heads = kv_heads * group;
  const int64_t span_bytes = kv_heads * head_dim * static_cast<int64_t>(sizeof(Cache));
  // bfloat16 read in pairs (load_pairs): the query split to match; o is summed split and put
  // back in order at the end. The same sums in the same order for each output element; the
  // scores add a key's products in another order.
  constexpr bool pairs = std::is_same_v<Cache, c10::BFloat16> && C % 2 == 0;
  const float* qs = q;
  if constexpr (pairs) {
    thread_local std::vector<float> split;
    split.assign(q, q + heads * head_dim);
    split_pairs<C>(split.data(), heads, false);
    qs = split.data();
  }
  // Pass 1: scores, a block of keys at a time for each query head.
  for_each_page(pages, first, length, page_size, page_stride, token_stride,
                [&](int64_t page, int64_t next, int64_t t0, int64_t n) {
                  const Cache* following = key_cache + next + offset;
                  const char* far = ahead.next();
                  const auto fetch = [&](int64_t from, int64_t to) {
                    for (int64_t j = from; j < to; ++j) {
                      if (next >= 0) prefetch_span(following + j * token_stride, span_bytes);
                      ahead.prefetch_slots(far, j, j + 1);
                    }
                  };
                  for (int64_t j0 = 0; j0 < n; j0 += kLanes) {
                    const int64_t m = std::min<int64_t>(kLanes, n - j0);
                    // The block's prefetches (the next page's slot into L1, the read-ahead's
                    // into L2), one slot per query head's scores (a burst of them all at once
                    // overfills the misses a core keeps in flight).
                    int64_t fetched = j0;
                    const Cache* keys = key_cache + page + offset + j0 * token_stride;
                    for (int64_t h = 0; h < kv_heads; ++h, keys += head_dim) {
                      const Cache* key[kLanes];
                      for (int j = 0; j < kLanes; ++j) {
                        key[j] = keys + std::min<int64_t>(j, m - 1) * token_stride;
                      }
                      for (int64_t g = h * group; g < (h + 1) * group; ++g) {
                        if (fetched < j0 + m) fetch(fetched, fetched + 1);
                        ++fetched;
                        if constexpr (pairs) {
                          score_block_pairs<C>(qs + g * head_dim, key, m, scale,
                                               s + g * count + t0 + j0);
                        } else {
                          score_block<C>(q + g * head_dim, key, m, scale,
                                         s + g * count + t0 + j0);
                        }
                      }
                    }
                    fetch(std::min(fetched, j0 + m), j0 + m);
                  }
                  ahead.prefetch_slots(far, n, page_size);
                });
  softmax_rows(s, heads, count, lse);
  // Pass 2: the weighted values, each KV head's query heads up to H at a time (a slot's values
  // widened once for all of them).
  constexpr int H = value_heads(C);
  std::fill(o, o + heads * head_dim, 0.0f);
  for_each_page(
      pages, first, length, page_size, page_stride, token_stride,
      [&](int64_t page, int64_t next, int64_t t0, int64_t n) {
        const Cache* following = value_cache + next + offset;
        const char* far = ahead.next();
        const auto fetch = [&](int64_t j) {
          if (next >= 0) prefetch_span(following + j * token_stride, span_bytes);
          ahead.prefetch_slots(far, j, j + 1);
        };
        const auto nothing = [](int64_t) {};
        for (int64_t h = 0; h < kv_heads; ++h) {
          const Cache* value = value_cache + page + offset + h * head_dim;
          for (int64_t g0 = h * group; g0 < (h + 1) * group; g0 += H) {
            const auto run = [&](auto heads_now) {
              constexpr int U = decltype(heads_now)::value;
              const float* w[U];
              float* out[U];
              for (int i = 0; i < U; ++i) {
                w[i] = s + (g0 + i) * count + t0;
                out[i] = o + (g0 + i) * head_dim;
              }
              if (g0 == 0) {
                sum_values<C, U>(w, value, n, token_stride, out, fetch);
              } else {
                sum_values<C, U>(w, value, n, token_stride, out, nothing);
              }
            };
            switch (std::min<int64_t>(H, (h + 1) * group - g0)) {
              case 1: run(std::integral_constant<int, 1>{}); break;
              case 2: if constexpr (H >= 2) run(std::integral_constant<int, 2>{}); break;
              case 3: if constexpr (H >= 3) run(std::integral_constant<int, 3>{}); break;
              default: if constexpr (H >= 4) run(std::integral_constant<int, 4>{}); break;
            }
          }
        }
        ahead.prefetch_slots(far, n, page_size);
      });
  if constexpr (pairs) split_pairs<C>(o, heads, true);
}

template <typename Cache>
using AttendVec = void (*)(const float*, const Cache*, const Cache*, const int64_t*, int64_t,
                           int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, float,
                           float*, float*, float*, ReadAhead&);

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

}  // namespace brigade_cpu
