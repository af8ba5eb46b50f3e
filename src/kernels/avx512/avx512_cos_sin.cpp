// cos/sin of position × frequency, 8 doubles at a time (cos_sin-inl.hpp over AVX-512 traits).
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
  static D load(const double* p) { return _mm512_loadu_pd(p); }
  static D set(double v) { return _mm512_set1_pd(v); }
  static D add(D a, D b) { return _mm512_add_pd(a, b); }
  static D sub(D a, D b) { return _mm512_sub_pd(a, b); }
  static D mul(D a, D b) { return _mm512_mul_pd(a, b); }
  static D fma(D a, D b, D c) { return _mm512_fmadd_pd(a, b, c); }
  static D fms(D a, D b, D c) { return _mm512_fmsub_pd(a, b, c); }
  static D fnma(D a, D b, D c) { return _mm512_fnmadd_pd(a, b, c); }
  static D bit_xor(D a, D b) { return _mm512_xor_pd(a, b); }
  template <int B>
  static D sign_of_bit(D t) {
    return _mm512_castsi512_pd(_mm512_slli_epi64(_mm512_castpd_si512(t), 63 - B));
  }
  static D select_by_sign(D m, D a, D b) {
    return _mm512_mask_blend_pd(_mm512_movepi64_mask(_mm512_castpd_si512(m)), a, b);
  }
  static D flip_sign(D x, D m) { return _mm512_xor_pd(x, _mm512_and_pd(m, _mm512_set1_pd(-0.0))); }
  static void store_float(float* p, D v) { _mm256_storeu_ps(p, _mm512_cvtpd_ps(v)); }
};

}  // namespace

void avx512_cos_sin(std::int64_t n, const double* position, const double* frequency,
                    double amplitude, float* cos, float* sin) {
  cos_sin_common::cos_sin<Avx512Traits>(n, position, frequency, amplitude, cos, sin);
}

}  // namespace rome::kernels
