// AVX-512 dense rotations: x·B (and x·A) as fp32 FMA products (common/dense-inl.hpp over 16-lane
// traits) for CPUs without a matrix unit, and for fp32 x on those with one; bf16 x times a matrix
// exact in bf16 as bf16 dot products on CPUs with AVX512-BF16; and the dense backward's products.
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
  static ROME_INLINE __m512 load(const T* p) { return Base::load(p); }
  static ROME_INLINE __m512 load(const T* p, int n) { return Base::load(p, first_lanes(n)); }
  static ROME_INLINE void store(T* p, __m512 v) { Base::store(p, v); }
  static ROME_INLINE void store(T* p, __m512 v, int n) { Base::store(p, v, first_lanes(n)); }
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
  static ROME_INLINE F combine_one_fma(F xa, F c, F xb, F s) {
    return avx512::combine_one_fma(xa, c, xb, s);
  }
};

// R rows of c, 32 columns at a time: the accumulators stay in registers while b's row i is
// loaded once per tile and a[r][i] is broadcast.
template <int R>
void product_rows(std::int64_t k, std::int64_t n, const float* a, std::int64_t lda, const float* b,
                  std::int64_t ldb, float* c, std::int64_t ldc) {
  for (std::int64_t j0 = 0; j0 < n; j0 += 2 * kW) {
    const __mmask16 mask[2] = {first_lanes(n - j0), first_lanes(n - j0 - kW)};
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

// bf16 x times a matrix exact in bf16 (RotationData::pair_panel_packs) with vdpbf16ps, which
// multiplies pairs of bf16 lanes and adds both products to an fp32 lane: twice the FMA path's
// k-steps per instruction. The products are exact, so each output is an fp32 sum of exact terms
// like the FMA path's, but summed in another order (odd lane first within a pair) with subnormal
// inputs read as zero and subnormal sums flushed: held to the dot-product error bound
// (tests/cpp/test_dense_bf16_dot.cpp), not to the scalar kernel's bits.
//
// Shape as in dense-inl.hpp: R rows of x staged as bf16 pairs (each block from a pair boundary,
// an odd block padded with a zero lane), each column panel multiplied into an R × 2-vector
// register tile, the fp32 products into scratch rows, the same epilogue with one rounding.

// acc += a · b pair by pair. Inline assembly: the library is not built with -mavx512bf16, and
// this runs only from avx512_kernels(true, true), which the core picks on CPUs with AVX512-BF16
// whose vdpbf16ps is as fast as an fma (AMD; on an Intel Xeon it is a quarter as fast).
ROME_INLINE __m512 dot_bf16_pairs(__m512 acc, __m512i a, __m512i b) {
  __asm__("vdpbf16ps %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));  // AT&T: src2, src1, srcdest
  return acc;
}

// out[r][0, C·16) = x[r] · panel for R rows: `pairs` words of each x row (rows `stride` words
// apart, out rows `out_stride` floats apart), C = 1 for a block's last panel of <= 16 columns.
template <int R, int C>
ROME_INLINE void pair_panel_product(const std::uint32_t* x, std::int64_t stride,
                                    const std::uint32_t* panel, std::int64_t pairs, float* out,
                                    std::int64_t out_stride) {
  constexpr int W = detail::PairPanelMatrix::kWidth;
  __m512 acc[R][C];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < C; ++v) acc[r][v] = _mm512_setzero_ps();
  for (std::int64_t p = 0; p < pairs; ++p) {
    __m512i b[C];
    for (int v = 0; v < C; ++v) b[v] = _mm512_load_si512(panel + p * W + v * kW);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m512i xp = _mm512_set1_epi32(int(x[r * stride + p]));
      for (int v = 0; v < C; ++v) acc[r][v] = dot_bf16_pairs(acc[r][v], xp, b[v]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < C; ++v) _mm512_storeu_ps(out + r * out_stride + v * kW, acc[r][v]);
}

// out = x · m over every diagonal block for R rows, blocks in ascending order (a panel's zero
// columns spill into the next block's first lanes, which that block then overwrites).
template <int R>
void pair_block_products(int rows, const detail::PairPanelMatrix& m,
                         const std::vector<RotationData::Block>& blocks, const std::uint32_t* x,
                         std::int64_t stride, float* out, std::int64_t out_stride,
                         dense_common::RowPrefetch& prefetch) {
  if constexpr (R > 1) {
    if (rows < R)
      return pair_block_products<R - 1>(rows, m, blocks, x, stride, out, out_stride, prefetch);
  }
  constexpr int W = detail::PairPanelMatrix::kWidth;
  std::int64_t pair_first = 0;
  for (std::size_t bi = 0; bi < blocks.size(); ++bi) {
    const std::int64_t o = blocks[bi].offset, n = blocks[bi].size, pairs = (n + 1) / 2;
    const std::uint32_t* panel = m.data() + m.block_first[bi];
    for (std::int64_t c = 0; c < n; c += W, panel += pairs * W) {
      prefetch.step();
      if (n - c > kW)
        pair_panel_product<R, 2>(x + pair_first, stride, panel, pairs, out + o + c, out_stride);
      else
        pair_panel_product<R, 1>(x + pair_first, stride, panel, pairs, out + o + c, out_stride);
    }
    pair_first += pairs;
  }
}

void forward_dense_bf16_dot(const RotationData& r, const ForwardTile& tile) {
  using Bf16 = CountedLanes<DType::bf16>;
  constexpr int R = Avx512Vectors::kDenseRows, W = detail::PairPanelMatrix::kWidth;
  const detail::PairPanelPacks& packs = r.pair_panel_packs();
  const bool dense_a = !r.a_identity;
  const std::int64_t rd = r.rotary_dim, hd = r.head_dim;
  std::int64_t pairs = 0, panels = 0;
  for (const auto& block : r.dense_blocks) {
    pairs += (block.size + 1) / 2;
    panels += (block.size + W - 1) / W;
  }
  // Row strides of the staged pairs (words) and of the product rows (floats).
  const std::int64_t x_stride = (pairs + kW - 1) / kW * kW;
  const std::int64_t out_stride = (std::max(packs.b.padded_columns, rd) + W - 1) / W * W;
  thread_local Scratch scratch;
  char* base =
      static_cast<char*>(scratch.get(sizeof(float) * std::size_t(R * (2 * out_stride + x_stride))));
  float* XB = reinterpret_cast<float*>(base);
  float* XA = XB + R * out_stride;
  auto* XP = reinterpret_cast<std::uint32_t*>(XA + R * out_stride);
  // Lanes past rotary_dim the products may not write but the epilogue's last vector reads:
  // defined, discarded.
  for (int row = 0; row < R; ++row)
    for (std::int64_t j = rd; j < out_stride; ++j)
      XB[row * out_stride + j] = XA[row * out_stride + j] = 0.0f;
  const bool pass = tile.copy_passthrough && hd > rd;
  const std::int64_t row_bytes = rd * std::int64_t(sizeof(std::uint16_t));
  const std::int64_t steps = panels * (dense_a ? 2 : 1);
  for (std::int64_t first = 0; first < tile.count; first += R) {
    const int rows = int(std::min<std::int64_t>(R, tile.count - first));
    // Stage the rows as pairs before any write: a row's y may be its x.
    for (int row = 0; row < rows; ++row) {
      const auto* x = static_cast<const std::uint16_t*>(tile.x_row(first + row));
      auto* staged = reinterpret_cast<std::uint16_t*>(XP + row * x_stride);
      for (const auto& block : r.dense_blocks) {
        std::memcpy(staged, x + block.offset, std::size_t(block.size) * sizeof(std::uint16_t));
        if (block.size % 2) staged[block.size] = 0;
        staged += block.size + block.size % 2;
      }
    }
    auto prefetch = dense_common::RowPrefetch::next_group(tile, first, R, row_bytes, steps);
    pair_block_products<R>(rows, packs.b, r.dense_blocks, XP, x_stride, XB, out_stride, prefetch);
    if (dense_a)
      pair_block_products<R>(rows, packs.a, r.dense_blocks, XP, x_stride, XA, out_stride, prefetch);
    for (int row = 0; row < rows; ++row) {
      const auto* x = static_cast<const std::uint16_t*>(tile.x_row(first + row));
      auto* y = static_cast<std::uint16_t*>(tile.y_row(first + row));
      const float* xb = XB + row * out_stride;
      const float* xa = XA + row * out_stride;
      const float* c = tile.cos_row(first + row);
      const float* s = tile.sin_row(first + row);
      // In place, each vector of x is read before the same lanes of y are written.
      for (std::int64_t j = 0; j < rd; j += kW) {
        const int n = int(std::min<std::int64_t>(kW, rd - j));
        const __m512 xa_j = dense_a   ? _mm512_loadu_ps(xa + j)
                            : n == kW ? Bf16::load(x + j)
                                      : Bf16::load(x + j, n);
        // bf16 x: one fma (kernel_api.hpp: single_fma_epilogue).
        const __m512 v = combine_one_fma(xa_j, _mm512_loadu_ps(c + j), _mm512_loadu_ps(xb + j),
                                         _mm512_loadu_ps(s + j));
        if (n == kW)
          Bf16::store(y + j, v);
        else
          Bf16::store(y + j, v, n);
      }
      if (pass) std::memcpy(y + rd, x + rd, std::size_t(hd - rd) * sizeof(std::uint16_t));
    }
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

void avx512_bf16_forward_dense(const RotationData& r, const ForwardTile& tile) {
  if (tile.dtype == DType::bf16 && r.pair_panel_packs().bf16_exact)
    return forward_dense_bf16_dot(r, tile);
  avx512_forward_dense(r, tile);
}

}  // namespace rome::kernels
