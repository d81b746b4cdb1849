// One token per row of a batch's logits, for CPUs: the standard sampler's last stage.
//
// A row at temperature 0 takes its first maximum. Any other row is drawn from
// softmax(logits / temperature) by inverse transform: with u uniform in [0, 1), the token is
// the first whose running sum of exp(logit / temperature - max) exceeds u times their total.
// One uniform per row instead of one random number per vocabulary entry (the exponential race
// torch offers draws 49152 of them for SmolLM2, one row's worth of mt19937 calls: most of a
// 256-row step's sampling), and two passes over the row: its maximum, then the exponentials'
// sums in blocks, so that the search reads one block again, not the row.
//
// A row with top-k, top-p or min-p draws from the few tokens they can keep, sorted, instead of
// sorting its whole vocabulary as torch's path must (SmolLM2, 256 rows: top-p 0.9 in ~23 ms
// against ~760, top-k 50 in ~31 against ~690).
//
// A row holding a NaN, or whose every logit is -inf, has no distribution: its token is -1.
// Logits equal to -inf weigh exactly 0 and are never drawn. Rows run in parallel; the logits
// are only read.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "cpu_exp.h"
#include "cpu_vec.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

namespace {

constexpr int64_t kBlock = 512;  // entries per partial sum

// A row's maximum, the first index holding it, and whether the row holds a NaN: one pass,
// kLanes at a time, each lane keeping its own first maximum (GCC leaves a float maximum
// scalar without -ffast-math, even under `omp simd`).
struct RowMaximum {
  float value = -std::numeric_limits<float>::infinity();
  int64_t index = 0;
  bool nan = false;
};

RowMaximum row_maximum(const float* x, int64_t size) {
  using brigade_cpu::kLanes;
  using brigade_cpu::vecf;
  using brigade_cpu::veci;
  RowMaximum best;
  int64_t i = 0;
  if (size >= kLanes) {
    veci lane, where{}, nans{};
    for (int l = 0; l < kLanes; ++l) lane[l] = l;
    vecf most = vecf{} + best.value;
    for (; i + kLanes <= size; i += kLanes) {
      const vecf v = brigade_cpu::load_vec(x + i);
      const veci above = v > most;  // false for NaN: the maximum passes NaN over
      most = above ? v : most;
      where = above ? lane + static_cast<int32_t>(i) : where;
      nans |= v != v;
    }
    for (int l = 0; l < kLanes; ++l) {
      best.nan |= nans[l] != 0;
      if (most[l] > best.value || (most[l] == best.value && where[l] < best.index)) {
        best.value = most[l];
        best.index = where[l];
      }
    }
  }
  for (; i < size; ++i) {
    best.nan |= x[i] != x[i];
    if (x[i] > best.value) {
      best.value = x[i];
      best.index = i;
    }
  }
  return best;
}

// exp(x / t - top) for one entry; exactly 0 for a masked one (x = -inf).
inline float weight(float x, float temperature, float top) {
  const float d = x / temperature - top;  // <= 0
  return d >= -87.0f ? brigade_cpu::exp_clamped(d) : 0.0f;
}

// The drawn index of a row (see the file's comment): block sums of the weights, the block where
// u times their total falls, then that block's entries one by one.
int64_t draw(const float* x, int64_t size, float temperature, double u, float maximum,
             std::vector<float>& sums) {
  const float top = maximum / temperature;  // rounding is monotonic: the largest x / t
  const int64_t blocks = (size + kBlock - 1) / kBlock;
  sums.resize(static_cast<size_t>(blocks));
  double total = 0.0;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t end = std::min(size, (b + 1) * kBlock);
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = b * kBlock; i < end; ++i) sum += weight(x[i], temperature, top);
    sums[b] = sum;
    total += sum;
  }
  const double target = u * total;  // the walk below adds the same sums in the same order
  double run = 0.0;
  int64_t block = -1;
  for (int64_t b = 0; b < blocks; ++b) {
    if (run + sums[b] > target) {
      block = b;
      break;
    }
    run += sums[b];
  }
  if (block < 0) {  // u * total rounded up to total: the last block that weighs anything
    block = blocks - 1;
    while (block > 0 && sums[block] == 0.0f) --block;
    run = total - sums[block];
  }
  const int64_t begin = block * kBlock, end = std::min(size, begin + kBlock);
  int64_t last = -1;
  for (int64_t i = begin; i < end; ++i) {
    const float w = weight(x[i], temperature, top);
    if (w <= 0.0f) continue;
    run += w;
    last = i;
    if (run > target) return i;
  }
  return last;  // the block's float sum and this double walk disagreed in the last bits
}

// A row's top-k, top-p and min-p (0, 1 and 0: off), applied as the portable sampler applies
// them: top-k keeps the tokens at or above the k-th largest logit (ties kept); top-p then keeps
// the minimal nucleus of what is left, renormalised (the most likely token always stays);
// min-p, last, the tokens whose probability is at least min_p times the largest one's.
struct Filters {
  int64_t top_k;
  float top_p;
  float min_p;
};

// The drawn index of a filtered row: the weights of the whole row, the candidates the filters
// can keep (the top k; for top-p alone, every weight above a cut that provably leaves a
// nucleus among them), those sorted, cut down by top-p and min-p, and u times what is left
// found among them. `weights` and `kept` are the caller's buffers, reused across rows.
int64_t draw_filtered(const float* x, int64_t size, float temperature, double u, float maximum,
                      const Filters& f, std::vector<float>& weights,
                      std::vector<std::pair<float, int32_t>>& kept) {
  const float top = maximum / temperature;
  weights.resize(static_cast<size_t>(size));
  float* w = weights.data();
  double total = 0.0;
  for (int64_t b = 0; b < size; b += kBlock) {
    const int64_t end = std::min(size, b + kBlock);
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = b; i < end; ++i) {
      w[i] = weight(x[i], temperature, top);
      sum += w[i];
    }
    total += sum;
  }
  auto gather = [&](float cut) {  // every token of weight >= cut (and > 0)
    kept.clear();
    double mass = 0.0;
    for (int64_t i = 0; i < size; ++i) {
      if (w[i] >= cut && w[i] > 0.0f) {
        kept.emplace_back(w[i], static_cast<int32_t>(i));
        mass += w[i];
      }
    }
    return mass;
  };
  double base = total;  // what top-p's nucleus is a share of
  const auto k = static_cast<size_t>(f.top_k);
  if (f.top_k > 0 && f.top_k < size) {
    for (const float cut : {1e-4f, 1e-8f, 1e-16f, 0.0f}) {  // the top k, among few others
      base = gather(cut);
      if (kept.size() >= k) break;
    }
    if (kept.size() > k) {
      std::nth_element(kept.begin(), kept.begin() + static_cast<std::ptrdiff_t>(k - 1),
                       kept.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
      base = gather(kept[k - 1].first);  // the k-th largest, ties kept
    }
  } else if (f.top_p < 1.0f) {
    // Tokens under the cut weigh at most size * cut together; below (1 - p) * total that
    // leaves a nucleus among the rest. Most rows need far fewer: try a higher cut first.
    const double needed = static_cast<double>(f.top_p) * total;
    if (gather(1e-4f) < needed) {
      gather(static_cast<float>((1.0 - f.top_p) * total / static_cast<double>(size)));
    }
  } else {
    gather(f.min_p);  // min-p alone: what it keeps, no more
  }
  std::sort(kept.begin(), kept.end(), [](const auto& a, const auto& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  });
  size_t count = kept.size();
  if (f.top_p < 1.0f) {
    const double nucleus = static_cast<double>(f.top_p) * base;
    double before = 0.0;
    for (size_t j = 0; j < kept.size(); ++j) {
      if (j > 0 && before >= nucleus) {
        count = j;
        break;
      }
      before += kept[j].first;
    }
  }
  if (f.min_p > 0.0f) {  // the largest weight is 1: p_i / p_max is the weight itself
    while (count > 1 && kept[count - 1].first < f.min_p) --count;
  }
  double mass = 0.0;
  for (size_t j = 0; j < count; ++j) mass += kept[j].first;
  const double target = u * mass;
  double run = 0.0;
  for (size_t j = 0; j < count; ++j) {
    run += kept[j].first;
    if (run > target) return kept[j].second;
  }
  return kept[count - 1].second;  // u * mass rounded up to mass
}

// logits [rows, vocab] float32 (last dimension contiguous; left as they are),
// temperature [rows] float32 (0: greedy), uniforms [rows] float64 in [0, 1), and each row's
// top_k int64 (0: off), top_p float32 (1: off), min_p float32 (0: off) -> int64 [rows].
at::Tensor sample_rows(at::Tensor logits, at::Tensor temperature, at::Tensor uniforms,
                       at::Tensor top_k, at::Tensor top_p, at::Tensor min_p) {
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.dim() == 2 && logits.stride(1) == 1,
              "logits must be float32 [rows, vocab] with a contiguous last dimension");
  const int64_t rows = logits.size(0), size = logits.size(1);
  TORCH_CHECK(size > 0, "logits must have a vocabulary");
  TORCH_CHECK(temperature.scalar_type() == at::kFloat && temperature.is_contiguous() &&
                  temperature.numel() == rows,
              "temperature must be float32 [rows]");
  TORCH_CHECK(uniforms.scalar_type() == at::kDouble && uniforms.is_contiguous() &&
                  uniforms.numel() == rows,
              "uniforms must be float64 [rows]");
  TORCH_CHECK(top_k.scalar_type() == at::kLong && top_k.is_contiguous() && top_k.numel() == rows,
              "top_k must be int64 [rows]");
  for (const at::Tensor* t : {&top_p, &min_p}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == rows,
                "top_p and min_p must be float32 [rows]");
  }
  auto tokens = at::empty({rows}, logits.options().dtype(at::kLong));
  const int64_t* ks = top_k.data_ptr<int64_t>();
  const float* ps = top_p.data_ptr<float>();
  const float* mins = min_p.data_ptr<float>();
  const float* base = logits.data_ptr<float>();
  const int64_t stride = logits.stride(0);
  const float* t = temperature.data_ptr<float>();
  const double* u = uniforms.data_ptr<double>();
  int64_t* out = tokens.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t first, int64_t last) {
    std::vector<float> sums, weights;
    std::vector<std::pair<float, int32_t>> kept;
    for (int64_t row = first; row < last; ++row) {
      const float* x = base + row * stride;
      const RowMaximum best = row_maximum(x, size);
      if (best.nan || best.value == -std::numeric_limits<float>::infinity()) {
        out[row] = -1;  // no distribution
      } else if (t[row] == 0.0f) {
        out[row] = best.index;
      } else if (ks[row] > 0 || ps[row] < 1.0f || mins[row] > 0.0f) {
        const Filters filters{ks[row], ps[row], mins[row]};
        out[row] = draw_filtered(x, size, t[row], u[row], best.value, filters, weights, kept);
      } else {
        out[row] = draw(x, size, t[row], u[row], best.value, sums);
      }
    }
  });
  return tokens;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(brigade_cpu, m) { m.def("sample_rows", &sample_rows); }
