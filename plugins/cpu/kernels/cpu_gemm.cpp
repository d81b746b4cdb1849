// Brigade's GEMM for a model's linear layers on a CPU: y = x W^T (+ bias) on a weight packed
// once at load into column panels; float32 and bfloat16.
//
// A panel is kLanes output columns (one vector) of the weight, stored k-major: panels[p][k][j]
// = W[p * kLanes + j][k], the last panel zero-padded. A tile of up to kRows rows of x and up
// to tile_panels(rows) panels keeps its rows x panels output vectors in registers over the
// whole of K: per k it loads one vector of each panel and broadcasts one x value per row, so
// each weight vector read feeds a FMA per row and the panels stream through memory in order
// (at one row the layer is a read of its weight at the memory's speed, which oneDNN's GEMV on
// its own packed layout reached only about half of here). Rows are cut into tiles as even as
// possible (32 rows: 6, 6, 5, 5, 5, 5, not five 6s and a 2), larger batches are taken
// kBlockRows rows at a time so their x rows stay in L2 while every panel of a thread passes,
// and the threads split the panels (each its contiguous share, read once per row block).
// Each thread first copies a block's x rows k-major per tile (pack_rows; float32), so a
// tile's loop walks one pointer instead of one per row, whose bookkeeping had outnumbered
// its FMAs: 1.1-1.4x at 32-2048 rows on SmolLM2's shapes (AVX2).
// Where a group of panels is read by several row tiles (from L2 after the first), those tiles
// prefetch the next group, so that memory streams it meanwhile: ~5-18% on SmolLM2's batch-32
// decode (docs/benchmarks.md).
//
// Sums run along k in order, one chain per output: results equal F.linear's within float32
// rounding, not bit for bit (MKL and oneDNN sum in blocks). GCC fuses each step's multiply and
// add, except where a tile has one chain (1 x 1): tuned for AMD Zen it keeps a lone chain as a
// multiply and an add, whose loop-carried part (the add) is quicker than a FMA. So panels are
// grouped evenly (a thread's share of 4 by 3 as 2 + 2), and only a layer of one panel ever
// takes that tile: every other column is the same FMA chain whichever path computed it.
// bfloat16 weights are float32 sums too, rounded once per output: where the CPU has
// AVX512-BF16, on panels of k pairs with vdpbf16ps (tile_pairs); elsewhere on panels laid out
// as float32's, each weight vector widened to float32 as it is loaded (a shift), so a layer
// reads half the bytes of float32 and runs the same FMAs.
//
// A gate_up projection may be packed in pairs of panels (gate columns, then the same up
// columns): panel_silu_mul then stores silu(gate) * up as each tile finishes, so the
// projection's output (twice the MLP's width) is never written and read back.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <ATen/record_function.h>
#include <torch/library.h>

#include "cpu_vec.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

using brigade_cpu::kLanes;
using brigade_cpu::load_vec;
using brigade_cpu::store_vec;
using brigade_cpu::vecf;

// Accumulators kRows x kPanels, plus kPanels weight vectors and a broadcast, within the
// vector registers (32 with AVX-512, 16 with AVX2 or NEON). With 16, a tile of 6 rows x 2
// panels (BLIS's AVX2 shape) measured 1.2-1.5x a 3 x 3 one at 32-512 rows, but a row or two
// read their weights at memory speed, and there more panels at once keep more reads in flight
// (tile_panels). Blocks of rows (kBlockRows) are as many as keep their x in L2 at
// SmolLM2's widest K (1536): 1 MB on the AVX-512 CPUs measured, 512 KB on the AVX2 ones.
#if defined(__AVX512F__)
constexpr int kRows = 6;
constexpr int kPanels = 4;
constexpr int64_t kBlockRows = 16 * kRows;
constexpr int tile_panels(int64_t /*height*/) { return kPanels; }
#else
constexpr int kRows = 6;
constexpr int kPanels = 3;
constexpr int64_t kBlockRows = 8 * kRows;
constexpr int tile_panels(int64_t height) { return height <= 2 ? 3 : 2; }
#endif
static_assert(
    [] {
      for (int rows = 1; rows <= kRows; ++rows) {
        if ((rows + 1) * tile_panels(rows) + 1 > brigade_cpu::kVectorRegisters) return false;
      }
      return true;
    }(),
    "a tile's sums, weight vectors and broadcast must fit the vector registers");

template <typename T>
struct Gemm {
  const T* x;
  int64_t x_stride;  // between rows of x
  const T* panels;
  const T* bias;  // nullptr: none
  T* out;
  int64_t rows, in_features, out_features;
  // Paired panels (pack_panels(..., paired=true)): panel 2i holds gate columns [i * kLanes,
  // (i + 1) * kLanes) and panel 2i + 1 the same up columns, and the output is silu(gate) * up,
  // out_features (the width of each half) wide; bias, if any, is the layer's [gate, up].
  bool paired = false;
};

// Cache lines a tile asks the L2 cache to fetch while it runs (brigade_cpu::Ahead): the next
// panels' weights, so that a group of panels read once per row tile (from L2 after the first)
// streams the next group from memory meanwhile, instead of the first tile of each group waiting
// for it.
using brigade_cpu::Ahead;

// Rows [row, row + R) of one panel's output columns: sums(r) (row r's float32 sums) plus the
// bias, stored as T (the last panel's padding columns dropped).
template <int R, typename T, typename Sums>
void store_panel(const Gemm<T>& g, int64_t row, int64_t panel, const Sums& sums) {
  const int64_t column = panel * kLanes;
  const int64_t width = std::min<int64_t>(kLanes, g.out_features - column);
  vecf bias = {};
  if (g.bias != nullptr) {
    for (int64_t j = 0; j < width; ++j) bias[j] = static_cast<float>(g.bias[column + j]);
  }
  for (int r = 0; r < R; ++r) {
    T* o = g.out + (row + r) * g.out_features + column;
    const vecf result = sums(r) + bias;
    if (width == kLanes) {
      store_vec(o, result);
    } else {
      for (int64_t j = 0; j < width; ++j) o[j] = T(result[j]);
    }
  }
}

// Paired panels (panel, panel + 1): rows [row, row + R) of silu(gate) * up, each half's sums
// (gate(r), up(r)) plus its bias rounded to T first, as panel_linear's output would be before
// silu_mul (cpu_layer_ops.cpp) reads it, and silu rounded as silu_mul rounds it: the same results.
template <int R, typename T, typename Gate, typename Up>
void store_pair(const Gemm<T>& g, int64_t row, int64_t panel, const Gate& gate, const Up& up) {
  const int64_t column = panel / 2 * kLanes;
  const int64_t width = std::min<int64_t>(kLanes, g.out_features - column);
  vecf gate_bias = {}, up_bias = {};
  if (g.bias != nullptr) {
    for (int64_t j = 0; j < width; ++j) {
      gate_bias[j] = static_cast<float>(g.bias[column + j]);
      up_bias[j] = static_cast<float>(g.bias[g.out_features + column + j]);
    }
  }
  for (int r = 0; r < R; ++r) {
    T* o = g.out + (row + r) * g.out_features + column;
    const vecf result = brigade_cpu::silu_times_rounding<T>(gate(r) + gate_bias, up(r) + up_bias);
    if (width == kLanes) {
      store_vec(o, result);
    } else {
      for (int64_t j = 0; j < width; ++j) o[j] = T(result[j]);
    }
  }
}

// A tile's P panels from `panel` on: each stored as it is, or (paired) by twos as silu * up.
template <int R, int P, typename T, typename Sums>
void store_tile(const Gemm<T>& g, int64_t row, int64_t panel, const Sums& sums) {
  if (g.paired) {  // run_panels gives paired layers tiles of whole pairs only
    if constexpr (P % 2 == 0) {
      for (int p = 0; p < P; p += 2) {
        store_pair<R>(g, row, panel + p, [&](int r) { return sums(r, p); },
                      [&](int r) { return sums(r, p + 1); });
      }
    } else {
      TORCH_CHECK(false, "panel GEMM: a tile of ", P, " panels cannot hold pairs");
    }
    return;
  }
  for (int p = 0; p < P; ++p) {
    store_panel<R>(g, row, panel + p, [&](int r) { return sums(r, p); });
  }
}

// Rows [row, row + R) of the output, panels [panel, panel + P). xs: those rows of x packed
// k-major in float32 (xs[k * R + r], pack_rows), so one pointer reaches every row's value at
// k. T: float, or bfloat16 on panels laid out as float32's (load_vec widens each vector).
template <int R, int P, typename T>
void tile(const Gemm<T>& g, const float* xs, int64_t row, int64_t panel, Ahead ahead) {
  const int64_t K = g.in_features;
  const T* w = g.panels + panel * K * kLanes;
  // The prefetches are issued once per kChunk steps: in the loop of FMAs their bookkeeping
  // cost as many instructions as the FMAs themselves.
  constexpr int64_t kChunk = 16;
  const int64_t per_chunk = ahead.per_step((K + kChunk - 1) / kChunk);
  vecf acc[R][P] = {};
  for (int64_t k0 = 0; k0 < K; k0 += kChunk) {
    ahead.fetch(k0 / kChunk, per_chunk);
    const int64_t end = std::min(K, k0 + kChunk);
    for (int64_t k = k0; k < end; ++k) {
      vecf weight[P];
      for (int p = 0; p < P; ++p) weight[p] = load_vec(w + (p * K + k) * kLanes);
      for (int r = 0; r < R; ++r) {
        const float value = xs[k * R + r];
        for (int p = 0; p < P; ++p) acc[r][p] += value * weight[p];
      }
    }
  }
  store_tile<R, P>(g, row, panel, [&](int r, int p) { return acc[r][p]; });
}

#if defined(__AVX512BF16__)
// bfloat16 with AVX512-BF16: panels of pairs, panels[p][i][j][t] = W[p * 16 + j][2 i + t] (K
// padded to even), so one vdpbf16ps multiplies a vector of 16 columns x 2 k by a broadcast pair
// of x and adds both products, in float32, to the 16 sums (as oneDNN's bf16 kernels do).
// Outputs are rounded to bfloat16 once, after the bias. x is read in place (not packed).
constexpr bool kPairs = true;

template <int R, int P>
void tile_pairs(const Gemm<c10::BFloat16>& g, const float* /*xs: not packed*/, int64_t row,
                int64_t panel, Ahead ahead) {
  static_assert(kLanes == 16, "AVX512-BF16 vectors hold 16 floats");
  const int64_t K = g.in_features, pairs = (K + 1) / 2, whole = K / 2;
  const c10::BFloat16* x = g.x + row * g.x_stride;
  const c10::BFloat16* w = g.panels + panel * pairs * 2 * kLanes;
  __m512 acc[R][P];
  for (int r = 0; r < R; ++r) {
    for (int p = 0; p < P; ++p) acc[r][p] = _mm512_setzero_ps();
  }
  const int64_t per_step = ahead.per_step(pairs);
  // Pair i of every row: both halves from x, or (an odd K's last) the first and a zero.
  const auto step = [&](int64_t i, bool last_odd) {
    ahead.fetch(i, per_step);
    __m512bh weight[P];
    for (int p = 0; p < P; ++p) {
      weight[p] = (__m512bh)_mm512_loadu_si512(w + (p * pairs + i) * 2 * kLanes);
    }
    for (int r = 0; r < R; ++r) {
      uint32_t bits = 0;
      std::memcpy(&bits, x + r * g.x_stride + 2 * i, last_odd ? 2 : 4);
      const __m512bh value = (__m512bh)_mm512_set1_epi32(static_cast<int>(bits));
      for (int p = 0; p < P; ++p) acc[r][p] = _mm512_dpbf16_ps(acc[r][p], value, weight[p]);
    }
  };
  for (int64_t i = 0; i < whole; ++i) step(i, false);
  if (pairs > whole) step(whole, true);
  store_tile<R, P>(g, row, panel, [&](int r, int p) {
    vecf sums;
    std::memcpy(&sums, &acc[r][p], sizeof(sums));
    return sums;
  });
}
#else
constexpr bool kPairs = false;

template <int R, int P>  // declared for tiles_of_rows' discarded branch; never defined here
void tile_pairs(const Gemm<c10::BFloat16>&, const float*, int64_t, int64_t, Ahead);
#endif

// Whether bfloat16 panels hold pairs of k for tile_pairs (else float32's layout, for tile).
template <typename T>
constexpr bool kPaired = kPairs && std::is_same_v<T, c10::BFloat16>;

template <typename T>
using TileFn = void (*)(const Gemm<T>&, const float*, int64_t, int64_t, Ahead);

template <typename T, int R, int... P>
constexpr std::array<TileFn<T>, sizeof...(P)> tiles_of_rows(std::integer_sequence<int, P...>) {
  if constexpr (kPaired<T>) {
    return {&tile_pairs<R, P + 1>...};
  } else {
    return {&tile<R, P + 1, T>...};
  }
}

template <typename T, int... R>
constexpr std::array<std::array<TileFn<T>, kPanels>, sizeof...(R)> tile_table(
    std::integer_sequence<int, R...>) {
  return {tiles_of_rows<T, R + 1>(std::make_integer_sequence<int, kPanels>{})...};
}

// kTiles<T>[R - 1][P - 1] = tile<R, P> for T
template <typename T>
constexpr auto kTiles = tile_table<T>(std::make_integer_sequence<int, kRows>{});

// Panels a tile of `height` rows takes at most: tile_panels(height), or (paired) the whole
// pairs in it.
template <typename T>
int64_t group_panels(const Gemm<T>& g, int64_t height) {
  const int64_t most = tile_panels(height);
  return g.paired ? std::max<int64_t>(2, most / 2 * 2) : most;
}

// The height of tile t of `tiles` over `rows` rows: rows / tiles, the first rows % tiles of
// them one row more.
int64_t tile_height(int64_t rows, int64_t tiles, int64_t t) {
  return rows / tiles + (t < rows % tiles ? 1 : 0);
}

// Rows [block, block + rows) of x, cut into `tiles` tiles as run_panels cuts them, each
// packed k-major in float32 for tile (tile_pairs reads x in place).
template <typename T>
void pack_rows(const Gemm<T>& g, int64_t block, int64_t rows, int64_t tiles,
               std::vector<float>& packed) {
  if constexpr (!kPaired<T>) {
    const int64_t K = g.in_features;
    if (static_cast<int64_t>(packed.size()) < rows * K) packed.resize(rows * K);
    int64_t row = 0;
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t height = tile_height(rows, tiles, t);
      float* to = packed.data() + row * K;
      for (int64_t r = 0; r < height; ++r) {
        const T* from = g.x + (block + row + r) * g.x_stride;
        for (int64_t k = 0; k < K; ++k) to[k * height + r] = static_cast<float>(from[k]);
      }
      row += height;
    }
  }
}

// Panels [first, last) for every row, a thread's share (whole pairs, when paired).
template <typename T>
void run_panels(const Gemm<T>& g, int64_t first, int64_t last) {
  // One panel's bytes: K vectors of kLanes, K rounded up to pairs where they hold pairs.
  const int64_t depth = kPaired<T> ? (g.in_features + 1) / 2 * 2 : g.in_features;
  const int64_t panel_bytes = depth * kLanes * static_cast<int64_t>(sizeof(T));
  thread_local std::vector<float> packed;
  for (int64_t block = 0; block < g.rows; block += kBlockRows) {
    const int64_t rows = std::min(kBlockRows, g.rows - block);
    const int64_t tiles = (rows + kRows - 1) / kRows;
    pack_rows(g, block, rows, tiles, packed);
    // Groups of at most `most` panels, as even as possible (4 by 3: 2 + 2, not 3 + 1: GCC
    // leaves a lone 1 x 1 tile's chain unfused, see the top), in whole pairs when paired.
    const int64_t most = group_panels(g, (rows + tiles - 1) / tiles);
    const int64_t unit = g.paired ? 2 : 1;
    const int64_t units = (last - first) / unit;
    const int64_t groups = (last - first + most - 1) / most;
    const auto group_size = [&](int64_t i) {
      return (units / groups + (i < units % groups ? 1 : 0)) * unit;
    };
    for (int64_t i = 0, panel = first; i < groups; panel += group_size(i), ++i) {
      const int64_t count = group_size(i);
      // The next group of panels (this thread's, or its first for the next block of rows),
      // prefetched in equal shares by this group's tiles; only where a group is read more than
      // once (at one tile per group, i.e. up to kRows rows, it measured no faster: the
      // hardware's own prefetch streams the panels being read).
      const bool more = i + 1 < groups || block + kBlockRows < g.rows;
      const int64_t next = i + 1 < groups ? panel + count : first;
      const int64_t lines =
          tiles > 1 && more ? group_size(i + 1 < groups ? i + 1 : 0) * panel_bytes / 64 : 0;
      const char* ahead = reinterpret_cast<const char*>(g.panels) + next * panel_bytes;
      const int64_t share = (lines + tiles - 1) / tiles;  // of the lines, per tile
      int64_t row = block;
      for (int64_t t = 0; t < tiles; ++t) {
        const int64_t height = tile_height(rows, tiles, t);
        const int64_t begin = std::min(lines, t * share);
        const Ahead fetch{ahead + begin * 64, std::min(lines, begin + share) - begin};
        const float* xs = kPaired<T> ? nullptr : packed.data() + (row - block) * g.in_features;
        kTiles<T>[height - 1][count - 1](g, xs, row, panel, fetch);
        row += height;
      }
    }
  }
}

int64_t num_panels(int64_t out_features) { return (out_features + kLanes - 1) / kLanes; }

}  // namespace

// weight [out_features, in_features] -> panels [ceil(out / kLanes), in, kLanes] of its dtype
// (float32 or bfloat16), or where the CPU has AVX512-BF16 bfloat16 ones of k pairs
// [ceil(out / kLanes), ceil(in / 2), kLanes, 2].
// paired: the weight is a gate_up projection, [gate; up] halves of out_features / 2 rows each,
// packed as pairs of panels (gate columns i * kLanes.., then the same up columns), each half
// padded to whole panels, for panel_silu_mul.
at::Tensor pack_panels(at::Tensor weight, bool paired) {
  const bool bf16 = weight.scalar_type() == at::kBFloat16, pairs_layout = bf16 && kPairs;
  TORCH_CHECK(weight.dim() == 2 && (weight.scalar_type() == at::kFloat || bf16),
              "pack_panels: weight must be a float32 or bfloat16 [out_features, in_features] "
              "tensor");
  TORCH_CHECK(!paired || weight.size(0) % 2 == 0,
              "pack_panels: a paired (gate_up) weight needs an even number of rows");
  const at::Tensor w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1), pairs = (K + 1) / 2;
  const int64_t half = N / 2;
  const int64_t count = paired ? 2 * num_panels(half) : num_panels(N);
  // The weight row holding column j of panel p, or -1 (padding).
  const auto source_row = [&](int64_t p, int64_t j) -> int64_t {
    if (!paired) return p * kLanes + j < N ? p * kLanes + j : -1;
    const int64_t column = p / 2 * kLanes + j;
    return column < half ? (p % 2) * half + column : -1;
  };
  auto panels = pairs_layout ? at::zeros({count, pairs, kLanes, 2}, w.options())
                             : at::zeros({count, K, kLanes}, w.options());
  const auto pack = [&](auto type) {
    using T = decltype(type);
    const T* source = w.data_ptr<T>();
    T* target = panels.data_ptr<T>();
    at::parallel_for(0, count, 1, [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p) {
        for (int64_t j = 0; j < kLanes; ++j) {
          const int64_t n = source_row(p, j);
          if (n < 0) continue;
          const T* row = source + n * K;
          for (int64_t k = 0; k < K; ++k) {
            const int64_t at = pairs_layout ? ((p * pairs + k / 2) * kLanes + j) * 2 + k % 2
                                            : (p * K + k) * kLanes + j;
            target[at] = row[k];
          }
        }
      }
    });
  };
  if (bf16) {
    pack(c10::BFloat16{});
  } else {
    pack(float{});
  }
  return panels;
}

namespace {

// panel_linear (paired = false) and panel_silu_mul (true): out_features is the output's width.
at::Tensor run_gemm(const at::Tensor& x, const at::Tensor& panels,
                    const std::optional<at::Tensor>& bias, int64_t out_features, bool paired) {
  const char* name = paired ? "panel_silu_mul" : "panel_linear";
  const auto dtype = x.scalar_type();
  const bool bf16 = dtype == at::kBFloat16;
  TORCH_CHECK(x.dim() == 2 && (dtype == at::kFloat || bf16) && x.stride(1) == 1, name,
              ": x must be float32 or bfloat16 [rows, in_features] with contiguous rows");
  const int64_t K = x.size(1);
  const int64_t P = paired ? 2 * num_panels(out_features) : num_panels(out_features);
  TORCH_CHECK(panels.scalar_type() == dtype && panels.is_contiguous() && panels.size(0) == P &&
                  (bf16 && kPairs ? panels.dim() == 4 && panels.size(1) == (K + 1) / 2 &&
                              panels.size(2) == kLanes && panels.size(3) == 2
                        : panels.dim() == 3 && panels.size(1) == K && panels.size(2) == kLanes),
              name, ": panels must come from pack_panels for this x and ",
              paired ? "width (paired=True)" : "out_features");
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == dtype && bias->is_contiguous() &&
                    bias->numel() == (paired ? 2 : 1) * out_features,
                name, ": bias must be a vector of the layer's out_features in x's dtype");
  }
  auto out = at::empty({x.size(0), out_features}, x.options());
  if (x.size(0) == 0) return out;
  const auto run = [&](auto type) {
    using T = decltype(type);
    Gemm<T> g{x.data_ptr<T>(),
              x.stride(0),
              panels.data_ptr<T>(),
              bias.has_value() ? bias->data_ptr<T>() : nullptr,
              out.data_ptr<T>(),
              x.size(0),
              K,
              out_features};
    g.paired = paired;
    // The threads split the panels evenly (a tile's worth the smallest share), paired panels
    // by whole pairs.
    const int64_t unit = paired ? 2 : 1;
    const int64_t grain = group_panels(g, std::min<int64_t>(g.rows, kRows)) / unit;
    at::parallel_for(0, P / unit, grain, [&](int64_t begin, int64_t end) {
      run_panels<T>(g, begin * unit, end * unit);
    });
  };
  if (bf16) {
    run(c10::BFloat16{});
  } else {
    run(float{});
  }
  return out;
}

}  // namespace

// x [rows, in_features] float32 or bfloat16 (rows may be strided) -> [rows, out_features].
at::Tensor panel_linear(at::Tensor x, at::Tensor panels, std::optional<at::Tensor> bias,
                        int64_t out_features) {
  // decode_layers calls this directly, not through the dispatcher: name it for profilers.
  RECORD_FUNCTION("brigade_cpu::panel_linear", std::vector<c10::IValue>());
  return run_gemm(x, panels, bias, out_features, false);
}

// A gate_up projection on paired panels and the SiLU-mul after it, in one pass: x [rows,
// in_features] -> silu(gate) * up [rows, width], equal to silu_mul(panel_linear(...)) (the
// gate_up output is never written out). bias: the layer's [gate, up] (2 * width), if any.
at::Tensor panel_silu_mul(at::Tensor x, at::Tensor panels, std::optional<at::Tensor> bias,
                          int64_t width) {
  RECORD_FUNCTION("brigade_cpu::panel_silu_mul", std::vector<c10::IValue>());
  return run_gemm(x, panels, bias, width, true);
}

// Whether bfloat16 panels hold pairs of k for vdpbf16ps here (the CPU has AVX512-BF16); else
// they are laid out as float32's and widened as they are read.
bool panels_hold_pairs() { return kPairs; }

// The output columns of one panel (pack_panels' layout, for Python to check its packing).
int64_t panel_lanes() { return kLanes; }

TORCH_LIBRARY_FRAGMENT(brigade_cpu, m) {
  m.def("pack_panels(Tensor weight, bool paired=False) -> Tensor", &pack_panels);
  m.def("panel_linear", &panel_linear);
  m.def("panel_silu_mul", &panel_silu_mul);
  m.def("panel_lanes", &panel_lanes);
  m.def("panels_hold_pairs", &panels_hold_pairs);
}
