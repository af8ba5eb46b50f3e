// cos/sin of position × frequency, two at a time (two doubles reduced, two floats evaluated;
// cos_sin-inl.hpp over scalar traits).
#include <bit>
#include <cmath>
#include <cstdint>

#include "../common/cos_sin-inl.hpp"
#include "../kernel_api.hpp"

namespace rome::kernels {
namespace {

// Two fp32 lanes, one per double "vector" of the pair a step reduces.
struct Floats {
  float v[2];
};

template <class Op>
Floats per_lane(Op op) {
  return {{op(0), op(1)}};
}

std::uint32_t bits(float x) {
  return std::bit_cast<std::uint32_t>(x);
}
float from_bits(std::uint32_t b) {
  return std::bit_cast<float>(b);
}

struct ScalarTraits {
  static constexpr int kLanes = 1;
  using D = double;
  using F = Floats;
  static D load(const double* p) { return *p; }
  static D set(double v) { return v; }
  static D add(D a, D b) { return a + b; }
  static D sub(D a, D b) { return a - b; }
  static D mul(D a, D b) { return a * b; }
  static D fma(D a, D b, D c) { return std::fma(a, b, c); }
  static D fms(D a, D b, D c) { return std::fma(a, b, -c); }
  static D fnma(D a, D b, D c) { return std::fma(-a, b, c); }
  static F to_float(D a, D b) { return {{float(a), float(b)}}; }
  static F low_words(D a, D b) {
    return {{from_bits(std::uint32_t(std::bit_cast<std::uint64_t>(a))),
             from_bits(std::uint32_t(std::bit_cast<std::uint64_t>(b)))}};
  }
  static F fset(float v) { return {{v, v}}; }
  static F mul(F a, F b) {
    return per_lane([&](int i) { return a.v[i] * b.v[i]; });
  }
  static F fma(F a, F b, F c) {
    return per_lane([&](int i) { return std::fma(a.v[i], b.v[i], c.v[i]); });
  }
  static F bit_xor(F a, F b) {
    return per_lane([&](int i) { return from_bits(bits(a.v[i]) ^ bits(b.v[i])); });
  }
  template <int B>
  static F sign_of_bit(F x) {
    return per_lane([&](int i) { return from_bits(bits(x.v[i]) << (31 - B)); });
  }
  static F select_by_sign(F m, F a, F b) {
    return per_lane([&](int i) { return std::signbit(m.v[i]) ? b.v[i] : a.v[i]; });
  }
  static F flip_sign(F x, F m) {
    return per_lane([&](int i) { return from_bits(bits(x.v[i]) ^ (bits(m.v[i]) & 0x80000000u)); });
  }
  static F load_bits(const std::uint32_t* p) { return {{from_bits(p[0]), from_bits(p[1])}}; }
  static void store(float* p, F x) {
    p[0] = x.v[0];
    p[1] = x.v[1];
  }
};

}  // namespace

void scalar_cos_sin(std::int64_t n, const double* position, const double* frequency,
                    double amplitude, float* cos, float* sin) {
  cos_sin_common::cos_sin<ScalarTraits>(n, position, frequency, amplitude, cos, sin);
}

void scalar_cos_sin_rows(std::int64_t rows, const double* position, std::int64_t n,
                         const double* frequency, double amplitude, bool repeat_halves,
                         const std::uint32_t* cos_signs, const std::uint32_t* sin_signs,
                         std::int64_t stride, float* cos, float* sin) {
  cos_sin_common::cos_sin_rows<ScalarTraits>(rows, position, n, frequency, amplitude, repeat_halves,
                                             cos_signs, sin_signs, stride, cos, sin);
}

}  // namespace rome::kernels
