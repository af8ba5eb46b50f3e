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
  static constexpr int kAccumulators = 8;

  static ROME_INLINE F set1(float v) { return _mm256_set1_ps(v); }
  static ROME_INLINE F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  // Each row's ((s0+s4)+(s2+s6)) + ((s1+s5)+(s3+s7)), the contract's order. A whole group of 8
  // is reduced as a transpose, rows r and r + 4 side by side in the two 128-bit halves: 21
  // instructions for 8 rows instead of 6 a row, and the sums land as one vector.
  template <int A>
  static ROME_INLINE void reduce_rows(const F* acc, float* ss) {
    if constexpr (A == 8) {
      F v[4];  // lanes: rows r and r + 4, each (s0+s4, s1+s5, s2+s6, s3+s7)
#pragma GCC unroll 4
      for (int r = 0; r < 4; ++r)
        v[r] = _mm256_add_ps(_mm256_permute2f128_ps(acc[r], acc[r + 4], 0x20),
                             _mm256_permute2f128_ps(acc[r], acc[r + 4], 0x31));
      // Rows (r, r + 1): (s0+s4)+(s2+s6) in lanes 0 and 2, (s1+s5)+(s3+s7) in 1 and 3.
      const F z01 = _mm256_add_ps(_mm256_shuffle_ps(v[0], v[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm256_shuffle_ps(v[0], v[1], _MM_SHUFFLE(3, 2, 3, 2)));
      const F z23 = _mm256_add_ps(_mm256_shuffle_ps(v[2], v[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm256_shuffle_ps(v[2], v[3], _MM_SHUFFLE(3, 2, 3, 2)));
      _mm256_storeu_ps(ss, _mm256_add_ps(_mm256_shuffle_ps(z01, z23, _MM_SHUFFLE(2, 0, 2, 0)),
                                         _mm256_shuffle_ps(z01, z23, _MM_SHUFFLE(3, 1, 3, 1))));
    } else {
#pragma GCC unroll 8
      for (int a = 0; a < A; ++a) {
        const __m128 t =
            _mm_add_ps(_mm256_castps256_ps128(acc[a]), _mm256_extractf128_ps(acc[a], 1));
        const __m128 u = _mm_add_ps(t, _mm_movehl_ps(t, t));
        ss[a] = _mm_cvtss_f32(_mm_add_ss(u, _mm_shuffle_ps(u, u, 1)));
      }
    }
  }
  // 1 / sqrt(ss / hd + eps) of the group's first `rows` rows (up to 8), the scalar kernel's
  // operations lane by lane. A group of 4 or fewer takes the 128-bit forms: the 256-bit divide and
  // root cost 4-head tiles 4% more time on a Zen 3.
  static ROME_INLINE void inverse_rms(const float* ss, int rows, std::int64_t hd, float eps,
                                      float* scale) {
    if (rows <= 4) {
      _mm_storeu_ps(
          scale,
          _mm_div_ps(_mm_set1_ps(1.0f),
                     _mm_sqrt_ps(_mm_add_ps(_mm_div_ps(_mm_loadu_ps(ss), _mm_set1_ps(float(hd))),
                                            _mm_set1_ps(eps)))));
      return;
    }
    _mm256_storeu_ps(
        scale, _mm256_div_ps(_mm256_set1_ps(1.0f),
                             _mm256_sqrt_ps(_mm256_add_ps(
                                 _mm256_div_ps(_mm256_loadu_ps(ss), _mm256_set1_ps(float(hd))),
                                 _mm256_set1_ps(eps)))));
  }
  static ROME_INLINE void prefetch(const char* p) {
    _mm_prefetch(p, _MM_HINT_T0);
  }
  static ROME_INLINE void prefetch_to_l2(const char* p) {
    _mm_prefetch(p, _MM_HINT_T1);
  }
};

}  // namespace
}  // namespace rome::kernels::norm_rope
