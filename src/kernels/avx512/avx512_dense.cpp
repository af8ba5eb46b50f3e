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
// Shape: R rows of x staged as bf16 pairs (each block from a pair boundary, an odd block padded
// with a zero lane; a row's y may be its x), then per column panel of B (and of A, in the same
// loop over the pairs) an R × 2-vector register tile whose epilogue (⊙cos, ⊙sin, the sum, one
// rounding) runs on the accumulators and stores the panel's lanes of y, a row at a time inside
// the next tile's products (PendingEpilogue): no fp32 scratch rows, y written once. A 12 × 2
// tile alone issues a vdpbf16ps every 0.28 ns on an AVX-512 Zen 4 (~230 GFLOP/s); in the whole
// call the epilogue added about 9% and the staging, tables and executor about 8% (BENCHMARKS.md,
// twenty-sixth session).

// acc += a · b pair by pair, with the x pair read from memory and broadcast inside the instruction
// ({1to16}): one instruction instead of a broadcast and a product. Inline assembly: the library is
// not built with -mavx512bf16, and this runs only from avx512_kernels(true, true), which the core
// picks on CPUs with AVX512-BF16 whose vdpbf16ps is as fast as an fma (AMD; on an Intel Xeon it is
// a quarter as fast).
ROME_INLINE __m512 dot_bf16_pairs(__m512 acc, __m512i b, const std::uint32_t* x_pair) {
  __asm__("vdpbf16ps %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(b), "m"(*x_pair));  // AT&T order
  return acc;
}

// Rows of the tile per register tile: 12 × 2 vectors of x·B (24 accumulators + 2 panel vectors of
// the 32 registers), or 6 × 2 of x·A and 6 × 2 of x·B (4 panel vectors) when A is dense.
template <bool kDenseA>
constexpr int kDotRows = kDenseA ? 6 : 12;

// One column panel of one diagonal block: lanes [column, column + width) of y, the block's columns
// of the panel (width <= 32; one vector per row when width <= 16).
struct DotPanel {
  const std::uint32_t* b;  // the panel of B (pairs × 32 words)
  const std::uint32_t* a;  // the panel of A when dense
  const std::uint32_t* x;  // the block's first pair of the first staged row
  std::int64_t pairs, column, width;
};

// x, y and table rows of a group of R rows.
template <int R>
struct RowPointers {
  const std::uint16_t* x[R];
  std::uint16_t* y[R];
  const float* cos[R];
  const float* sin[R];

  RowPointers<R> at_lane(std::int64_t lane) const {
    RowPointers<R> p;
    for (int r = 0; r < R; ++r)
      p.x[r] = x[r] + lane, p.y[r] = y[r] + lane, p.cos[r] = cos[r] + lane,
      p.sin[r] = sin[r] + lane;
    return p;
  }
};

// A register tile whose products are done and whose epilogue (⊙cos, ⊙sin, the sum, one rounding,
// the store) is still to run: the next tile's products run it a row at a time between their
// steps, so its loads, conversions and stores issue beside the dot products instead of after them
// (run after each tile's products, the epilogue took 0.22x the products' time on an AVX-512 Zen 4).
template <bool kDenseA>
struct PendingEpilogue {
  alignas(64) __m512 b[kDotRows<kDenseA>][2];                // x·B
  alignas(64) __m512 a[kDenseA ? kDotRows<kDenseA> : 1][2];  // x·A when dense
  RowPointers<kDotRows<kDenseA>> row;  // of the tile's rows, at the panel's first lane
  std::int64_t width = 0;
  int rows = 0;  // 0: nothing pending
};

// Row r of a pending tile into y. In place, a panel's lanes of x are read before the same lanes of
// y are written; no other panel writes them. bf16 x: one fma (kernel_api.hpp: single_fma_epilogue).
template <bool kDenseA>
ROME_INLINE void epilogue_row(const PendingEpilogue<kDenseA>& t, int r) {
  using Bf16 = avx512::Lanes<DType::bf16, NarrowBf16Insn>;
  const std::uint16_t* x = t.row.x[r];
  std::uint16_t* y = t.row.y[r];
  const float *c = t.row.cos[r], *s = t.row.sin[r];
  if (__builtin_expect(t.width == 2 * kW, 1)) {
    // A whole panel: unmasked loads the arithmetic folds in, and both vectors narrowed by one
    // vcvtne2ps2bf16 where neither has a subnormal lane (the instruction would flush it).
    __m512 out[2];
#pragma GCC unroll 2
    for (int v = 0; v < 2; ++v) {
      const __m512 xa = kDenseA ? t.a[r][v] : Bf16::load(x + v * kW);
      out[v] =
          combine_one_fma(xa, _mm512_loadu_ps(c + v * kW), t.b[r][v], _mm512_loadu_ps(s + v * kW));
    }
    const __mmask16 subnormal =
        _kor_mask16(_mm512_fpclass_ps_mask(out[0], 0x20), _mm512_fpclass_ps_mask(out[1], 0x20));
    if (__builtin_expect(_kortestz_mask16_u8(subnormal, subnormal), 1)) {
      _mm512_storeu_si512(y, Bf16::narrow_pair(out[0], out[1]));
    } else {
      Bf16::store(y, out[0]);
      Bf16::store(y + kW, out[1]);
    }
    return;
  }
  for (int v = 0; v * kW < t.width; ++v) {
    const __mmask16 m = first_lanes(t.width - v * kW);
    const __m512 xa = kDenseA ? t.a[r][v] : Bf16::load(x + v * kW, m);
    const __m512 out = combine_one_fma(xa, _mm512_maskz_loadu_ps(m, c + v * kW), t.b[r][v],
                                       _mm512_maskz_loadu_ps(m, s + v * kW));
    Bf16::store(y + v * kW, out, m);
  }
}

template <bool kDenseA>
void finish_epilogue(PendingEpilogue<kDenseA>& pending, int from = 0) {
  for (int r = from; r < pending.rows; ++r) epilogue_row(pending, r);
  pending.rows = 0;
}

// The R staged rows · the panel (and · A's), over the panel's pairs, running the pending tile's
// epilogue a row every four pairs; then this tile becomes the pending one. Out of line: inlined
// into the caller's loops, GCC 12 spilled accumulators to the stack on every step (the asm
// operands); alone it keeps all of them in registers.
template <int R, int C, bool kDenseA>
__attribute__((noinline)) void dot_products(const DotPanel& panel, std::int64_t x_stride,
                                            const RowPointers<kDotRows<kDenseA>>& rows,
                                            PendingEpilogue<kDenseA>& pending) {
  constexpr int W = detail::PairPanelMatrix::kWidth;
  __m512 acc_b[R][C], acc_a[R][C];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int v = 0; v < C; ++v) {
      acc_b[r][v] = _mm512_setzero_ps();
      if constexpr (kDenseA) acc_a[r][v] = _mm512_setzero_ps();
    }
  int pending_row = 0;
  const std::uint32_t* x = panel.x;
  for (std::int64_t p = 0; p < panel.pairs; ++p, ++x) {
    __m512i b[C], a[C];
#pragma GCC unroll 2
    for (int v = 0; v < C; ++v) {
      b[v] = _mm512_load_si512(panel.b + p * W + v * kW);
      if constexpr (kDenseA) a[v] = _mm512_load_si512(panel.a + p * W + v * kW);
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
      for (int v = 0; v < C; ++v) {
        acc_b[r][v] = dot_bf16_pairs(acc_b[r][v], b[v], x + r * x_stride);
        if constexpr (kDenseA) acc_a[r][v] = dot_bf16_pairs(acc_a[r][v], a[v], x + r * x_stride);
      }
    if ((p & 3) == 3 && pending_row < pending.rows) epilogue_row(pending, pending_row++);
  }
  finish_epilogue(pending, pending_row);
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int v = 0; v < C; ++v) {
      pending.b[r][v] = acc_b[r][v];
      if constexpr (kDenseA) pending.a[r][v] = acc_a[r][v];
    }
  pending.row = rows.at_lane(panel.column);
  pending.width = panel.width;
  pending.rows = R;
}

// Every panel of every diagonal block for the R rows at `first`.
template <int R, bool kDenseA>
void dot_rows(int rows, const detail::PairPanelPacks& packs,
              const std::vector<RotationData::Block>& blocks, const std::uint32_t* x,
              std::int64_t x_stride, const RowPointers<kDotRows<kDenseA>>& row_pointers,
              dense_common::RowPrefetch& prefetch, PendingEpilogue<kDenseA>& pending) {
  if constexpr (R > 1) {
    if (rows < R)
      return dot_rows<R - 1, kDenseA>(rows, packs, blocks, x, x_stride, row_pointers, prefetch,
                                      pending);
  }
  constexpr int W = detail::PairPanelMatrix::kWidth;
  std::int64_t pair_first = 0;
  for (std::size_t bi = 0; bi < blocks.size(); ++bi) {
    const std::int64_t o = blocks[bi].offset, n = blocks[bi].size, pairs = (n + 1) / 2;
    DotPanel panel{packs.b.data() + packs.b.block_first[bi],
                   kDenseA ? packs.a.data() + packs.a.block_first[bi] : nullptr,
                   x + pair_first,
                   pairs,
                   o,
                   0};
    for (std::int64_t c = 0; c < n; c += W, panel.column += W) {
      prefetch.step();
      panel.width = std::min<std::int64_t>(W, n - c);
      if (panel.width > kW)
        dot_products<R, 2, kDenseA>(panel, x_stride, row_pointers, pending);
      else
        dot_products<R, 1, kDenseA>(panel, x_stride, row_pointers, pending);
      panel.b += pairs * W;
      if constexpr (kDenseA) panel.a += pairs * W;
    }
    pair_first += pairs;
  }
}

template <bool kDenseA>
void forward_dense_bf16_dot(const RotationData& r, const ForwardTile& tile) {
  constexpr int R = kDotRows<kDenseA>, W = detail::PairPanelMatrix::kWidth;
  const detail::PairPanelPacks& packs = r.pair_panel_packs();
  const std::int64_t rd = r.rotary_dim, hd = r.head_dim;
  std::int64_t pairs = 0, panels = 0;
  for (const auto& block : r.dense_blocks) {
    pairs += (block.size + 1) / 2;
    panels += (block.size + W - 1) / W;
  }
  const std::int64_t x_stride = (pairs + kW - 1) / kW * kW;  // words per staged row
  thread_local Scratch scratch;
  auto* staged_rows =
      static_cast<std::uint32_t*>(scratch.get(sizeof(std::uint32_t) * R * x_stride));
  PendingEpilogue<kDenseA> pending;
  const bool pass = tile.copy_passthrough && hd > rd;
  const std::int64_t row_bytes = rd * std::int64_t(sizeof(std::uint16_t));
  // Every block even: a staged row is the row's first rotary_dim lanes.
  const bool even_blocks =
      std::all_of(r.dense_blocks.begin(), r.dense_blocks.end(),
                  [](const RotationData::Block& b) { return b.size % 2 == 0; });
  for (std::int64_t first = 0; first < tile.count; first += R) {
    const int rows = int(std::min<std::int64_t>(R, tile.count - first));
    RowPointers<R> row_pointers;
    for (int row = 0; row < R; ++row) {
      const std::int64_t n = first + std::min(row, rows - 1);  // rows past the tile: never read
      row_pointers.x[row] = static_cast<const std::uint16_t*>(tile.x_row(n));
      row_pointers.y[row] = static_cast<std::uint16_t*>(tile.y_row(n));
      row_pointers.cos[row] = tile.cos_row(n);
      row_pointers.sin[row] = tile.sin_row(n);
    }
    // Stage the rows as pairs before any of their lanes of y is written: a row's y may be its x.
    // (The pending epilogue writes earlier rows only.)
    for (int row = 0; row < rows; ++row) {
      const std::uint16_t* x = row_pointers.x[row];
      if (even_blocks) {
        avx512::copy_bytes(staged_rows + row * x_stride, x, row_bytes, false);
        continue;
      }
      auto* staged = reinterpret_cast<std::uint16_t*>(staged_rows + row * x_stride);
      for (const auto& block : r.dense_blocks) {
        std::memcpy(staged, x + block.offset, std::size_t(block.size) * sizeof(std::uint16_t));
        if (block.size % 2) staged[block.size] = 0;
        staged += block.size + block.size % 2;
      }
    }
    auto prefetch = dense_common::RowPrefetch::next_group(tile, first, R, row_bytes, panels);
    dot_rows<R, kDenseA>(rows, packs, r.dense_blocks, staged_rows, x_stride, row_pointers, prefetch,
                         pending);
    if (pass)
      for (int row = 0; row < rows; ++row)
        std::memcpy(row_pointers.y[row] + rd, row_pointers.x[row] + rd,
                    std::size_t(hd - rd) * sizeof(std::uint16_t));
  }
  finish_epilogue(pending);
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
    return r.a_identity ? forward_dense_bf16_dot<false>(r, tile)
                        : forward_dense_bf16_dot<true>(r, tile);
  avx512_forward_dense(r, tile);
}

}  // namespace rome::kernels
