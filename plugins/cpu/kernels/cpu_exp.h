// exp for Brigade's CPU kernels (cpu_paged.cpp's softmax, cpu_layer_ops.cpp's SiLU),
// vectorizable.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace brigade_cpu {

// exp(x) for x clamped to [-87, 88] (no inf, no denormals): 2^n * p(r) with r = x - n ln2 in
// [-ln2/2, ln2/2] and a degree-6 polynomial (relative error < 2e-7). GCC vectorizes the
// clamps only with -fno-trapping-math (the kernels' build flags).
inline float exp_clamped(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  // Round to nearest by adding and subtracting 1.5 * 2^23 (std::nearbyint honours the
  // rounding mode and is not vectorized: a library call per element).
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// silu(x) = x / (1 + exp(-x)) of one value, as cpu_vec.h's silu_vec computes it (-0 below -88,
// where exp_clamped would clamp).
inline float silu_clamped(float x) {
  return x < -88.0f ? x * 0.0f : x / (1.0f + exp_clamped(-x));
}

}  // namespace brigade_cpu
