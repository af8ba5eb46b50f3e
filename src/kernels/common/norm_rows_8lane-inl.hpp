// Pass 1 of the QK-norm kernel (norm_rope-inl.hpp) with one row per 8-lane accumulator: the
// contract's 8 partial sums sit in the lanes as they are, so the reduction and the group's
// 1 / rms are the same 256- and 128-bit code on AVX2 and AVX-512 (its f32 rows). x86 only; each
// SIMD kernel library compiles its own copy (anonymous namespace).
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "../kernel_support.hpp"

namespace rome::kernels::norm_rope {
namespace {

struct OneRowPer8Lanes {
  using F = __m256;
  static constexpr int kRowsPerVector = 1;

  static ROME_INLINE F set1(float v) { return _mm256_set1_ps(v); }
  static ROME_INLINE F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  // ((s0+s4)+(s2+s6)) + ((s1+s5)+(s3+s7)), the contract's order.
  static ROME_INLINE void reduce_rows(F acc, float* ss) {
    const __m128 t = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    const __m128 u = _mm_add_ps(t, _mm_movehl_ps(t, t));
    *ss = _mm_cvtss_f32(_mm_add_ss(u, _mm_shuffle_ps(u, u, 1)));
  }
  // 1 / sqrt(ss / hd + eps) of the group's 4 rows, the scalar kernel's operations lane by lane.
  static ROME_INLINE void inverse_rms(const float* ss, std::int64_t hd, float eps, float* scale) {
    _mm_storeu_ps(
        scale,
        _mm_div_ps(_mm_set1_ps(1.0f),
                   _mm_sqrt_ps(_mm_add_ps(_mm_div_ps(_mm_loadu_ps(ss), _mm_set1_ps(float(hd))),
                                          _mm_set1_ps(eps)))));
  }
  static ROME_INLINE void prefetch(const char* p) { _mm_prefetch(p, _MM_HINT_T0); }
};

}  // namespace
}  // namespace rome::kernels::norm_rope
