// cos/sin of position × frequency, 16 at a time (two vectors of 8 doubles reduced, one of 16
// floats evaluated; cos_sin-inl.hpp over AVX-512 traits).
// GCC 12 warns about the _mm512_undefined_* placeholders inside its own intrinsic headers.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include <cstdint>

#include "../common/cos_sin-inl.hpp"
#include "../kernel_api.hpp"

namespace rome::kernels {
namespace {

struct Avx512Traits {
  static constexpr int kLanes = 8;
  using D = __m512d;
  using F = __m512;
  static D load(const double* p) { return _mm512_loadu_pd(p); }
  static D set(double v) { return _mm512_set1_pd(v); }
  static D add(D a, D b) { return _mm512_add_pd(a, b); }
  static D sub(D a, D b) { return _mm512_sub_pd(a, b); }
  static D mul(D a, D b) { return _mm512_mul_pd(a, b); }
  static D fma(D a, D b, D c) { return _mm512_fmadd_pd(a, b, c); }
  static D fms(D a, D b, D c) { return _mm512_fmsub_pd(a, b, c); }
  static D fnma(D a, D b, D c) { return _mm512_fnmadd_pd(a, b, c); }
  static F to_float(D a, D b) {
    return _mm512_insertf32x8(_mm512_castps256_ps512(_mm512_cvtpd_ps(a)), _mm512_cvtpd_ps(b), 1);
  }
  static F low_words(D a, D b) {  // the even 32-bit words of a, then of b: one permute
    const __m512i even =
        _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    return _mm512_castsi512_ps(
        _mm512_permutex2var_epi32(_mm512_castpd_si512(a), even, _mm512_castpd_si512(b)));
  }
  static F fset(float v) { return _mm512_set1_ps(v); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F bit_xor(F a, F b) { return _mm512_xor_ps(a, b); }
  template <int B>
  static F sign_of_bit(F x) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_castps_si512(x), 31 - B));
  }
  static F select_by_sign(F m, F a, F b) {
    return _mm512_mask_blend_ps(_mm512_movepi32_mask(_mm512_castps_si512(m)), a, b);
  }
  static F flip_sign(F x, F m) { return _mm512_xor_ps(x, _mm512_and_ps(m, _mm512_set1_ps(-0.0f))); }
  static F load_bits(const std::uint32_t* p) { return _mm512_castsi512_ps(_mm512_loadu_si512(p)); }
  static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
};

}  // namespace

void avx512_cos_sin(std::int64_t n, const double* position, const double* frequency,
                    double amplitude, float* cos, float* sin) {
  cos_sin_common::cos_sin<Avx512Traits>(n, position, frequency, amplitude, cos, sin);
}

void avx512_cos_sin_rows(std::int64_t rows, const double* position, std::int64_t n,
                         const double* frequency, double amplitude, bool repeat_halves,
                         const std::uint32_t* cos_signs, const std::uint32_t* sin_signs,
                         std::int64_t stride, float* cos, float* sin) {
  cos_sin_common::cos_sin_rows<Avx512Traits>(rows, position, n, frequency, amplitude, repeat_halves,
                                             cos_signs, sin_signs, stride, cos, sin);
}

}  // namespace rome::kernels
