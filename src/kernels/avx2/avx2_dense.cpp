// AVX2 dense rotations: x·B (and x·A) as fp32 FMA products, for CPUs without AVX-512. The same
// scheme as the AVX-512 dense kernel with 8-lane vectors (ascending i from +0 per lane: bit for
// bit the scalar kernel), in tiles sized for 16 ymm registers.
#include <algorithm>

#include "../dense_kernels.hpp"
#include "../kernel_api.hpp"
#include "avx2_lanes.hpp"

namespace rome::kernels {
namespace {

using detail::RotationData;
using namespace avx2;

constexpr int kColumnVectors = 2;  // 16 output columns per tile

template <DType D, int R, bool DenseA>
void dense_tile(const RotationData& r, const ForwardTile& tile, std::int64_t first_row,
                const float* X, std::int64_t x_stride) {
  using L = Lanes<D>;
  using T = typename L::T;
  const std::int64_t rd = r.rotary_dim;
  const float* a = r.dense_a.data();
  const float* b = r.dense_b.data();
  for (const auto& block : r.dense_blocks) {
    const std::int64_t begin = block.offset, end = block.offset + block.size;
    for (std::int64_t c0 = begin; c0 < end; c0 += kColumnVectors * kW) {
      int width[kColumnVectors];
      __m256i mask[kColumnVectors];
      for (int v = 0; v < kColumnVectors; ++v) {
        width[v] = int(std::clamp<std::int64_t>(end - (c0 + v * kW), 0, kW));
        mask[v] = lane_mask(width[v]);
      }
      __m256 acc_b[R][kColumnVectors], acc_a[R][kColumnVectors];
      for (int i = 0; i < R; ++i)
        for (int v = 0; v < kColumnVectors; ++v) acc_b[i][v] = acc_a[i][v] = _mm256_setzero_ps();
      for (std::int64_t i = begin; i < end; ++i) {
        __m256 bi[kColumnVectors], ai[kColumnVectors];
        for (int v = 0; v < kColumnVectors; ++v) {
          bi[v] = _mm256_maskload_ps(b + i * rd + c0 + v * kW, mask[v]);
          if constexpr (DenseA) ai[v] = _mm256_maskload_ps(a + i * rd + c0 + v * kW, mask[v]);
        }
        for (int row = 0; row < R; ++row) {
          const __m256 xi = _mm256_broadcast_ss(X + row * x_stride + i);
          for (int v = 0; v < kColumnVectors; ++v) {
            acc_b[row][v] = _mm256_fmadd_ps(xi, bi[v], acc_b[row][v]);
            if constexpr (DenseA) acc_a[row][v] = _mm256_fmadd_ps(xi, ai[v], acc_a[row][v]);
          }
        }
      }
      for (int v = 0; v < kColumnVectors; ++v) {
        if (width[v] == 0) continue;
        const std::int64_t j = c0 + v * kW;
        for (int row = 0; row < R; ++row) {
          const __m256 c = _mm256_maskload_ps(tile.cos_row(first_row + row) + j, mask[v]);
          const __m256 s = _mm256_maskload_ps(tile.sin_row(first_row + row) + j, mask[v]);
          const __m256 xa =
              DenseA ? acc_a[row][v] : _mm256_maskload_ps(X + row * x_stride + j, mask[v]);
          const __m256 y = combine(xa, c, acc_b[row][v], s);
          T* out = static_cast<T*>(tile.y_row(first_row + row)) + j;
          if (width[v] == kW)
            L::store(out, y);
          else
            L::store(out, y, width[v]);
        }
      }
    }
  }
}

template <DType D, bool DenseA>
void forward_dense_rows(const RotationData& r, const ForwardTile& tile) {
  using L = Lanes<D>;
  using T = typename L::T;
  constexpr int kRows = DenseA ? 2 : 4;  // accumulators: kRows × 2 (× 2 with A) ≤ 8 ymm
  const std::int64_t rd = r.rotary_dim, hd = r.head_dim;
  const std::int64_t x_stride = (rd + kW - 1) / kW * kW;
  thread_local Scratch scratch;
  float* X = static_cast<float*>(scratch.get(sizeof(float) * std::size_t(kRows * x_stride)));
  const bool pass = tile.copy_passthrough && hd > rd;
  for (std::int64_t first = 0; first < tile.count; first += kRows) {
    const int rows = int(std::min<std::int64_t>(kRows, tile.count - first));
    // Stage the tile's rows in fp32 before any write: a row's y may be its x.
    for (int row = 0; row < rows; ++row) {
      const T* x = static_cast<const T*>(tile.x_row(first + row));
      for (std::int64_t j = 0; j < rd; j += kW) {
        const int n = int(std::min<std::int64_t>(kW, rd - j));
        _mm256_store_ps(X + row * x_stride + j, n == kW ? L::load(x + j) : L::load(x + j, n));
      }
    }
    if (rows == kRows) {
      dense_tile<D, kRows, DenseA>(r, tile, first, X, x_stride);
    } else {
      for (int row = 0; row < rows; ++row)
        dense_tile<D, 1, DenseA>(r, tile, first + row, X + row * x_stride, x_stride);
    }
    if (pass)
      for (int row = 0; row < rows; ++row)
        std::memcpy(static_cast<T*>(tile.y_row(first + row)) + rd,
                    static_cast<const T*>(tile.x_row(first + row)) + rd, (hd - rd) * sizeof(T));
  }
}

template <DType D>
void forward_dense_typed(const RotationData& r, const ForwardTile& tile) {
  if (r.a_identity)
    forward_dense_rows<D, false>(r, tile);
  else
    forward_dense_rows<D, true>(r, tile);
}

// R rows of c, 16 columns at a time (masked loads never touch memory past n).
template <int R>
void product_rows(std::int64_t k, std::int64_t n, const float* a, std::int64_t lda, const float* b,
                  std::int64_t ldb, float* c, std::int64_t ldc) {
  for (std::int64_t j0 = 0; j0 < n; j0 += 2 * kW) {
    __m256i mask[2];
    for (int v = 0; v < 2; ++v)
      mask[v] = lane_mask(int(std::clamp<std::int64_t>(n - (j0 + v * kW), 0, kW)));
    __m256 acc[R][2];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < 2; ++v)
        acc[r][v] = _mm256_maskload_ps(c + r * ldc + j0 + v * kW, mask[v]);
    for (std::int64_t i = 0; i < k; ++i) {
      const __m256 b0 = _mm256_maskload_ps(b + i * ldb + j0, mask[0]);
      const __m256 b1 = _mm256_maskload_ps(b + i * ldb + j0 + kW, mask[1]);
      for (int r = 0; r < R; ++r) {
        const __m256 ai = _mm256_broadcast_ss(a + r * lda + i);
        acc[r][0] = _mm256_fmadd_ps(ai, b0, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(ai, b1, acc[r][1]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < 2; ++v)
        _mm256_maskstore_ps(c + r * ldc + j0 + v * kW, mask[v], acc[r][v]);
  }
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
    case DType::f32: return forward_dense_typed<DType::f32>(r, tile);
    case DType::f16: return forward_dense_typed<DType::f16>(r, tile);
    case DType::bf16: return forward_dense_typed<DType::bf16>(r, tile);
    default: return scalar_kernels().forward_dense(r, tile);
  }
}

}  // namespace rome::kernels
