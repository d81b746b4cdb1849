// A decoder layer's small operations for CPUs, each one pass over its rows: RMSNorm
// (optionally after the residual add), SiLU(gate) * up, RoPE on q and k, and RoPE with the KV
// write (rope_into_cache). decode_layers (cpu_fused.cpp) runs them between its GEMMs.
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

#include "cpu_layer_ops.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "cpu_exp.h"
#include "cpu_scalar.h"
#include "cpu_vec.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>

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

// RoPE's inputs: q [tokens, heads, head_dim], k [tokens, kv_heads, head_dim]; cos, sin
// [tokens, head_dim / 2] contiguous; all of one dtype.
void check_rope_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                       const at::Tensor& sin) {
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
}

}  // namespace

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
          const float silu = round_as<T>(brigade_cpu::silu_clamped(g));
          o[e] = from_float<T>(silu * to_float(up[e]));
        }
      }
    });
  });
  return out;
}

// q [tokens, heads, head_dim], k [tokens, kv_heads, head_dim]; cos, sin [tokens, head_dim / 2],
// all of one dtype.
std::tuple<at::Tensor, at::Tensor> rope(at::Tensor q, at::Tensor k, at::Tensor cos,
                                        at::Tensor sin) {
  check_rope_inputs(q, k, cos, sin);
  const int64_t half = cos.size(1);
  std::tuple<at::Tensor, at::Tensor> out;
  with_scalar(q.scalar_type(), "q", [&](auto type) {
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
  check_rope_inputs(q, k, cos, sin);
  TORCH_CHECK(v.scalar_type() == q.scalar_type() && key_cache.scalar_type() == q.scalar_type() &&
                  value_cache.scalar_type() == q.scalar_type(),
              "v and the caches must have q's dtype");
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
  check_heads(q, half);
  const int64_t q_size = q.size(1) * q.size(2);
  auto q_rot = at::empty(q.sizes(), q.options());
  with_scalar(q.scalar_type(), "q", [&](auto type) {
    using T = decltype(type);
    const T* c = cos.data_ptr<T>();
    const T* s = sin.data_ptr<T>();
    T* keys = key_cache.data_ptr<T>();
    T* values = value_cache.data_ptr<T>();
    // Each token's q, k and v in one pass (one fork/join of the thread pool a layer).
    at::parallel_for(0, tokens, grain(q_size + 2 * kv_size), [&](int64_t begin, int64_t end) {
      for (int64_t token = begin; token < end; ++token) {
        const T* ct = c + token * half;
        const T* st = s + token * half;
        rotate_token(q.data_ptr<T>() + token * q.stride(0), ct, st, q.size(1), half,
                     q_rot.data_ptr<T>() + token * q_size);
        rotate_token(k.data_ptr<T>() + token * k.stride(0), ct, st, k.size(1), half,
                     keys + slot[token] * kv_size);
        std::memcpy(values + slot[token] * kv_size, v.data_ptr<T>() + token * v.stride(0),
                    kv_size * sizeof(T));
      }
    });
  });
  return q_rot;
}

TORCH_LIBRARY_FRAGMENT(brigade_cpu, m) {
  m.def("rms_norm", &rms_norm);
  m.def("add_rms_norm", &add_rms_norm);
  m.def("silu_mul", &silu_mul);
  m.def("rope", &rope);
}
