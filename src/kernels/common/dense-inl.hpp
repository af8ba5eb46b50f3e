// The dense forward y = (x·A) ⊙ cos + (x·B) ⊙ sin as fp32 FMA products, written once over a
// vector-traits type and compiled per ISA.
//
// Shape of the work: a group of R rows of x is staged in fp32; each column panel of B (packed
// once per rotation, RotationData::panel_packs) is multiplied into an R × (2 vectors) register
// tile, BLIS-style: per step of the inner loop two aligned panel loads, R broadcasts of x and
// 2R fmas, with no masks (panels are zero-padded); a block's last panel holding at most kLanes
// of its columns takes one vector per row. The products land in an fp32 scratch row and
// the epilogue applies the tables with one rounding per lane. x·A, when A is dense, is a second
// product into a second scratch row.
//
// Every output lane is one fma per input lane of its diagonal block, in ascending order from
// +0, and the epilogue is combine_lane, or combine_lane_one_fma for 16-bit x (combine-inl.hpp,
// kernel_api.hpp's single_fma_epilogue): bit for bit the scalar kernel on every ISA, whatever R or
// the panel width.
//
// The traits type V provides: F (a vector of kLanes floats); kDenseRows (R: R·2 accumulators +
// 2 panel vectors + 1 broadcast must fit the register file); Lanes<D> (load/store of storage
// type D, whole or the first n lanes); zero(), load(const float*), broadcast(const float*),
// fma(a, b, c) = a·b + c rounded once, store(float*, F) (unaligned forms), combine(xa, c, xb, s),
// combine_one_fma(xa, c, xb, s); optionally any_nan(a, b) and Lanes<D>::store_pair_not_nan, which
// let the one-fma epilogue take 2·kLanes lanes at a time (kStoresPairs).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "../kernel_api.hpp"
#include "../kernel_support.hpp"

namespace rome::kernels::dense_common {

// out[r][0, C·kLanes) = x[r][0, k) · panel (its first C vectors of each panel row), for R rows
// (x rows `stride` floats apart). C = 1 serves a block's last panel when at most kLanes of its
// columns are the block's: half the fmas of a whole panel.
template <class V, int R, int C>
ROME_INLINE void panel_product(const float* x, std::int64_t stride, const float* panel,
                               std::int64_t k, float* out) {
  using F = typename V::F;
  constexpr int L = V::kLanes;
  F acc[R][C];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < C; ++v) acc[r][v] = V::zero();
  for (std::int64_t i = 0; i < k; ++i) {
    F b[C];
    for (int v = 0; v < C; ++v) b[v] = V::load(panel + i * 2 * L + v * L);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const F xi = V::broadcast(x + r * stride + i);
      for (int v = 0; v < C; ++v) acc[r][v] = V::fma(xi, b[v], acc[r][v]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < C; ++v) V::store(out + r * stride + v * L, acc[r][v]);
}

// Rows [row, end) of x (and of y, out of place) into the cache a few lines per step, the steps
// spread over a group's products: issued at once, the prefetches stalled on the line fill
// buffers (AVX-512, bf16 rows from DRAM: unprefetched, the loads of x and stores to y were half
// the time outside the products).
struct RowPrefetch {
  const ForwardTile& tile;
  std::int64_t row, end, row_bytes, per_step, byte = 0;

  // The group of `rows` rows after the one at `first`, `row_bytes` each, over `steps` steps.
  static RowPrefetch next_group(const ForwardTile& tile, std::int64_t first, int rows,
                                std::int64_t row_bytes, std::int64_t steps) {
    const std::int64_t lines = rows * ((row_bytes + 63) / 64);
    return {tile, first + rows, std::min(first + 2 * rows, tile.count), row_bytes,
            (lines + steps - 1) / steps};
  }

  void step() {
    const bool in_place = tile.x == tile.y;
    for (std::int64_t n = 0; n < per_step && row < end; ++n) {
      __builtin_prefetch(static_cast<const char*>(tile.x_row(row)) + byte);
      if (!in_place) __builtin_prefetch(static_cast<const char*>(tile.y_row(row)) + byte, 1);
      if ((byte += 64) >= row_bytes) byte = 0, ++row;
    }
  }
};

// Panels x · m takes: the steps a RowPrefetch spreads over.
inline std::int64_t panel_count(const detail::PanelPackedMatrix& m,
                                const std::vector<detail::RotationData::Block>& blocks) {
  std::int64_t panels = 0;
  for (const auto& block : blocks) panels += (block.size + m.width - 1) / m.width;
  return panels;
}

// out = x · m over every diagonal block, for R rows. Blocks run in ascending order: a panel's
// zero-padded columns spill into the next block's first lanes, which that block then overwrites.
template <class V, int R>
void block_products(const detail::PanelPackedMatrix& m,
                    const std::vector<detail::RotationData::Block>& blocks, const float* x,
                    std::int64_t stride, float* out, RowPrefetch& prefetch) {
  const int w = m.width;
  for (std::size_t bi = 0; bi < blocks.size(); ++bi) {
    const std::int64_t o = blocks[bi].offset, n = blocks[bi].size;
    const float* panel = m.data() + m.block_first[bi];
    for (std::int64_t c = 0; c < n; c += w, panel += n * w) {
      prefetch.step();
      if (n - c > V::kLanes)
        panel_product<V, R, 2>(x + o, stride, panel, n, out + o + c);
      else
        panel_product<V, R, 1>(x + o, stride, panel, n, out + o + c);
    }
  }
}

template <class V, int R = V::kDenseRows>
void block_products(int rows, const detail::PanelPackedMatrix& m,
                    const std::vector<detail::RotationData::Block>& blocks, const float* x,
                    std::int64_t stride, float* out, RowPrefetch& prefetch) {
  if constexpr (R > 1) {
    if (rows < R) return block_products<V, R - 1>(rows, m, blocks, x, stride, out, prefetch);
  }
  block_products<V, R>(m, blocks, x, stride, out, prefetch);
}

// Whether V's storage lanes of D narrow two vectors with no NaN lane in one step (AVX2 bf16).
template <class V, DType D>
constexpr bool kStoresPairs = requires(typename V::template Lanes<D>::T* y, typename V::F v) {
  V::template Lanes<D>::store_pair_not_nan(y, v, v);
  V::any_nan(v, v);
};

template <class V, DType D>
void forward_dense(const detail::RotationData& r, const ForwardTile& tile) {
  using Lanes = typename V::template Lanes<D>;
  using T = typename Lanes::T;
  constexpr int L = V::kLanes, R = V::kDenseRows, W = 2 * L;
  const detail::PanelPacks& packs = r.panel_packs(W);
  const bool dense_a = !r.a_identity;
  const std::int64_t rd = r.rotary_dim, hd = r.head_dim;
  const std::int64_t padded = std::max(packs.b.padded_columns, (rd + L - 1) / L * L);
  const std::int64_t stride = (padded + W - 1) / W * W;
  thread_local Scratch scratch;
  float* X = static_cast<float*>(scratch.get(sizeof(float) * std::size_t(3 * R * stride)));
  float* XB = X + R * stride;
  float* XA = XB + R * stride;
  // Lanes past rotary_dim the products may not write but the epilogue's last vector reads:
  // defined, discarded.
  for (int row = 0; row < R; ++row)
    for (std::int64_t j = rd; j < stride; ++j) XB[row * stride + j] = XA[row * stride + j] = 0.0f;
  const bool pass = tile.copy_passthrough && hd > rd;
  constexpr bool kOneFma = single_fma_epilogue(D);
  const std::int64_t row_bytes = rd * std::int64_t(sizeof(T));
  const std::int64_t steps = panel_count(packs.b, r.dense_blocks) * (dense_a ? 2 : 1);
  for (std::int64_t first = 0; first < tile.count; first += R) {
    const int rows = int(std::min<std::int64_t>(R, tile.count - first));
    // Stage the rows in fp32 before any write: a row's y may be its x.
    for (int row = 0; row < rows; ++row) {
      const T* x = static_cast<const T*>(tile.x_row(first + row));
      for (std::int64_t j = 0; j < rd; j += L) {
        const int n = int(std::min<std::int64_t>(L, rd - j));
        V::store(X + row * stride + j, n == L ? Lanes::load(x + j) : Lanes::load(x + j, n));
      }
    }
    // The next group's rows, staged after these products.
    RowPrefetch prefetch = RowPrefetch::next_group(tile, first, R, row_bytes, steps);
    block_products<V>(rows, packs.b, r.dense_blocks, X, stride, XB, prefetch);
    if (dense_a) block_products<V>(rows, packs.a, r.dense_blocks, X, stride, XA, prefetch);
    const float* xa_rows = dense_a ? XA : X;
    for (int row = 0; row < rows; ++row) {
      const float* xa = xa_rows + row * stride;
      const float* xb = XB + row * stride;
      const float* c = tile.cos_row(first + row);
      const float* s = tile.sin_row(first + row);
      T* y = static_cast<T*>(tile.y_row(first + row));
      // Lanes [k, k + L) of the epilogue (kernel_api.hpp: single_fma_epilogue).
      auto lanes = [&](std::int64_t k) ROME_INLINE_LAMBDA {
        const auto a = V::load(xa + k), ck = V::load(c + k), b = V::load(xb + k);
        if constexpr (kOneFma)
          return V::combine_one_fma(a, ck, b, V::load(s + k));
        else
          return V::combine(a, ck, b, V::load(s + k));
      };
      std::int64_t j = 0;
      if constexpr (kOneFma && kStoresPairs<V, D>) {
        // Two vectors at a time without the NaN-aware narrowing where neither has a NaN lane.
        for (; j + 2 * L <= rd; j += 2 * L) {
          const auto v0 = lanes(j), v1 = lanes(j + L);
          if (__builtin_expect(!V::any_nan(v0, v1), 1)) {
            Lanes::store_pair_not_nan(y + j, v0, v1);
          } else {
            Lanes::store(y + j, v0);
            Lanes::store(y + j + L, v1);
          }
        }
      }
      for (; j < rd; j += L) {
        const auto v = lanes(j);
        const int n = int(std::min<std::int64_t>(L, rd - j));
        if (n == L)
          Lanes::store(y + j, v);
        else
          Lanes::store(y + j, v, n);
      }
      if (pass)
        std::memcpy(y + rd, static_cast<const T*>(tile.x_row(first + row)) + rd,
                    std::size_t(hd - rd) * sizeof(T));
    }
  }
}

}  // namespace rome::kernels::dense_common
