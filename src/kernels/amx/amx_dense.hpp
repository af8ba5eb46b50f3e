// The matrix-unit kernel for dense rotations, RoME's original design on the CPU: x·B (and x·A)
// run as bf16 tile products with fp32 accumulation, and the AVX-512 epilogue applies
// (x·A) ⊙ C + (x·B) ⊙ S with one rounding. Written once against a `Tiles` backend: the AMX
// instructions (amx_kernels.cpp) or an exact software model of them (tests on CPUs without
// AMX run the same tiling, packing and epilogue).
//
// Precision: bf16 tiles would round x and the matrix to 8 bits. Both are split, v = hi + lo
// with hi, lo bf16 (|v - hi - lo| <= 2^-16·|v|), and the products hi·hi + hi·lo + lo·hi are
// accumulated (lo·lo, below 2^-16, is dropped; a part that is all zero is skipped: bf16 x has
// no lo, signed or bf16-exact matrices have no lo). Per output, |error| <= (3·2^-16 +
// (rd + 3)·2^-24)·Σ|x_i·M_ij| times |C| or |S|, plus the output rounding.
#pragma once

#include <algorithm>
#include <cstring>

#include "../avx512/avx512_lanes.hpp"
#include "../kernel_api.hpp"

namespace rome::kernels::amx {

using detail::RotationData;
using detail::TilePackedMatrix;
using namespace avx512;

// Tile registers: 0, 1 accumulate x·B and x·A (16×16 fp32); 2, 3 hold x hi/lo (16 rows × 32
// bf16); 4, 5 the matrix tile hi/lo (16 VNNI rows × 32 bf16).
constexpr int kTileRows = 16, kTileK = TilePackedMatrix::kTileK, kTileN = TilePackedMatrix::kTileN;
constexpr std::size_t kRowBytes = 64;

template <class Tiles>
void accumulate_product(const TilePackedMatrix& m, std::int64_t tile, bool x_lo,
                        const std::uint16_t* xh, const std::uint16_t* xl,
                        std::size_t x_stride_bytes) {
  const std::uint16_t* hi = m.hi.data() + tile * TilePackedMatrix::kTileElements;
  const std::uint16_t* lo = m.lo.data() + tile * TilePackedMatrix::kTileElements;
  Tiles::template load<2>(xh, x_stride_bytes);
  Tiles::template load<4>(hi, kRowBytes);
  Tiles::template dot<0, 2, 4>();
  if (m.has_lo) {
    Tiles::template load<5>(lo, kRowBytes);
    Tiles::template dot<0, 2, 5>();
  }
  if (x_lo) {
    Tiles::template load<3>(xl, x_stride_bytes);
    Tiles::template dot<0, 3, 4>();
  }
}

template <class Tiles, DType D>
void forward_dense(const RotationData& r, const ForwardTile& tile) {
  using L = Lanes<D, NarrowExact>;
  using T = typename L::T;
  const auto& packs = r.tile_packs();
  const bool dense_a = !r.a_identity;
  const bool x_lo = D != DType::bf16;
  const std::int64_t rd = r.rotary_dim, hd = r.head_dim;
  const std::int64_t xs = (rd + kW - 1) / kW * kW;  // fp32 staging stride
  std::int64_t widest = 0;
  for (const auto& b : r.dense_blocks) widest = std::max(widest, b.size);
  const std::int64_t ks = (widest + kTileK - 1) / kTileK * kTileK;  // bf16 staging stride
  thread_local Scratch scratch;
  // fp32 rows, then the current block's bf16 hi and lo rows.
  float* X = static_cast<float*>(
      scratch.get(sizeof(float) * std::size_t(kTileRows * xs + kTileRows * ks)));
  auto* xh = reinterpret_cast<std::uint16_t*>(X + kTileRows * xs);
  std::uint16_t* xl = xh + kTileRows * ks;
  alignas(64) float acc[2][kTileRows * kTileN];  // x·A, x·B of one 16×16 output tile
  Tiles::configure();
  const bool pass = tile.copy_passthrough && hd > rd;
  for (std::int64_t first = 0; first < tile.count; first += kTileRows) {
    const int rows = int(std::min<std::int64_t>(kTileRows, tile.count - first));
    for (int row = 0; row < rows; ++row) {  // all rows read before any write: y may be x
      const T* x = static_cast<const T*>(tile.x_row(first + row));
      for (std::int64_t j = 0; j < rd; j += kW) {
        const std::int64_t left = rd - j;
        const __mmask16 m = left >= kW ? __mmask16(0xffff) : __mmask16((1u << left) - 1);
        _mm512_store_ps(X + row * xs + j, L::load(x + j, m));
      }
    }
    for (std::size_t bi = 0; bi < r.dense_blocks.size(); ++bi) {
      const std::int64_t o = r.dense_blocks[bi].offset, n = r.dense_blocks[bi].size;
      // The block's lanes as bf16 hi/lo, zero past its end (other blocks never leak in).
      for (int row = 0; row < kTileRows; ++row)
        for (std::int64_t k = 0; k < ks; k += kW) {
          const std::int64_t left = n - k;
          const __mmask16 m = left >= kW  ? __mmask16(0xffff)
                              : left <= 0 ? 0
                                          : __mmask16((1u << left) - 1);
          const __m512 v =
              row < rows ? _mm512_maskz_loadu_ps(m, X + row * xs + o + k) : _mm512_setzero_ps();
          Lanes<DType::bf16, NarrowExact>::store(xh + row * ks + k, v);
          if (x_lo) {
            const __m512 hi = Lanes<DType::bf16, NarrowExact>::load(xh + row * ks + k);
            Lanes<DType::bf16, NarrowExact>::store(xl + row * ks + k, _mm512_sub_ps(v, hi));
          }
        }
      const std::int64_t k_tiles = (n + kTileK - 1) / kTileK, n_tiles = (n + kTileN - 1) / kTileN;
      for (std::int64_t u = 0; u < n_tiles; ++u) {
        Tiles::template zero<0>();
        for (std::int64_t t = 0; t < k_tiles; ++t)
          accumulate_product<Tiles>(packs.b, packs.b.block_first_tile[bi] + t * n_tiles + u, x_lo,
                                    xh + t * kTileK, xl + t * kTileK, std::size_t(ks) * 2);
        Tiles::template store<0>(acc[1], kRowBytes);
        if (dense_a) {
          Tiles::template zero<0>();
          for (std::int64_t t = 0; t < k_tiles; ++t)
            accumulate_product<Tiles>(packs.a, packs.a.block_first_tile[bi] + t * n_tiles + u, x_lo,
                                      xh + t * kTileK, xl + t * kTileK, std::size_t(ks) * 2);
          Tiles::template store<0>(acc[0], kRowBytes);
        }
        const std::int64_t j = o + u * kTileN, left = o + n - j;
        const __mmask16 m = left >= kW ? __mmask16(0xffff) : __mmask16((1u << left) - 1);
        for (int row = 0; row < rows; ++row) {
          const __m512 c = _mm512_maskz_loadu_ps(m, tile.cos_row(first + row) + j);
          const __m512 s = _mm512_maskz_loadu_ps(m, tile.sin_row(first + row) + j);
          const __m512 xa = dense_a ? _mm512_load_ps(acc[0] + row * kTileN)
                                    : _mm512_maskz_loadu_ps(m, X + row * xs + j);
          const __m512 y = combine(xa, c, _mm512_load_ps(acc[1] + row * kTileN), s);
          L::store(static_cast<T*>(tile.y_row(first + row)) + j, y, m);
        }
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

template <class Tiles>
void forward_dense_any(const RotationData& r, const ForwardTile& tile) {
  switch (tile.dtype) {
    case DType::f32: return forward_dense<Tiles, DType::f32>(r, tile);
    case DType::f16: return forward_dense<Tiles, DType::f16>(r, tile);
    case DType::bf16: return forward_dense<Tiles, DType::bf16>(r, tile);
    default: return scalar_kernels().forward_dense(r, tile);
  }
}

}  // namespace rome::kernels::amx
