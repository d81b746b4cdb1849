// Prefill attention over the paged KV cache in bfloat16 on AMX tiles: cpu_prefill.cpp's causal
// (and sliding-window) attention of each row's chunk to the row's keys, with the two products
// of flash attention, scores = Q K^T and out += P V, on oneDNN's AMX micro-kernel as torch
// exports it (at::native::cpublas::brgemm: bfloat16 products summed in float32).
//
// First each (chunk, KV head) copies its keys and values out of the pages once (from the first
// its tokens' windows reach, if any), in blocks of kKeyBlock keys laid out as the micro-kernel
// reads its second operand (k pairs interleaved): K^T blocks [head_dim / 2][kKeyBlock][2] and
// V blocks [kKeyBlock / 2][head_dim][2], the last block zero-padded. Then a task is a block of
// up to query_block(group) tokens of one chunk and one KV head, its rows the (token, query
// head of that KV head) pairs (so the query heads of a KV head share every key block it reads),
// copied once into a dense [rows, head_dim] block. Per key block: scores for all rows in one
// call, the running softmax per row in float32 (scaled, masked past the row's position and
// outside its window, flash attention's rescaling of the row's sums), the weights rounded to
// bfloat16 and out += P V in a second call. Blocks no row can see are skipped. Tasks run
// costliest first on a shared counter (cpu_tasks.h).
//
// torch's flash attention, which bfloat16 prefills on AMX took before, runs the same two
// products on the same micro-kernel, but its softmax and packing cost more: a 512-token
// SmolLM2 prompt's attention took ~32 ms there and ~20 here in the engine (one layer,
// benchmarks/cpu_prefill.py: 1.03 ms with the keys gathered as the backend did, 0.54 here, the
// vector kernel cpu_prefill.cpp 1.70), on an Intel Xeon with AMX, 2 threads
// (docs/benchmarks.md). What bounded it on the way: the softmax's exp and rounding
// (hence exp2_vec and the one-instruction rounding) and per-row overhead per key block (hence
// blocks of 128 keys).
//
// Layouts as paged_prefill's (cpu_prefill.cpp): query [tokens, heads, head_dim], key_cache and
// value_cache [pages, page_size, kv_heads, head_dim], all bfloat16 and contiguous; block_tables
// [rows, max_pages] int64; chunks [n, 4] int64 rows of (row, first token, end token, seq_len).
// Returns the chunks' tokens [tokens, heads, head_dim] in bfloat16.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/native/CPUBlas.h>
#include <ATen/ops/empty.h>
#include <ATen/record_function.h>
#include <torch/library.h>

#include "cpu_tasks.h"
#include "cpu_vec.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

using brigade_cpu::exp_vec;
using brigade_cpu::kLanes;
using brigade_cpu::load_vec;
using brigade_cpu::store_vec;
using brigade_cpu::vecf;
using BFloat16 = c10::BFloat16;

// Query tokens per task: its rows (token, query head) number ~96-128 whatever the model's
// group (SmolLM2's 3: 32 tokens; a group of 2: 64), as each micro-kernel call costs about as
// much to set up as its products of few rows take (a group of 2 at 32 tokens: 64 rows a call;
// at 64, the small Llama's prefill attention 0.91-0.94x the time, benchmarks/cpu_prefill.py).
int64_t query_block(int64_t group) {
  return std::max<int64_t>(32, 128 / std::max<int64_t>(group, 1) / 32 * 32);
}
constexpr int64_t kKeyBlock = 128;   // keys per micro-kernel call
// A block's last keys that no row of a task sees are left out of its products in steps of
// kKeySteps (one AMX tile's k depth).
constexpr int64_t kKeySteps = 32;
static_assert(kKeyBlock % kKeySteps == 0 && kKeySteps % kLanes == 0,
              "a key block holds whole steps, a step whole vectors");

struct Geometry {
  int64_t num_heads, group, head_dim, page_size, kv_heads, window;
  float scale;
};

// One (chunk, KV head)'s keys and values from key block first_block on (the blocks before it
// are out of every token's window), packed: key blocks of [head_dim / 2][kKeyBlock][2] and
// value blocks of [kKeyBlock / 2][head_dim][2], each block kKeyBlock * head_dim values.
struct Packed {
  const BFloat16* keys;
  const BFloat16* values;
  int64_t first_block;
};

// The first key block a chunk's tokens can see: its first token's window's first key's.
int64_t first_block(int64_t window, int64_t start_position) {
  return window > 0 ? std::max<int64_t>(0, start_position - window + 1) / kKeyBlock : 0;
}

// Copies keys [first_block * kKeyBlock, seq_len) of `row`'s KV head `kv_head` out of the pages
// into key_blocks and value_blocks (ceil(seq_len / kKeyBlock) - first_block blocks each),
// padding the last block with zeros.
void pack_keys(const Geometry& geo, const BFloat16* key_cache, const BFloat16* value_cache,
               const int64_t* table, int64_t first_block, int64_t seq_len, int64_t kv_head,
               BFloat16* key_blocks, BFloat16* value_blocks) {
  const int64_t D = geo.head_dim, block_size = kKeyBlock * D;
  const int64_t whole = seq_len / kKeyBlock - first_block;  // blocks before a partial last one
  const int64_t end = ((seq_len + kKeyBlock - 1) / kKeyBlock - first_block) * block_size;
  std::fill(key_blocks + whole * block_size, key_blocks + end, BFloat16(0));
  std::fill(value_blocks + whole * block_size, value_blocks + end, BFloat16(0));
  const auto at = [&](int64_t key) {  // where a key's head_dim values lie in either cache
    const int64_t slot = table[key / geo.page_size] * geo.page_size + key % geo.page_size;
    return (slot * geo.kv_heads + kv_head) * D;
  };
  for (int64_t key = first_block * kKeyBlock; key < seq_len; key += 2) {
    const int64_t b = key / kKeyBlock - first_block, j = key % kKeyBlock;  // j even
    const bool pair = key + 1 < seq_len;
    const int64_t first = at(key), second = pair ? at(key + 1) : first;
    // K^T: the pair (d, d + 1) of key j is element j of pair row d / 2.
    uint32_t* kt = reinterpret_cast<uint32_t*>(key_blocks + b * block_size);
    for (int64_t d = 0; d < D; d += 2) {
      std::memcpy(kt + (d / 2) * kKeyBlock + j, key_cache + first + d, 4);
      if (pair) std::memcpy(kt + (d / 2) * kKeyBlock + j + 1, key_cache + second + d, 4);
    }
    // V: keys j and j + 1 interleaved per element d (a lone last key beside zeros).
    const auto* low = reinterpret_cast<const uint16_t*>(value_cache + first);
    const auto* high = reinterpret_cast<const uint16_t*>(value_cache + second);
    const uint32_t keep = pair ? 0xFFFFu : 0u;
    uint32_t* vb = reinterpret_cast<uint32_t*>(value_blocks + b * block_size + j * D);
    for (int64_t d = 0; d < D; ++d) vb[d] = low[d] | (high[d] & keep) << 16;
  }
}

using Task = brigade_cpu::PrefillTask;

// A thread's buffers for one task at a time; releases the AMX tile state when the thread is
// done.
struct Scratch {
  std::vector<BFloat16> queries, weights;
  std::vector<float> scores, sums, maxima, totals;
  explicit Scratch(const Geometry& geo) : Scratch(geo, query_block(geo.group) * geo.group) {}
  Scratch(const Geometry& geo, int64_t rows)  // rows: a task's most
      : queries(rows * geo.head_dim),
        weights(rows * kKeyBlock),
        scores(rows * kKeyBlock),
        sums(rows * geo.head_dim),
        maxima(rows),
        totals(rows) {}
  Scratch(Scratch&&) = default;
  ~Scratch() {
    if (!queries.empty()) at::native::cpublas::brgemm_release(true);
  }
};

// 2^t for t <= 0 (a row's scores less its maximum, in base 2; -inf gives a tiny positive
// value, masked by the caller): 2^round(t) times a degree-5 polynomial of the rest (relative
// error ~2e-7, far below the bfloat16 rounding of the weights), with AVX-512's scalef instead
// of building the exponent's bits: half exp_vec's instructions, which bounded this kernel.
inline vecf exp2_vec(vecf t) {
#if defined(__AVX512F__)
  const __m512 x = _mm512_max_ps(reinterpret_cast<__m512>(t), _mm512_set1_ps(-126.0f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);  // [-0.5, 0.5]
  __m512 p = _mm512_set1_ps(1.3333558146e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108665e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650696e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718056e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return reinterpret_cast<vecf>(_mm512_scalef_ps(p, n));
#else
  return exp_vec(t * 0.693147180559945f);
#endif
}

// p rounded to bfloat16 (to nearest even) at out: one instruction where the CPU has
// AVX512-BF16 (every CPU with AMX has), else cpu_vec.h's integer rounding.
inline void store_weights(BFloat16* out, vecf p) {
#if defined(__AVX512BF16__)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out),
                      reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(reinterpret_cast<__m512>(p))));
#else
  store_vec(out, p);
#endif
}

// The largest and the sum of v's lanes.
inline float lane_max(vecf v) {
#if defined(__AVX512F__)
  return _mm512_reduce_max_ps(reinterpret_cast<__m512>(v));
#else
  float m = v[0];
  for (int i = 1; i < kLanes; ++i) m = std::max(m, v[i]);
  return m;
#endif
}

inline float lane_sum(vecf v) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps(reinterpret_cast<__m512>(v));
#else
  float total = 0.0f;
  for (int i = 0; i < kLanes; ++i) total += v[i];
  return total;
#endif
}

// Scores of the first `keys` keys of a key block (keys [first_key, first_key + keys), keys a
// multiple of kLanes) for the task's rows into the running softmax: weights (bfloat16) for
// out += P V, the rows' sums rescaled. A row's vectors past its last visible key get zero
// weights without an exp2.
void softmax_block(const Geometry& geo, const Task& task, int64_t first_key, int64_t keys,
                   Scratch& s) {
  const int64_t rows = task.count * geo.group, D = geo.head_dim;
  constexpr float kMinusInf = -std::numeric_limits<float>::infinity();
  constexpr int64_t kVectors = kKeyBlock / kLanes;
  // Scores in base 2: exp(scale * s - m) = 2^(scale * log2(e) * s - m'), maxima kept so.
  const float scale2 = geo.scale * 1.4426950408889634f;
  vecf lane = {};
  for (int i = 0; i < kLanes; ++i) lane[i] = static_cast<float>(i);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t position = task.position + r / geo.group;
    // Keys [low, high) of this block are visible to the row, as offsets in the block.
    const int64_t high = std::min<int64_t>(keys, position + 1 - first_key);
    const int64_t low =
        geo.window > 0 ? std::max<int64_t>(0, position - geo.window + 1 - first_key) : 0;
    const float* score = s.scores.data() + r * kKeyBlock;
    BFloat16* weight = s.weights.data() + r * kKeyBlock;
    if (high <= low) {  // nothing here for this row
      std::fill(weight, weight + keys, BFloat16(0));
      continue;
    }
    const int64_t vectors = (high + kLanes - 1) / kLanes;  // those holding a visible key
    std::fill(weight + vectors * kLanes, weight + keys, BFloat16(0));
    const bool whole = low == 0 && high == vectors * kLanes;
    const vecf lo = vecf{} + static_cast<float>(low), hi = vecf{} + static_cast<float>(high);
    vecf x[kVectors];
    vecf block_max = vecf{} + kMinusInf;
    for (int64_t v = 0; v < vectors; ++v) {
      x[v] = load_vec(score + v * kLanes) * scale2;
      if (!whole) {
        const vecf at = lane + static_cast<float>(v * kLanes);
        x[v] = (at >= lo) & (at < hi) ? x[v] : vecf{} + kMinusInf;
      }
      block_max = block_max > x[v] ? block_max : x[v];
    }
    const float old_max = s.maxima[r], new_max = std::max(old_max, lane_max(block_max));
    // The maximum moves in a row's first blocks and seldom after: no exp2 or rescaling then.
    const float rescale = old_max == new_max    ? 1.0f
                          : old_max == kMinusInf ? 0.0f
                                                 : std::exp2(old_max - new_max);
    vecf total = {};
    for (int64_t v = 0; v < vectors; ++v) {
      vecf p = exp2_vec(x[v] - new_max);
      if (!whole) p = x[v] == kMinusInf ? vecf{} : p;  // exp2_vec clamps: never exactly 0
      total += p;
      store_weights(weight + v * kLanes, p);
    }
    s.maxima[r] = new_max;
    s.totals[r] = s.totals[r] * rescale + lane_sum(total);
    if (rescale != 1.0f) {
      float* out = s.sums.data() + r * D;
      for (int64_t d = 0; d < D; d += kLanes) store_vec(out + d, load_vec(out + d) * rescale);
    }
  }
}

// One task: its rows' attention into out (the chunks' tokens from out_first on).
void run_task(const Geometry& geo, const Task& task, const BFloat16* query, const Packed& packed,
              BFloat16* out, int64_t out_first, Scratch& s) {
  const int64_t rows = task.count * geo.group, D = geo.head_dim;
  for (int64_t t = 0; t < task.count; ++t) {
    const BFloat16* q = query + ((task.token + t) * geo.num_heads + task.kv_head * geo.group) * D;
    std::copy(q, q + geo.group * D, s.queries.data() + t * geo.group * D);
  }
  std::fill(s.sums.begin(), s.sums.begin() + rows * D, 0.0f);
  std::fill(s.maxima.begin(), s.maxima.begin() + rows, -std::numeric_limits<float>::infinity());
  std::fill(s.totals.begin(), s.totals.begin() + rows, 0.0f);
  const int64_t last = task.position + task.count;  // keys [0, last) are visible to some row
  const int64_t first =
      geo.window > 0 ? std::max<int64_t>(0, task.position - geo.window + 1) : 0;
  for (int64_t block = first / kKeyBlock; block * kKeyBlock < last; ++block) {
    const int64_t offset = (block - packed.first_block) * kKeyBlock * D;
    // The block's keys up to the last any row sees, in steps of kKeySteps (both products take
    // the first `keys` columns of the packed block).
    const int64_t keys = std::min<int64_t>(
        kKeyBlock, (last - block * kKeyBlock + kKeySteps - 1) / kKeySteps * kKeySteps);
    at::native::cpublas::brgemm(rows, keys, D, D, kKeyBlock, kKeyBlock, false,
                                s.queries.data(), packed.keys + offset, s.scores.data(), true);
    softmax_block(geo, task, block * kKeyBlock, keys, s);
    at::native::cpublas::brgemm(rows, D, keys, kKeyBlock, D, D, true, s.weights.data(),
                                packed.values + offset, s.sums.data(), true);
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = r / geo.group, head = task.kv_head * geo.group + r % geo.group;
    const float inverse = 1.0f / s.totals[r];
    const float* sum = s.sums.data() + r * D;
    BFloat16* o = out + ((task.token - out_first + t) * geo.num_heads + head) * D;
    for (int64_t d = 0; d < D; d += kLanes) store_vec(o + d, load_vec(sum + d) * inverse);
  }
}

}  // namespace

// paged_prefill (cpu_prefill.cpp) for bfloat16 on AMX tiles: the same arguments and result.
at::Tensor paged_prefill_tiles(at::Tensor query, at::Tensor key_cache, at::Tensor value_cache,
                               at::Tensor block_tables, at::Tensor chunks, int64_t window,
                               double scale) {
  RECORD_FUNCTION("brigade_cpu::paged_prefill_tiles", std::vector<c10::IValue>());
  TORCH_CHECK(at::native::cpublas::could_pack(at::kBFloat16),
              "paged_prefill_tiles: this CPU has no AMX tiles for bfloat16");
  brigade_cpu::check_prefill_inputs("paged_prefill_tiles", query, key_cache, value_cache, true,
                                    kLanes);
  const int64_t num_heads = query.size(1), head_dim = query.size(2);
  const int64_t page_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;
  const Geometry geo{num_heads, group, head_dim, page_size, num_kv_heads, window,
                     static_cast<float>(scale)};
  int64_t out_first = 0, out_end = 0;
  const std::vector<Task> tasks =
      brigade_cpu::prefill_tasks(chunks, block_tables, query.size(0), page_size, num_kv_heads,
                                 query_block(group), window, out_first, out_end);
  const int64_t* spec = chunks.data_ptr<int64_t>();
  const int64_t num_chunks = chunks.size(0);
  std::vector<int64_t> packed_at(num_chunks + 1, 0);  // each chunk's first packed value
  std::vector<int64_t> first_blocks(num_chunks);
  for (int64_t c = 0; c < num_chunks; ++c) {
    const int64_t seq_len = spec[4 * c + 3], tokens = spec[4 * c + 2] - spec[4 * c + 1];
    first_blocks[c] = first_block(window, seq_len - tokens);
    const int64_t blocks = (seq_len + kKeyBlock - 1) / kKeyBlock - first_blocks[c];
    packed_at[c + 1] = packed_at[c] + num_kv_heads * blocks * kKeyBlock * head_dim;
  }
  auto out = at::empty({out_end - out_first, num_heads, head_dim}, query.options());
  if (num_chunks == 0) return out;
  const at::Tensor keys = at::empty({packed_at[num_chunks]}, query.options());
  const at::Tensor values = at::empty({packed_at[num_chunks]}, query.options());
  const auto* key_data = key_cache.data_ptr<BFloat16>();
  const auto* value_data = value_cache.data_ptr<BFloat16>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const auto offset = [&](int64_t c, int64_t kv_head) {  // of a chunk's KV head's blocks
    return packed_at[c] + kv_head * (packed_at[c + 1] - packed_at[c]) / num_kv_heads;
  };
  BFloat16* key_blocks = keys.data_ptr<BFloat16>();
  BFloat16* value_blocks = values.data_ptr<BFloat16>();
  at::parallel_for(0, num_chunks * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t c = i / num_kv_heads, kv_head = i % num_kv_heads, at = offset(c, kv_head);
      pack_keys(geo, key_data, value_data, tables + spec[4 * c] * block_tables.size(1),
                first_blocks[c], spec[4 * c + 3], kv_head, key_blocks + at, value_blocks + at);
    }
  });
  const BFloat16* q = query.data_ptr<BFloat16>();
  BFloat16* o = out.data_ptr<BFloat16>();
  brigade_cpu::run_tasks(
      static_cast<int64_t>(tasks.size()), [&] { return Scratch(geo); },
      [&](int64_t index, Scratch& scratch) {
        const Task& task = tasks[index];
        const int64_t at = offset(task.chunk, task.kv_head);
        const Packed packed{key_blocks + at, value_blocks + at, first_blocks[task.chunk]};
        run_task(geo, task, q, packed, o, out_first, scratch);
      });
  return out;
}

TORCH_LIBRARY_FRAGMENT(brigade_cpu, m) { m.def("paged_prefill_tiles", &paged_prefill_tiles); }
