// Brigade's bfloat16 GEMM on AMX tiles for a model's linear layers: y = x W^T (+ bias), on a
// weight packed once at load; float32 sums of the bfloat16 products, rounded once.
//
// Layout: the weight's output columns in blocks of kWidth (two 16-column AMX tiles), each
// block stored as oneDNN's batch-reduce micro-kernel reads it (cpublas::pack: k pairs
// interleaved, "VNNI"), [blocks, K * kWidth], the last block zero-padded. Per call the threads
// split the blocks, each its contiguous share (above kBlockRows rows they split the rows, and
// each takes every block), so each weight byte is read once per call per row block, in the
// order it lies in memory. The products run in Brigade's own loop over the tiles
// (cpu_tile_loop.cpp: the next block's weights fetched while the tiles work), or, in builds
// that do not target AMX or for K not a multiple of 32, in the micro-kernel as torch exports
// it (at::native::cpublas::brgemm), a block at a time over all of K for up to kBlockRows rows.
// Either way a block's float32 sums go through store_block, which adds the bias and rounds.
//
// A gate_up projection may be packed in pairs (a block of kWidth gate columns, then the same
// up columns, one call of 2 * kWidth columns): tile_silu_mul then stores silu(gate) * up as
// each block finishes, rounded as silu_mul (cpu_layer_ops.cpp) rounds the projection's output,
// so it equals silu_mul(tile_linear(...)) without writing the projection's output and reading
// it back.
//
// Only where cpublas packs bfloat16 for its micro-kernel (could_pack: a CPU with AMX);
// tiles_usable says so, and Python keeps the other GEMMs elsewhere.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/native/CPUBlas.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <ATen/record_function.h>
#include <torch/library.h>

#include "cpu_tasks.h"
#include "cpu_vec.h"
#include "cpu_tiles.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

namespace brigade_tiles {

using brigade_cpu::kLanes;
using brigade_cpu::load_vec;
using brigade_cpu::store_vec;
using brigade_cpu::vecf;
static_assert(kWidth % kLanes == 0, "a block holds whole vectors");

// The weight row holding column j of block b (paired: gate columns b * kWidth.., then the
// same up columns), or -1 (padding).
int64_t source_row(int64_t b, int64_t j, int64_t out_features, bool paired) {
  if (!paired) {
    const int64_t column = b * kWidth + j;
    return column < out_features ? column : -1;
  }
  const int64_t half = out_features / 2, column = b * kWidth + j % kWidth;
  return column < half ? (j / kWidth) * half + column : -1;
}

namespace {

// One row's Columns values (v, float32) rounded to bfloat16 into o: with AVX512-BF16 a line
// (two vectors) per instruction, stored past the caches where `stream` and the row starts on a
// line; else as store_vec stores them.
template <int64_t Columns>
inline void store_row(bool stream, BFloat16* o, const vecf (&v)[Columns / kLanes]) {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  static_assert(kWidth == 2 * kLanes, "a line is two vectors");
  const bool past = stream && reinterpret_cast<uintptr_t>(o) % 64 == 0;
  for (int64_t j = 0; j < Columns / kLanes; j += 2) {
    // Rounded as bfloat16_bits rounds (one instruction for both halves of the line).
    const __m512bh line = _mm512_cvtne2ps_pbh(reinterpret_cast<__m512>(v[j + 1]),
                                              reinterpret_cast<__m512>(v[j]));
    __m512i bits;
    std::memcpy(&bits, &line, sizeof(bits));
    if (past) {
      _mm512_stream_si512(reinterpret_cast<__m512i*>(o + j * kLanes), bits);
    } else {
      _mm512_storeu_si512(o + j * kLanes, bits);
    }
  }
#else
  (void)stream;
  for (int64_t j = 0; j < Columns / kLanes; ++j) store_vec(o + j * kLanes, v[j]);
#endif
}

// store_block for one kind of block, every choice made once: Columns output columns a row
// (kWidth, or 2 * kWidth for tile_linear on paired blocks), silu(gate) * up or the sums as they
// are, with or without a bias. Alone, a 32 x 32 unit's epilogue took 170 ns with the choices
// made row by row and each line stored in two halves, 40 here (a paired one's 450, and 330 with
// silu_times_rounding). Between the tile products it costs more than alone, and about as much
// either way: with no epilogue at all the small Llama's layers at 128 rows took 0.8x the time,
// with this one level with the old (docs/benchmarks.md).
template <int64_t Columns, bool Silu, bool Bias>
void store_rows(const Gemm& g, const float* sums, int64_t row, int64_t count, int64_t column,
                int64_t valid, const float* bias) {
  constexpr int64_t vectors = Columns / kLanes;
  BFloat16* o = g.out + row * g.out_features + column;
  for (int64_t r = 0; r < count; ++r, sums += g.width, o += g.out_features) {
    vecf v[vectors];
    for (int64_t j = 0; j < vectors; ++j) {
      vecf value = load_vec(sums + j * kLanes);
      if constexpr (Bias) value += load_vec(bias + j * kLanes);
      if constexpr (Silu) {
        vecf up = load_vec(sums + kWidth + j * kLanes);
        if constexpr (Bias) up += load_vec(bias + kWidth + j * kLanes);
        value = brigade_cpu::silu_times_rounding<BFloat16>(value, up);
      }
      v[j] = value;
    }
    if (valid == Columns) {
      store_row<Columns>(g.stream, o, v);
    } else {  // the last block's padding columns are not the output's
      alignas(64) BFloat16 staged[Columns];
      for (int64_t j = 0; j < vectors; ++j) store_vec(staged + j * kLanes, v[j]);
      std::copy(staged, staged + valid, o);
    }
  }
}

// store_rows for g's kind of block.
template <bool Bias>
void store_kind(const Gemm& g, const float* sums, int64_t row, int64_t count, int64_t column,
                int64_t valid, const float* bias) {
  if (g.silu) {
    store_rows<kWidth, true, Bias>(g, sums, row, count, column, valid, bias);
  } else if (g.width == kWidth) {
    store_rows<kWidth, false, Bias>(g, sums, row, count, column, valid, bias);
  } else {
    store_rows<2 * kWidth, false, Bias>(g, sums, row, count, column, valid, bias);
  }
}

}  // namespace

void store_block(const Gemm& g, const float* sums, int64_t row, int64_t count, int64_t b) {
  const int64_t columns = g.silu ? kWidth : g.width, column = b * columns;
  const int64_t valid = std::min(columns, g.out_features - column);
  if (g.bias == nullptr) {
    store_kind<false>(g, sums, row, count, column, valid, nullptr);
    return;
  }
  alignas(64) float bias[2 * kWidth] = {};
  for (int64_t j = 0; j < valid; ++j) {
    bias[j] = static_cast<float>(g.bias[column + j]);
    if (g.silu) bias[kWidth + j] = static_cast<float>(g.bias[g.out_features + column + j]);
  }
  store_kind<true>(g, sums, row, count, column, valid, bias);
}

}  // namespace brigade_tiles

namespace {

using namespace brigade_tiles;

// Blocks [first, last) of the output, all rows, on this thread, through cpublas' micro-kernel.
void brgemm_blocks(const Gemm& g, int64_t first, int64_t last) {
  const int64_t K = g.in_features;
  thread_local std::vector<float> sums;
  sums.resize(static_cast<size_t>(std::min(g.rows, kBlockRows) * g.width));
  for (int64_t row = 0; row < g.rows; row += kBlockRows) {
    const int64_t count = std::min(kBlockRows, g.rows - row);
    for (int64_t b = first; b < last; ++b) {
      at::native::cpublas::brgemm(count, g.width, K, g.x_stride, g.width, g.width, false,
                                  g.x + row * g.x_stride, g.blocks + b * K * g.width,
                                  sums.data(), true);
      store_block(g, sums.data(), row, count, b);
    }
  }
  at::native::cpublas::brgemm_release(true);
}

// Blocks [first, last) of the output, all rows, on this thread: Brigade's tile loop where it
// runs (with `runs`, as tile_loop takes them), else cpublas' micro-kernel.
void run_blocks(const Gemm& g, int64_t first, int64_t last,
                brigade_cpu::StealableRuns* runs = nullptr, int64_t run = 0) {
  if (tile_loop_runs(g)) {
    tile_loop(g, first, last, runs, run);
  } else {
    brgemm_blocks(g, first, last);
  }
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  if (g.stream) _mm_sfence();  // this thread's streamed lines, before other threads read them
#endif
}

int64_t num_blocks(int64_t columns, int64_t width) { return (columns + width - 1) / width; }

// Outputs of at least this many bytes are stored past the caches (Gemm::stream): a thread's
// half is more than half its core's L2. Smaller ones, a decode step's, are read by the next
// operation from the caches.
constexpr int64_t kStreamBytes = 2 << 20;

// tile_linear (silu = false; blocks paired or not) and tile_silu_mul (true; paired blocks).
at::Tensor run_gemm(const at::Tensor& x, const at::Tensor& blocks,
                    const std::optional<at::Tensor>& bias, int64_t out_features, bool silu) {
  const char* name = silu ? "tile_silu_mul" : "tile_linear";
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1, name,
              ": x must be bfloat16 [rows, in_features] with contiguous rows");
  const int64_t K = x.size(1);
  const int64_t width = K > 0 && blocks.dim() == 2 ? blocks.size(1) / K : 0;
  TORCH_CHECK(blocks.scalar_type() == at::kBFloat16 && blocks.is_contiguous() &&
                  blocks.dim() == 2 && blocks.size(1) == K * width &&
                  (width == 2 * kWidth || (width == kWidth && !silu)) &&
                  blocks.size(0) == num_blocks(out_features, silu ? kWidth : width),
              name, ": blocks must come from tile_pack for this x and ",
              silu ? "width (paired=True)" : "out_features");
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->is_contiguous() &&
                    bias->numel() == (silu ? 2 : 1) * out_features,
                name, ": bias must be a bfloat16 vector of the layer's out_features");
  }
  auto out = at::empty({x.size(0), out_features}, x.options());
  if (x.size(0) == 0) return out;
  // An output larger than the threads' L2 caches is stored past them (non-temporal stores of
  // whole lines): written through the caches, each line was fetched first and evicted x's rows
  // and the weights the products were reading (the small Llama's qkv projection at 4096 rows:
  // 0.78x the time; 0.71x with the epilogue spread, cpu_tile_loop.cpp).
  const bool stream = x.size(0) * out_features * 2 >= kStreamBytes;
  const Gemm g{x.data_ptr<BFloat16>(),
               x.stride(0),
               blocks.data_ptr<BFloat16>(),
               bias.has_value() ? bias->data_ptr<BFloat16>() : nullptr,
               out.data_ptr<BFloat16>(),
               x.size(0),
               K,
               out_features,
               width,
               silu,
               stream};
  if (!tile_loop_runs(g)) {
    at::parallel_for(0, blocks.size(0), 1,
                     [&](int64_t begin, int64_t end) { run_blocks(g, begin, end); });
    return out;
  }
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  if (g.rows <= kBlockRows) {
    // Each thread its contiguous share of the blocks, in order; one done with its own takes
    // the last blocks of the other's (cpu_tasks.h): at 1-128 rows the thread that finished
    // first waited 4-9% of the call.
    const int64_t count = blocks.size(0), shares = std::min(threads, count);
    std::vector<int64_t> bounds(shares + 1);
    for (int64_t t = 0; t <= shares; ++t) bounds[t] = count * t / shares;
    brigade_cpu::run_stealing(
        bounds,
        [&](brigade_cpu::StealableRuns& runs, int64_t run) {
          const int64_t first = runs.take_front(run);
          if (first >= 0) run_blocks(g, first, bounds[run + 1], &runs, run);
        },
        [&](int64_t begin, int64_t end) { run_blocks(g, begin, end); });
    return out;
  }
  // Many rows: the threads split the rows, each part over every block (they write whole rows
  // of the output; split by blocks, SmolLM2's GEMMs at 2048 rows ran 3-5% slower). Parts of at
  // most kBlockRows rows (fewer where their x would not fit kPartBytes), as many for every
  // thread, in whole groups of the loop's rows.
  const int64_t most = std::clamp(kPartBytes / (2 * K) / kGroupRows * kGroupRows, kGroupRows,
                                  kBlockRows);
  const int64_t parts = num_blocks(num_blocks(g.rows, most), threads) * threads;
  const int64_t part_rows = num_blocks(num_blocks(g.rows, parts), kGroupRows) * kGroupRows;
  at::parallel_for(0, num_blocks(g.rows, part_rows), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      Gemm part = g;
      part.x = g.x + i * part_rows * g.x_stride;
      part.out = g.out + i * part_rows * g.out_features;
      part.rows = std::min(part_rows, g.rows - i * part_rows);
      run_blocks(part, 0, blocks.size(0));
    }
  });
  return out;
}

}  // namespace

// Whether the tile GEMM runs here: cpublas packs bfloat16 for its micro-kernel (AMX).
bool tiles_usable() { return at::native::cpublas::could_pack(at::kBFloat16); }

// weight [out_features, in_features] bfloat16 (in_features even) -> blocks [ceil(out /
// kWidth), in_features * kWidth] in the micro-kernel's layout. paired: a gate_up projection,
// [gate; up] halves of out_features / 2 rows, packed as blocks of kWidth gate columns and the
// same up columns ([ceil(half / kWidth), in_features * 2 * kWidth]), for tile_silu_mul.
at::Tensor tile_pack(at::Tensor weight, bool paired) {
  TORCH_CHECK(tiles_usable(), "tile_pack: this CPU has no AMX tiles for bfloat16");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16,
              "tile_pack: weight must be a bfloat16 [out_features, in_features] tensor");
  TORCH_CHECK(weight.size(1) % 2 == 0, "tile_pack: in_features must be even (k pairs)");
  TORCH_CHECK(!paired || weight.size(0) % 2 == 0,
              "tile_pack: a paired (gate_up) weight needs an even number of rows");
  const at::Tensor w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1), width = paired ? 2 * kWidth : kWidth;
  const int64_t count = num_blocks(paired ? N / 2 : N, kWidth);
  auto blocks = at::empty({count, K * width}, w.options());
  const BFloat16* source = w.data_ptr<BFloat16>();
  at::parallel_for(0, count, 1, [&](int64_t begin, int64_t end) {
    std::vector<BFloat16> dense(static_cast<size_t>(K * width));  // the block, [K, width]
    for (int64_t b = begin; b < end; ++b) {
      for (int64_t j = 0; j < width; ++j) {
        const int64_t n = source_row(b, j, N, paired);
        for (int64_t k = 0; k < K; ++k) {
          dense[k * width + j] = n < 0 ? BFloat16(0) : source[n * K + k];
        }
      }
      at::native::cpublas::pack(K, width, width, width, at::kBFloat16, at::kBFloat16,
                                dense.data(), blocks.data_ptr<BFloat16>() + b * K * width);
    }
  });
  return blocks;
}

// x [rows, in_features] bfloat16 (rows may be strided) -> [rows, out_features]. On paired
// blocks: the projection in pair order (each block's gate columns, then its up columns), with
// out_features = 2 * kWidth * blocks.
at::Tensor tile_linear(at::Tensor x, at::Tensor blocks, std::optional<at::Tensor> bias,
                       int64_t out_features) {
  // decode_layers calls this directly, not through the dispatcher: name it for profilers.
  RECORD_FUNCTION("brigade_cpu::tile_linear", std::vector<c10::IValue>());
  return run_gemm(x, blocks, bias, out_features, false);
}

// A gate_up projection on paired blocks and the SiLU-mul after it, in one pass: x [rows,
// in_features] -> silu(gate) * up [rows, width], equal to silu_mul(tile_linear(...)) on the
// unpaired weight. bias: the layer's [gate, up] (2 * width), if any.
at::Tensor tile_silu_mul(at::Tensor x, at::Tensor blocks, std::optional<at::Tensor> bias,
                         int64_t width) {
  RECORD_FUNCTION("brigade_cpu::tile_silu_mul", std::vector<c10::IValue>());
  return run_gemm(x, blocks, bias, width, true);
}

// The output columns of one block (tile_pack's layout, for Python to unpack a paired output).
int64_t tile_width() { return kWidth; }

TORCH_LIBRARY_FRAGMENT(brigade_cpu, m) {
  m.def("tile_pack(Tensor weight, bool paired=False) -> Tensor", &tile_pack);
  m.def("tile_linear", &tile_linear);
  m.def("tile_silu_mul", &tile_silu_mul);
  m.def("tile_width", &tile_width);
  m.def("tiles_usable", &tiles_usable);
}
