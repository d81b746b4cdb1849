// The small per-token operations of a decoder layer, fused for CPUs: RMSNorm (optionally after
// the residual add), SiLU(gate) * up, and RoPE on q and k in one call.
//
// In eager PyTorch each of these is three to seven operator calls, each with its dispatch and
// a fork/join of the thread pool, on a few hundred kilobytes at decode batch sizes; here each
// is one pass over its rows (rows in parallel only when there are enough of them to pay).
// Arithmetic follows transformers' order in float32: x * rsqrt(mean(x^2) + eps) * weight,
// silu(g) = g / (1 + exp(-g)), and rotate-half RoPE (x1 cos - x2 sin, x2 cos + x1 sin). In
// bfloat16 every value is computed in float32 and rounded to bfloat16 wherever the chain of
// torch operations transformers runs in bfloat16 rounds (after the normalisation and after the
// weight; after SiLU and after the product; after each RoPE product and after their sum).
//
// Layouts: every tensor float32 or bfloat16 (one dtype per call) with a contiguous last
// dimension; rows may be strided (views such as the q/k/v columns of a fused projection's
// output are taken as they are).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <ATen/ops/add.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/index_copy.h>
#include <ATen/ops/linear.h>
#include <torch/library.h>

#include "cpu_exp.h"
#include "cpu_scalar.h"
#include "cpu_vec.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
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

using brigade_cpu::from_float;
using brigade_cpu::kLanes;
using brigade_cpu::load_vec;
using brigade_cpu::round_as;
using brigade_cpu::round_vec;
using brigade_cpu::store_vec;
using brigade_cpu::to_float;
using brigade_cpu::vecf;

// Rows per task such that a task holds at least ~16K elements (smaller work runs inline).
inline int64_t grain(int64_t row_elements) {
  return std::max<int64_t>(1, 16384 / std::max<int64_t>(row_elements, 1));
}

// Calls body(T{}) with T the C++ type of `dtype` (float32 or bfloat16).
template <typename Body>
void with_scalar(at::ScalarType dtype, const char* name, Body body) {
  if (dtype == at::kFloat) {
    body(float{});
  } else if (dtype == at::kBFloat16) {
    body(c10::BFloat16{});
  } else {
    TORCH_CHECK(false, name, " must be float32 or bfloat16");
  }
}

void check_rows(const at::Tensor& t, const char* name, at::ScalarType dtype) {
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, name,
              " must be float32 or bfloat16");
  TORCH_CHECK(t.scalar_type() == dtype, name, " must have the dtype of the other inputs");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name,
              " must be [rows, features] with a contiguous last dimension");
}

void check_weight(const at::Tensor& weight, const at::Tensor& x) {
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.is_contiguous() &&
                  weight.numel() == x.size(1),
              "weight must be a contiguous vector of the input's width and dtype");
}

// out[row] = weight * (x * rsqrt(mean(x^2) + eps)) for x = a[row] (+ b[row]); with b, the sum
// is also stored in sum[row].
template <typename T>
void norm_rows(const at::Tensor& a, const at::Tensor* b, const at::Tensor& weight, double eps,
               at::Tensor& out, at::Tensor* sum) {
  const int64_t rows = a.size(0), size = a.size(1);
  const T* w = weight.data_ptr<T>();
  const float epsilon = static_cast<float>(eps);
  at::parallel_for(0, rows, grain(size), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const T* x = a.data_ptr<T>() + row * a.stride(0);
      T* o = out.data_ptr<T>() + row * out.stride(0);
      const T* source = x;
      if (b != nullptr) {
        const T* y = b->data_ptr<T>() + row * b->stride(0);
        T* s = sum->data_ptr<T>() + row * sum->stride(0);
#pragma omp simd
        for (int64_t e = 0; e < size; ++e) s[e] = from_float<T>(to_float(x[e]) + to_float(y[e]));
        source = s;
      }
      float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
      for (int64_t e = 0; e < size; ++e) squares += to_float(source[e]) * to_float(source[e]);
      const float inverse = 1.0f / std::sqrt(squares / static_cast<float>(size) + epsilon);
#pragma omp simd
      for (int64_t e = 0; e < size; ++e) {
        o[e] = from_float<T>(to_float(w[e]) * round_as<T>(to_float(source[e]) * inverse));
      }
    }
  });
}

at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps) {
  check_rows(x, "x", x.scalar_type());
  check_weight(weight, x);
  auto out = at::empty(x.sizes(), x.options());
  with_scalar(x.scalar_type(), "x", [&](auto t) {
    norm_rows<decltype(t)>(x, nullptr, weight, eps, out, nullptr);
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(at::Tensor hidden, at::Tensor delta,
                                                at::Tensor weight, double eps) {
  check_rows(hidden, "hidden", hidden.scalar_type());
  check_rows(delta, "delta", hidden.scalar_type());
  TORCH_CHECK(hidden.sizes() == delta.sizes(), "hidden and delta must have one shape");
  check_weight(weight, hidden);
  auto sum = at::empty(hidden.sizes(), hidden.options());
  auto out = at::empty(hidden.sizes(), hidden.options());
  with_scalar(hidden.scalar_type(), "hidden", [&](auto t) {
    norm_rows<decltype(t)>(hidden, &delta, weight, eps, out, &sum);
  });
  return {sum, out};
}

// gate_up [rows, 2 * width] (gate columns first) -> silu(gate) * up [rows, width].
at::Tensor silu_mul(at::Tensor gate_up) {
  check_rows(gate_up, "gate_up", gate_up.scalar_type());
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up must have an even width");
  const int64_t rows = gate_up.size(0), width = gate_up.size(1) / 2;
  auto out = at::empty({rows, width}, gate_up.options());
  with_scalar(gate_up.scalar_type(), "gate_up", [&](auto type) {
    using T = decltype(type);
    at::parallel_for(0, rows, grain(width), [&](int64_t begin, int64_t end) {
      for (int64_t row = begin; row < end; ++row) {
        const T* gate = gate_up.data_ptr<T>() + row * gate_up.stride(0);
        const T* up = gate + width;
        T* o = out.data_ptr<T>() + row * width;
        int64_t e = 0;
        for (; e + brigade_cpu::kLanes <= width; e += brigade_cpu::kLanes) {
          brigade_cpu::store_vec(o + e, brigade_cpu::silu_times<T>(brigade_cpu::load_vec(gate + e),
                                                                   brigade_cpu::load_vec(up + e)));
        }
        for (; e < width; ++e) {
          const float g = to_float(gate[e]);
          const float silu = round_as<T>(g / (1.0f + brigade_cpu::exp_clamped(-g)));
          o[e] = from_float<T>(silu * to_float(up[e]));
        }
      }
    });
  });
  return out;
}

// One token's heads rotated: x [heads, head_dim] (contiguous heads) -> out, as contiguous.
template <typename T>
inline void rotate_token(const T* x, const T* c, const T* s, int64_t heads, int64_t half,
                         T* out) {
  for (int64_t head = 0; head < heads; ++head) {
    const T* x1 = x + head * 2 * half;
    const T* x2 = x1 + half;
    T* o1 = out + head * 2 * half;
    T* o2 = o1 + half;
    int64_t e = 0;
    for (; e + kLanes <= half; e += kLanes) {  // as the tail below, kLanes at a time
      const vecf a = load_vec(x1 + e), b = load_vec(x2 + e);
      const vecf ce = load_vec(c + e), se = load_vec(s + e);
      store_vec(o1 + e, round_vec(a * ce, T{}) - round_vec(b * se, T{}));
      store_vec(o2 + e, round_vec(b * ce, T{}) + round_vec(a * se, T{}));
    }
    for (; e < half; ++e) {
      const float a = to_float(x1[e]), b = to_float(x2[e]);
      const float ce = to_float(c[e]), se = to_float(s[e]);
      o1[e] = from_float<T>(round_as<T>(a * ce) - round_as<T>(b * se));
      o2[e] = from_float<T>(round_as<T>(b * ce) + round_as<T>(a * se));
    }
  }
}

void check_heads(const at::Tensor& x, int64_t half) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2) &&
                  x.size(2) == 2 * half,
              "q and k must be [tokens, heads, head_dim] with contiguous heads");
}

// x [tokens, heads, head_dim] (strided tokens, contiguous heads) -> rotated, contiguous.
template <typename T>
at::Tensor rotate(const at::Tensor& x, const T* cos, const T* sin, int64_t half) {
  check_heads(x, half);
  const int64_t tokens = x.size(0), heads = x.size(1), head_dim = x.size(2);
  auto out = at::empty({tokens, heads, head_dim}, x.options());
  at::parallel_for(0, tokens, grain(heads * head_dim), [&](int64_t begin, int64_t end) {
    for (int64_t token = begin; token < end; ++token) {
      rotate_token(x.data_ptr<T>() + token * x.stride(0), cos + token * half, sin + token * half,
                   heads, half, out.data_ptr<T>() + token * heads * head_dim);
    }
  });
  return out;
}

// q [tokens, heads, head_dim], k [tokens, kv_heads, head_dim]; cos, sin [tokens, head_dim / 2],
// all of one dtype.
std::tuple<at::Tensor, at::Tensor> rope(at::Tensor q, at::Tensor k, at::Tensor cos,
                                        at::Tensor sin) {
  const auto dtype = q.scalar_type();
  TORCH_CHECK(k.scalar_type() == dtype && cos.scalar_type() == dtype &&
                  sin.scalar_type() == dtype,
              "q, k, cos and sin must have one dtype");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.dim() == 2 &&
                  cos.sizes() == sin.sizes(),
              "cos and sin must be contiguous [tokens, head_dim / 2] tensors");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.size(0) == cos.size(0) &&
                  k.size(0) == cos.size(0),
              "q, k, cos and sin need one row per token");
  const int64_t half = cos.size(1);
  std::tuple<at::Tensor, at::Tensor> out;
  with_scalar(dtype, "q", [&](auto type) {
    using T = decltype(type);
    const T* c = cos.data_ptr<T>();
    const T* s = sin.data_ptr<T>();
    out = {rotate(q, c, s, half), rotate(k, c, s, half)};
  });
  return out;
}

// A layer's RoPE and KV write in one pass (what rope and two index_copy_ calls do): q
// [tokens, heads, head_dim] -> rotated, contiguous; k rotated and v copied as they are into
// rows slot_mapping[token] of key_cache and value_cache (as [slots, kv_heads, head_dim]).
// Every tensor of one dtype; slot_mapping int64, one in-range slot per token.
at::Tensor rope_into_cache(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const at::Tensor& cos, const at::Tensor& sin, at::Tensor& key_cache,
                           at::Tensor& value_cache, const at::Tensor& slot_mapping) {
  const int64_t half = cos.size(1);
  check_heads(k, half);
  check_heads(v, half);
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous() &&
                  key_cache.sizes() == value_cache.sizes(),
              "key_cache and value_cache must be contiguous and of one shape");
  const int64_t tokens = k.size(0), kv_size = k.size(1) * k.size(2);
  const int64_t slots = key_cache.numel() / kv_size;
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.numel() == tokens,
              "slot_mapping must be a contiguous int64 vector of one slot per token");
  const int64_t* slot = slot_mapping.data_ptr<int64_t>();
  for (int64_t token = 0; token < tokens; ++token) {
    TORCH_CHECK(slot[token] >= 0 && slot[token] < slots, "slot_mapping[", token, "] = ",
                slot[token], " is outside the cache's ", slots, " slots");
  }
  at::Tensor q_rot;
  with_scalar(q.scalar_type(), "q", [&](auto type) {
    using T = decltype(type);
    const T* c = cos.data_ptr<T>();
    const T* s = sin.data_ptr<T>();
    q_rot = rotate(q, c, s, half);
    T* keys = key_cache.data_ptr<T>();
    T* values = value_cache.data_ptr<T>();
    at::parallel_for(0, tokens, grain(2 * kv_size), [&](int64_t begin, int64_t end) {
      for (int64_t token = begin; token < end; ++token) {
        rotate_token(k.data_ptr<T>() + token * k.stride(0), c + token * half, s + token * half,
                     k.size(1), half, keys + slot[token] * kv_size);
        std::memcpy(values + slot[token] * kv_size, v.data_ptr<T>() + token * v.stride(0),
                    kv_size * sizeof(T));
      }
    });
  });
  return q_rot;
}

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

TORCH_LIBRARY_FRAGMENT(brigade_cpu, m) {
  m.def("decode_layers", &decode_layers);
  m.def("rms_norm", &rms_norm);
  m.def("add_rms_norm", &add_rms_norm);
  m.def("silu_mul", &silu_mul);
  m.def("rope", &rope);
}
