// The contract between the core and the per-ISA kernels. The core validates, plans and splits
// work; a kernel rotates a batch of rows that share one table row.
#pragma once

#include <cstdint>

#include "../core/rotation_data.hpp"
#include "rome/tensor.hpp"

namespace rome::kernels {

struct RowRef {
  const void* x;
  void* y;  // may equal x (in place); never partially overlaps another row
};

struct ForwardBatch {
  const float* cos;  // rotary_dim contiguous fp32 values
  const float* sin;
  const RowRef* rows;
  std::int64_t count;
  DType dtype;            // of x and y
  bool copy_passthrough;  // out of place: copy lanes [rotary_dim, head_dim) from x to y
};

// y = (x·A) ⊙ cos + (x·B) ⊙ sin for every row of the batch; math in fp32, one rounding.
using ForwardFn = void (*)(const detail::RotationData& rotation, const ForwardBatch& batch);

struct KernelTable {
  const char* name;
  ForwardFn forward_permute;  // rotation.kind == signed_permutation
  ForwardFn forward_dense;    // rotation.kind == dense; nullptr: use the scalar kernel
};

// One per ISA, each defined in its own object library compiled with that ISA's flags.
const KernelTable& scalar_kernels();
const KernelTable& avx2_kernels();
const KernelTable& avx512_kernels();
const KernelTable& amx_kernels();

}  // namespace rome::kernels
