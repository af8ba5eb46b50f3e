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

// c[r·ldc + j] += Σ_{i<k} a[r·lda + i] · b[i·ldb + j] for r < rows, j < n, in fp32: per
// element one fma per i in ascending i, starting from c's value. Every ISA performs exactly this
// sequence, so results agree bit for bit across ISAs (and do not depend on how rows are split).
// The dense backward's products (dx through Mᵀ, x·M for the table gradients, dM = xᵀ·(g ⊙ S)).
using AccumulateProductFn = void (*)(std::int64_t rows, std::int64_t k, std::int64_t n,
                                     const float* a, std::int64_t lda, const float* b,
                                     std::int64_t ldb, float* c, std::int64_t ldc);

struct KernelTable {
  const char* name;
  ForwardFn forward_permute;  // rotation.kind == signed_permutation
  ForwardFn forward_dense;    // rotation.kind == dense; nullptr: use the scalar kernel
  AccumulateProductFn accumulate_product;
};

// One per ISA, each defined in its own object library compiled with that ISA's flags.
const KernelTable& scalar_kernels();
const KernelTable& avx2_kernels();
const KernelTable& avx512_kernels();
const KernelTable& amx_kernels();

}  // namespace rome::kernels
