// AVX2 building blocks shared by this ISA's kernels: fp32 vectors of 8 lanes from and to each
// storage type (bit exact with src/core/convert.hpp), the compensated epilogue (guarded, and
// unguarded with a NaN check), bf16 even/odd splitting and rounding, byte copies.
// Included only by translation units compiled with the AVX2 flags.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "../kernel_support.hpp"
#include "rome/tensor.hpp"

namespace rome::kernels::avx2 {

constexpr int kW = 8;  // fp32 lanes per vector

// Storage types <-> fp32 vectors of 8 lanes. The `n`-lane forms (0 < n <= 8) touch only the
// first n elements.

ROME_INLINE __m256i lane_mask(int n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

template <DType D>
struct Lanes;

template <>
struct Lanes<DType::f32> {
  using T = float;
  static ROME_INLINE __m256 load(const T* p) { return _mm256_loadu_ps(p); }
  static ROME_INLINE __m256 load(const T* p, int n) {
    return n == kW ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, lane_mask(n));
  }
  static ROME_INLINE void store(T* p, __m256 v) { _mm256_storeu_ps(p, v); }
  static ROME_INLINE void store(T* p, __m256 v, int n) {
    if (n == kW)
      _mm256_storeu_ps(p, v);
    else
      _mm256_maskstore_ps(p, lane_mask(n), v);
  }
  static ROME_INLINE void stream(T* p, __m256 v) { _mm256_stream_ps(p, v); }  // 32-byte aligned
};

// 16-bit storage: 8 elements in an __m128i; partial vectors are staged through a buffer.
template <typename Convert>
struct Lanes16 {
  using T = std::uint16_t;
  static ROME_INLINE __m256 load(const T* p) {
    return Convert::widen(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static ROME_INLINE __m256 load(const T* p, int n) {
    if (n == kW) return load(p);
    alignas(16) T buf[kW] = {};
    std::memcpy(buf, p, std::size_t(n) * sizeof(T));
    return Convert::widen(_mm_load_si128(reinterpret_cast<const __m128i*>(buf)));
  }
  static ROME_INLINE void store(T* p, __m256 v) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), Convert::narrow(v));
  }
  static ROME_INLINE void store(T* p, __m256 v, int n) {
    if (n == kW) return store(p, v);
    alignas(16) T buf[kW];
    _mm_store_si128(reinterpret_cast<__m128i*>(buf), Convert::narrow(v));
    std::memcpy(p, buf, std::size_t(n) * sizeof(T));
  }
  static ROME_INLINE void stream(T* p, __m256 v) {  // 16-byte aligned
    _mm_stream_si128(reinterpret_cast<__m128i*>(p), Convert::narrow(v));
  }
};

// Round-to-nearest-even of fp32 lanes that are not NaN, to bf16 in their upper 16 bits.
ROME_INLINE __m256i round_bf16_high_not_nan(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  return _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb);
}

// The same for any lane: a NaN is quietened as u | 0x00400000 (its upper half then is
// (u >> 16) | 0x40).
ROME_INLINE __m256i round_bf16_high(__m256 v) {
  const __m256i q = _mm256_or_si256(_mm256_castps_si256(v), _mm256_set1_epi32(0x00400000));
  return _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(round_bf16_high_not_nan(v)),
                                              _mm256_castsi256_ps(q),
                                              _mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
}

// 16 bf16 values in lane order from the rounded even and odd lanes (round_bf16_high*): the even
// lanes' upper halves shifted down, the odd lanes' kept in place (one shift and one word blend).
ROME_INLINE __m256i merge_bf16_even_odd(__m256i even, __m256i odd) {
  return _mm256_blend_epi16(_mm256_srli_epi32(even, 16), odd, 0xaa);
}

// The upper halves of 8 lanes as 8 packed 16-bit values.
ROME_INLINE __m128i pack_high_halves(__m256i rounded) {
  const __m256i h = _mm256_srli_epi32(rounded, 16);
  return _mm_packus_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

// Two vectors with no NaN lane narrowed to bf16 and packed into 16 consecutive values (one
// 32-byte store instead of two 16-byte ones).
ROME_INLINE __m256i narrow_bf16_pair_not_nan(__m256 a, __m256 b) {
  const __m256i packed = _mm256_packus_epi32(_mm256_srli_epi32(round_bf16_high_not_nan(a), 16),
                                             _mm256_srli_epi32(round_bf16_high_not_nan(b), 16));
  return _mm256_permute4x64_epi64(packed, _MM_SHUFFLE(3, 1, 2, 0));  // a0-3 a4-7 b0-3 b4-7
}

// bf16: widening is a shift; narrowing is round to nearest even in integer arithmetic, NaN
// quietened as (u >> 16) | 0x40, subnormals kept.
struct Bf16 {
  static ROME_INLINE __m256 widen(__m128i h) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static ROME_INLINE __m128i narrow(__m256 v) { return pack_high_halves(round_bf16_high(v)); }
};

// fp16: F16C conversions are exact both ways (round to nearest even, subnormals, overflow to
// inf, NaN payloads as the scalar conversion).
struct Fp16 {
  static ROME_INLINE __m256 widen(__m128i h) { return _mm256_cvtph_ps(h); }
  static ROME_INLINE __m128i narrow(__m256 v) {
    return _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
};

// bf16 narrowing of values whose NaNs (if any) have 16 zero low bits (kernel_api.hpp's
// nan_results_low_bits_zero): round to nearest even leaves such a NaN's high half unchanged, so
// the NaN case of Bf16::narrow is not needed.
struct Bf16NanLowBitsZero {
  static ROME_INLINE __m256 widen(__m128i h) { return Bf16::widen(h); }
  static ROME_INLINE __m128i narrow(__m256 v) {
    return pack_high_halves(round_bf16_high_not_nan(v));
  }
};

template <>
struct Lanes<DType::bf16> : Lanes16<Bf16> {
  // 16 consecutive values from two vectors with no NaN lane: one narrowing, one 32-byte store.
  static ROME_INLINE void store_pair_not_nan(T* p, __m256 a, __m256 b) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), narrow_bf16_pair_not_nan(a, b));
  }
};
template <>
struct Lanes<DType::f16> : Lanes16<Fp16> {};

// Copies `bytes` bytes (the pass-through lanes of a partial rotation); non-temporal when asked
// and the destination is 32-byte aligned.
ROME_INLINE void copy_bytes(void* dst, const void* src, std::int64_t bytes, bool stream) {
  auto* d = static_cast<char*>(dst);
  const auto* s = static_cast<const char*>(src);
  if (stream && (reinterpret_cast<std::uintptr_t>(d) & 31) == 0) {
    for (; bytes >= 32; bytes -= 32, d += 32, s += 32)
      _mm256_stream_si256(reinterpret_cast<__m256i*>(d),
                          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s)));
  } else {
    for (; bytes >= 32; bytes -= 32, d += 32, s += 32)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(d),
                          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s)));
  }
  if (bytes > 0) std::memcpy(d, s, std::size_t(bytes));
}

// xa·c + xb·s with the bits of combine_lane (common/combine-inl.hpp): p = xa·c, e = fma(xa, c,
// -p) where p is finite (else 0), y = fma(xb, s, p) + e. Instead of combine_lane's test of p, e is
// clamped to ±FLT_MAX (one operation fewer; fp32 interleave rows in L2: 5.5% fewer instructions):
// e is only infinite or NaN where p is not finite (max takes its second operand for a NaN
// first), and then fma(xb, s, p) is ±inf or NaN, which adding ±FLT_MAX leaves as adding 0 does.
ROME_INLINE __m256 combine(__m256 xa, __m256 c, __m256 xb, __m256 s) {
  const __m256 p = _mm256_mul_ps(xa, c);
  const __m256 largest = _mm256_set1_ps(3.40282347e+38f);
  const __m256 e = _mm256_min_ps(
      _mm256_max_ps(_mm256_fmsub_ps(xa, c, p), _mm256_set1_ps(-3.40282347e+38f)), largest);
  return _mm256_add_ps(_mm256_fmadd_ps(xb, s, p), e);
}

// xa·c + xb·s in one fma (kernel_api.hpp: single_fma_epilogue), operation for operation as
// combine_lane_one_fma.
ROME_INLINE __m256 combine_one_fma(__m256 xa, __m256 c, __m256 xb, __m256 s) {
  return _mm256_fmadd_ps(xb, s, _mm256_mul_ps(xa, c));
}

// avx2::combine without its guard for a non-finite xa·c. Where the guard matters (xa·c is inf
// or NaN) this returns NaN, and where it returns no NaN it equals avx2::combine bit for bit:
// then p = xa·c is finite, so e = fma(xa, c, -p) is too and nothing was guarded.
ROME_INLINE __m256 combine_unguarded(__m256 xa, __m256 c, __m256 xb, __m256 s) {
  const __m256 p = _mm256_mul_ps(xa, c);
  return _mm256_add_ps(_mm256_fmadd_ps(xb, s, p), _mm256_fmsub_ps(xa, c, p));
}

// Whether a or b has a NaN lane: one compare (unordered: lane i of a or of b is NaN) and a test.
ROME_INLINE bool any_nan(__m256 a, __m256 b) {
  const __m256 nan = _mm256_cmp_ps(a, b, _CMP_UNORD_Q);
  return !_mm256_testz_ps(nan, nan);
}

// bf16, 16 lanes at a time: one 32-byte load split into its even lanes (shifted up) and its odd
// lanes (masked) as two fp32 vectors; results go back through round_bf16_high(_not_nan) and
// merge_bf16_even_odd: no vpmovzx, pack or lane-crossing shuffle.
struct EvenOdd {
  __m256 even, odd;
};

// The even and the odd lanes of the 16 fp32 values a, b, each in lane order (two shuffles, two
// lane permutes): interleave_half's deinterleave, and tables put in even/odd order.
ROME_INLINE EvenOdd split_even_odd(__m256 a, __m256 b) {
  const __m256 even = _mm256_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0));  // a0 a2 b0 b2 a4 a6 b4 b6
  const __m256 odd = _mm256_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1));
  constexpr int kOrder = _MM_SHUFFLE(3, 1, 2, 0);
  return {_mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(even), kOrder)),
          _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(odd), kOrder))};
}

ROME_INLINE EvenOdd split_bf16(__m256i w) {
  return {_mm256_castsi256_ps(_mm256_slli_epi32(w, 16)),
          _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32(int(0xffff0000u))))};
}

ROME_INLINE EvenOdd split_bf16(const std::uint16_t* p) {
  return split_bf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

}  // namespace rome::kernels::avx2
