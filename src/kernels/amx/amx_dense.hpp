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
// Blocking: 32 rows of x at a time. bf16 x whose blocks are whole multiples of 32 lanes is read
// by the tile loads where it is (a partial last group, or rows laid out backwards, is copied);
// anything else is split per block into bf16 rows zero-padded to 32 lanes. Each block's product
// runs 2 × 2 tiles at once (rows 0-15 / 16-31 × two 16-column tiles of the matrix), so every tile
// load feeds two products and four accumulators take turns (with one, every product waited for
// the previous: x [1,24,8192,128] bf16, 41 -> 26 ms on one thread). The accumulators land in fp32
// scratch rows; the epilogue reads them with the tables, one rounding per lane, overlapping the
// next group's products (forward_dense).
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
// between() runs after each k-tile's products: vector work that overlaps the tile unit's.
template <class Tiles, int U, class Between>
ROME_INLINE void tile_product(const TilePackedMatrix& m, std::int64_t first, std::int64_t n_tiles,
                              std::int64_t k_tiles, std::int64_t u0, const std::uint16_t* xh,
                              const std::uint16_t* xl, std::size_t x_stride, float* out,
                              std::size_t out_stride, Between& between) {
  static_assert(U == 1 || U == 2);
  Tiles::template zero<kAcc + 0>();
  Tiles::template zero<kAcc + 2>();
  if constexpr (U == 2) {
    Tiles::template zero<kAcc + 1>();
    Tiles::template zero<kAcc + 3>();
  }
  const std::size_t x_half = kTileRows * x_stride;  // bytes to rows 16..31
  auto dots = [] {
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
    dots();
    if (m.has_lo) {
      load_m(m.lo_tiles(), t);
      dots();
    }
    if (xl) {
      const char* lt = reinterpret_cast<const char*>(xl + t * kTileK);
      Tiles::template load<kX + 0>(lt, x_stride);
      Tiles::template load<kX + 1>(lt + x_half, x_stride);
      load_m(m.hi_tiles(), t);
      dots();
    }
    between();
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

// How a row group's staged x is laid out: bf16 rows as they are (every block whole k-tiles),
// or each block's hi (and lo) lanes padded to whole k-tiles, blocks one after the other.
struct Staging {
  bool whole_tiles;
  bool x_lo;
  std::int64_t ks;  // bf16 lanes per staged row
};

inline std::int64_t k_tiles_of(std::int64_t n) {
  return (n + kTileK - 1) / kTileK;
}
inline std::int64_t n_tiles_of(std::int64_t n) {
  return (n + kTileN - 1) / kTileN;
}

// k-tile steps of one group's products (between() calls).
inline std::int64_t product_steps(const RotationData& r) {
  std::int64_t steps = 0;
  for (const auto& b : r.dense_blocks) steps += (n_tiles_of(b.size) + 1) / 2 * k_tiles_of(b.size);
  return steps * (r.a_identity ? 1 : 2);
}

// out = x · m over every diagonal block, for 32 rows of x (xh, xl, x_stride bytes apart). Blocks
// run in ascending order: a tile's zero-padded columns spill into the next block's first lanes,
// which that block then overwrites.
template <class Tiles, class Between>
void block_products(const TilePackedMatrix& m, const std::vector<RotationData::Block>& blocks,
                    const Staging& st, const std::uint16_t* xh, const std::uint16_t* xl,
                    std::size_t x_stride, float* out, std::size_t out_stride, Between& between) {
  std::int64_t k_at = 0;  // the block's first staged lane (split staging)
  for (std::size_t bi = 0; bi < blocks.size(); ++bi) {
    const std::int64_t o = blocks[bi].offset, n = blocks[bi].size;
    const std::int64_t k_tiles = k_tiles_of(n), n_tiles = n_tiles_of(n);
    const std::int64_t at = st.whole_tiles ? o : k_at;
    const std::uint16_t* bh = xh + at;
    const std::uint16_t* bl = st.x_lo ? xl + at : nullptr;
    k_at += k_tiles * kTileK;
    const std::int64_t first = m.block_first_tile[bi];
    std::int64_t u = 0;
    for (; u + 2 <= n_tiles; u += 2)
      tile_product<Tiles, 2>(m, first, n_tiles, k_tiles, u, bh, bl, x_stride, out + o, out_stride,
                             between);
    if (u < n_tiles)
      tile_product<Tiles, 1>(m, first, n_tiles, k_tiles, u, bh, bl, x_stride, out + o, out_stride,
                             between);
  }
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
  Staging st{D == DType::bf16, D != DType::bf16, 0};
  std::int64_t padded_k = 0, out_lanes = 0;
  for (const auto& b : r.dense_blocks) {
    st.whole_tiles &= b.size % kTileK == 0;
    padded_k += k_tiles_of(b.size) * kTileK;
    out_lanes = std::max(out_lanes, b.offset + n_tiles_of(b.size) * kTileN);
  }
  st.ks = k_tiles_of(st.whole_tiles ? rd : padded_k) * kTileK;
  const std::int64_t ks = st.ks;
  const std::int64_t xs = (rd + kW - 1) / kW * kW;  // fp32 row stride (split staging)
  const std::int64_t os = (std::max(out_lanes, xs) + kW - 1) / kW * kW;
  const std::size_t out_stride = std::size_t(os) * sizeof(float);
  // Two buffers of each: one group's products run while the previous group is finished.
  const std::size_t group_bytes = sizeof(float) * std::size_t(kRows * (xs + 2 * os)) +
                                  2 * sizeof(std::uint16_t) * std::size_t(kRows * ks);
  thread_local Scratch scratch;
  char* base = static_cast<char*>(scratch.get(2 * group_bytes));
  struct Buffers {
    float *X, *XB, *XA;  // fp32 x (split staging), x·B, x·A
    std::uint16_t *xh, *xl;
    // The group's bf16 rows as the products and the epilogue read them: xh, or x itself.
    const std::uint16_t* rows;
    std::int64_t row_step;  // elements
  };
  auto rows_of = [&](std::int64_t first) {
    return int(std::min<std::int64_t>(kRows, tile.count - first));
  };
  auto buffers = [&](int b) {
    float* X = reinterpret_cast<float*>(base + b * group_bytes);
    float* XB = X + kRows * xs;
    float* XA = XB + kRows * os;
    auto* xh = reinterpret_cast<std::uint16_t*>(XA + kRows * os);
    return Buffers{X, XB, XA, xh, xh + kRows * ks, xh, ks};
  };
  // bf16 x in whole k-tiles, 32 rows evenly spaced forward: the tile unit and the epilogue read
  // the rows where they are, nothing is staged. In place too: a group's products read only its
  // own rows, and each row's lanes are read before the same lanes are written.
  const bool direct = st.whole_tiles && tile.x_step > 0;
  auto group = [&](std::int64_t first, int parity) {
    Buffers b = buffers(parity);
    if (direct && rows_of(first) == kRows) {
      b.rows = static_cast<const std::uint16_t*>(tile.x_row(first));
      b.row_step = tile.x_step / std::int64_t(sizeof(std::uint16_t));
    }
    return b;
  };
  // Every row of a group is read here, before any is written (a row's y may be its x). Rows
  // past the tile's end are zero (the tile unit multiplies all 32; they are never stored).
  auto stage = [&](std::int64_t first, const Buffers& b) {
    const int rows = rows_of(first);
    for (int row = 0; row < kRows; ++row) {
      const T* x = row < rows ? static_cast<const T*>(tile.x_row(first + row)) : nullptr;
      if (st.whole_tiles) {
        std::uint16_t* dst = b.xh + row * ks;
        for (std::int64_t j = 0; j < ks; j += 32) {
          const __mmask32 m = j + 32 <= rd
                                  ? ~__mmask32(0)
                                  : _bzhi_u32(~0u, unsigned(std::max<std::int64_t>(0, rd - j)));
          _mm512_storeu_si512(dst + j,
                              x ? _mm512_maskz_loadu_epi16(m, x + j) : _mm512_setzero_si512());
        }
        continue;
      }
      float* X = b.X + row * xs;
      for (std::int64_t j = 0; j < xs; j += kW)
        _mm512_store_ps(X + j, x ? L::load(x + j, first_lanes(rd - j)) : _mm512_setzero_ps());
      std::int64_t k_at = 0;
      for (const auto& block : r.dense_blocks) {
        const std::int64_t padded = k_tiles_of(block.size) * kTileK;
        for (std::int64_t k = 0; k < padded; k += kW) {
          const __m512 v = _mm512_maskz_loadu_ps(first_lanes(block.size - k), X + block.offset + k);
          std::uint16_t* h = b.xh + row * ks + k_at + k;
          Bf16::store(h, v);
          if (st.x_lo) Bf16::store(b.xl + row * ks + k_at + k, _mm512_sub_ps(v, Bf16::load(h)));
        }
        k_at += padded;
      }
    }
  };
  // One row of a group, finished: y = xa ⊙ C + xb ⊙ S, and the passed-through lanes.
  auto finish_row = [&](std::int64_t first, const Buffers& b, int row) {
    const float* c = tile.cos_row(first + row);
    const float* s = tile.sin_row(first + row);
    T* y = static_cast<T*>(tile.y_row(first + row));
    // Table rows are padded with zeros to whole vectors: no masks to read them.
    auto lanes = [&](std::int64_t j) {
      const __m512 xa = dense_a          ? _mm512_load_ps(b.XA + row * os + j)
                        : st.whole_tiles ? Bf16::load(b.rows + row * b.row_step + j)
                                         : _mm512_load_ps(b.X + row * xs + j);
      const __m512 xb = _mm512_load_ps(b.XB + row * os + j);
      const __m512 cj = _mm512_load_ps(c + j), sj = _mm512_load_ps(s + j);
      return combine_one_fma(xa, cj, xb, sj);  // 16-bit x: kernel_api.hpp's single_fma_epilogue
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
    if (tile.copy_passthrough && hd > rd)
      copy_bytes(y + rd, static_cast<const T*>(tile.x_row(first + row)) + rd,
                 (hd - rd) * std::int64_t(sizeof(T)), false);
  };
  // Software pipeline over groups of 32 rows: while the tile unit multiplies group g, the vector
  // units finish group g - 1 a few rows per k-tile step (run one after the other, the products
  // and the epilogue took 16 + 9 ns per row in L2: overlapping them can hide the smaller), and
  // ask for group g + 1's rows, staged next.
  const std::int64_t steps = product_steps(r);
  struct Pending {
    std::int64_t first = -1;  // the group being finished (-1: none)
    int next_row = 0, rows = 0, per_step = 0;
    Buffers b{};
  } pending;
  auto finish_some = [&](int count) {
    for (; count > 0 && pending.next_row < pending.rows; --count, ++pending.next_row) {
      const int row = pending.next_row;
      const std::int64_t ahead = pending.first + 2 * kRows + row;  // staged after this group
      if (ahead < tile.count) {
        const char* next = static_cast<const char*>(tile.x_row(ahead));
        for (std::int64_t byte = 0; byte < rd * std::int64_t(sizeof(T)); byte += 64)
          _mm_prefetch(next + byte, _MM_HINT_T0);
      }
      finish_row(pending.first, pending.b, row);
    }
  };
  auto between = [&] { finish_some(pending.per_step); };
  Tiles::configure();
  auto stage_group = [&](std::int64_t first, int parity) {
    const Buffers b = group(first, parity);
    if (b.rows == b.xh) stage(first, b);
  };
  stage_group(0, 0);
  for (std::int64_t first = 0, g = 0; first < tile.count; first += kRows, ++g) {
    const Buffers b = group(first, int(g & 1));
    const std::size_t x_stride = std::size_t(b.row_step) * sizeof(std::uint16_t);
    block_products<Tiles>(packs.b, r.dense_blocks, st, b.rows, b.xl, x_stride, b.XB, out_stride,
                          between);
    if (dense_a)
      block_products<Tiles>(packs.a, r.dense_blocks, st, b.rows, b.xl, x_stride, b.XA, out_stride,
                            between);
    finish_some(kRows);
    if (first + kRows < tile.count) stage_group(first + kRows, int((g + 1) & 1));
    pending = Pending{first, 0, rows_of(first), int((rows_of(first) + steps - 1) / steps), b};
  }
  Tiles::release();
  finish_some(kRows);
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
