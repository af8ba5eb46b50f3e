// cos/sin of position × frequency, 8 at a time (two vectors of 4 doubles reduced, one of 8
// floats evaluated; cos_sin-inl.hpp over AVX2 traits).
#include <immintrin.h>

#include <cstdint>

#include "../common/cos_sin-inl.hpp"
#include "../kernel_api.hpp"

namespace rome::kernels {
namespace {

struct Avx2Traits {
  static constexpr int kLanes = 4;
  using D = __m256d;
  using F = __m256;
  static D load(const double* p) { return _mm256_loadu_pd(p); }
  static D set(double v) { return _mm256_set1_pd(v); }
  static D add(D a, D b) { return _mm256_add_pd(a, b); }
  static D sub(D a, D b) { return _mm256_sub_pd(a, b); }
  static D mul(D a, D b) { return _mm256_mul_pd(a, b); }
  static D fma(D a, D b, D c) { return _mm256_fmadd_pd(a, b, c); }
  static D fms(D a, D b, D c) { return _mm256_fmsub_pd(a, b, c); }
  static D fnma(D a, D b, D c) { return _mm256_fnmadd_pd(a, b, c); }
  static F to_float(D a, D b) { return _mm256_set_m128(_mm256_cvtpd_ps(b), _mm256_cvtpd_ps(a)); }
  static F low_words(D a, D b) {
    // Even words of each 128-bit half: (a0 a1 b0 b1 | a2 a3 b2 b3), then the 64-bit pairs in order.
    const __m256 even =
        _mm256_shuffle_ps(_mm256_castpd_ps(a), _mm256_castpd_ps(b), _MM_SHUFFLE(2, 0, 2, 0));
    return _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(even), _MM_SHUFFLE(3, 1, 2, 0)));
  }
  static F fset(float v) { return _mm256_set1_ps(v); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F bit_xor(F a, F b) { return _mm256_xor_ps(a, b); }
  template <int B>
  static F sign_of_bit(F x) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_castps_si256(x), 31 - B));
  }
  static F select_by_sign(F m, F a, F b) { return _mm256_blendv_ps(a, b, m); }
  static F flip_sign(F x, F m) { return _mm256_xor_ps(x, _mm256_and_ps(m, _mm256_set1_ps(-0.0f))); }
  static F load_bits(const std::uint32_t* p) {
    return _mm256_castsi256_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
};

}  // namespace

void avx2_cos_sin(std::int64_t n, const double* position, const double* frequency, double amplitude,
                  float* cos, float* sin) {
  cos_sin_common::cos_sin<Avx2Traits>(n, position, frequency, amplitude, cos, sin);
}

void avx2_cos_sin_rows(std::int64_t rows, const double* position, std::int64_t n,
                       const double* frequency, double amplitude, bool repeat_halves,
                       const std::uint32_t* cos_signs, const std::uint32_t* sin_signs,
                       std::int64_t stride, float* cos, float* sin) {
  cos_sin_common::cos_sin_rows<Avx2Traits>(rows, position, n, frequency, amplitude, repeat_halves,
                                           cos_signs, sin_signs, stride, cos, sin);
}

}  // namespace rome::kernels
