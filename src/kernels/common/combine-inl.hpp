// The permute kernels' epilogue, one lane at a time: written once and compiled into each kernel
// library (internal linkage: each copy is built with its own flags). The SIMD kernels compute
// exactly these operations in this order, so every ISA gives the same bits.
#pragma once

#include <cmath>

namespace rome::kernels {
namespace {

// xa·c + xb·s with the rounding error of xa·c added back (an error-free product), so the result
// stays within about one fp32 ulp even when the two terms cancel. A product that is not finite
// has no error term (inf - inf would turn an infinite result into NaN).
inline float combine_lane(float xa, float c, float xb, float s) {
  const float p = xa * c;
  const float e = std::fabs(p) <= 3.40282347e+38f ? std::fma(xa, c, -p) : 0.0f;
  return std::fma(xb, s, p) + e;
}

// xa·c + xb·s in one fma, without the rounding error of xa·c: the epilogue of 16-bit x
// (kernel_api.hpp: single_fma_epilogue). Where xa·c is exact in fp32 (a 16-bit x times a 16-bit
// table value: at most 11 + 11 significant bits) this is the correctly rounded sum.
inline float combine_lane_one_fma(float xa, float c, float xb, float s) {
  return std::fma(xb, s, xa * c);
}

// The forward epilogue of one lane: one fma for 16-bit x (kernel_api.hpp: single_fma_epilogue),
// else compensated.
inline float epilogue_lane(bool one_fma, float xa, float c, float xb, float s) {
  return one_fma ? combine_lane_one_fma(xa, c, xb, s) : combine_lane(xa, c, xb, s);
}

}  // namespace
}  // namespace rome::kernels
