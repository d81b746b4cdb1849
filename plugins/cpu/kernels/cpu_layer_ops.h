// A decoder layer's small operations for CPUs (cpu_layer_ops.cpp), for decode_layers
// (cpu_fused.cpp), which runs them between its GEMMs.
#pragma once

#include <ATen/core/Tensor.h>

#include <tuple>

// x [rows, features] -> its RMSNorm with weight [features].
at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps);
// (hidden + delta, its RMSNorm): the residual add and the next norm in one pass.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(at::Tensor hidden, at::Tensor delta,
                                                at::Tensor weight, double eps);
// gate_up [rows, 2 * width] (gate columns first) -> silu(gate) * up [rows, width].
at::Tensor silu_mul(at::Tensor gate_up);
// (q, k) rotated: q [tokens, heads, head_dim], k [tokens, kv_heads, head_dim]; cos, sin
// [tokens, head_dim / 2].
std::tuple<at::Tensor, at::Tensor> rope(at::Tensor q, at::Tensor k, at::Tensor cos,
                                        at::Tensor sin);
// q rotated; k rotated and v copied into rows slot_mapping[token] of the caches.
at::Tensor rope_into_cache(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const at::Tensor& cos, const at::Tensor& sin, at::Tensor& key_cache,
                           at::Tensor& value_cache, const at::Tensor& slot_mapping);
