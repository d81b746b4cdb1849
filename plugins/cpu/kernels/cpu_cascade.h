// Cascade decode attention on a CPU: decode rows whose block tables start with the same pages
// (a system prompt held once by the prefix cache) score those shared keys together, as one
// block of queries, instead of each row reading them again. cpu_paged.cpp finds the shared
// pages, runs each row over its own keys and merges; cpu_cascade.cpp computes the shared part.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace brigade_cpu {

// Rows must share at least this many keys: below it, the merge and the extra tasks cost about
// what the shared reads save.
constexpr int64_t kMinSharedKeys = 64;

// Rows whose block tables start with the same pages, and how many keys they share.
struct SharedGroup {
  std::vector<int64_t> rows;  // rows[0] is the leader, whose pages the shared tasks read
  int64_t keys;
};

// Groups rows by their first page (cpu_cascade.cpp says how); rows in no group read alone.
std::vector<SharedGroup> shared_groups(const int64_t* tables, const int64_t* seq_lens,
                                       int64_t num_rows, int64_t max_pages, int64_t page_size);

// Decode rows one shared-prefix task serves at most.
constexpr int64_t kSharedRows = 32;

// The most keys one task may read when it serves `queries` (rows x query heads of a KV head):
// its scores [queries, keys] stay within a few hundred kilobytes (L2).
int64_t max_shared_keys(int64_t queries);

// One KV head of up to kSharedRows decode rows against keys [key_begin, key_end) of the pages
// they share (read through row `leader`'s block table). Writes each (row, query head) pair's
// attention over those keys alone, normalized, in float32, and its log-sum-exp (of the scaled
// scores), so that partial results over disjoint key ranges can be merged.
struct SharedPrefixTask {
  int64_t leader, kv_head;
  const int64_t* rows;  // the rows' indices into the query tensor, `count` of them
  int64_t count;
  int64_t key_begin, key_end;
  float* out;  // [count * group, head_dim]: pair (i, g) at row i * group + g
  float* lse;  // [count * group]
};

// Runs the tasks on the thread pool. query [rows, heads, head_dim]; caches
// [pages, page_size, kv_heads, head_dim]; block_tables [rows, max_pages]; the keys of a task
// must lie in its leader's pages.
void shared_prefix_attention(const at::Tensor& query, const at::Tensor& key_cache,
                             const at::Tensor& value_cache, const at::Tensor& block_tables,
                             std::vector<SharedPrefixTask>& tasks, double scale);

}  // namespace brigade_cpu
