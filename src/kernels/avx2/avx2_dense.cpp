// AVX2 dense rotations: x·B (and x·A) as fp32 FMA products (common/dense-inl.hpp over 8-lane
// traits), for CPUs without AVX-512; and the dense backward's products.
#include <algorithm>

#include "../common/dense-inl.hpp"
#include "../dense_kernels.hpp"
#include "../kernel_api.hpp"
#include "avx2_lanes.hpp"

namespace rome::kernels {
namespace {

using detail::RotationData;
using namespace avx2;

// 6 rows × 2 vectors: 12 accumulators + 2 panel vectors + 1 broadcast of the 16 ymm registers.
struct Avx2Vectors {
  using F = __m256;
  static constexpr int kLanes = kW;
  static constexpr int kDenseRows = 6;
  template <DType D>
  using Lanes = avx2::Lanes<D>;
  static ROME_INLINE F zero() { return _mm256_setzero_ps(); }
  static ROME_INLINE F load(const float* p) { return _mm256_loadu_ps(p); }
  static ROME_INLINE F broadcast(const float* p) { return _mm256_broadcast_ss(p); }
  static ROME_INLINE F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static ROME_INLINE void store(float* p, F v) { _mm256_storeu_ps(p, v); }
  static ROME_INLINE F combine(F xa, F c, F xb, F s) { return avx2::combine(xa, c, xb, s); }
  static ROME_INLINE F combine_one_fma(F xa, F c, F xb, F s) {
    return avx2::combine_one_fma(xa, c, xb, s);
  }
  static ROME_INLINE bool any_nan(F a, F b) { return avx2::any_nan(a, b); }
};

// R rows of c, 16 columns at a time. Whole column groups use plain loads and stores (masked
// stores are microcoded on AMD cores); only the last, partial group is masked, so no access
// touches memory past n.
template <int R, bool Masked>
ROME_INLINE void product_columns(std::int64_t k, std::int64_t n, std::int64_t j0, const float* a,
                                 std::int64_t lda, const float* b, std::int64_t ldb, float* c,
                                 std::int64_t ldc) {
  __m256i mask[2];
  if constexpr (Masked)
    for (int v = 0; v < 2; ++v)
      mask[v] = lane_mask(int(std::clamp<std::int64_t>(n - (j0 + v * kW), 0, kW)));
  auto load = [&](const float* p, int v) {
    if constexpr (Masked) return _mm256_maskload_ps(p, mask[v]);
    return _mm256_loadu_ps(p);
  };
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 2; ++v) acc[r][v] = load(c + r * ldc + j0 + v * kW, v);
  for (std::int64_t i = 0; i < k; ++i) {
    const __m256 b0 = load(b + i * ldb + j0, 0);
    const __m256 b1 = load(b + i * ldb + j0 + kW, 1);
    for (int r = 0; r < R; ++r) {
      const __m256 ai = _mm256_broadcast_ss(a + r * lda + i);
      acc[r][0] = _mm256_fmadd_ps(ai, b0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(ai, b1, acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 2; ++v) {
      if constexpr (Masked)
        _mm256_maskstore_ps(c + r * ldc + j0 + v * kW, mask[v], acc[r][v]);
      else
        _mm256_storeu_ps(c + r * ldc + j0 + v * kW, acc[r][v]);
    }
}

template <int R>
void product_rows(std::int64_t k, std::int64_t n, const float* a, std::int64_t lda, const float* b,
                  std::int64_t ldb, float* c, std::int64_t ldc) {
  std::int64_t j0 = 0;
  for (; j0 + 2 * kW <= n; j0 += 2 * kW)
    product_columns<R, false>(k, n, j0, a, lda, b, ldb, c, ldc);
  if (j0 < n) product_columns<R, true>(k, n, j0, a, lda, b, ldb, c, ldc);
}

}  // namespace

void avx2_accumulate_product(std::int64_t rows, std::int64_t k, std::int64_t n, const float* a,
                             std::int64_t lda, const float* b, std::int64_t ldb, float* c,
                             std::int64_t ldc) {
  std::int64_t r = 0;
  for (; r + 6 <= rows; r += 6) product_rows<6>(k, n, a + r * lda, lda, b, ldb, c + r * ldc, ldc);
  for (; r < rows; ++r) product_rows<1>(k, n, a + r * lda, lda, b, ldb, c + r * ldc, ldc);
}

void avx2_forward_dense(const RotationData& r, const ForwardTile& tile) {
  switch (tile.dtype) {
    case DType::f32: return dense_common::forward_dense<Avx2Vectors, DType::f32>(r, tile);
    case DType::f16: return dense_common::forward_dense<Avx2Vectors, DType::f16>(r, tile);
    case DType::bf16: return dense_common::forward_dense<Avx2Vectors, DType::bf16>(r, tile);
    default: return scalar_kernels().forward_dense(r, tile);
  }
}

}  // namespace rome::kernels
