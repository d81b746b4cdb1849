// Float vectors for Brigade's CPU attention kernels (cpu_paged.cpp, cpu_prefill.cpp): GCC vector
// extensions of 16 floats where the CPU has AVX-512, else 8 (AVX2, NEON), with bfloat16 widened
// as it is loaded.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>

namespace brigade_cpu {

#if defined(__AVX512F__)
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;
#endif
// The vector kernels take head_dim of 1-8 vectors, and 128 (16 vectors of 8 without AVX-512);
// kernels_take_head_dim in cpu_kernels.py says the same.
constexpr int kMaxChunks = 128 / kLanes;
typedef float vecf __attribute__((vector_size(4 * kLanes)));
typedef int32_t veci __attribute__((vector_size(4 * kLanes)));
typedef uint16_t vech __attribute__((vector_size(2 * kLanes)));
typedef uint32_t vecw __attribute__((vector_size(4 * kLanes)));
typedef float vec8 __attribute__((vector_size(32)));
typedef float vec4 __attribute__((vector_size(16)));

inline vecf load_vec(const float* p) {
  vecf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline vecf load_vec(const c10::BFloat16* p) {
  vech half;
  std::memcpy(&half, p, sizeof(half));
  const vecw wide = __builtin_convertvector(half, vecw) << 16;  // bfloat16 -> float32 bits
  vecf v;
  std::memcpy(&v, &wide, sizeof(v));
  return v;
}

inline void store_vec(float* p, vecf v) { std::memcpy(p, &v, sizeof(v)); }

// Rounded to nearest even (NaN kept a NaN), as cpu_scalar.h's from_float does one value.
inline vech bfloat16_bits(vecf v) {
  vecw bits;
  std::memcpy(&bits, &v, sizeof(bits));
  const vecw rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  const vecw nan = vecw{} + 0x7FC0u;
  return __builtin_convertvector(v != v ? nan : rounded, vech);
}

inline void store_vec(c10::BFloat16* p, vecf v) {
  const vech half = bfloat16_bits(v);
  std::memcpy(p, &half, sizeof(half));
}

// The value each lane takes when stored as a T (float: itself).
inline vecf round_vec(vecf v, float) { return v; }

inline vecf round_vec(vecf v, c10::BFloat16) {
  const vecw wide = __builtin_convertvector(bfloat16_bits(v), vecw) << 16;
  vecf out;
  std::memcpy(&out, &wide, sizeof(out));
  return out;
}

inline vec4 quarters(vecf v, bool maximum) {
#if defined(__AVX512F__)
  const vec8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7);
  const vec8 b = __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const vec8 half = maximum ? (a > b ? a : b) : a + b;
#else
  const vec8 half = v;
#endif
  const vec4 c = __builtin_shufflevector(half, half, 0, 1, 2, 3);
  const vec4 d = __builtin_shufflevector(half, half, 4, 5, 6, 7);
  return maximum ? (c > d ? c : d) : c + d;
}

inline float sum_lanes(vecf v) {
  const vec4 q = quarters(v, false);
  return (q[0] + q[2]) + (q[1] + q[3]);
}

inline float max_lanes(vecf v) {
  const vec4 q = quarters(v, true);
  const float a = q[0] > q[2] ? q[0] : q[2], b = q[1] > q[3] ? q[1] : q[3];
  return a > b ? a : b;
}

// exp of every lane for x in [-87, 88] after clamping (cpu_exp.h's polynomial, on vectors).
inline vecf exp_vec(vecf x) {
  const vecf lo = vecf{} - 87.0f, hi = vecf{} + 88.0f;
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  const vecf n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const vecf r = x - n * 0.693359375f + n * 2.12194440e-4f;
  vecf p = vecf{} + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const veci bits = (__builtin_convertvector(n, veci) + 127) << 23;
  vecf scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

}  // namespace brigade_cpu
