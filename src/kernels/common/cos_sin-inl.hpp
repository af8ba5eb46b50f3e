// cos/sin of position × frequency, written once over a vector-traits type and compiled per ISA
// (scalar: one double per "vector"; AVX2: 4; AVX-512: 8). Every ISA performs the same IEEE
// operations in the same order (explicit fma, no contraction: the kernel libraries build with
// -ffp-contract=off), so the results agree bit for bit across ISAs.
//
// Why not libm or fp32 throughout: the angle of a token at position 10^6 is ~10^6 rad; formed in
// fp32 it is off by ~0.03 rad before any cos is taken. Here the product is error-free (a double
// product plus its fma residual) and the reduction by π/2 uses a two-part π/2 (good to 2^-107),
// so the reduced argument r (|r| ≤ π/4) is exact to double precision at any position. Only then
// is r rounded to fp32 and sin/cos evaluated in fp32, on twice the lanes of a double vector
// (16% off the bf16 rotary module at S = 4096 against double polynomials). Rounding r and the
// fp32 polynomial cost < 2 ulp (1.55 ulp, 9.2e-8, over 10^6 random angles up to 10^7 rad); the
// amplitude, when not 1, one more fp32 rounding. The contract is 3e-7.
//
// The traits type V provides: kLanes; D (kLanes doubles); load(const double*), set(double),
// add, sub, mul, fma(a, b, c) = a·b + c, fms(a, b, c) = a·b − c and fnma(a, b, c) = c − a·b on D,
// each rounded once; F (2·kLanes floats) with to_float(a, b): a's lanes then b's, each rounded to
// nearest even; low_words(a, b): the low 32 bits of a's then b's lanes, as F; fset(float), mul
// and fma on F; sign_of_bit<B>(x): an F whose sign bits are bit B of x's lanes (other bits
// arbitrary); select_by_sign(m, a, b): b where m's sign bit is set, else a; flip_sign(x, m): x
// with its sign flipped where m's sign bit is set; bit_xor(a, b); load_bits(const uint32_t*): F
// with those bits; store(float*, F).
#pragma once

#include <cstdint>
#include <cstring>

namespace rome::kernels::cos_sin_common {

// π/2 = kHalfPi1 + kHalfPi2 to about 2^-107 (the two leading doubles of π/2).
constexpr double kHalfPi1 = 0x1.921fb54442d18p+0;
constexpr double kHalfPi2 = 0x1.1a62633145c07p-54;
constexpr double kTwoOverPi = 0x1.45f306dc9c883p-1;
// Adding then subtracting 1.5·2^52 rounds |y| < 2^51 to the nearest integer (ties to even);
// the sum's low mantissa bits hold that integer modulo 2^32 (so its low two bits, the quadrant).
constexpr double kRoundMagic = 0x1.8p+52;

// θ = p·f exactly as theta + theta_lo, then r = θ − k·π/2 with k the nearest integer (carried in
// t's low bits).
template <class V>
inline void reduce(const typename V::D& p, const typename V::D& f, typename V::D& r,
                   typename V::D& t) {
  using D = typename V::D;
  const D theta = V::mul(p, f);
  const D theta_lo = V::fms(p, f, theta);  // p·f − theta, exactly
  t = V::fma(theta, V::set(kTwoOverPi), V::set(kRoundMagic));
  const D k = V::sub(t, V::set(kRoundMagic));
  r = V::fnma(k, V::set(kHalfPi1), theta);
  r = V::fnma(k, V::set(kHalfPi2), r);
  r = V::add(r, theta_lo);
}

// Minimax polynomials on |r| ≤ π/4 (Remez, relative error as weight; relative error 3.8e-9 for
// sin, 1.2e-10 for cos in exact arithmetic, the coefficients rounded to fp32), in fp32.
template <class V>
inline void sin_cos_reduced(const typename V::F& r, typename V::F& s, typename V::F& c) {
  using F = typename V::F;
  const F z = V::mul(r, r);
  // sin r = r + r·z·(s3 + s5·z + s7·z²)
  F ps = V::fma(V::fset(-0x1.9943e0f9cced6p-13f), z, V::fset(0x1.11073afd0b73ap-7f));
  ps = V::fma(ps, z, V::fset(-0x1.5555452689e42p-3f));
  s = V::fma(V::mul(r, z), ps, r);
  // cos r = 1 − z/2 + z²·(c4 + c6·z + c8·z²)
  F pc = V::fma(V::fset(0x1.99eb9c952b7e9p-16f), z, V::fset(-0x1.6c0c33a94613ep-10f));
  pc = V::fma(pc, z, V::fset(0x1.55554a115d752p-5f));
  c = V::fma(V::mul(z, z), pc, V::fma(z, V::fset(-0.5f), V::fset(1.0f)));
}

// 2·kLanes angles: two double vectors of positions and frequencies reduced, their r rounded
// into one fp32 vector.
template <class V, bool kScaled>
inline void cos_sin_values(const typename V::D& p0, const typename V::D& p1,
                           const typename V::D& f0, const typename V::D& f1,
                           const typename V::F& amplitude, typename V::F& cos_q,
                           typename V::F& sin_q) {
  using D = typename V::D;
  using F = typename V::F;
  D r0, t0, r1, t1;
  reduce<V>(p0, f0, r0, t0);
  reduce<V>(p1, f1, r1, t1);
  F s, c;
  sin_cos_reduced<V>(V::to_float(r0, r1), s, c);
  // Quadrant q = k mod 4: sin θ = (s, c, −s, −c)[q], cos θ = (c, −s, −c, s)[q].
  const F q = V::low_words(t0, t1);
  const F odd = V::template sign_of_bit<0>(q), second = V::template sign_of_bit<1>(q);
  sin_q = V::flip_sign(V::select_by_sign(odd, s, c), second);
  cos_q = V::flip_sign(V::select_by_sign(odd, c, s), V::bit_xor(odd, second));
  if constexpr (kScaled) {
    sin_q = V::mul(sin_q, amplitude);
    cos_q = V::mul(cos_q, amplitude);
  }
}

template <class V, bool kScaled>
inline void cos_sin_step(const double* position, const double* frequency,
                         const typename V::F& amplitude, float* cos_out, float* sin_out) {
  constexpr int W = V::kLanes;
  typename V::F c, s;
  cos_sin_values<V, kScaled>(V::load(position), V::load(position + W), V::load(frequency),
                             V::load(frequency + W), amplitude, c, s);
  V::store(cos_out, c);
  V::store(sin_out, s);
}

template <class V, bool kScaled>
void cos_sin_loop(std::int64_t n, const double* position, const double* frequency, double amplitude,
                  float* cos_out, float* sin_out) {
  constexpr int W = 2 * V::kLanes;
  const typename V::F amp = V::fset(float(amplitude));
  std::int64_t i = 0;
  for (; i + W <= n; i += W)
    cos_sin_step<V, kScaled>(position + i, frequency + i, amp, cos_out + i, sin_out + i);
  if (i == n) return;
  // The tail through padded buffers: the same operations on every lane.
  double p[W] = {}, f[W] = {};
  float c[W], s[W];
  for (std::int64_t j = i; j < n; ++j) {
    p[j - i] = position[j];
    f[j - i] = frequency[j];
  }
  cos_sin_step<V, kScaled>(p, f, amp, c, s);
  for (std::int64_t j = i; j < n; ++j) {
    cos_out[j] = c[j - i];
    sin_out[j] = s[j - i];
  }
}

// Whole rows in one loop: the position broadcast from a register, and the rows' chains of
// dependent operations overlapped by the out-of-order core. One row of 64 per call waited on each
// row's latency: 1.27 against 0.87 ns per angle here (AVX-512, 64 rows of 64, both halves written).
// With kSigned each stored lane's bits are xor-ed with its word of cos_signs / sin_signs (null:
// none), so the core's sign folding needs no second pass over the rows.
template <class V, bool kScaled, bool kSigned>
void cos_sin_rows_loop(std::int64_t rows, const double* position, std::int64_t n,
                       const double* frequency, double amplitude, bool repeat_halves,
                       const std::uint32_t* cos_signs, const std::uint32_t* sin_signs,
                       std::int64_t stride, float* cos_out, float* sin_out) {
  using F = typename V::F;
  constexpr int W = 2 * V::kLanes;
  const F amp = V::fset(float(amplitude));
  const std::int64_t whole = n - n % W;
  // The tail's frequencies, padded once for every row.
  double tail_f[W] = {};
  for (std::int64_t j = whole; j < n; ++j) tail_f[j - whole] = frequency[j];
  const std::int64_t second = repeat_halves ? n : 0;
  // Sign words, all zero where a side has none, so the loop xors unconditionally.
  std::uint32_t zeros[W] = {};
  auto signs_at = [&](const std::uint32_t* signs, std::int64_t lane) {
    return V::load_bits(signs ? signs + lane : zeros);
  };
  auto sign_word = [&](const std::uint32_t* signs, std::int64_t lane) -> std::uint32_t {
    return signs ? signs[lane] : 0u;
  };
  for (std::int64_t r = 0; r < rows; ++r) {
    const typename V::D p = V::set(position[r]);
    float* const co = cos_out + r * stride;
    float* const so = sin_out + r * stride;
    auto store = [&](std::int64_t lane, F c, F s) {
      if constexpr (kSigned) {
        c = V::bit_xor(c, signs_at(cos_signs, lane));
        s = V::bit_xor(s, signs_at(sin_signs, lane));
      }
      V::store(co + lane, c);
      V::store(so + lane, s);
    };
    for (std::int64_t i = 0; i < whole; i += W) {
      F c, s;
      cos_sin_values<V, kScaled>(p, p, V::load(frequency + i), V::load(frequency + i + V::kLanes),
                                 amp, c, s);
      store(i, c, s);
      if (repeat_halves) store(second + i, c, s);
    }
    if (whole == n) continue;
    F c, s;
    float cb[W], sb[W];
    cos_sin_values<V, kScaled>(p, p, V::load(tail_f), V::load(tail_f + V::kLanes), amp, c, s);
    V::store(cb, c);
    V::store(sb, s);
    auto store_lane = [&](std::int64_t lane, std::int64_t j) {
      std::uint32_t cbits, sbits;
      std::memcpy(&cbits, cb + j, 4);
      std::memcpy(&sbits, sb + j, 4);
      cbits ^= sign_word(cos_signs, lane);
      sbits ^= sign_word(sin_signs, lane);
      std::memcpy(co + lane, &cbits, 4);
      std::memcpy(so + lane, &sbits, 4);
    };
    for (std::int64_t j = whole; j < n; ++j) {
      store_lane(j, j - whole);
      if (repeat_halves) store_lane(second + j, j - whole);
    }
  }
}

template <class V>
void cos_sin_rows(std::int64_t rows, const double* position, std::int64_t n,
                  const double* frequency, double amplitude, bool repeat_halves,
                  const std::uint32_t* cos_signs, const std::uint32_t* sin_signs,
                  std::int64_t stride, float* cos_out, float* sin_out) {
  auto run = [&]<bool kScaled, bool kSigned>() {
    cos_sin_rows_loop<V, kScaled, kSigned>(rows, position, n, frequency, amplitude, repeat_halves,
                                           cos_signs, sin_signs, stride, cos_out, sin_out);
  };
  const bool scaled = amplitude != 1.0, signed_lanes = cos_signs || sin_signs;
  if (scaled)
    signed_lanes ? run.template operator()<true, true>() : run.template operator()<true, false>();
  else
    signed_lanes ? run.template operator()<false, true>() : run.template operator()<false, false>();
}

// cos_out[i] = amplitude·cos(position[i]·frequency[i]) in fp32, sin_out likewise, i < n.
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
