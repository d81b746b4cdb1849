// Brigade's float32 GEMM for a model's linear layers on a CPU: y = x W^T (+ bias) on a weight
// packed once at load into column panels.
//
// A panel is kLanes output columns (one vector) of the weight, stored k-major: panels[p][k][j]
// = W[p * kLanes + j][k], the last panel zero-padded. A tile of kRows rows of x and up to
// kPanels panels keeps its kRows x kPanels output vectors in registers over the whole of K:
// per k it loads one vector of each panel and broadcasts one x value per row, so each weight
// vector read feeds kRows FMAs and the panels stream through memory in order (at one row the
// layer is a read of its weight at the memory's speed, which oneDNN's GEMV on its own packed
// layout reached only about half of here). Rows are cut into tiles as even as possible (32
// rows: 6, 6, 5, 5, 5, 5, not five 6s and a 2), larger batches are taken kBlockRows rows at a
// time so their x rows stay in L2 while every panel of a thread passes, and the threads split
// the panels (each its contiguous share, read once per row block).
//
// Sums run along k in order, one chain per output: results equal F.linear's within float32
// rounding, not bit for bit (MKL and oneDNN sum in blocks).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <ATen/record_function.h>
#include <torch/library.h>

#include "../attention/cpu_vec.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <optional>
#include <utility>

namespace {

using brigade_cpu::kLanes;
using brigade_cpu::load_vec;
using brigade_cpu::store_vec;
using brigade_cpu::vecf;

// Accumulators kRows x kPanels, plus kPanels weight vectors and a broadcast, within the
// vector registers (32 with AVX-512, 16 with AVX2 or NEON).
#if defined(__AVX512F__)
constexpr int kRows = 6;
constexpr int kPanels = 4;
#else
constexpr int kRows = 3;
constexpr int kPanels = 3;
#endif
constexpr int64_t kBlockRows = 16 * kRows;

struct Gemm {
  const float* x;
  int64_t x_stride;  // between rows of x
  const float* panels;
  const float* bias;  // nullptr: none
  float* out;
  int64_t rows, in_features, out_features;
};

// Rows [row, row + R) of the output, panels [panel, panel + P).
template <int R, int P>
void tile(const Gemm& g, int64_t row, int64_t panel) {
  const int64_t K = g.in_features;
  const float* x = g.x + row * g.x_stride;
  const float* w = g.panels + panel * K * kLanes;
  vecf acc[R][P] = {};
  for (int64_t k = 0; k < K; ++k) {
    vecf weight[P];
    for (int p = 0; p < P; ++p) weight[p] = load_vec(w + (p * K + k) * kLanes);
    for (int r = 0; r < R; ++r) {
      const float value = x[r * g.x_stride + k];
      for (int p = 0; p < P; ++p) acc[r][p] += value * weight[p];
    }
  }
  for (int p = 0; p < P; ++p) {
    const int64_t column = (panel + p) * kLanes;
    const int64_t width = std::min<int64_t>(kLanes, g.out_features - column);
    vecf bias = {};
    if (g.bias != nullptr) {
      for (int64_t j = 0; j < width; ++j) bias[j] = g.bias[column + j];
    }
    for (int r = 0; r < R; ++r) {
      float* o = g.out + (row + r) * g.out_features + column;
      const vecf result = acc[r][p] + bias;
      if (width == kLanes) {
        store_vec(o, result);
      } else {
        for (int64_t j = 0; j < width; ++j) o[j] = result[j];
      }
    }
  }
}

using TileFn = void (*)(const Gemm&, int64_t, int64_t);

template <int R, int... P>
constexpr std::array<TileFn, sizeof...(P)> tiles_of_rows(std::integer_sequence<int, P...>) {
  return {&tile<R, P + 1>...};
}

template <int... R>
constexpr std::array<std::array<TileFn, kPanels>, sizeof...(R)> tile_table(
    std::integer_sequence<int, R...>) {
  return {tiles_of_rows<R + 1>(std::make_integer_sequence<int, kPanels>{})...};
}

// kTiles[R - 1][P - 1] = tile<R, P>
constexpr auto kTiles = tile_table(std::make_integer_sequence<int, kRows>{});

// Panels [first, last) for every row, a thread's share.
void run_panels(const Gemm& g, int64_t first, int64_t last) {
  for (int64_t block = 0; block < g.rows; block += kBlockRows) {
    const int64_t rows = std::min(kBlockRows, g.rows - block);
    const int64_t tiles = (rows + kRows - 1) / kRows;
    for (int64_t panel = first; panel < last; panel += kPanels) {
      const int64_t count = std::min<int64_t>(kPanels, last - panel);
      // Tiles of rows / tiles rows, the first rows % tiles of them one row more.
      int64_t row = block;
      for (int64_t t = 0; t < tiles; ++t) {
        const int64_t height = rows / tiles + (t < rows % tiles ? 1 : 0);
        kTiles[height - 1][count - 1](g, row, panel);
        row += height;
      }
    }
  }
}

int64_t num_panels(int64_t out_features) { return (out_features + kLanes - 1) / kLanes; }

}  // namespace

// weight [out_features, in_features] float32 -> panels [ceil(out / kLanes), in, kLanes].
at::Tensor pack_panels(at::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat,
              "pack_panels: weight must be a float32 [out_features, in_features] tensor");
  const at::Tensor w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1);
  auto panels = at::zeros({num_panels(N), K, kLanes}, w.options());
  const float* source = w.data_ptr<float>();
  float* target = panels.data_ptr<float>();
  at::parallel_for(0, num_panels(N), 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      for (int64_t j = 0; j < kLanes && p * kLanes + j < N; ++j) {
        const float* row = source + (p * kLanes + j) * K;
        for (int64_t k = 0; k < K; ++k) target[(p * K + k) * kLanes + j] = row[k];
      }
    }
  });
  return panels;
}

// x [rows, in_features] float32 (rows may be strided) -> [rows, out_features].
at::Tensor panel_linear(at::Tensor x, at::Tensor panels, std::optional<at::Tensor> bias,
                        int64_t out_features) {
  // decode_layers calls this directly, not through the dispatcher: name it for profilers.
  RECORD_FUNCTION("brigade_cpu::panel_linear", std::vector<c10::IValue>());
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "panel_linear: x must be float32 [rows, in_features] with contiguous rows");
  TORCH_CHECK(panels.dim() == 3 && panels.scalar_type() == at::kFloat && panels.is_contiguous() &&
                  panels.size(2) == kLanes && panels.size(1) == x.size(1) &&
                  panels.size(0) == num_panels(out_features),
              "panel_linear: panels must come from pack_panels for this x and out_features");
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                    bias->numel() == out_features,
                "panel_linear: bias must be a float32 vector of out_features");
  }
  auto out = at::empty({x.size(0), out_features}, x.options());
  const Gemm g{x.data_ptr<float>(),
               x.stride(0),
               panels.data_ptr<float>(),
               bias.has_value() ? bias->data_ptr<float>() : nullptr,
               out.data_ptr<float>(),
               x.size(0),
               x.size(1),
               out_features};
  if (g.rows == 0) return out;
  const int64_t P = panels.size(0);
  // The threads split the panels evenly (a tile's kPanels the smallest share worth one).
  at::parallel_for(0, P, kPanels, [&](int64_t begin, int64_t end) { run_panels(g, begin, end); });
  return out;
}

// The output columns of one panel (pack_panels' layout, for Python to check its packing).
int64_t panel_lanes() { return kLanes; }

TORCH_LIBRARY_FRAGMENT(brigade_cpu, m) {
  m.def("pack_panels", &pack_panels);
  m.def("panel_linear", &panel_linear);
  m.def("panel_lanes", &panel_lanes);
}
