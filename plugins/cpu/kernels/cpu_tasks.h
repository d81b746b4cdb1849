// Tasks of Brigade's CPU kernels on torch's thread pool (cpu_prefill.cpp,
// cpu_prefill_tiles.cpp, cpu_cascade.cpp; runs that threads steal from: cpu_paged.cpp, the tile
// GEMM).
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

namespace brigade_cpu {

// Runs body(index, scratch) for every index in [0, num_tasks): each thread makes its scratch
// once and takes the next index from a shared counter until none is left, so tasks of uneven
// cost (ordered costliest first by the caller) spread evenly.
template <typename MakeScratch, typename Body>
void run_tasks(int64_t num_tasks, const MakeScratch& make_scratch, const Body& body) {
  std::atomic<int64_t> next{0};
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), num_tasks);
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    auto scratch = make_scratch();
    for (int64_t worker = begin; worker < end; ++worker) {
      for (int64_t index = next++; index < num_tasks; index = next++) body(index, scratch);
    }
  });
}

// Runs of consecutive tasks, one a thread, that a thread done with its own may take the last
// tasks of: each owner walks its run from the front (the order its read-ahead follows), and a
// thief takes the back half of what is left of the fullest run. Runs of equal work do not end
// together: in the small Llama's mixed workload the thread that finished a tile GEMM call first
// waited 7-9% of it for the other (memory and cache luck: either thread), and idle time in
// these calls fell from 4-5% to 1.6% with stealing (docs/benchmarks.md).
class StealableRuns {
 public:
  // Run r: tasks [bounds[r], bounds[r + 1]).
  explicit StealableRuns(const std::vector<int64_t>& bounds)
      : size_(static_cast<int64_t>(bounds.size()) - 1),
        runs_(new Run[std::max<int64_t>(size_, 1)]) {
    TORCH_CHECK(bounds.empty() || bounds.back() < (int64_t{1} << 32), "too many tasks to steal");
    for (int64_t r = 0; r < size_; ++r) runs_[r].store(pack(bounds[r], bounds[r + 1]));
  }

  int64_t size() const { return size_; }

  // The first task left in run r, now the caller's (its owner's); -1 when none is left.
  int64_t take_front(int64_t r) {
    uint64_t bounds = runs_[r].load();
    for (;;) {
      const int64_t next = low(bounds), end = high(bounds);
      if (next >= end) return -1;
      if (runs_[r].compare_exchange_weak(bounds, pack(next + 1, end))) return next;
    }
  }

  // The back half (rounded up) of what is left of the run with the most left: [begin, end),
  // now the caller's; false when every run is empty.
  bool steal(int64_t& begin, int64_t& end) {
    for (;;) {
      int64_t fullest = -1, most = 0;
      for (int64_t r = 0; r < size_; ++r) {
        const uint64_t bounds = runs_[r].load();
        if (high(bounds) - low(bounds) > most) {
          most = high(bounds) - low(bounds);
          fullest = r;
        }
      }
      if (fullest < 0) return false;
      uint64_t bounds = runs_[fullest].load();
      const int64_t next = low(bounds), last = high(bounds);
      if (next >= last) continue;
      const int64_t split = last - (last - next + 1) / 2;
      if (runs_[fullest].compare_exchange_weak(bounds, pack(next, split))) {
        begin = split;
        end = last;
        return true;
      }
    }
  }

 private:
  using Run = std::atomic<uint64_t>;  // a run's next task (low half) and its end (high half)
  static uint64_t pack(int64_t next, int64_t end) {
    return static_cast<uint64_t>(end) << 32 | static_cast<uint32_t>(next);
  }
  static int64_t low(uint64_t bounds) { return static_cast<int64_t>(bounds & 0xffffffffu); }
  static int64_t high(uint64_t bounds) { return static_cast<int64_t>(bounds >> 32); }

  int64_t size_;
  std::unique_ptr<Run[]> runs_;
};

// Runs own(runs, r) for each run r on the thread it falls to (one run a thread), then
// stolen(begin, end) for what that thread steals, until no run has tasks left. own takes its
// tasks with runs.take_front(r) until it gets -1.
template <typename Own, typename Stolen>
void run_stealing(const std::vector<int64_t>& bounds, const Own& own, const Stolen& stolen) {
  StealableRuns runs(bounds);
  at::parallel_for(0, runs.size(), 1, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) own(runs, r);
    int64_t begin = 0, end = 0;
    while (runs.steal(begin, end)) stolen(begin, end);
  });
}

// The input checks both prefill kernels make: query [tokens, heads, head_dim] and the caches
// [pages, page_size, kv_heads, head_dim], contiguous, bfloat16 (bfloat16_only) or float32 or
// bfloat16 (the caches of one dtype), heads a multiple of the KV heads, and head_dim a multiple
// of `multiple` (what `kernel`'s loops take).
inline void check_prefill_inputs(const char* kernel, const at::Tensor& query,
                                 const at::Tensor& key_cache, const at::Tensor& value_cache,
                                 bool bfloat16_only, int64_t multiple) {
  const auto allowed = [&](const at::Tensor& t) {
    return t.scalar_type() == at::kBFloat16 || (!bfloat16_only && t.scalar_type() == at::kFloat);
  };
  const char* dtypes = bfloat16_only ? "bfloat16" : "float32 or bfloat16";
  TORCH_CHECK(query.dim() == 3 && query.is_contiguous() && allowed(query), "query must be a ",
              "contiguous ", dtypes, " [tokens, heads, head_dim] tensor");
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.is_contiguous() && value_cache.is_contiguous() &&
                  key_cache.sizes() == value_cache.sizes() &&
                  key_cache.scalar_type() == value_cache.scalar_type() && allowed(key_cache),
              "key_cache and value_cache must be contiguous ", dtypes,
              " [pages, page_size, kv_heads, head_dim] tensors of one dtype");
  const int64_t head_dim = query.size(2);
  TORCH_CHECK(key_cache.size(3) == head_dim && query.size(1) % key_cache.size(2) == 0,
              "query and cache head sizes disagree");
  TORCH_CHECK(head_dim % multiple == 0, kernel, ": head_dim ", head_dim,
              " is not a multiple of ", multiple);
}

// A prefill task: query tokens [token, token + count) of chunk `chunk` (of block table row
// `row`), at positions [position, position + count), for KV head kv_head.
struct PrefillTask {
  int64_t chunk, row, token, count, position, kv_head;
};

// The tasks of a step's prefill chunks (chunks [n, 4] int64 rows of (row, first token, end
// token, seq_len); block_tables [rows, max_pages] int64): blocks of up to `block` tokens of a
// chunk per KV head, costliest first (a task's work grows with the keys its last token sees).
// Checks that the chunks are contiguous runs of tokens in order, inside query's `tokens` and
// their rows' block tables. Sets first and end to the tokens the chunks span.
inline std::vector<PrefillTask> prefill_tasks(const at::Tensor& chunks,
                                              const at::Tensor& block_tables, int64_t tokens,
                                              int64_t page_size, int64_t num_kv_heads,
                                              int64_t block, int64_t window, int64_t& first,
                                              int64_t& end) {
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.is_contiguous() &&
                  block_tables.dim() == 2 && chunks.scalar_type() == at::kLong &&
                  chunks.is_contiguous() && chunks.dim() == 2 && chunks.size(1) == 4,
              "block_tables must be int64 [rows, max_pages], chunks int64 [n, 4]");
  const int64_t* spec = chunks.data_ptr<int64_t>();
  const int64_t num_chunks = chunks.size(0);
  const int64_t capacity = block_tables.size(1) * page_size;
  std::vector<PrefillTask> tasks;
  first = num_chunks ? spec[1] : 0;
  end = first;
  for (int64_t c = 0; c < num_chunks; ++c) {
    const int64_t row = spec[4 * c], start = spec[4 * c + 1], stop = spec[4 * c + 2];
    const int64_t seq_len = spec[4 * c + 3];
    TORCH_CHECK(row >= 0 && row < block_tables.size(0) && start == end && stop > start &&
                    stop <= tokens && seq_len >= stop - start && seq_len <= capacity,
                "chunk ", c, " is not a contiguous run of tokens inside its row's block table");
    end = stop;
    const int64_t start_position = seq_len - (stop - start);
    for (int64_t token = start; token < stop; token += block) {
      const int64_t count = std::min(block, stop - token);
      for (int64_t kv_head = 0; kv_head < num_kv_heads; ++kv_head) {
        tasks.push_back({c, row, token, count, start_position + (token - start), kv_head});
      }
    }
  }
  std::stable_sort(tasks.begin(), tasks.end(), [&](const PrefillTask& a, const PrefillTask& b) {
    const auto keys = [&](const PrefillTask& t) {
      const int64_t last = t.position + t.count;
      return window > 0 ? std::min(window + t.count, last) : last;
    };
    return keys(a) * a.count > keys(b) * b.count;
  });
  return tasks;
}

}  // namespace brigade_cpu
