// The small per-token operations of a decoder layer, fused for CPUs: RMSNorm (optionally after
// the residual add), SiLU(gate) * up, and RoPE on q and k in one call.
//
// In eager PyTorch each of these is three to seven operator calls, each with its dispatch and
// a fork/join of the thread pool, on a few hundred kilobytes at decode batch sizes; here each
// is one pass over its rows (rows in parallel only when there are enough of them to pay).
// Arithmetic follows transformers' order in float32: x * rsqrt(mean(x^2) + eps) * weight,
// silu(g) = g / (1 + exp(-g)), and rotate-half RoPE (x1 cos - x2 sin, x2 cos + x1 sin).
//
// Layouts: every tensor float32 with a contiguous last dimension; rows may be strided (views
// such as the q/k/v columns of a fused projection's output are taken as they are).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <ATen/ops/add.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/index_copy.h>
#include <ATen/ops/linear.h>
#include <torch/library.h>

#include "cpu_exp.h"

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
                        double scale);

namespace {

// Rows per task such that a task holds at least ~16K elements (smaller work runs inline).
inline int64_t grain(int64_t row_elements) {
  return std::max<int64_t>(1, 16384 / std::max<int64_t>(row_elements, 1));
}

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat, name, " must be float32");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name,
              " must be [rows, features] with a contiguous last dimension");
}

// out[row] = weight * (x * rsqrt(mean(x^2) + eps)) for x = a[row] (+ b[row]); with b, the sum
// is also stored in sum[row].
void norm_rows(const at::Tensor& a, const at::Tensor* b, const at::Tensor& weight, double eps,
               at::Tensor& out, at::Tensor* sum) {
  const int64_t rows = a.size(0), size = a.size(1);
  const float* w = weight.data_ptr<float>();
  const float epsilon = static_cast<float>(eps);
  at::parallel_for(0, rows, grain(size), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const float* x = a.data_ptr<float>() + row * a.stride(0);
      float* o = out.data_ptr<float>() + row * out.stride(0);
      const float* source = x;
      if (b != nullptr) {
        const float* y = b->data_ptr<float>() + row * b->stride(0);
        float* s = sum->data_ptr<float>() + row * sum->stride(0);
#pragma omp simd
        for (int64_t e = 0; e < size; ++e) s[e] = x[e] + y[e];
        source = s;
      }
      float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
      for (int64_t e = 0; e < size; ++e) squares += source[e] * source[e];
      const float inverse = 1.0f / std::sqrt(squares / static_cast<float>(size) + epsilon);
#pragma omp simd
      for (int64_t e = 0; e < size; ++e) o[e] = w[e] * (source[e] * inverse);
    }
  });
}

at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps) {
  check_rows(x, "x");
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous() &&
                  weight.numel() == x.size(1),
              "weight must be a contiguous float32 vector of x's width");
  auto out = at::empty(x.sizes(), x.options());
  norm_rows(x, nullptr, weight, eps, out, nullptr);
  return out;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(at::Tensor hidden, at::Tensor delta,
                                                at::Tensor weight, double eps) {
  check_rows(hidden, "hidden");
  check_rows(delta, "delta");
  TORCH_CHECK(hidden.sizes() == delta.sizes(), "hidden and delta must have one shape");
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous() &&
                  weight.numel() == hidden.size(1),
              "weight must be a contiguous float32 vector of hidden's width");
  auto sum = at::empty(hidden.sizes(), hidden.options());
  auto out = at::empty(hidden.sizes(), hidden.options());
  norm_rows(hidden, &delta, weight, eps, out, &sum);
  return {sum, out};
}

// gate_up [rows, 2 * width] (gate columns first) -> silu(gate) * up [rows, width].
at::Tensor silu_mul(at::Tensor gate_up) {
  check_rows(gate_up, "gate_up");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up must have an even width");
  const int64_t rows = gate_up.size(0), width = gate_up.size(1) / 2;
  auto out = at::empty({rows, width}, gate_up.options());
  at::parallel_for(0, rows, grain(width), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const float* gate = gate_up.data_ptr<float>() + row * gate_up.stride(0);
      const float* up = gate + width;
      float* o = out.data_ptr<float>() + row * width;
#pragma omp simd
      for (int64_t e = 0; e < width; ++e) {
        o[e] = gate[e] / (1.0f + brigade_cpu::exp_clamped(-gate[e])) * up[e];
      }
    }
  });
  return out;
}

// x [tokens, heads, head_dim] (strided tokens, contiguous heads) -> rotated, contiguous.
at::Tensor rotate(const at::Tensor& x, const float* cos, const float* sin, int64_t half) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 3 && x.stride(2) == 1 &&
                  x.stride(1) == x.size(2) && x.size(2) == 2 * half,
              "q and k must be float32 [tokens, heads, head_dim] with contiguous heads");
  const int64_t tokens = x.size(0), heads = x.size(1), head_dim = x.size(2);
  auto out = at::empty({tokens, heads, head_dim}, x.options());
  at::parallel_for(0, tokens, grain(heads * head_dim), [&](int64_t begin, int64_t end) {
    for (int64_t token = begin; token < end; ++token) {
      const float* c = cos + token * half;
      const float* s = sin + token * half;
      for (int64_t head = 0; head < heads; ++head) {
        const float* x1 = x.data_ptr<float>() + token * x.stride(0) + head * head_dim;
        const float* x2 = x1 + half;
        float* o1 = out.data_ptr<float>() + (token * heads + head) * head_dim;
        float* o2 = o1 + half;
#pragma omp simd
        for (int64_t e = 0; e < half; ++e) {
          o1[e] = x1[e] * c[e] - x2[e] * s[e];
          o2[e] = x2[e] * c[e] + x1[e] * s[e];
        }
      }
    }
  });
  return out;
}

// q [tokens, heads, head_dim], k [tokens, kv_heads, head_dim]; cos, sin [tokens, head_dim / 2].
std::tuple<at::Tensor, at::Tensor> rope(at::Tensor q, at::Tensor k, at::Tensor cos,
                                        at::Tensor sin) {
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                  cos.is_contiguous() && sin.is_contiguous() && cos.dim() == 2 &&
                  cos.sizes() == sin.sizes(),
              "cos and sin must be contiguous float32 [tokens, head_dim / 2] tensors");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.size(0) == cos.size(0) &&
                  k.size(0) == cos.size(0),
              "q, k, cos and sin need one row per token");
  const int64_t half = cos.size(1);
  return {rotate(q, cos.data_ptr<float>(), sin.data_ptr<float>(), half),
          rotate(k, cos.data_ptr<float>(), sin.data_ptr<float>(), half)};
}

// The model's linear layer as the eager forward runs it (``OneDnnLinear``): oneDNN's matmul
// on the weight as loaded from `min_rows` rows up, F.linear (MKL) below (min_rows 0: never).
at::Tensor linear(const at::Tensor& x, const at::Tensor& weight,
                  const std::optional<at::Tensor>& bias, int64_t min_rows) {
  if (min_rows <= 0 || x.size(0) < min_rows) return at::linear(x, weight, bias);
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

// Every decoder layer of a pure decode step (each row one new token) in one call: the same
// kernels in the same order as the eager forward (input RMSNorm, qkv, RoPE, KV write, paged
// decode attention, o_proj, residual + post-attention RMSNorm, gate_up, SiLU-mul, down,
// residual), so the result is identical to it; what it saves is Python and ~40 operator
// dispatches per layer. Per layer l: weights[6l .. 6l+5] = input norm, qkv, o, post-attention
// norm, gate_up, down; biases[4l .. 4l+3] = qkv, o, gate_up, down (None when absent);
// windows[l] the sliding window (0: none). Returns the residual stream after the last layer
// (before the final norm).
at::Tensor decode_layers(at::Tensor hidden, at::Tensor cos, at::Tensor sin,
                         std::vector<at::Tensor> key_caches, std::vector<at::Tensor> value_caches,
                         at::Tensor slot_mapping, at::Tensor block_tables, at::Tensor seq_lens,
                         std::vector<at::Tensor> weights,
                         c10::List<std::optional<at::Tensor>> biases, std::vector<int64_t> windows,
                         int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps,
                         double scale, int64_t min_rows) {
  const int64_t num_layers = static_cast<int64_t>(key_caches.size());
  TORCH_CHECK(value_caches.size() == key_caches.size() &&
                  static_cast<int64_t>(weights.size()) == 6 * num_layers &&
                  static_cast<int64_t>(biases.size()) == 4 * num_layers &&
                  static_cast<int64_t>(windows.size()) == num_layers,
              "decode_layers: per-layer lists of mismatched lengths");
  const int64_t tokens = hidden.size(0);
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  for (int64_t l = 0; l < num_layers; ++l) {
    const at::Tensor* w = weights.data() + 6 * l;
    const auto bias = [&](int64_t i) -> std::optional<at::Tensor> { return biases.get(4 * l + i); };
    const at::Tensor normed = rms_norm(hidden, w[0], eps);
    const at::Tensor qkv = linear(normed, w[1], bias(0), min_rows);
    const at::Tensor q = qkv.narrow(1, 0, q_size).view({tokens, num_heads, head_dim});
    const at::Tensor k = qkv.narrow(1, q_size, kv_size).view({tokens, num_kv_heads, head_dim});
    const at::Tensor v =
        qkv.narrow(1, q_size + kv_size, kv_size).view({tokens, num_kv_heads, head_dim});
    auto [q_rot, k_rot] = rope(q, k, cos, sin);
    at::Tensor& key_cache = key_caches[l];
    at::Tensor& value_cache = value_caches[l];
    key_cache.view({-1, num_kv_heads, head_dim}).index_copy_(0, slot_mapping, k_rot);
    value_cache.view({-1, num_kv_heads, head_dim}).index_copy_(0, slot_mapping, v);
    const at::Tensor attention =
        paged_decode(q_rot, key_cache, value_cache, block_tables, seq_lens, windows[l], scale);
    const at::Tensor delta = linear(attention.view({tokens, q_size}), w[2], bias(1), min_rows);
    auto [summed, post] = add_rms_norm(hidden, delta, w[3], eps);
    const at::Tensor gate_up = linear(post, w[4], bias(2), min_rows);
    hidden = at::add(summed, linear(silu_mul(gate_up), w[5], bias(3), min_rows));
  }
  return hidden;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(brigade_cpu, m) {
  m.def("decode_layers", &decode_layers);
  m.def("rms_norm", &rms_norm);
  m.def("add_rms_norm", &add_rms_norm);
  m.def("silu_mul", &silu_mul);
  m.def("rope", &rope);
}
