// AVX-512 dense rotations: x·B (and x·A) as fp32 FMA products on the CPU's vector units, for
// CPUs without a matrix unit. Per diagonal block, output columns are vectorised 16 at a time and
// x[i] is broadcast in ascending i from +0, so every lane does exactly the scalar kernel's
// sequence of FMAs: the results match it bit for bit. Tiles of R rows × 32 columns (16 for a
// block's tail) keep the accumulators in registers while each row of B is loaded once per tile.
#include "../dense_kernels.hpp"
#include "../kernel_api.hpp"
#include "avx512_lanes.hpp"

namespace rome::kernels {
namespace {

using detail::RotationData;
using namespace avx512;

constexpr int kColumnVectors = 2;  // 32 output columns per tile

// Output columns [c0, c0 + CV·16) of one block (masked past `end`) for R rows.
template <DType D, int R, bool DenseA, int CV>
ROME_INLINE void dense_columns(const RotationData& r, const ForwardTile& tile,
                               std::int64_t first_row, const float* X, std::int64_t x_stride,
                               std::int64_t begin, std::int64_t end, std::int64_t c0) {
  using L = Lanes<D, NarrowExact>;
  using T = typename L::T;
  const std::int64_t rd = r.rotary_dim;
  const float* a = r.dense_a.data();
  const float* b = r.dense_b.data();
  __mmask16 mask[CV];
  for (int v = 0; v < CV; ++v) {
    const std::int64_t left = end - (c0 + v * kW);
    mask[v] = left >= kW  ? __mmask16(0xffff)
              : left <= 0 ? __mmask16(0)
                          : __mmask16((1u << left) - 1);
  }
  __m512 acc_b[R][CV], acc_a[R][CV];
  for (int i = 0; i < R; ++i)
    for (int v = 0; v < CV; ++v) acc_b[i][v] = acc_a[i][v] = _mm512_setzero_ps();
  for (std::int64_t i = begin; i < end; ++i) {
    __m512 bi[CV], ai[CV];
    for (int v = 0; v < CV; ++v) {
      bi[v] = _mm512_maskz_loadu_ps(mask[v], b + i * rd + c0 + v * kW);
      if constexpr (DenseA) ai[v] = _mm512_maskz_loadu_ps(mask[v], a + i * rd + c0 + v * kW);
    }
    for (int row = 0; row < R; ++row) {
      const __m512 xi = _mm512_set1_ps(X[row * x_stride + i]);
      for (int v = 0; v < CV; ++v) {
        acc_b[row][v] = _mm512_fmadd_ps(xi, bi[v], acc_b[row][v]);
        if constexpr (DenseA) acc_a[row][v] = _mm512_fmadd_ps(xi, ai[v], acc_a[row][v]);
      }
    }
  }
  for (int v = 0; v < CV; ++v) {
    if (!mask[v]) continue;
    const std::int64_t j = c0 + v * kW;
    for (int row = 0; row < R; ++row) {
      const __m512 c = _mm512_maskz_loadu_ps(mask[v], tile.cos_row(first_row + row) + j);
      const __m512 s = _mm512_maskz_loadu_ps(mask[v], tile.sin_row(first_row + row) + j);
      const __m512 xa =
          DenseA ? acc_a[row][v] : _mm512_maskz_loadu_ps(mask[v], X + row * x_stride + j);
      const __m512 y = combine(xa, c, acc_b[row][v], s);
      L::store(static_cast<T*>(tile.y_row(first_row + row)) + j, y, mask[v]);
    }
  }
}

// Per diagonal block: 32-column tiles, and a 16-column tile for a tail of at most 16 (a 44-lane
// block is 32 + 16, not 32 + 32 with a wholly masked vector).
template <DType D, int R, bool DenseA>
void dense_tile(const RotationData& r, const ForwardTile& tile, std::int64_t first_row,
                const float* X, std::int64_t x_stride) {
  for (const auto& block : r.dense_blocks) {
    const std::int64_t begin = block.offset, end = block.offset + block.size;
    std::int64_t c0 = begin;
    for (; end - c0 > kW; c0 += kColumnVectors * kW)
      dense_columns<D, R, DenseA, kColumnVectors>(r, tile, first_row, X, x_stride, begin, end, c0);
    if (c0 < end) dense_columns<D, R, DenseA, 1>(r, tile, first_row, X, x_stride, begin, end, c0);
  }
}

template <DType D, bool DenseA>
void forward_dense_rows(const RotationData& r, const ForwardTile& tile) {
  using L = Lanes<D, NarrowExact>;
  using T = typename L::T;
  constexpr int kRows = DenseA ? 4 : 8;  // accumulators: kRows × 2 (× 2 with A) ≤ 16 zmm
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
        const std::int64_t left = rd - j;
        const __mmask16 m = left >= kW ? __mmask16(0xffff) : __mmask16((1u << left) - 1);
        _mm512_store_ps(X + row * x_stride + j, L::load(x + j, m));
      }
    }
    switch (rows) {
      case kRows: dense_tile<D, kRows, DenseA>(r, tile, first, X, x_stride); break;
      default:
        for (int row = 0; row < rows; ++row)
          dense_tile<D, 1, DenseA>(r, tile, first + row, X + row * x_stride, x_stride);
    }
    if (pass)
      for (int row = 0; row < rows; ++row)
        copy_bytes(static_cast<T*>(tile.y_row(first + row)) + rd,
                   static_cast<const T*>(tile.x_row(first + row)) + rd,
                   (hd - rd) * std::int64_t(sizeof(T)), false);
  }
}

template <DType D>
void forward_dense_typed(const RotationData& r, const ForwardTile& tile) {
  if (r.a_identity)
    forward_dense_rows<D, false>(r, tile);
  else
    forward_dense_rows<D, true>(r, tile);
}

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
    case DType::f32: return forward_dense_typed<DType::f32>(r, tile);
    case DType::f16: return forward_dense_typed<DType::f16>(r, tile);
    case DType::bf16: return forward_dense_typed<DType::bf16>(r, tile);
    default: return scalar_kernels().forward_dense(r, tile);
  }
}

}  // namespace rome::kernels
