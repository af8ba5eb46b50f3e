// cos/sin of position × frequency, one double at a time (cos_sin-inl.hpp over scalar traits).
#include <bit>
#include <cmath>
#include <cstdint>

#include "../common/cos_sin-inl.hpp"
#include "../kernel_api.hpp"

namespace rome::kernels {
namespace {

struct ScalarTraits {
  static constexpr int kLanes = 1;
  using D = double;
  static D load(const double* p) { return *p; }
  static D set(double v) { return v; }
  static D add(D a, D b) { return a + b; }
  static D sub(D a, D b) { return a - b; }
  static D mul(D a, D b) { return a * b; }
  static D fma(D a, D b, D c) { return std::fma(a, b, c); }
  static D fms(D a, D b, D c) { return std::fma(a, b, -c); }
  static D fnma(D a, D b, D c) { return std::fma(-a, b, c); }
  static D bit_xor(D a, D b) {
    return std::bit_cast<double>(std::bit_cast<std::uint64_t>(a) ^ std::bit_cast<std::uint64_t>(b));
  }
  template <int B>
  static D sign_of_bit(D t) {
    return std::bit_cast<double>(std::bit_cast<std::uint64_t>(t) << (63 - B));
  }
  static D select_by_sign(D m, D a, D b) { return std::signbit(m) ? b : a; }
  static D flip_sign(D x, D m) {
    return std::bit_cast<double>(std::bit_cast<std::uint64_t>(x) ^
                                 (std::bit_cast<std::uint64_t>(m) & (std::uint64_t(1) << 63)));
  }
  static void store_float(float* p, D v) { *p = float(v); }
};

}  // namespace

void scalar_cos_sin(std::int64_t n, const double* position, const double* frequency,
                    double amplitude, float* cos, float* sin) {
  cos_sin_common::cos_sin<ScalarTraits>(n, position, frequency, amplitude, cos, sin);
}

}  // namespace rome::kernels
