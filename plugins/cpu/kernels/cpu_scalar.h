// Element types of Brigade's CPU kernels: float32, or bfloat16 stored and float32 computed.
//
// from_float rounds to nearest even (as torch does) with plain integer arithmetic, so loops
// over bfloat16 vectorize; round_as<T> is the value a float takes when stored as a T, which
// lets a kernel round where a chain of torch operations in T would round after each one.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>

namespace brigade_cpu {

inline float to_float(float value) { return value; }

inline float to_float(c10::BFloat16 value) {
  const uint32_t bits = static_cast<uint32_t>(value.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

template <typename T>
inline T from_float(float value);

template <>
inline float from_float<float>(float value) {
  return value;
}

template <>
inline c10::BFloat16 from_float<c10::BFloat16>(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  const uint16_t half = value != value ? uint16_t{0x7FC0} : static_cast<uint16_t>(rounded);
  return c10::BFloat16(half, c10::BFloat16::from_bits());
}

template <typename T>
inline float round_as(float value) {
  return to_float(from_float<T>(value));
}

}  // namespace brigade_cpu
