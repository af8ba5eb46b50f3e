// QK-norm + RoPE (NormForwardFn): the norm weight folded into a table row, written once and
// compiled into each kernel library (internal linkage: each copy is built with its own flags).
#pragma once

#include <cstdint>

#include "../../core/rotation_data.hpp"

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

}  // namespace
}  // namespace rome::kernels
