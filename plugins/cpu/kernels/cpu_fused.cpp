// Every decoder layer of a step in one C++ call on a CPU (decode_layers, below): the layers'
// GEMMs (Brigade's panel or tile GEMM, oneDNN's matmul or F.linear, as the eager forward runs
// them), the small operations between them (cpu_layer_ops.cpp) and the paged attention kernels
// (cpu_paged.cpp, cpu_prefill.cpp, cpu_prefill_tiles.cpp), in the eager forward's order, so
// that the result is the eager layers' bit for bit without Python and ~40 operator dispatches
// per layer.

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <ATen/ops/add.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/index_copy.h>
#include <ATen/ops/linear.h>
#include <torch/library.h>

#include "cpu_layer_ops.h"

#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

// cpu_paged.cpp
at::Tensor paged_decode(at::Tensor query, at::Tensor key_cache, at::Tensor value_cache,
                        at::Tensor block_tables, at::Tensor seq_lens, int64_t window,
                        double scale, bool cascade);
// cpu_prefill.cpp, cpu_prefill_tiles.cpp
at::Tensor paged_prefill(at::Tensor query, at::Tensor key_cache, at::Tensor value_cache,
                         at::Tensor block_tables, at::Tensor chunks, int64_t window,
                         double scale);
at::Tensor paged_prefill_tiles(at::Tensor query, at::Tensor key_cache, at::Tensor value_cache,
                               at::Tensor block_tables, at::Tensor chunks, int64_t window,
                               double scale);
// cpu_gemm.cpp
at::Tensor panel_linear(at::Tensor x, at::Tensor panels, std::optional<at::Tensor> bias,
                        int64_t out_features);
at::Tensor panel_silu_mul(at::Tensor x, at::Tensor panels, std::optional<at::Tensor> bias,
                          int64_t width);
// cpu_tiles.cpp
at::Tensor tile_linear(at::Tensor x, at::Tensor blocks, std::optional<at::Tensor> bias,
                       int64_t out_features);
at::Tensor tile_silu_mul(at::Tensor x, at::Tensor blocks, std::optional<at::Tensor> bias,
                         int64_t width);

namespace {

// How decode_layers runs the model's linear layers (``CpuDecodeLayers`` passes it).
enum Gemm : int64_t { kPlain = 0, kOneDnn = 1, kPanels = 2, kTiles = 3 };

// The model's linear layer as the eager forward runs it: Brigade's panel or tile GEMM or
// oneDNN's matmul (``CpuLinear``, on panels, tile blocks, a packed or a dense weight), or
// F.linear (a plain ``nn.Linear``). out_features: the layer's width (panels and blocks are
// padded).
at::Tensor linear(const at::Tensor& x, const at::Tensor& weight,
                  const std::optional<at::Tensor>& bias, int64_t gemm, int64_t out_features) {
  if (gemm == kPanels) return panel_linear(x, weight, bias, out_features);
  if (gemm == kTiles) return tile_linear(x, weight, bias, out_features);
  if (gemm == kPlain) return at::linear(x, weight, bias);
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  const at::Tensor flat = x.is_contiguous() ? x : x.contiguous();
  torch::jit::Stack stack;
  stack.reserve(6);
  stack.emplace_back(flat);
  stack.emplace_back(weight);
  stack.emplace_back(bias.has_value() ? c10::IValue(*bias) : c10::IValue());
  stack.emplace_back(std::string("none"));
  stack.emplace_back(c10::List<std::optional<at::Scalar>>());
  stack.emplace_back(std::string(""));
  op.callBoxed(&stack);
  return stack.back().toTensor();
}

// Which prefill attention kernel decode_layers calls for a step's chunks (as the sdpa backend
// picks it): none (a pure decode step), the vector kernel, or the one on AMX tiles.
enum Prefill : int64_t { kNoChunks = 0, kVectorPrefill = 1, kTilePrefill = 2 };

// One layer's attention as the sdpa backend's forward computes it: the first num_decodes rows
// (one token each) by paged_decode, the chunks after them (prefill_chunks, rows of (row, first
// token, end token, seq_len)) by the prefill kernel `prefill`.
at::Tensor attend(const at::Tensor& q, const at::Tensor& key_cache, const at::Tensor& value_cache,
                  const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t window,
                  double scale, bool cascade, int64_t num_decodes,
                  const std::optional<at::Tensor>& prefill_chunks, int64_t prefill) {
  if (prefill == kNoChunks) {
    return paged_decode(q, key_cache, value_cache, block_tables, seq_lens, window, scale,
                        cascade);
  }
  const int64_t tokens = q.size(0);
  at::Tensor out = at::empty_like(q);
  if (num_decodes > 0) {
    out.narrow(0, 0, num_decodes)
        .copy_(paged_decode(q.narrow(0, 0, num_decodes).contiguous(), key_cache, value_cache,
                            block_tables.narrow(0, 0, num_decodes),
                            seq_lens.narrow(0, 0, num_decodes), window, scale, cascade));
  }
  const auto kernel = prefill == kTilePrefill ? paged_prefill_tiles : paged_prefill;
  out.narrow(0, num_decodes, tokens - num_decodes)
      .copy_(kernel(q.contiguous(), key_cache, value_cache, block_tables, *prefill_chunks,
                    window, scale));
  return out;
}

// Every decoder layer of a step in one call: the same arithmetic in the same order as the eager
// forward (input RMSNorm, qkv, RoPE, KV write, paged attention, o_proj, residual +
// post-attention RMSNorm, gate_up, SiLU-mul, down, residual), so the result is identical to
// it; what it saves is Python and ~40 operator dispatches per layer (RoPE and the KV write in
// one pass, rope_into_cache, where the cache has the model's dtype). A pure decode step (each
// row one new token) has prefill = kNoChunks; a step with prefill chunks (after its
// num_decodes decode rows) names the prefill kernel the sdpa backend would run for them.
// Per layer l: weights[6l .. 6l+5] = input norm, qkv, o, post-attention norm, gate_up, down;
// biases[4l .. 4l+3] = qkv, o, gate_up, down (None when absent);
// windows[l] the sliding window (0: none); gemm how the linear layers run (enum Gemm) and
// intermediate the MLP's width (the panel GEMM needs each layer's width); paired_gate_up: the
// gate_up weights are paired panels or tile blocks (pack_panels or tile_pack, paired=True),
// their SiLU-mul done in the GEMM (panel_silu_mul or tile_silu_mul, the same results).
// Returns the residual stream after the last layer (before the final norm).
at::Tensor decode_layers(at::Tensor hidden, at::Tensor cos, at::Tensor sin,
                         std::vector<at::Tensor> key_caches, std::vector<at::Tensor> value_caches,
                         at::Tensor slot_mapping, at::Tensor block_tables, at::Tensor seq_lens,
                         std::vector<at::Tensor> weights,
                         c10::List<std::optional<at::Tensor>> biases, std::vector<int64_t> windows,
                         int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps,
                         double scale, int64_t gemm, bool cascade, int64_t intermediate,
                         bool paired_gate_up, int64_t num_decodes,
                         std::optional<at::Tensor> prefill_chunks, int64_t prefill) {
  const int64_t num_layers = static_cast<int64_t>(key_caches.size());
  TORCH_CHECK(value_caches.size() == key_caches.size() &&
                  static_cast<int64_t>(weights.size()) == 6 * num_layers &&
                  static_cast<int64_t>(biases.size()) == 4 * num_layers &&
                  static_cast<int64_t>(windows.size()) == num_layers,
              "decode_layers: per-layer lists of mismatched lengths");
  TORCH_CHECK(gemm == kPlain || gemm == kOneDnn || gemm == kPanels || gemm == kTiles,
              "decode_layers: gemm must be 0 (F.linear), 1 (oneDNN), 2 (panels) or 3 (tiles)");
  TORCH_CHECK(!paired_gate_up || gemm == kPanels || gemm == kTiles,
              "decode_layers: paired gate_up needs panels or tiles");
  TORCH_CHECK(prefill == kNoChunks ? num_decodes == hidden.size(0)
                                   : (prefill == kVectorPrefill || prefill == kTilePrefill) &&
                                         prefill_chunks.has_value() && num_decodes >= 0 &&
                                         num_decodes <= hidden.size(0),
              "decode_layers: a decode step's rows are all decodes; a step with chunks needs "
              "prefill 1 (vector kernel) or 2 (tiles), its chunks and at most its rows of "
              "decodes");
  const int64_t tokens = hidden.size(0), hidden_size = hidden.size(1);
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  // The last MLP's output, added to the residual stream by the next layer's input norm
  // (add_rms_norm: the sum at::add gives, and the norm of it, in one pass).
  std::optional<at::Tensor> pending;
  for (int64_t l = 0; l < num_layers; ++l) {
    const at::Tensor* w = weights.data() + 6 * l;
    const auto bias = [&](int64_t i) -> std::optional<at::Tensor> { return biases.get(4 * l + i); };
    at::Tensor normed;
    if (pending.has_value()) {
      std::tie(hidden, normed) = add_rms_norm(hidden, *pending, w[0], eps);
    } else {
      normed = rms_norm(hidden, w[0], eps);
    }
    const at::Tensor qkv = linear(normed, w[1], bias(0), gemm, q_size + 2 * kv_size);
    const at::Tensor q = qkv.narrow(1, 0, q_size).view({tokens, num_heads, head_dim});
    const at::Tensor k = qkv.narrow(1, q_size, kv_size).view({tokens, num_kv_heads, head_dim});
    const at::Tensor v =
        qkv.narrow(1, q_size + kv_size, kv_size).view({tokens, num_kv_heads, head_dim});
    at::Tensor& key_cache = key_caches[l];
    at::Tensor& value_cache = value_caches[l];
    at::Tensor q_rot;
    if (key_cache.scalar_type() == q.scalar_type() && key_cache.is_contiguous() &&
        value_cache.is_contiguous()) {
      q_rot = rope_into_cache(q, k, v, cos, sin, key_cache, value_cache, slot_mapping);
    } else {  // a cache of another dtype (or layout): as the eager forward writes it
      at::Tensor k_rot;
      std::tie(q_rot, k_rot) = rope(q, k, cos, sin);
      key_cache.view({-1, num_kv_heads, head_dim})
          .index_copy_(0, slot_mapping, k_rot.to(key_cache.scalar_type()));
      value_cache.view({-1, num_kv_heads, head_dim})
          .index_copy_(0, slot_mapping, v.to(value_cache.scalar_type()));
    }
    const at::Tensor attention =
        attend(q_rot, key_cache, value_cache, block_tables, seq_lens, windows[l], scale,
               cascade, num_decodes, prefill_chunks, prefill);
    const at::Tensor delta =
        linear(attention.view({tokens, q_size}), w[2], bias(1), gemm, hidden_size);
    auto [summed, post] = add_rms_norm(hidden, delta, w[3], eps);
    const at::Tensor activated =
        !paired_gate_up  ? silu_mul(linear(post, w[4], bias(2), gemm, 2 * intermediate))
        : gemm == kTiles ? tile_silu_mul(post, w[4], bias(2), intermediate)
                         : panel_silu_mul(post, w[4], bias(2), intermediate);
    hidden = summed;
    pending = linear(activated, w[5], bias(3), gemm, hidden_size);
  }
  return pending.has_value() ? at::add(hidden, *pending) : hidden;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(brigade_cpu, m) { m.def("decode_layers", &decode_layers); }
