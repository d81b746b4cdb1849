// Brigade's own loop over the AMX tiles for the tile GEMM (cpu_tiles.cpp): the same products
// as cpublas' micro-kernel on the same packed blocks, but with the weights of the blocks to come
// fetched while the tiles work. The micro-kernel reads each block's weights when its products
// need them, so at decode sizes a step waited on memory, then computed, layer after layer
// (for SmolLM2's 270 MB of weights at 112 rows, ~13 ms of tile work and ~12 of reading); here
// every step over k asks for a share of the next block's lines and both overlap. Against
// oneDNN's matmul on its packed weights (SmolLM2's layers, 30 layers' weights cold, an Intel
// Xeon with AMX, 2 threads, benchmarks/cpu_gemm.py --step 30): 1.3-1.4x as fast at 1-16 rows,
// 1.0-1.2x at 112-512, 0.8-0.85x at 2048; on the small Llama's (K = 1024-2816) level at
// 1024-4096 rows (docs/benchmarks.md).
//
// Only where the compiler targets AMX (-march=native on such a CPU); elsewhere tile_loop_runs
// says no and cpu_tiles.cpp calls the micro-kernel.

#include "cpu_tiles.h"

#include "cpu_tasks.h"
#include "cpu_vec.h"

#include <ATen/native/CPUBlas.h>

#include <algorithm>
#include <vector>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace brigade_tiles {
namespace {

constexpr int64_t kTile = 16;  // a tile's rows, and its float32 columns
constexpr int64_t kStep = 32;  // k per tile product: 16 pairs
// The step of a unit at which the previous unit's epilogue runs: its output lines are fetched
// for writing at step 0 and have arrived by then (stores that missed every cache, or whose
// lines were fetched earlier and evicted by the weights passing through L1, stalled the loop:
// at 2048 rows 4-6% of the GEMMs' time). The SiLU-mul's epilogue, and a plain one that
// streams its lines past the caches (Gemm::stream), are spread over the steps from kSpreadStep
// on, a few rows a step, so the tiles never wait for all of it (the small Llama's qkv
// projection at 4096 rows: 0.91x the time; SmolLM2's gate_up with its SiLU-mul at 112-4096
// rows: 0.89-0.95x). A plain epilogue stored through the caches, spread, made SmolLM2's layers
// at 512-2048 rows slower (1.07-1.1x): it runs at kStoreStep in one piece.
constexpr int64_t kStoreStep = 8;
constexpr int64_t kSpreadStep = 2;

// Whether Linux lets this process use the tiles (it must ask once).
bool tiles_permitted() {
  static const bool permitted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                        18 /* XFEATURE_XTILEDATA */) == 0;
  return permitted;
}

// Every tile 16 rows of 64 bytes: A (tiles 0, 1) 16 rows x 16 k pairs, B (2, 3) 16 pairs x 16
// columns, C (4-7) 16 x 16 float32 sums.
void configure_tiles() {
  struct alignas(64) Config {
    uint8_t palette = 1, start_row = 0;
    uint8_t reserved[14] = {};
    uint16_t bytes_per_row[16] = {};
    uint8_t rows[16] = {};
  } config;
  for (int t = 0; t < 8; ++t) {
    config.bytes_per_row[t] = 64;
    config.rows[t] = kTile;
  }
  _tile_loadconfig(&config);
}

// A unit's sums waiting for the epilogue, which runs under the next unit's products.
struct Pending {
  const float* sums = nullptr;
  int64_t row = 0, count = 0, block = 0;
  int64_t stored = 0;  // its rows stored so far

  // Its output lines, fetched for writing some steps before store writes them (not when they
  // are streamed past the caches: fetching them would read each from memory for nothing).
  void fetch(const Gemm& g) const {
    if (sums == nullptr || g.stream) return;
    const int64_t columns = g.silu ? kWidth : g.width;
    const BFloat16* out = g.out + row * g.out_features + block * columns;
    for (int64_t r = 0; r < count; ++r) {
      _mm_prefetch(reinterpret_cast<const char*>(out + r * g.out_features), _MM_HINT_ET0);
    }
  }

  // Its rows up to `rows` (of its count) stored.
  void store_rows(const Gemm& g, int64_t rows) {
    if (sums == nullptr) return;
    rows = std::min(rows, count);
    if (rows > stored) store_block(g, sums + stored * g.width, row + stored, rows - stored, block);
    stored = std::max(stored, rows);
  }

  void store(const Gemm& g) {
    store_rows(g, count);
    sums = nullptr;
    stored = 0;
  }

  // Its share of the epilogue at step `step` of `steps` of the unit running now.
  void store_at(const Gemm& g, int64_t step, int64_t steps) {
    if (!g.silu && !g.stream) {
      if (step == kStoreStep) store(g);
      return;
    }
    if (step < kSpreadStep) return;
    const int64_t per_step = (kGroupRows + steps - kSpreadStep - 1) / (steps - kSpreadStep);
    store_rows(g, (step - kSpreadStep + 1) * per_step);
  }
};

// A thread's blocks [first, first + blocks) over all rows: units of 32 rows x 32 columns
// (one 32-column half of a paired block), the rows inner (a block's weights stay in L1/L2
// while its groups of rows pass).
struct Units {
  const Gemm& g;
  int64_t first, blocks, groups;
  const BFloat16* tail;  // the last group of rows, zero-padded to 32 when short
  int64_t whole;         // where that group starts (g.rows when none is short)

  int64_t halves() const { return g.width / kWidth; }  // paired blocks: gate, then up
  int64_t count() const { return groups * blocks * halves(); }
  void unit(int64_t u, int64_t& group, int64_t& block, int64_t& half) const {
    half = u % halves();
    group = u / halves() % groups;
    block = first + u / halves() / groups;
  }
  // Whether the group holds 16 rows or fewer: its second A tile would be all padding, so its
  // loads and products are skipped (the last group at 1-16, 33-48, 65-80, 97-112 rows: the
  // small Llama's 8 layers took 0.78-0.85x the time at 1-48 rows, 0.92-0.94x at 80-112).
  bool upper_empty(int64_t group) const { return g.rows - group * kGroupRows <= kTile; }
  const BFloat16* rows(int64_t group, int64_t& lda) const {
    const int64_t row = group * kGroupRows;
    lda = row == whole ? g.in_features : g.x_stride;
    return row == whole ? tail : g.x + row * g.x_stride;
  }
  const char* weights(int64_t block, int64_t half, int64_t step) const {
    return reinterpret_cast<const char*>(g.blocks + block * g.in_features * g.width) +
           (step * kStep / 2 * g.width + half * kWidth) * 4;  // k pairs of g.width columns
  }
};

// The tile products of every unit, as one stream of steps over k: A in tiles 0-1, B in 2-3,
// sums in 4-7. Each tile is loaded for the next step (the next unit's first, at a unit's end)
// as soon as this step's last product reading it has issued (the tiles are not renamed), so
// the loads run under the products; a unit's sums go to one of two buffers and are rounded
// into the output under the next unit's products.
void run_units(const Units& t, std::vector<float>& buffers, const brigade_cpu::Ahead& ahead,
               int64_t per_step, brigade_cpu::StealableRuns* runs, int64_t run) {
  const Gemm& g = t.g;
  const int64_t steps = g.in_features / kStep, per_block = t.groups * t.halves();
  int64_t units = t.count();
  const int64_t pair_bytes = g.width * 4, ld = g.width * 4, unit_sums = kGroupRows * g.width;
  int64_t group = 0, block = 0, half = 0, lda = 0;
  t.unit(0, group, block, half);
  const BFloat16* a = t.rows(group, lda);
  int buffer = 0;
  int64_t stream_step = 0;  // steps over k so far, all units
  Pending pending;
  _tile_zero(4);
  _tile_zero(5);
  _tile_zero(6);
  _tile_zero(7);
  _tile_loadd(0, a, lda * 2);
  if (!t.upper_empty(group)) _tile_loadd(1, a + kTile * lda, lda * 2);
  _tile_loadd(2, t.weights(block, half, 0), pair_bytes);
  _tile_loadd(3, t.weights(block, half, 0) + 64, pair_bytes);
  for (int64_t u = 0; u < units; ++u) {
    const int64_t this_group = group, this_block = block, this_half = half;
    const bool this_upper_empty = t.upper_empty(group);  // one A tile: tiles 1, 6, 7 unused
    for (int64_t step = 0; step < steps; ++step) {
      int64_t next_step = step + 1, next_lda = lda;
      const BFloat16* next_a = a;
      bool more = true;
      if (next_step == steps) {
        next_step = 0;
        // A block's first unit: the thread's only if it still gets the block.
        more = u + 1 < units &&
               ((u + 1) % per_block != 0 || runs == nullptr ||
                runs->take_front(run) == t.first + (u + 1) / per_block);
        if (!more) units = u + 1;
        if (more) {
          t.unit(u + 1, group, block, half);
          next_a = t.rows(group, next_lda);
        }
      }
      _tile_dpbf16ps(4, 0, 2);
      if (!this_upper_empty) _tile_dpbf16ps(6, 1, 2);
      if (more) _tile_loadd(2, t.weights(block, half, next_step), pair_bytes);
      _tile_dpbf16ps(5, 0, 3);
      if (more) _tile_loadd(0, next_a + next_step * kStep, next_lda * 2);
      if (!this_upper_empty) _tile_dpbf16ps(7, 1, 3);
      if (more) {
        _tile_loadd(3, t.weights(block, half, next_step) + 64, pair_bytes);
        if (!t.upper_empty(group)) {  // the next step's unit (this one's, or the next)
          _tile_loadd(1, next_a + kTile * next_lda + next_step * kStep, next_lda * 2);
        }
      }
      a = next_a;
      lda = next_lda;
      ahead.fetch(stream_step++, per_step);
      if (step == 0) pending.fetch(g);
      pending.store_at(g, step, steps);
    }
    float* sums = buffers.data() + buffer * unit_sums + this_half * kWidth;
    _tile_stored(4, sums, ld);
    _tile_zero(4);
    _tile_stored(5, sums + kTile, ld);
    _tile_zero(5);
    if (!this_upper_empty) {  // else never written: still zero, and its rows are not stored
      _tile_stored(6, sums + kTile * g.width, ld);
      _tile_zero(6);
      _tile_stored(7, sums + kTile * g.width + kTile, ld);
      _tile_zero(7);
    }
    if (this_half + 1 == t.halves()) {
      pending.store(g);  // what the unit's steps left of it (a unit of few steps)
      const int64_t row = this_group * kGroupRows;
      pending = Pending{buffers.data() + buffer * unit_sums, row,
                        std::min(kGroupRows, g.rows - row), this_block};
      buffer ^= 1;
    }
  }
  pending.store(g);
}

}  // namespace

bool tile_loop_runs(const Gemm& g) {
  return g.in_features > 0 && g.in_features % kStep == 0 && tiles_permitted();
}

void tile_loop(const Gemm& g, int64_t first, int64_t last, brigade_cpu::StealableRuns* runs,
               int64_t run) {
  at::native::cpublas::brgemm_release(true);  // cpublas loads its own tile layout next time
  configure_tiles();
  const int64_t K = g.in_features;
  thread_local std::vector<float> buffers;
  buffers.resize(static_cast<size_t>(2 * kGroupRows * g.width));
  // The last group of rows, when short, zero-padded to the tiles it fills (tiles read 16
  // rows; one tile where it holds 16 rows or fewer, see Units::upper_empty).
  const int64_t whole = g.rows / kGroupRows * kGroupRows;
  thread_local std::vector<BFloat16> tail;
  if (whole < g.rows) {
    const int64_t padded = g.rows - whole <= kTile ? kTile : kGroupRows;
    tail.assign(static_cast<size_t>(padded * K), BFloat16(0));
    for (int64_t r = whole; r < g.rows; ++r) {
      std::copy(g.x + r * g.x_stride, g.x + r * g.x_stride + K, tail.data() + (r - whole) * K);
    }
  }
  const Units units{g, first, last - first, (g.rows + kGroupRows - 1) / kGroupRows,
                    tail.data(), whole};
  // One block ahead, as fast as the blocks pass.
  const int64_t block_lines = K * g.width * 2 / 64, steps = units.count() * (K / kStep);
  const brigade_cpu::Ahead ahead{
      reinterpret_cast<const char*>(g.blocks + (first + 1) * K * g.width),
      (last - first - 1) * block_lines};
  run_units(units, buffers, ahead, (block_lines * (last - first) + steps - 1) / steps, runs,
            run);
  _tile_release();
}

}  // namespace brigade_tiles

#else  // no AMX in this build: cpublas' micro-kernel runs every GEMM

#include <c10/util/Exception.h>

namespace brigade_tiles {

bool tile_loop_runs(const Gemm&) { return false; }

void tile_loop(const Gemm&, int64_t, int64_t, brigade_cpu::StealableRuns*, int64_t) {
  TORCH_CHECK(false, "tile_loop: this build does not target AMX");
}

}  // namespace brigade_tiles

#endif
