// Dense-rotation kernels, one per ISA, defined beside that ISA's permute kernels.
#pragma once

#include "kernel_api.hpp"

namespace rome::kernels {

void avx2_forward_dense(const detail::RotationData& rotation, const ForwardTile& tile);
void avx512_forward_dense(const detail::RotationData& rotation, const ForwardTile& tile);
// avx512_forward_dense, but bf16 x times a matrix exact in bf16 takes vdpbf16ps: for CPUs with
// AVX512-BF16 only (avx512_kernels(true, true)).
void avx512_bf16_forward_dense(const detail::RotationData& rotation, const ForwardTile& tile);
void scalar_accumulate_product(std::int64_t rows, std::int64_t k, std::int64_t n, const float* a,
                               std::int64_t lda, const float* b, std::int64_t ldb, float* c,
                               std::int64_t ldc);
void avx2_accumulate_product(std::int64_t rows, std::int64_t k, std::int64_t n, const float* a,
                             std::int64_t lda, const float* b, std::int64_t ldb, float* c,
                             std::int64_t ldc);
void avx512_accumulate_product(std::int64_t rows, std::int64_t k, std::int64_t n, const float* a,
                               std::int64_t lda, const float* b, std::int64_t ldb, float* c,
                               std::int64_t ldc);
// The AMX ISA's kernels with the tile unit replaced by a software model: for tests on CPUs
// without AMX (it needs AVX-512).
const KernelTable& amx_emulated_kernels();

}  // namespace rome::kernels
