// Tasks of Brigade's CPU attention kernels on torch's thread pool (cpu_prefill.cpp,
// cpu_cascade.cpp).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

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

}  // namespace brigade_cpu
