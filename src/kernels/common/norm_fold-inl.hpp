// QK-norm + RoPE (NormForwardFn): the norm weight folded into a table row and the contract's
// lane-by-lane form, shared by the scalar kernel and the SIMD one (norm_rope-inl.hpp), compiled
// into each kernel library (internal linkage: each copy is built with its own flags).
#pragma once

#include <cmath>
#include <cstdint>

#include "../../core/convert.hpp"
#include "../../core/rotation_data.hpp"
#include "../kernel_api.hpp"
#include "combine-inl.hpp"

namespace rome::kernels {
namespace {

// cw[j] = cos[j]·w[a(j)] and sw[j] = sin[j]·w[b(j)] for j < rotary_dim, where a(j) and b(j) are
// the lanes A and B read for lane j (a(j) = j when A = I). A lane reading nothing keeps the plain
// table value: its source is 0 and must stay 0, whatever the weight (a NaN weight times the 0 of
// an unread lane would make the lane NaN). One fp32 product per entry, so every ISA folds the
// same bits.
inline void fold_norm_weight(const detail::RotationData& r, const float* cos, const float* sin,
                             const float* weight, float* cw, float* sw) {
  for (std::int64_t j = 0; j < r.rotary_dim; ++j) {
    const bool reads_a = r.a_identity || r.a.sign[j] != 0;
    const std::int64_t a = r.a_identity ? j : r.a.src[j];
    cw[j] = reads_a ? cos[j] * weight[a] : cos[j];
    sw[j] = r.b.sign[j] != 0 ? sin[j] * weight[r.b.src[j]] : sin[j];
  }
}

// One row of the contract (kernel_api.hpp's NormForwardFn), lane by lane: x holds the row's
// lanes in fp32, r its 1 / rms, cw and sw the folded table row. The scalar kernel's row, and the
// SIMD kernels' row for sizes and permutations they have no vector loop for.
template <DType D>
void store_norm_row_lanes(const detail::RotationData& r, const float* x, float scale,
                          const float* cw, const float* sw, const NormParams& norm,
                          typename detail::Storage<D>::type* y) {
  const std::int64_t rd = r.rotary_dim, hd = r.head_dim;
  for (std::int64_t j = 0; j < rd; ++j) {
    const float xa = r.a_identity ? x[j] : r.a.sign[j] == 0 ? 0.0f : x[r.a.src[j]];
    const float xb = r.b.sign[j] == 0 ? 0.0f : x[r.b.src[j]];
    const float sum = epilogue_lane(single_fma_epilogue(D), xa, cw[j], xb, sw[j]);
    float v = sum * scale;
    if (!std::isfinite(v)) v = combine_lane(xa * scale, cw[j], xb * scale, sw[j]);
    detail::store_float<D>(y + j, v);
  }
  for (std::int64_t j = rd; j < hd; ++j)
    detail::store_float<D>(y + j, x[j] * scale * norm.weight[j]);
}

}  // namespace
}  // namespace rome::kernels
