// What a Rotation holds after analysis; shared by the core and every kernel.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "rome/rotation.hpp"

namespace rome::detail {

// A signed partial permutation: output lane j reads lane src[j] times sign[j] (sign 0: nothing).
struct SignedPermutation {
  std::vector<std::int32_t> src;
  std::vector<std::int8_t> sign;

  static SignedPermutation identity(std::int64_t dim);
  SignedPermutation transposed() const;  // valid when every lane is read at most once
  bool is_identity() const;
};

// A signed permutation split into SIMD vectors of `width` lanes. Output vector v is built by the
// steps [step_begin[v], step_begin[v+1]): each permutes source vectors src0 (and src1, for
// two-source permutes such as vpermt2ps) with idx and blends the result into the lanes it owns.
// Lane indices in idx are < width, or in [width, 2·width) when they read src1.
struct PermuteStep {
  std::int32_t src0 = 0;
  std::int32_t src1 = 0;
  std::uint32_t lanes = 0;  // bit l: this step fills output lane l
  std::int32_t idx[16] = {};
};

struct VectorPermutePlan {
  int width = 0;
  std::int64_t vectors = 0;
  std::vector<std::int32_t> step_begin;
  std::vector<PermuteStep> steps;
  std::vector<std::uint32_t> sign_bits;  // 0x80000000 on lanes whose sign is negative
  std::vector<std::uint32_t> keep_bits;  // 0xFFFFFFFF on lanes that have a source

  static VectorPermutePlan build(const SignedPermutation& perm, int width, bool two_sources);
};

struct PermutePlans {
  VectorPermutePlan a, b;  // x·A, x·B
};

// The first 64-byte aligned element of v (vectors of packed matrices carry slack for it). Derived
// on every call, so a copy of the vector stays correct.
template <class T>
const T* first_aligned_64(const std::vector<T>& v) {
  const auto address = reinterpret_cast<std::uintptr_t>(v.data());
  return v.data() + (64 - address % 64) % 64 / sizeof(T);
}

// A dense matrix split into bf16 hi + lo parts (m ≈ hi + lo to about 2^-16 relative) and packed
// as AMX B tiles: per diagonal block, tiles of 32 k-rows × 16 n-columns in VNNI order (row p
// holds the pairs (m[k0+2p][n], m[k0+2p+1][n]) for 16 n), zero outside the block.
struct TilePackedMatrix {
  static constexpr int kTileK = 32, kTileN = 16, kTileElements = kTileK * kTileN;
  std::vector<std::uint16_t> hi, lo;  // the tiles plus 32 elements of slack for the alignment
  std::vector<std::int64_t> block_first_tile;  // index of each block's first tile
  bool has_lo = false;                         // false when every entry is exact in bf16

  // The first tile, 64-byte aligned (a tile row is one cache line).
  const std::uint16_t* hi_tiles() const { return first_aligned_64(hi); }
  const std::uint16_t* lo_tiles() const { return first_aligned_64(lo); }
  std::uint16_t* hi_tiles() { return const_cast<std::uint16_t*>(first_aligned_64(hi)); }
  std::uint16_t* lo_tiles() { return const_cast<std::uint16_t*>(first_aligned_64(lo)); }
};
struct TilePacks {
  TilePackedMatrix a, b;  // a empty when A = I
};

// A dense matrix packed for the fp32 FMA kernels: per diagonal block, column panels `width`
// floats wide (zero past the block's end), each block.size rows of `width` contiguous floats, so
// the kernels' inner loop reads whole aligned vectors with no masks. Panel p of block bi starts
// at data() + block_first[bi] + p·size·width.
struct PanelPackedMatrix {
  int width = 0;
  std::vector<std::int64_t> block_first;
  std::int64_t padded_columns = 0;  // the last panel's end: kernels' scratch rows need this many
  std::vector<float> storage;       // the panels plus 16 floats of slack for the alignment

  const float* data() const { return first_aligned_64(storage); }
  float* data() { return const_cast<float*>(std::as_const(*this).data()); }
};
struct PanelPacks {
  PanelPackedMatrix a, b;  // a empty when A = I
};

// A dense matrix exact in bf16, packed for the bf16 dot-product kernels (vdpbf16ps): per diagonal
// block, column panels kWidth columns wide (zero past the block's end) of (size + 1) / 2 rows of
// kWidth 32-bit words. Word j of row p holds the pair m[2p][j] (low half), m[2p + 1][j] (high
// half) as bf16; an odd block's last row has a zero high half. Panel q of block bi starts at
// data() + block_first[bi] + q·pairs·kWidth.
struct PairPanelMatrix {
  static constexpr int kWidth = 32;
  std::vector<std::int64_t> block_first;
  std::vector<std::uint32_t> storage;  // the panels plus 16 words of slack for the alignment

  const std::uint32_t* data() const { return first_aligned_64(storage); }
  std::uint32_t* data() { return const_cast<std::uint32_t*>(std::as_const(*this).data()); }
};
struct PairPanelPacks {
  // Every entry of B (and of A when dense) is zero or a normal bf16 value, so its products with
  // bf16 x are exact in fp32 (the instruction reads subnormals as zero). False: nothing packed.
  bool bf16_exact = false;
  PairPanelMatrix a, b;  // a empty when A = I
};

// A number no other rotation built in this process has (copies keep it: they share the
// analysed matrices). Kernels that cache per-rotation data check it before comparing content.
std::uint64_t next_rotation_uid() noexcept;

// TableLayout::even_odd_16 of n values (a multiple of 16): each 16's even lanes, then its odd
// ones (table rows for the kernels that split bf16 x the same way, and their sign bits).
template <typename T>
void split_even_odd_16(const T* in, std::int64_t n, T* out) {
  for (std::int64_t k = 0; k < n; k += 16)
    for (int i = 0; i < 8; ++i) {
      out[k + i] = in[k + 2 * i];
      out[k + 8 + i] = in[k + 2 * i + 1];
    }
}

struct RotationData {
  std::uint64_t uid = next_rotation_uid();
  std::int64_t head_dim = 0;
  std::int64_t rotary_dim = 0;
  // Lanes before the rotated ones. The executors never see it: they run `unshifted` (this
  // rotation with head_dim - lane_offset lanes and no offset) on views narrowed by the offset.
  std::int64_t lane_offset = 0;
  std::shared_ptr<const RotationData> unshifted;
  Rotation::Kind kind = Rotation::Kind::signed_permutation;
  bool a_identity = true;

  // kind == signed_permutation
  SignedPermutation a, b, a_t, b_t;
  // rotary_dim lanes each: 0x80000000 where A (for cos) or B (for sin) has a negative sign. The
  // executor folds them into the table rows it hands to the kernels: (±x)·c == x·(±c) and
  // fma(±x, s, t) == fma(x, ±s, t) bit for bit, so kernels only move lanes.
  std::vector<std::uint32_t> cos_sign_bits, sin_sign_bits;
  // The same in TableLayout::even_odd_16 order (split_even_odd_16), when rotary_dim is whole
  // 16-lane chunks; else empty.
  std::vector<std::uint32_t> cos_sign_bits_even_odd_16, sin_sign_bits_even_odd_16;
  // Table-free RoPE: the frequency index of each output lane, when the rotation turns pairs of
  // output lanes {j, m} by one angle each ((x·B)[j] reads the lane that (x·A)[m] reads, and the
  // other way round, with opposite signs); pairs are numbered by their lower lane. Empty when
  // the rotation does not pair lanes that way.
  std::vector<std::int32_t> lane_frequency;
  std::int64_t frequency_count = 0;
  // lane_frequency[j] == j % frequency_count (half): a row is its frequencies' values twice.
  bool lane_frequency_halves = false;
  PermutePlans avx2;    // 8 lanes, one source per step
  PermutePlans avx512;  // 16 lanes, two sources per step

  // kind == dense: rotary_dim × rotary_dim row-major; dense_a is empty when A = I.
  std::vector<float> dense_a, dense_b;
  // Diagonal blocks outside which A and B are zero: output lane j in block [offset, offset+size)
  // only sums inputs of that block (44+44+40 costs Σ size² instead of rotary_dim²).
  struct Block {
    std::int64_t offset, size;
  };
  std::vector<Block> dense_blocks;

  // Built on first use by the matrix-unit kernel (and its emulation in the tests).
  const TilePacks& tile_packs() const;
  // Built on first use by the FMA dense kernels; width 16 or 32 floats.
  const PanelPacks& panel_packs(int width) const;
  // Built on first use by the bf16 dot-product kernel (and by tests asking whether it applies).
  const PairPanelPacks& pair_panel_packs() const;

 private:
  struct LazyTilePacks {
    std::once_flag once;
    TilePacks packs;
  };
  std::shared_ptr<LazyTilePacks> lazy_tile_packs_ = std::make_shared<LazyTilePacks>();
  struct LazyPanelPacks {
    std::once_flag once[2];
    PanelPacks packs[2];
  };
  std::shared_ptr<LazyPanelPacks> lazy_panel_packs_ = std::make_shared<LazyPanelPacks>();
  struct LazyPairPanelPacks {
    std::once_flag once;
    PairPanelPacks packs;
  };
  std::shared_ptr<LazyPairPanelPacks> lazy_pair_panel_packs_ =
      std::make_shared<LazyPairPanelPacks>();
};

}  // namespace rome::detail
