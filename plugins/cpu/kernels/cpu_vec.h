// Float vectors for Brigade's CPU attention kernels (cpu_paged.cpp, cpu_prefill.cpp): GCC vector
// extensions of 16 floats where the CPU has AVX-512, else 8 (AVX2, NEON), with bfloat16 widened
// as it is loaded.
#pragma once

#include <c10/util/BFloat16.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

namespace brigade_cpu {

#if defined(__AVX512F__)
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;
#endif
// The vector kernels take head_dim of 1-8 vectors, and 128 (16 vectors of 8 without AVX-512);
// kernels_take_head_dim in cpu_kernels.py says the same.
constexpr int kMaxChunks = 128 / kLanes;
// Vector registers of kLanes floats: 32 with AVX-512, 16 with AVX2 (and NEON, two to a vector).
constexpr int kVectorRegisters = kLanes == 16 ? 32 : 16;
typedef float vecf __attribute__((vector_size(4 * kLanes)));
typedef int32_t veci __attribute__((vector_size(4 * kLanes)));
typedef uint16_t vech __attribute__((vector_size(2 * kLanes)));
typedef uint32_t vecw __attribute__((vector_size(4 * kLanes)));

inline vecf load_vec(const float* p) {
  vecf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline vecf load_vec(const c10::BFloat16* p) {
  // bfloat16 -> float32 bits: zero-extend to 32 bits and shift up. Spelled out with AVX
  // intrinsics where there are some: from the generic form GCC (tuned for Zen) widened each
  // half of the vector apart and joined them, six instructions instead of two, which made the
  // bfloat16 panel GEMM 1.5x slower than the float32 one (docs/benchmarks.md).
#if defined(__AVX512F__)
  const __m512i wide = _mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16);
  return reinterpret_cast<vecf>(_mm512_castsi512_ps(wide));
#elif defined(__AVX2__)
  const __m256i wide = _mm256_slli_epi32(
      _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16);
  return reinterpret_cast<vecf>(_mm256_castsi256_ps(wide));
#else
  vech half;
  std::memcpy(&half, p, sizeof(half));
  const vecw wide = __builtin_convertvector(half, vecw) << 16;
  vecf v;
  std::memcpy(&v, &wide, sizeof(v));
  return v;
#endif
}

inline void store_vec(float* p, vecf v) { std::memcpy(p, &v, sizeof(v)); }

// 2 * kLanes bfloat16 at p as floats, with no lane-crossing shuffle: `even` gets elements 0, 2,
// 4, ..., `odd` elements 1, 3, 5, ... (a 32-bit lane holds a pair; little-endian). load_vec's
// widening shuffles one port that the FMAs and the kernels' sums also need: this takes a
// shift and a mask.
inline void load_pairs(const c10::BFloat16* p, vecf& even, vecf& odd) {
  static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "load_pairs reads pairs little-endian");
  vecw pairs;
  std::memcpy(&pairs, p, sizeof(pairs));
  const vecw low = pairs << 16, high = pairs & 0xFFFF0000u;
  std::memcpy(&even, &low, sizeof(even));
  std::memcpy(&odd, &high, sizeof(odd));
}

// Rounded to nearest even (NaN kept a NaN), as cpu_scalar.h's from_float does one value: one
// instruction where the CPU has AVX512-BF16 (which also flushes values below bfloat16's
// smallest normal, ~1.2e-38, to zero), else seven integer operations.
inline vech bfloat16_bits(vecf v) {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  static_assert(kLanes == 16, "AVX-512 vectors");
  return reinterpret_cast<vech>(_mm512_cvtneps_pbh(reinterpret_cast<__m512>(v)));
#else
  vecw bits;
  std::memcpy(&bits, &v, sizeof(bits));
  const vecw rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  const vecw nan = vecw{} + 0x7FC0u;
  return __builtin_convertvector(v != v ? nan : rounded, vech);
#endif
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

// Lane `lane` of one folding step of sum_each: pieces of S / 2 lanes, taken in turns from u's
// and w's segments of S lanes, their lower halves (or, `upper`, their upper halves).
constexpr int fold_index(int S, bool upper, int lane) {
  const int piece = lane / (S / 2), offset = lane % (S / 2);
  return (piece % 2 == 1 ? kLanes : 0) + piece / 2 * S + offset + (upper ? S / 2 : 0);
}

template <int S, int... I>
inline vecf fold(vecf u, vecf w, std::integer_sequence<int, I...>) {
  return __builtin_shufflevector(u, w, fold_index(S, false, I)...) +
         __builtin_shufflevector(u, w, fold_index(S, true, I)...);
}

// out[j] = the sum of v[j]'s lanes, for all kLanes vectors at once: each step adds the halves
// of every segment of two vectors into one (kLanes - 1 shuffle pairs and adds in all, instead
// of a horizontal sum per vector). v is used as scratch.
inline vecf sum_each(vecf (&v)[kLanes]) {
  constexpr auto lanes = std::make_integer_sequence<int, kLanes>{};
  int count = kLanes;
  const auto level = [&](auto segment) {
    constexpr int S = decltype(segment)::value;
    count /= 2;
    for (int i = 0; i < count; ++i) v[i] = fold<S>(v[i], v[i + count], lanes);
  };
  if constexpr (kLanes == 16) level(std::integral_constant<int, 16>{});
  level(std::integral_constant<int, 8>{});
  level(std::integral_constant<int, 4>{});
  level(std::integral_constant<int, 2>{});
  return v[0];
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

// silu(gate) = gate / (1 + exp(-gate)) in float32; below -88, where exp_vec would clamp its
// argument (and silu(-1e38) came out -2), -0 as torch's underflows to (NaN for -inf). One value
// at a time: silu_clamped (cpu_exp.h).
inline vecf silu_vec(vecf gate) {
  const vecf silu = gate / (1.0f + exp_vec(-gate));
  return gate < -88.0f ? gate * 0.0f : silu;
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
// silu_vec of every bfloat16 value, rounded to bfloat16, by the value's bits (128 KiB, built on
// first use; kLanes entries of padding, as a gather reads 32 bits at an entry). A bfloat16
// gate has 65536 values, so its rounded SiLU is a lookup: one gather instead of the ~25
// operations and a division of silu_vec, which ran as the tile GEMM's epilogue between its
// products (SmolLM2's gate_up projection at 112-4096 rows: 0.84-0.92x the time).
inline const uint16_t* silu_bfloat16_table() {
  static const uint16_t* const table = [] {
    auto* entries = new uint16_t[65536 + kLanes]();
    for (uint32_t i = 0; i < 65536; i += kLanes) {
      vecw bits;
      for (int lane = 0; lane < kLanes; ++lane) bits[lane] = (i + lane) << 16;
      vecf gate;
      std::memcpy(&gate, &bits, sizeof(gate));
      const vech silu = bfloat16_bits(silu_vec(gate));
      std::memcpy(entries + i, &silu, sizeof(silu));
    }
    return entries;
  }();
  return table;
}

// The rounded SiLU of the bfloat16 values whose bits are `gate`, from silu_bfloat16_table.
inline vecf silu_lookup(vech gate) {
  const __m512i index = _mm512_cvtepu16_epi32(reinterpret_cast<__m256i>(gate));
  const __m512i silu =
      _mm512_slli_epi32(_mm512_i32gather_epi32(index, silu_bfloat16_table(), 2), 16);
  return reinterpret_cast<vecf>(silu);
}
#endif

// silu(gate) * up as torch computes it in T: silu = gate / (1 + exp(-gate)) rounded to T, times
// up (gate and up already T's values); the caller's store rounds the product. silu_mul
// (cpu_layer_ops.cpp) and the GEMMs that store it from their sums (cpu_gemm.cpp, cpu_tiles.cpp)
// all take it from here, so that their results agree bit for bit. bfloat16 with AVX512-BF16
// looks the rounded SiLU up (silu_bfloat16_table: the same values, computed once).
template <typename T>
inline vecf silu_times(vecf gate, vecf up) {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) return silu_lookup(bfloat16_bits(gate)) * up;
#endif
  return round_vec(silu_vec(gate), T{}) * up;
}

// silu_times<T> of gate and up rounded to T first (a GEMM epilogue's float32 sums): the same
// values; with the table, the gate's rounded bits index it as they are, not widened to be
// rounded again.
template <typename T>
inline vecf silu_times_rounding(vecf gate, vecf up) {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    return silu_lookup(bfloat16_bits(gate)) * round_vec(up, T{});
  }
#endif
  return silu_times<T>(round_vec(gate, T{}), round_vec(up, T{}));
}

// Lines of memory a loop asks the L2 cache to fetch while it works, spread over its steps:
// fetch(step, per_step) prefetches lines [step * per_step, (step + 1) * per_step) of the
// `lines` lines at `at` (the panel GEMM's next panels, the tile GEMM's next block).
struct Ahead {
  const char* at = nullptr;
  int64_t lines = 0;

  void fetch(int64_t step, int64_t per_step) const {
    for (int64_t line = step * per_step; line < std::min(lines, (step + 1) * per_step); ++line) {
      __builtin_prefetch(at + line * 64, 0, 2);
    }
  }
  int64_t per_step(int64_t steps) const { return (lines + steps - 1) / steps; }
};

}  // namespace brigade_cpu
