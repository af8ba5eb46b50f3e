// QK-norm + RoPE (NormForwardFn): the norm weight folded into a table row and the contract's
// lane-by-lane form, written once and compiled into each kernel library (internal linkage: each
// copy is built with its own flags).
#pragma once

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>

#include "../../core/convert.hpp"
#include "../../core/rotation_data.hpp"
#include "../kernel_api.hpp"
#include "combine-inl.hpp"

namespace rome::kernels {
namespace {

// The rotations the SIMD norm kernels have vector loops for: half (lane j reads j ± rd/2) and
// interleave (j reads j ^ 1), A = I; everything else takes the lane loop.
enum class NormKind { half, interleave, other };

// Classified once per rotation per thread in each kernel library (kernels keep no other state).
inline NormKind classify_norm(const detail::RotationData& r) {
  thread_local const detail::RotationData* last = nullptr;
  thread_local std::uint64_t last_uid = 0;
  thread_local NormKind kind = NormKind::other;
  if (last == &r && last_uid == r.uid) return kind;
  const std::int64_t rd = r.rotary_dim, h = rd / 2;
  bool half = r.a_identity && rd % 2 == 0, pairs = r.a_identity && rd % 2 == 0;
  for (std::int64_t j = 0; j < rd && (half || pairs); ++j) {
    const bool has = r.b.sign[j] != 0;
    half = half && has && r.b.src[j] == (j < h ? j + h : j - h);
    pairs = pairs && has && r.b.src[j] == (j ^ 1);
  }
  kind = half ? NormKind::half : pairs ? NormKind::interleave : NormKind::other;
  last = &r;
  last_uid = r.uid;
  return kind;
}

// Whether half / interleave rows are whole vectors of `lanes` floats (the SIMD kernels' vector
// loops: half with a whole-vector half, interleave with rotary_dim whole vectors).
inline bool whole_vector_rows(const detail::RotationData& r, NormKind kind, std::int64_t lanes) {
  return (kind == NormKind::half && (r.rotary_dim / 2) % lanes == 0) ||
         (kind == NormKind::interleave && r.rotary_dim % lanes == 0);
}

// The largest sum of squares of a row whose vector loop needs no inf/NaN test, given
// m >= max |cw| + max |sw| of the folded table row (INFINITY for NaN); -1: no row. Such a row has
// no lane of r·(x_a·C' + x_b·S') that is inf or NaN: x is finite (its sum of squares is),
// |x_j| <= sqrt(ss), |C'_j| + |S'_j| <= m, and r <= sqrt(head_dim / ss) (eps >= 0); so every lane
// is at most sqrt(ss)·m <= 1e37 before scaling and sqrt(head_dim)·m <= 1e37 after (the 30x
// margin to FLT_MAX covers fp32's rounding of ss and the underflow of x² or ss / head_dim in the
// subnormal range, which can make r up to about 1.7x larger than the bound).
inline float finite_sum_squares_bound(double m, std::int64_t head_dim) {
  if (!(m * std::sqrt(double(head_dim)) <= 1e37)) return -1.0f;
  return float(std::min(m > 0 ? (1e37 / m) * (1e37 / m) : INFINITY, double(FLT_MAX)));
}

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
    const float sum = D == DType::bf16 && norm.exact_products
                          ? combine_lane_exact_product(xa, cw[j], xb, sw[j])
                          : combine_lane(xa, cw[j], xb, sw[j]);
    float v = sum * scale;
    if (!std::isfinite(v)) v = combine_lane(xa * scale, cw[j], xb * scale, sw[j]);
    detail::store_float<D>(y + j, v);
  }
  for (std::int64_t j = rd; j < hd; ++j)
    detail::store_float<D>(y + j, x[j] * scale * norm.weight[j]);
}

}  // namespace
}  // namespace rome::kernels
