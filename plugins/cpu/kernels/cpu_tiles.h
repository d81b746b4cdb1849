// What cpu_tiles.cpp (packing, the epilogue, cpublas' micro-kernel, the ops) and
// cpu_tile_loop.cpp (Brigade's own loop over the AMX tiles) share: a call's operands and the
// epilogue that rounds a block's float32 sums into the output.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>

namespace brigade_cpu {
class StealableRuns;
}

namespace brigade_tiles {

using BFloat16 = c10::BFloat16;

// Output columns per block: two AMX tiles of 16 float32 columns.
constexpr int64_t kWidth = 32;
// Rows per pass of a thread over its blocks (x's rows stay in L2 while the blocks pass); above
// it the threads split the rows, kBlockRows at a time, or fewer where x's rows are long: as
// many as fit in kPartBytes. On SmolLM2's layers 512 was level with 256 and 1024 and faster
// than 32-128; on the small Llama's down projection (K = 2816: 512 rows are 2.9 MB, more
// than a core's 2 MB L2) 160 rows took 0.72x the time of 512 at 4096 rows.
constexpr int64_t kBlockRows = 512;
constexpr int64_t kPartBytes = 1 << 20;
// Rows of x per unit of the tile loop: two tiles of A.
constexpr int64_t kGroupRows = 32;

struct Gemm {
  const BFloat16* x;
  int64_t x_stride;
  const BFloat16* blocks;
  const BFloat16* bias;  // [out] or, silu, [gate; up] (2 * out); nullptr: none
  BFloat16* out;
  int64_t rows, in_features, out_features;
  int64_t width;  // a block's columns: kWidth, or 2 * kWidth for paired blocks
  bool silu;      // paired blocks stored as silu(gate) * up (kWidth columns a block)
  bool stream;    // whole 64-byte lines of the output stored past the caches (see run_gemm)
};

// Rows [row, row + count) of block b's output from its float32 sums (count x g.width): the
// bias added and rounded to bfloat16, or (silu) silu(gate) * up rounded as silu_mul rounds it.
void store_block(const Gemm& g, const float* sums, int64_t row, int64_t count, int64_t b);

// Whether Brigade's loop runs this GEMM here: built for AMX, the tiles permitted by the
// kernel, K in whole steps of 32 (and not 0). Else cpublas' micro-kernel does.
bool tile_loop_runs(const Gemm& g);

// Blocks [first, last) of the output, all rows, on this thread (where tile_loop_runs). With
// `runs`, block `first` is this thread's and each later one only once runs->take_front(run)
// hands it over: the loop ends at the first the thread does not get (another took it).
void tile_loop(const Gemm& g, int64_t first, int64_t last,
               brigade_cpu::StealableRuns* runs = nullptr, int64_t run = 0);

}  // namespace brigade_tiles
