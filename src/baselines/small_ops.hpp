// What unfused frameworks do for RoPE: slice, negate, concatenate, multiply and add, each a pass
// over memory through a temporary rounded to x's dtype. For benchmarks and tests only.
#pragma once

#include <cstdint>
#include <span>

#include "rome/tensor.hpp"

namespace rome::baselines {

enum class Mode { half, interleave };

// x, y: [rows, dim] contiguous; cos, sin: [tokens, dim] contiguous in x's dtype, row r of x uses
// table row r % tokens (BNSD with 1-1-S-D tables). `sections` splits dim per axis (empty: one
// axis); each axis is rotated on its own slice and the slices concatenated, as models do.
void small_ops_rope(Mode mode, DType dtype, const void* x, void* y, std::int64_t rows,
                    std::int64_t dim, const void* cos, const void* sin, std::int64_t tokens,
                    std::span<const std::int64_t> sections = {});

}  // namespace rome::baselines
