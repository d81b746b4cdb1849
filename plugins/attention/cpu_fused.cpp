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
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "cpu_exp.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>

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

}  // namespace

TORCH_LIBRARY_FRAGMENT(brigade_cpu, m) {
  m.def("rms_norm", &rms_norm);
  m.def("add_rms_norm", &add_rms_norm);
  m.def("silu_mul", &silu_mul);
  m.def("rope", &rope);
}
