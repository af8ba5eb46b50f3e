// AVX-512 dense rotations: x·B (and x·A) as fp32 FMA products (common/dense-inl.hpp over 16-lane
// traits) for CPUs without a matrix unit, and for fp32 x on those with one; and the dense
// backward's products.
#include "../common/dense-inl.hpp"
#include "../dense_kernels.hpp"
#include "../kernel_api.hpp"
#include "avx512_lanes.hpp"

namespace rome::kernels {
namespace {

using detail::RotationData;
using namespace avx512;

// Storage lanes with the n-lane forms dense-inl.hpp calls (0 < n <= 16), as masks.
template <DType D>
struct CountedLanes {
  using Base = avx512::Lanes<D, NarrowExact>;
  using T = typename Base::T;
  static ROME_INLINE __mmask16 first(int n) { return __mmask16(_bzhi_u32(0xffff, unsigned(n))); }
  static ROME_INLINE __m512 load(const T* p) { return Base::load(p); }
  static ROME_INLINE __m512 load(const T* p, int n) { return Base::load(p, first(n)); }
  static ROME_INLINE void store(T* p, __m512 v) { Base::store(p, v); }
  static ROME_INLINE void store(T* p, __m512 v, int n) { Base::store(p, v, first(n)); }
};

// 12 rows × 2 vectors: 24 accumulators + 2 panel vectors + 1 broadcast of the 32 zmm registers.
// 8, 10, 12 and 14 rows timed alike (the products run near the FMA units' peak); 12 keeps each
// row's x pointer in a general register, where 14 spilled three to the stack.
struct Avx512Vectors {
  using F = __m512;
  static constexpr int kLanes = kW;
  static constexpr int kDenseRows = 12;
  template <DType D>
  using Lanes = CountedLanes<D>;
  static ROME_INLINE F zero() { return _mm512_setzero_ps(); }
  static ROME_INLINE F load(const float* p) { return _mm512_loadu_ps(p); }
  static ROME_INLINE F broadcast(const float* p) { return _mm512_set1_ps(*p); }
  static ROME_INLINE F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static ROME_INLINE void store(float* p, F v) { _mm512_storeu_ps(p, v); }
  static ROME_INLINE F combine(F xa, F c, F xb, F s) { return avx512::combine(xa, c, xb, s); }
};

// R rows of c, 32 columns at a time: the accumulators stay in registers while b's row i is
// loaded once per tile and a[r][i] is broadcast.
template <int R>
void product_rows(std::int64_t k, std::int64_t n, const float* a, std::int64_t lda, const float* b,
                  std::int64_t ldb, float* c, std::int64_t ldc) {
  for (std::int64_t j0 = 0; j0 < n; j0 += 2 * kW) {
    __mmask16 mask[2];
    for (int v = 0; v < 2; ++v) {
      const std::int64_t left = n - (j0 + v * kW);
      mask[v] = left >= kW ? __mmask16(0xffff) : left <= 0 ? 0 : __mmask16((1u << left) - 1);
    }
    __m512 acc[R][2];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < 2; ++v)
        acc[r][v] = _mm512_maskz_loadu_ps(mask[v], c + r * ldc + j0 + v * kW);
    for (std::int64_t i = 0; i < k; ++i) {
      const __m512 b0 = _mm512_maskz_loadu_ps(mask[0], b + i * ldb + j0);
      const __m512 b1 = _mm512_maskz_loadu_ps(mask[1], b + i * ldb + j0 + kW);
      for (int r = 0; r < R; ++r) {
        const __m512 ai = _mm512_set1_ps(a[r * lda + i]);
        acc[r][0] = _mm512_fmadd_ps(ai, b0, acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(ai, b1, acc[r][1]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < 2; ++v)
        _mm512_mask_storeu_ps(c + r * ldc + j0 + v * kW, mask[v], acc[r][v]);
  }
}

}  // namespace

void avx512_accumulate_product(std::int64_t rows, std::int64_t k, std::int64_t n, const float* a,
                               std::int64_t lda, const float* b, std::int64_t ldb, float* c,
                               std::int64_t ldc) {
  std::int64_t r = 0;
  for (; r + 8 <= rows; r += 8) product_rows<8>(k, n, a + r * lda, lda, b, ldb, c + r * ldc, ldc);
  for (; r + 4 <= rows; r += 4) product_rows<4>(k, n, a + r * lda, lda, b, ldb, c + r * ldc, ldc);
  for (; r < rows; ++r) product_rows<1>(k, n, a + r * lda, lda, b, ldb, c + r * ldc, ldc);
}

void avx512_forward_dense(const RotationData& r, const ForwardTile& tile) {
  switch (tile.dtype) {
    case DType::f32: return dense_common::forward_dense<Avx512Vectors, DType::f32>(r, tile);
    case DType::f16: return dense_common::forward_dense<Avx512Vectors, DType::f16>(r, tile);
    case DType::bf16: return dense_common::forward_dense<Avx512Vectors, DType::bf16>(r, tile);
    default: return scalar_kernels().forward_dense(r, tile);
  }
}

}  // namespace rome::kernels
