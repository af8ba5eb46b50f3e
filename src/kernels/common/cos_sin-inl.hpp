// cos/sin of position × frequency, written once over a vector-traits type and compiled per ISA
// (scalar: one double per "vector"; AVX2: 4; AVX-512: 8). Every ISA performs the same IEEE
// double operations in the same order (explicit fma, no contraction: the kernel libraries build
// with -ffp-contract=off), so the results agree bit for bit across ISAs.
//
// Why not libm or fp32: the angle of a token at position 10^6 is ~10^6 rad; formed in fp32 it
// is off by ~0.03 rad before any cos is taken. Here the product is error-free (a double product
// plus its fma residual) and the reduction by π/2 uses a two-part π/2 (good to 2^-107): the
// reduced argument is exact to double precision at any position. The polynomials then only
// need fp32 accuracy (relative error < 4e-9 in double on |r| ≤ π/4), so each result is within
// an fp32 ulp of the true value after its one rounding to fp32 (amplitude applied in double
// first): |error| < 4e-8 at amplitude 1 (the contract allows 3e-7).
//
// The traits type V provides: kLanes; D (a vector of doubles); load(const double*), set(double),
// add, sub, mul, fma(a, b, c) = a·b + c, fms(a, b, c) = a·b − c and fnma(a, b, c) = c − a·b, each
// rounded once; sign_of_bit<B>(t): a vector whose sign bit
// is bit B of t's bits (other bits arbitrary); select_by_sign(m, a, b): b where m's sign bit is
// set, else a; flip_sign(x, m): x with its sign flipped where m's sign bit is set; bit_xor(a, b);
// store_float(float*, D): kLanes floats, each rounded to nearest even.
#pragma once

#include <cstdint>

namespace rome::kernels::cos_sin_common {

// π/2 = kHalfPi1 + kHalfPi2 to about 2^-107 (the two leading doubles of π/2).
constexpr double kHalfPi1 = 0x1.921fb54442d18p+0;
constexpr double kHalfPi2 = 0x1.1a62633145c07p-54;
constexpr double kTwoOverPi = 0x1.45f306dc9c883p-1;
// Adding then subtracting 1.5·2^52 rounds |y| < 2^51 to the nearest integer (ties to even);
// the sum's low mantissa bits hold that integer modulo 4.
constexpr double kRoundMagic = 0x1.8p+52;

// Minimax polynomials on |r| ≤ π/4 (Remez, relative error as weight), evaluated in double:
// relative error < 4e-9 for sin and < 2e-10 for cos, below a tenth of an fp32 ulp (≥ 2^-24
// relative), so the one rounding to fp32 stays within an ulp of the true value. The Taylor
// polynomials they replace were exact to 1e-11 at twice the operations: nothing the fp32
// rounding keeps, and the kernel was most of table-free RoPE's cos/sin time.
template <class V>
inline void sin_cos_reduced(const typename V::D& r, typename V::D& s, typename V::D& c) {
  using D = typename V::D;
  const D z = V::mul(r, r);
  // sin r = r + r·z·(s3 + s5·z + s7·z²)
  D ps = V::fma(V::set(-0x1.9943e0f9cced6p-13), z, V::set(0x1.11073afd0b73ap-7));
  ps = V::fma(ps, z, V::set(-0x1.5555452689e42p-3));
  s = V::fma(V::mul(r, z), ps, r);
  // cos r = 1 − z/2 + z²·(c4 + c6·z + c8·z²)
  D pc = V::fma(V::set(0x1.99eb9c952b7e9p-16), z, V::set(-0x1.6c0c33a94613ep-10));
  pc = V::fma(pc, z, V::set(0x1.55554a115d752p-5));
  c = V::fma(V::mul(z, z), pc, V::fma(z, V::set(-0.5), V::set(1.0)));
}

// One vector: angles position·frequency, exact product, reduced by π/2.
template <class V, bool kScaled>
inline void cos_sin_vector(const typename V::D& p, const typename V::D& f,
                           const typename V::D& amplitude, float* cos_out, float* sin_out) {
  using D = typename V::D;
  const D theta = V::mul(p, f);
  const D theta_lo = V::fms(p, f, theta);  // p·f − theta, exactly
  const D t = V::fma(theta, V::set(kTwoOverPi), V::set(kRoundMagic));
  const D k = V::sub(t, V::set(kRoundMagic));
  D r = V::fnma(k, V::set(kHalfPi1), theta);
  r = V::fnma(k, V::set(kHalfPi2), r);
  r = V::add(r, theta_lo);
  D s, c;
  sin_cos_reduced<V>(r, s, c);
  // Quadrant q = k mod 4: sin θ = (s, c, −s, −c)[q], cos θ = (c, −s, −c, s)[q].
  const D odd = V::template sign_of_bit<0>(t), second = V::template sign_of_bit<1>(t);
  D sin_q = V::flip_sign(V::select_by_sign(odd, s, c), second);
  D cos_q = V::flip_sign(V::select_by_sign(odd, c, s), V::bit_xor(odd, second));
  if constexpr (kScaled) {
    sin_q = V::mul(sin_q, amplitude);
    cos_q = V::mul(cos_q, amplitude);
  }
  V::store_float(cos_out, cos_q);
  V::store_float(sin_out, sin_q);
}

template <class V, bool kScaled>
void cos_sin_loop(std::int64_t n, const double* position, const double* frequency, double amplitude,
                  float* cos_out, float* sin_out) {
  constexpr int W = V::kLanes;
  const typename V::D amp = V::set(amplitude);
  std::int64_t i = 0;
  for (; i + W <= n; i += W)
    cos_sin_vector<V, kScaled>(V::load(position + i), V::load(frequency + i), amp, cos_out + i,
                               sin_out + i);
  if (i == n) return;
  // The tail through padded buffers: the same operations on every lane.
  double p[W] = {}, f[W] = {};
  float c[W], s[W];
  for (std::int64_t j = i; j < n; ++j) {
    p[j - i] = position[j];
    f[j - i] = frequency[j];
  }
  cos_sin_vector<V, kScaled>(V::load(p), V::load(f), amp, c, s);
  for (std::int64_t j = i; j < n; ++j) {
    cos_out[j] = c[j - i];
    sin_out[j] = s[j - i];
  }
}

// cos_out[i] = fp32(amplitude·cos(position[i]·frequency[i])), sin_out likewise, i < n.
// |position[i]·frequency[i]| must be below 2^51·π/2 (the reduction's integer range).
template <class V>
void cos_sin(std::int64_t n, const double* position, const double* frequency, double amplitude,
             float* cos_out, float* sin_out) {
  // An amplitude of 1 skips its multiplication (x·1 == x: the same bits either way).
  if (amplitude == 1.0)
    cos_sin_loop<V, false>(n, position, frequency, amplitude, cos_out, sin_out);
  else
    cos_sin_loop<V, true>(n, position, frequency, amplitude, cos_out, sin_out);
}

}  // namespace rome::kernels::cos_sin_common
