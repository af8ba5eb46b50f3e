// The matrix-unit kernel for dense rotations, RoME's original design on the CPU: x·B (and x·A)
// run as bf16 tile products with fp32 accumulation, and the AVX-512 epilogue applies
// (x·A) ⊙ C + (x·B) ⊙ S with one rounding. Written once against a `Tiles` backend: the AMX
// instructions (amx_kernels.cpp) or a software model of them (tests on CPUs without AMX run the
// same tiling, packing and epilogue; the model sums in another order than the hardware, so both
// are held to the same bound, not to each other's bits).
//
// Only 16-bit x comes here; fp32 x takes the FMA kernel (fp32 work keeps fp32 products).
// Precision: the matrix is split, m = hi + lo with hi, lo bf16 (|m - hi - lo| <= 2^-16·|m|), and
// so is fp16 x (exactly: 11 significant bits fit in two bf16); bf16 x needs no split. The
// products hi·hi + hi·lo + lo·hi are accumulated in fp32 (lo·lo, below 2^-16, is dropped; a
// matrix exact in bf16 has no lo). Per output, |error| <= (3·2^-16 + (rd + 3)·2^-24)·Σ|x_i·M_ij|
// times |C| or |S|, plus the output rounding. The tile unit treats bf16 subnormals as zero
// (inputs below 1.2e-38 contribute nothing).
//
// Blocking: 32 rows of x at a time are staged as bf16 (bf16 x whose blocks are whole multiples of
// 32 lanes is copied as it is; anything else is split per block, zero-padded to 32 lanes). Each
// block's product runs 2 × 2 tiles at once (rows 0-15 / 16-31 × two 16-column tiles of the
// matrix), so every tile load feeds two products and four accumulators hide the product latency
// (one accumulator made every product wait for the previous one: 5x slower). The accumulators
// land in fp32 scratch rows; the epilogue reads them with the tables, one rounding per lane.
#pragma once

#include <algorithm>
#include <cstring>

#include "../avx512/avx512_lanes.hpp"
#include "../kernel_api.hpp"

namespace rome::kernels::amx {

using detail::RotationData;
using detail::TilePackedMatrix;
using namespace avx512;

// Tile registers: kAcc + 2·r + u accumulates rows 16r.. × column tile u (16×16 fp32); kX + r holds
// x rows 16r.. (16 rows × 32 bf16); kM + u a matrix tile (16 VNNI rows × 32 bf16).
constexpr int kAcc = 0, kX = 4, kM = 6;
constexpr int kTileRows = 16, kRows = 2 * kTileRows;
constexpr int kTileK = TilePackedMatrix::kTileK, kTileN = TilePackedMatrix::kTileN;
constexpr std::size_t kTileRowBytes = 64;

// out[32 rows][columns of tiles u0 .. u0 + U) = x · m over one block: k_tiles k-tiles of x
// (x_lo: its lo part too), tiles of m from `first` (row-major over k-tiles, n_tiles per k-tile).
template <class Tiles, int U>
ROME_INLINE void tile_product(const TilePackedMatrix& m, std::int64_t first, std::int64_t n_tiles,
                              std::int64_t k_tiles, std::int64_t u0, const std::uint16_t* xh,
                              const std::uint16_t* xl, std::size_t x_stride, float* out,
                              std::size_t out_stride) {
  static_assert(U == 1 || U == 2);
  Tiles::template zero<kAcc + 0>();
  Tiles::template zero<kAcc + 2>();
  if constexpr (U == 2) {
    Tiles::template zero<kAcc + 1>();
    Tiles::template zero<kAcc + 3>();
  }
  const std::size_t x_half = kTileRows * x_stride;  // bytes to rows 16..31
  auto dots = [](auto) {
    Tiles::template dot<kAcc + 0, kX + 0, kM + 0>();
    Tiles::template dot<kAcc + 2, kX + 1, kM + 0>();
    if constexpr (U == 2) {
      Tiles::template dot<kAcc + 1, kX + 0, kM + 1>();
      Tiles::template dot<kAcc + 3, kX + 1, kM + 1>();
    }
  };
  auto load_m = [&](const std::uint16_t* parts, std::int64_t t) {
    const std::uint16_t* tile =
        parts + (first + t * n_tiles + u0) * TilePackedMatrix::kTileElements;
    Tiles::template load<kM + 0>(tile, kTileRowBytes);
    if constexpr (U == 2)
      Tiles::template load<kM + 1>(tile + TilePackedMatrix::kTileElements, kTileRowBytes);
  };
  for (std::int64_t t = 0; t < k_tiles; ++t) {
    const char* xt = reinterpret_cast<const char*>(xh + t * kTileK);
    Tiles::template load<kX + 0>(xt, x_stride);
    Tiles::template load<kX + 1>(xt + x_half, x_stride);
    load_m(m.hi_tiles(), t);
    dots(0);
    if (m.has_lo) {
      load_m(m.lo_tiles(), t);
      dots(0);
    }
    if (xl) {
      const char* lt = reinterpret_cast<const char*>(xl + t * kTileK);
      Tiles::template load<kX + 0>(lt, x_stride);
      Tiles::template load<kX + 1>(lt + x_half, x_stride);
      load_m(m.hi_tiles(), t);
      dots(0);
    }
  }
  char* o = reinterpret_cast<char*>(out + u0 * kTileN);
  const std::size_t o_half = kTileRows * out_stride;
  Tiles::template store<kAcc + 0>(o, out_stride);
  Tiles::template store<kAcc + 2>(o + o_half, out_stride);
  if constexpr (U == 2) {
    Tiles::template store<kAcc + 1>(o + kTileN * sizeof(float), out_stride);
    Tiles::template store<kAcc + 3>(o + kTileN * sizeof(float) + o_half, out_stride);
  }
}

// out = x · m over every diagonal block, for 32 staged rows. x_block(bi) gives the block's bf16
// hi rows (and lo rows, or null) and their stride in bytes. Blocks run in ascending order: a
// tile's zero-padded columns spill into the next block's first lanes, which that block then
// overwrites.
template <class Tiles, class XBlock>
void block_products(const TilePackedMatrix& m, const std::vector<RotationData::Block>& blocks,
                    XBlock&& x_block, float* out, std::size_t out_stride) {
  for (std::size_t bi = 0; bi < blocks.size(); ++bi) {
    const std::int64_t o = blocks[bi].offset, n = blocks[bi].size;
    const std::int64_t k_tiles = (n + kTileK - 1) / kTileK, n_tiles = (n + kTileN - 1) / kTileN;
    const auto [xh, xl, x_stride] = x_block(bi);
    float* block_out = out + o;
    std::int64_t u = 0;
    for (; u + 2 <= n_tiles; u += 2)
      tile_product<Tiles, 2>(m, m.block_first_tile[bi], n_tiles, k_tiles, u, xh, xl, x_stride,
                             block_out, out_stride);
    if (u < n_tiles)
      tile_product<Tiles, 1>(m, m.block_first_tile[bi], n_tiles, k_tiles, u, xh, xl, x_stride,
                             block_out, out_stride);
  }
}

struct XRows {
  const std::uint16_t* hi;
  const std::uint16_t* lo;  // null: x is exact in bf16
  std::size_t stride;       // bytes between rows
};

inline __mmask16 first_lanes(std::int64_t n) {
  return n >= kW ? __mmask16(0xffff) : n <= 0 ? __mmask16(0) : __mmask16((1u << n) - 1);
}

template <class Tiles, DType D, class N>
void forward_dense(const RotationData& r, const ForwardTile& tile) {
  using L = Lanes<D, N>;
  using T = typename L::T;
  using Bf16 = Lanes<DType::bf16, NarrowExact>;
  static_assert(D != DType::f32, "fp32 x takes the FMA kernel");
  const auto& packs = r.tile_packs();
  const bool dense_a = !r.a_identity;
  const std::int64_t rd = r.rotary_dim, hd = r.head_dim;
  // bf16 rows copied as they are when every block is whole k-tiles (tile loads read them in
  // place); otherwise each block is split into hi (and lo) rows padded to whole k-tiles.
  bool whole_tiles = D == DType::bf16;
  std::int64_t padded_k = 0;  // staged bf16 lanes per row, all blocks
  std::int64_t out_lanes = 0;
  for (const auto& b : r.dense_blocks) {
    whole_tiles &= b.size % kTileK == 0;
    padded_k += (b.size + kTileK - 1) / kTileK * kTileK;
    out_lanes = std::max(out_lanes, b.offset + (b.size + kTileN - 1) / kTileN * kTileN);
  }
  const std::int64_t xs = (rd + kW - 1) / kW * kW;  // fp32 row stride
  const std::int64_t ks =                           // bf16 row stride
      ((whole_tiles ? rd : padded_k) + kTileK - 1) / kTileK * kTileK;
  const std::int64_t os = (std::max(out_lanes, xs) + kW - 1) / kW * kW;
  const bool x_lo = D != DType::bf16;
  // A 16-bit x times a 16-bit table value is exact in fp32 (kernel_api.hpp): one fma.
  const bool exact = !dense_a && exact_products(tile);
  thread_local Scratch scratch;
  // fp32 x rows (split path), x·B rows, x·A rows, then bf16 hi and lo rows.
  float* X = static_cast<float*>(scratch.get(sizeof(float) * std::size_t(kRows * (xs + 2 * os)) +
                                             2 * sizeof(std::uint16_t) * kRows * ks));
  float* XB = X + kRows * xs;
  float* XA = XB + kRows * os;
  auto* xh = reinterpret_cast<std::uint16_t*>(XA + kRows * os);
  std::uint16_t* xl = xh + kRows * ks;
  const std::size_t out_stride = std::size_t(os) * sizeof(float);
  std::vector<std::int64_t> block_k(r.dense_blocks.size());  // first staged lane of each block
  for (std::size_t bi = 0, at = 0; bi < r.dense_blocks.size(); ++bi) {
    block_k[bi] = std::int64_t(at);
    at += std::size_t((r.dense_blocks[bi].size + kTileK - 1) / kTileK * kTileK);
  }
  auto x_block = [&](std::size_t bi) {
    if (whole_tiles) return XRows{xh + r.dense_blocks[bi].offset, nullptr, std::size_t(ks) * 2};
    return XRows{xh + block_k[bi], x_lo ? xl + block_k[bi] : nullptr, std::size_t(ks) * 2};
  };
  Tiles::configure();
  const bool pass = tile.copy_passthrough && hd > rd;
  for (std::int64_t first = 0; first < tile.count; first += kRows) {
    const int rows = int(std::min<std::int64_t>(kRows, tile.count - first));
    // Every row is read before any is written: a row's y may be its x. Rows past the tile's
    // end are zero (the tile unit multiplies all 32; their results are never stored).
    for (int row = 0; row < kRows; ++row) {
      const T* x = row < rows ? static_cast<const T*>(tile.x_row(first + row)) : nullptr;
      if (whole_tiles) {
        std::uint16_t* dst = xh + row * ks;
        for (std::int64_t j = 0; j < ks; j += 32) {
          const __mmask32 m = j + 32 <= rd
                                  ? ~__mmask32(0)
                                  : _bzhi_u32(~0u, unsigned(std::max<std::int64_t>(0, rd - j)));
          _mm512_storeu_si512(dst + j,
                              x ? _mm512_maskz_loadu_epi16(m, x + j) : _mm512_setzero_si512());
        }
        continue;
      }
      for (std::int64_t j = 0; j < xs; j += kW)
        _mm512_store_ps(X + row * xs + j,
                        x ? L::load(x + j, first_lanes(rd - j)) : _mm512_setzero_ps());
      for (std::size_t bi = 0; bi < r.dense_blocks.size(); ++bi) {
        const std::int64_t o = r.dense_blocks[bi].offset, n = r.dense_blocks[bi].size;
        const std::int64_t padded = (n + kTileK - 1) / kTileK * kTileK;
        for (std::int64_t k = 0; k < padded; k += kW) {
          const __m512 v = _mm512_maskz_loadu_ps(first_lanes(n - k), X + row * xs + o + k);
          Bf16::store(xh + row * ks + block_k[bi] + k, v);
          if (x_lo) {
            const __m512 hi = Bf16::load(xh + row * ks + block_k[bi] + k);
            Bf16::store(xl + row * ks + block_k[bi] + k, _mm512_sub_ps(v, hi));
          }
        }
      }
    }
    block_products<Tiles>(packs.b, r.dense_blocks, x_block, XB, out_stride);
    if (dense_a) block_products<Tiles>(packs.a, r.dense_blocks, x_block, XA, out_stride);
    for (int row = 0; row < rows; ++row) {
      // The next rows load while these are finished (staging them waited on memory for a third
      // of the kernel's time); one row per row, so the loads never queue up.
      if (first + kRows + row < tile.count) {
        const char* next = static_cast<const char*>(tile.x_row(first + kRows + row));
        for (std::int64_t b = 0; b < rd * std::int64_t(sizeof(T)); b += 64)
          _mm_prefetch(next + b, _MM_HINT_T0);
      }
      const float* c = tile.cos_row(first + row);
      const float* s = tile.sin_row(first + row);
      T* y = static_cast<T*>(tile.y_row(first + row));
      // Table rows are padded with zeros to whole vectors: no masks to read them.
      auto lanes = [&](std::int64_t j) {
        const __m512 xa = dense_a       ? _mm512_load_ps(XA + row * os + j)
                          : whole_tiles ? Bf16::load(xh + row * ks + j)
                                        : _mm512_load_ps(X + row * xs + j);
        const __m512 xb = _mm512_load_ps(XB + row * os + j);
        const __m512 cj = _mm512_load_ps(c + j), sj = _mm512_load_ps(s + j);
        return exact ? combine_exact_product(xa, cj, xb, sj) : combine(xa, cj, xb, sj);
      };
      std::int64_t j = 0;
      for (; j + 2 * kW <= rd; j += 2 * kW) {
        const __m512 v0 = lanes(j), v1 = lanes(j + kW);
        if constexpr (L::kPairs) {
          const __mmask16 subnormal =
              _mm512_fpclass_ps_mask(v0, 0x20) | _mm512_fpclass_ps_mask(v1, 0x20);
          if (__builtin_expect(subnormal == 0, 1)) {
            _mm512_storeu_si512(y + j, L::narrow_pair(v0, v1));
            continue;
          }
        }
        L::store(y + j, v0);
        L::store(y + j + kW, v1);
      }
      for (; j < rd; j += kW) {
        const __mmask16 m = first_lanes(rd - j);
        const __m512 v = lanes(j);
        if (m == 0xffff)
          L::store(y + j, v);
        else
          L::store(y + j, v, m);
      }
    }
    if (pass)
      for (int row = 0; row < rows; ++row)
        copy_bytes(static_cast<T*>(tile.y_row(first + row)) + rd,
                   static_cast<const T*>(tile.x_row(first + row)) + rd,
                   (hd - rd) * std::int64_t(sizeof(T)), false);
  }
  Tiles::release();
}

// fp32 x goes to `fma_kernel` (the AVX-512 FMA kernel: fp32 products for fp32 work).
template <class Tiles, class N>
void forward_dense_any(const RotationData& r, const ForwardTile& tile, ForwardFn fma_kernel) {
  switch (tile.dtype) {
    case DType::f16: return forward_dense<Tiles, DType::f16, N>(r, tile);
    case DType::bf16: return forward_dense<Tiles, DType::bf16, N>(r, tile);
    default: return fma_kernel(r, tile);
  }
}

}  // namespace rome::kernels::amx
