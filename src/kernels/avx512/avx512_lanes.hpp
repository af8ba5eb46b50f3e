// AVX-512 building blocks shared by this ISA's kernels: fp32 vectors of 16 lanes from and to
// each storage type (bit exact with src/core/convert.hpp), the compensated epilogue, byte copies.
// Included only by translation units compiled with the AVX-512 flags.
#pragma once

// GCC 12 warns about the _mm512_undefined_* placeholders inside its own intrinsic headers. The
// warnings are reported where the intrinsics are inlined, so a push/pop around the include does
// not silence them: they stay off for the translation units that include this header.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "../kernel_support.hpp"
#include "rome/tensor.hpp"

namespace rome::kernels::avx512 {

constexpr int kW = 16;  // fp32 lanes per vector

// The first n lanes of a vector (none for n <= 0, all for n >= 16): a row's last, partial vector.
ROME_INLINE __mmask16 first_lanes(std::int64_t n) {
  return n >= kW ? __mmask16(0xffff) : n <= 0 ? __mmask16(0) : __mmask16((1u << n) - 1);
}

// Storage types <-> fp32 vectors of 16 lanes. `N` narrows fp32 to bf16.

// Round to nearest even in integer arithmetic, NaN quietened as (u >> 16) | 0x40, subnormals
// kept: float_to_bf16 of the scalar kernel, lane by lane.
ROME_INLINE __m256i bf16_narrow_exact(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  r = _mm512_mask_or_epi32(r, nan, u, _mm512_set1_epi32(0x00400000));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}

struct NarrowExact {
  static constexpr bool kPairs = false;
  static ROME_INLINE __m256i narrow(__m512 v) { return bf16_narrow_exact(v); }
};

// vcvtneps2bf16 rounds to nearest even and quietens NaN exactly like float_to_bf16 (checked
// over every fp32 input) but flushes subnormal inputs to zero; those vectors go the exact way.
// Emitted as inline assembly: the object library is not built with -mavx512bf16, and this path
// is only in the table the core picks for a CPU with AVX512-BF16 (avx512_kernels(true)).
struct NarrowBf16Insn {
  static constexpr bool kPairs = true;
  static ROME_INLINE __m256i narrow(__m512 v) {
    if (__builtin_expect(_mm512_fpclass_ps_mask(v, 0x20) != 0, 0)) return bf16_narrow_exact(v);
    __m256i h;
    __asm__("vcvtneps2bf16 %1, %0" : "=v"(h) : "v"(v));
    return h;
  }
  // lo in the low 16 lanes, hi in the high ones; the caller has checked for subnormals.
  static ROME_INLINE __m512i narrow_pair(__m512 lo, __m512 hi) {
    __m512i h;
    __asm__("vcvtne2ps2bf16 %2, %1, %0" : "=v"(h) : "v"(hi), "v"(lo));
    return h;
  }
};

template <DType D, typename N>
struct Lanes;

template <typename N>
struct Lanes<DType::f32, N> {
  using T = float;
  static constexpr bool kPairs = false;
  static ROME_INLINE __m512 load(const T* p) { return _mm512_loadu_ps(p); }
  static ROME_INLINE __m512 load(const T* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
  static ROME_INLINE void store(T* p, __m512 v) { _mm512_storeu_ps(p, v); }
  static ROME_INLINE void store(T* p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }
  static ROME_INLINE void stream(T* p, __m512 v) { _mm512_stream_ps(p, v); }  // 64-byte aligned
};

template <typename N>
struct Lanes<DType::bf16, N> {
  using T = std::uint16_t;
  static constexpr bool kPairs = N::kPairs;  // narrow_pair: two vectors to one 64-byte store
  static ROME_INLINE __m512i narrow_pair(__m512 lo, __m512 hi) { return N::narrow_pair(lo, hi); }
  static ROME_INLINE __m512 widen(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  static ROME_INLINE __m512 load(const T* p) {
    return widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static ROME_INLINE __m512 load(const T* p, __mmask16 m) {
    return widen(_mm256_maskz_loadu_epi16(m, p));
  }
  static ROME_INLINE void store(T* p, __m512 v) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), N::narrow(v));
  }
  static ROME_INLINE void store(T* p, __m512 v, __mmask16 m) {
    _mm256_mask_storeu_epi16(p, m, N::narrow(v));
  }
  static ROME_INLINE void stream(T* p, __m512 v) {  // 32-byte aligned
    _mm256_stream_si256(reinterpret_cast<__m256i*>(p), N::narrow(v));
  }
  // Two places of two vectors each (lanes p0[0, 32) and p1[0, 32)), every lane finite: one
  // subnormal test and one vcvtne2ps2bf16 per place, the bits of store (which narrows each
  // vector alone, testing each).
  static ROME_INLINE void store_finite_pairs(T* p0, __m512 lo0, __m512 hi0, T* p1, __m512 lo1,
                                             __m512 hi1) requires N::kPairs {
    const __mmask16 subnormal = _kor_mask16(
        _kor_mask16(_mm512_fpclass_ps_mask(lo0, 0x20), _mm512_fpclass_ps_mask(hi0, 0x20)),
        _kor_mask16(_mm512_fpclass_ps_mask(lo1, 0x20), _mm512_fpclass_ps_mask(hi1, 0x20)));
    if (__builtin_expect(_kortestz_mask16_u8(subnormal, subnormal), 1)) {
      _mm512_storeu_si512(p0, N::narrow_pair(lo0, hi0));
      _mm512_storeu_si512(p1, N::narrow_pair(lo1, hi1));
      return;
    }
    store(p0, lo0), store(p0 + kW, hi0), store(p1, lo1), store(p1 + kW, hi1);
  }
};

constexpr int kToHalf = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;

template <typename N>
struct Lanes<DType::f16, N> {
  using T = std::uint16_t;
  static constexpr bool kPairs = false;
  static ROME_INLINE __m512 load(const T* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static ROME_INLINE __m512 load(const T* p, __mmask16 m) {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p));
  }
  static ROME_INLINE void store(T* p, __m512 v) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v, kToHalf));
  }
  static ROME_INLINE void store(T* p, __m512 v, __mmask16 m) {
    _mm256_mask_storeu_epi16(p, m, _mm512_cvtps_ph(v, kToHalf));
  }
  static ROME_INLINE void stream(T* p, __m512 v) {  // 32-byte aligned
    _mm256_stream_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v, kToHalf));
  }
};

// Copies `bytes` bytes (the pass-through lanes of a partial rotation); non-temporal when asked
// and the destination is 64-byte aligned.
ROME_INLINE void copy_bytes(void* dst, const void* src, std::int64_t bytes, bool stream) {
  auto* d = static_cast<char*>(dst);
  const auto* s = static_cast<const char*>(src);
  if (stream && (reinterpret_cast<std::uintptr_t>(d) & 63) == 0) {
    for (; bytes >= 64; bytes -= 64, d += 64, s += 64)
      _mm512_stream_si512(reinterpret_cast<__m512i*>(d), _mm512_loadu_si512(s));
  } else {
    for (; bytes >= 64; bytes -= 64, d += 64, s += 64)
      _mm512_storeu_si512(d, _mm512_loadu_si512(s));
  }
  if (bytes > 0) {
    const __mmask64 m = _bzhi_u64(~std::uint64_t(0), unsigned(bytes));
    _mm512_mask_storeu_epi8(d, m, _mm512_maskz_loadu_epi8(m, s));
  }
}

// xa·c + xb·s, operation for operation as combine_lane (common/combine-inl.hpp): p = xa·c,
// e = fma(xa, c, -p) where p is finite (else 0), y = fma(xb, s, p) + e.
ROME_INLINE __m512 combine(__m512 xa, __m512 c, __m512 xb, __m512 s) {
  const __m512 p = _mm512_mul_ps(xa, c);
  const __mmask16 finite = _mm512_fpclass_ps_mask(p, 0x99) ^ __mmask16(0xffff);  // not inf/NaN
  const __m512 e = _mm512_maskz_fmsub_ps(finite, xa, c, p);
  return _mm512_add_ps(_mm512_fmadd_ps(xb, s, p), e);
}

// combine without the guard: the same operations, so the same bits wherever xa·c is finite; where
// it is not, the result is NaN (fma(xa, c, -p) is inf - inf, or NaN, and so is the sum). A caller
// that finds no NaN among the results has combine's bits; one that does redoes them with combine.
ROME_INLINE __m512 combine_unguarded(__m512 xa, __m512 c, __m512 xb, __m512 s) {
  const __m512 p = _mm512_mul_ps(xa, c);
  return _mm512_add_ps(_mm512_fmadd_ps(xb, s, p), _mm512_fmsub_ps(xa, c, p));
}

// xa·c + xb·s in one fma (kernel_api.hpp: single_fma_epilogue), operation for operation as
// combine_lane_one_fma.
ROME_INLINE __m512 combine_one_fma(__m512 xa, __m512 c, __m512 xb, __m512 s) {
  return _mm512_fmadd_ps(xb, s, _mm512_mul_ps(xa, c));
}

}  // namespace rome::kernels::avx512
