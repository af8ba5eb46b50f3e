// cos/sin of position × frequency, 4 doubles at a time (cos_sin-inl.hpp over AVX2 traits).
#include <immintrin.h>

#include <cstdint>

#include "../common/cos_sin-inl.hpp"
#include "../kernel_api.hpp"

namespace rome::kernels {
namespace {

struct Avx2Traits {
  static constexpr int kLanes = 4;
  using D = __m256d;
  static D load(const double* p) { return _mm256_loadu_pd(p); }
  static D set(double v) { return _mm256_set1_pd(v); }
  static D add(D a, D b) { return _mm256_add_pd(a, b); }
  static D sub(D a, D b) { return _mm256_sub_pd(a, b); }
  static D mul(D a, D b) { return _mm256_mul_pd(a, b); }
  static D fma(D a, D b, D c) { return _mm256_fmadd_pd(a, b, c); }
  static D fms(D a, D b, D c) { return _mm256_fmsub_pd(a, b, c); }
  static D fnma(D a, D b, D c) { return _mm256_fnmadd_pd(a, b, c); }
  static D bit_xor(D a, D b) { return _mm256_xor_pd(a, b); }
  template <int B>
  static D sign_of_bit(D t) {
    return _mm256_castsi256_pd(_mm256_slli_epi64(_mm256_castpd_si256(t), 63 - B));
  }
  static D select_by_sign(D m, D a, D b) { return _mm256_blendv_pd(a, b, m); }
  static D flip_sign(D x, D m) { return _mm256_xor_pd(x, _mm256_and_pd(m, _mm256_set1_pd(-0.0))); }
  static void store_float(float* p, D v) { _mm_storeu_ps(p, _mm256_cvtpd_ps(v)); }
};

}  // namespace

void avx2_cos_sin(std::int64_t n, const double* position, const double* frequency, double amplitude,
                  float* cos, float* sin) {
  cos_sin_common::cos_sin<Avx2Traits>(n, position, frequency, amplitude, cos, sin);
}

}  // namespace rome::kernels
