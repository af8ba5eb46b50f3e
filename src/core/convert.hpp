// Scalar conversions between fp32 and the 16-bit float formats, bit exact with the SIMD kernels:
// round to nearest even, NaN kept (quietened), fp16 subnormals and overflow to ±inf exact.
#pragma once

#include <cstdint>
#include <cstring>

#include "rome/tensor.hpp"

namespace rome::detail {

inline std::uint32_t float_bits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float bits_float(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float bf16_to_float(std::uint16_t h) {
  return bits_float(std::uint32_t(h) << 16);
}

// Both results formed and one selected, so loops over rows vectorise (a branch per element made
// the bf16 tables of rome.tables.cos_sin cost 4x the fp32 ones).
inline std::uint16_t float_to_bf16(float f) {
  const std::uint32_t u = float_bits(f);
  const std::uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const std::uint32_t quiet_nan = (u >> 16) | 0x0040u;
  return std::uint16_t((u & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
}

inline float fp16_to_float(std::uint16_t h) {
  const std::uint32_t sign = std::uint32_t(h & 0x8000u) << 16;
  const std::uint32_t exp = (h >> 10) & 0x1fu;
  const std::uint32_t man = h & 0x3ffu;
  if (exp == 0x1f) return bits_float(sign | 0x7f800000u | (man << 13));
  if (exp == 0) {
    // Subnormal: value = man · 2^-24, exact in fp32.
    float v = float(man) * 5.9604644775390625e-8f;
    return sign ? -v : v;
  }
  return bits_float(sign | ((exp + 112) << 23) | (man << 13));
}

inline std::uint16_t float_to_fp16(float f) {
  const std::uint32_t u = float_bits(f);
  const std::uint16_t sign = std::uint16_t((u >> 16) & 0x8000u);
  const std::uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return std::uint16_t(sign | 0x7e00u | ((abs >> 13) & 0x3ffu));  // NaN
  if (abs >= 0x477ff000u) return std::uint16_t(sign | 0x7c00u);  // rounds to ±inf
  if (abs < 0x38800000u) {
    // Result is subnormal or zero: add 0.5 (as 2^-1 in fp32) so the fp32 adder rounds to
    // nearest even at the fp16 subnormal quantum, then read the mantissa bits.
    const float r = bits_float(abs) + 0.5f;
    return std::uint16_t(sign | (float_bits(r) - 0x3f000000u));
  }
  std::uint32_t rounded = abs + 0xfffu + ((abs >> 13) & 1u);
  return std::uint16_t(sign | ((rounded - 0x38000000u) >> 13));
}

template <DType D>
struct Storage;
template <>
struct Storage<DType::f32> {
  using type = float;
};
template <>
struct Storage<DType::f16> {
  using type = std::uint16_t;
};
template <>
struct Storage<DType::bf16> {
  using type = std::uint16_t;
};

template <DType D>
inline float load_float(const typename Storage<D>::type* p) {
  if constexpr (D == DType::f32) return *p;
  if constexpr (D == DType::bf16) return bf16_to_float(*p);
  if constexpr (D == DType::f16) return fp16_to_float(*p);
}
template <DType D>
inline void store_float(typename Storage<D>::type* p, float v) {
  if constexpr (D == DType::f32) *p = v;
  if constexpr (D == DType::bf16) *p = float_to_bf16(v);
  if constexpr (D == DType::f16) *p = float_to_fp16(v);
}

// Reads element i of a floating view row of any dtype as fp32.
inline float load_any(const void* base, DType dtype, std::int64_t i) {
  switch (dtype) {
    case DType::f32: return static_cast<const float*>(base)[i];
    case DType::bf16: return bf16_to_float(static_cast<const std::uint16_t*>(base)[i]);
    case DType::f16: return fp16_to_float(static_cast<const std::uint16_t*>(base)[i]);
    default: return 0.0f;
  }
}
inline void store_any(void* base, DType dtype, std::int64_t i, float v) {
  switch (dtype) {
    case DType::f32: static_cast<float*>(base)[i] = v; break;
    case DType::bf16: static_cast<std::uint16_t*>(base)[i] = float_to_bf16(v); break;
    case DType::f16: static_cast<std::uint16_t*>(base)[i] = float_to_fp16(v); break;
    default: break;
  }
}

// Whole rows, with the dtype switch outside the loop so the compiler can vectorise each loop.
inline void load_row_any(const void* base, DType dtype, std::int64_t n, float* out) {
  switch (dtype) {
    case DType::f32: std::memcpy(out, base, std::size_t(n) * sizeof(float)); break;
    case DType::bf16: {
      const auto* p = static_cast<const std::uint16_t*>(base);
      for (std::int64_t i = 0; i < n; ++i) out[i] = bf16_to_float(p[i]);
      break;
    }
    case DType::f16: {
      const auto* p = static_cast<const std::uint16_t*>(base);
      for (std::int64_t i = 0; i < n; ++i) out[i] = fp16_to_float(p[i]);
      break;
    }
    default: std::memset(out, 0, std::size_t(n) * sizeof(float)); break;  // as load_any
  }
}
inline void store_row_any(void* base, DType dtype, std::int64_t n, const float* in) {
  switch (dtype) {
    case DType::f32: std::memcpy(base, in, std::size_t(n) * sizeof(float)); break;
    case DType::bf16: {
      auto* p = static_cast<std::uint16_t*>(base);
      for (std::int64_t i = 0; i < n; ++i) p[i] = float_to_bf16(in[i]);
      break;
    }
    case DType::f16: {
      auto* p = static_cast<std::uint16_t*>(base);
      for (std::int64_t i = 0; i < n; ++i) p[i] = float_to_fp16(in[i]);
      break;
    }
    default: break;
  }
}

}  // namespace rome::detail
