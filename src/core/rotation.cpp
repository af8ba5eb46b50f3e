#include "rome/rotation.hpp"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <stdexcept>
#include <string>

#include "convert.hpp"
#include "rome/error.hpp"
#include "rotation_data.hpp"

namespace rome {
namespace detail {

SignedPermutation SignedPermutation::identity(std::int64_t dim) {
  SignedPermutation p;
  p.src.resize(dim);
  p.sign.assign(dim, 1);
  for (std::int64_t j = 0; j < dim; ++j) p.src[j] = std::int32_t(j);
  return p;
}

SignedPermutation SignedPermutation::transposed() const {
  const std::size_t dim = src.size();
  SignedPermutation t;
  t.src.assign(dim, 0);
  t.sign.assign(dim, 0);
  for (std::size_t j = 0; j < dim; ++j) {
    if (sign[j] == 0) continue;
    t.src[src[j]] = std::int32_t(j);
    t.sign[src[j]] = sign[j];
  }
  return t;
}

bool SignedPermutation::is_identity() const {
  for (std::size_t j = 0; j < src.size(); ++j)
    if (sign[j] != 1 || src[j] != std::int32_t(j)) return false;
  return true;
}

VectorPermutePlan VectorPermutePlan::build(const SignedPermutation& perm, int width,
                                           bool two_sources) {
  VectorPermutePlan plan;
  const std::int64_t dim = std::int64_t(perm.src.size());
  plan.width = width;
  plan.vectors = (dim + width - 1) / width;
  plan.sign_bits.assign(plan.vectors * width, 0u);
  plan.keep_bits.assign(plan.vectors * width, 0u);
  plan.step_begin.push_back(0);
  for (std::int64_t v = 0; v < plan.vectors; ++v) {
    // Source vectors this output vector reads, in first-use order.
    std::vector<std::int32_t> sources;
    for (int l = 0; l < width; ++l) {
      const std::int64_t j = v * width + l;
      if (j >= dim || perm.sign[j] == 0) continue;
      plan.keep_bits[j] = 0xffffffffu;
      if (perm.sign[j] < 0) plan.sign_bits[j] = 0x80000000u;
      const std::int32_t s = perm.src[j] / width;
      bool seen = false;
      for (auto x : sources) seen |= x == s;
      if (!seen) sources.push_back(s);
    }
    const std::size_t per_step = two_sources ? 2 : 1;
    for (std::size_t first = 0; first < sources.size(); first += per_step) {
      PermuteStep step;
      step.src0 = sources[first];
      step.src1 = first + 1 < sources.size() && two_sources ? sources[first + 1] : step.src0;
      for (int l = 0; l < width; ++l) {
        const std::int64_t j = v * width + l;
        if (j >= dim || perm.sign[j] == 0) continue;
        const std::int32_t s = perm.src[j] / width, lane = perm.src[j] % width;
        if (s == step.src0) {
          step.idx[l] = lane;
        } else if (two_sources && s == step.src1) {
          step.idx[l] = lane + width;
        } else {
          continue;
        }
        step.lanes |= 1u << l;
      }
      plan.steps.push_back(step);
    }
    plan.step_begin.push_back(std::int32_t(plan.steps.size()));
  }
  return plan;
}

namespace {

TilePackedMatrix pack_tiles(const std::vector<float>& m, std::int64_t dim,
                            const std::vector<RotationData::Block>& blocks) {
  using P = TilePackedMatrix;
  P packed;
  std::int64_t tiles = 0;
  for (const auto& block : blocks) {
    packed.block_first_tile.push_back(tiles);
    tiles +=
        ((block.size + P::kTileK - 1) / P::kTileK) * ((block.size + P::kTileN - 1) / P::kTileN);
  }
  packed.hi.assign(tiles * P::kTileElements + 32, 0);
  packed.lo.assign(tiles * P::kTileElements + 32, 0);
  std::uint16_t* hi_tiles = packed.hi_tiles();
  std::uint16_t* lo_tiles = packed.lo_tiles();
  for (std::size_t bi = 0; bi < blocks.size(); ++bi) {
    const std::int64_t o = blocks[bi].offset, n = blocks[bi].size;
    const std::int64_t n_tiles = (n + P::kTileN - 1) / P::kTileN;
    for (std::int64_t k = 0; k < n; ++k)
      for (std::int64_t j = 0; j < n; ++j) {
        const float v = m[(o + k) * dim + o + j];
        const std::uint16_t hi = float_to_bf16(v);
        const std::uint16_t lo = float_to_bf16(v - bf16_to_float(hi));
        const std::int64_t tile =
            packed.block_first_tile[bi] + (k / P::kTileK) * n_tiles + j / P::kTileN;
        const std::int64_t kk = k % P::kTileK, jj = j % P::kTileN;
        const std::int64_t at =
            tile * P::kTileElements + (kk / 2) * (2 * P::kTileN) + jj * 2 + kk % 2;
        hi_tiles[at] = hi;
        lo_tiles[at] = lo;
        packed.has_lo |= lo != 0 && (lo & 0x7fff) != 0;
      }
  }
  return packed;
}

}  // namespace

const TilePacks& RotationData::tile_packs() const {
  std::call_once(lazy_tile_packs_->once, [&] {
    if (!dense_a.empty()) lazy_tile_packs_->packs.a = pack_tiles(dense_a, rotary_dim, dense_blocks);
    lazy_tile_packs_->packs.b = pack_tiles(dense_b, rotary_dim, dense_blocks);
  });
  return lazy_tile_packs_->packs;
}

namespace {

PanelPackedMatrix pack_panels(const std::vector<float>& m, std::int64_t dim,
                              const std::vector<RotationData::Block>& blocks, int width) {
  PanelPackedMatrix packed;
  packed.width = width;
  std::int64_t floats = 0;
  for (const auto& block : blocks) {
    packed.block_first.push_back(floats);
    const std::int64_t panels = (block.size + width - 1) / width;
    floats += panels * block.size * width;
    packed.padded_columns = std::max(packed.padded_columns, block.offset + panels * width);
  }
  packed.storage.assign(std::size_t(floats) + 16, 0.0f);
  float* data = packed.data();
  for (std::size_t bi = 0; bi < blocks.size(); ++bi) {
    const std::int64_t o = blocks[bi].offset, n = blocks[bi].size;
    for (std::int64_t i = 0; i < n; ++i)
      for (std::int64_t j = 0; j < n; ++j)
        data[packed.block_first[bi] + (j / width) * n * width + i * width + j % width] =
            m[(o + i) * dim + o + j];
  }
  return packed;
}

}  // namespace

const PanelPacks& RotationData::panel_packs(int width) const {
  if (width != 16 && width != 32) throw std::logic_error("panel_packs: width must be 16 or 32");
  const int slot = width == 16 ? 0 : 1;
  std::call_once(lazy_panel_packs_->once[slot], [&] {
    PanelPacks& packs = lazy_panel_packs_->packs[slot];
    if (!dense_a.empty()) packs.a = pack_panels(dense_a, rotary_dim, dense_blocks, width);
    packs.b = pack_panels(dense_b, rotary_dim, dense_blocks, width);
  });
  return lazy_panel_packs_->packs[slot];
}

namespace {

// Zero or a normal bf16 value: its product with a bf16 value is exact in fp32, also on the
// dot-product instruction, which reads bf16 subnormals as zero.
bool bf16_dot_exact(float v) {
  const std::uint32_t bits = float_bits(v), exponent = bits & 0x7f800000u;
  return (bits & 0xffffu) == 0 && (exponent != 0 || (bits & 0x7fffffffu) == 0);
}

PairPanelMatrix pack_pair_panels(const std::vector<float>& m, std::int64_t dim,
                                 const std::vector<RotationData::Block>& blocks) {
  constexpr int w = PairPanelMatrix::kWidth;
  PairPanelMatrix packed;
  std::int64_t words = 0;
  for (const auto& block : blocks) {
    packed.block_first.push_back(words);
    const std::int64_t panels = (block.size + w - 1) / w;
    words += panels * ((block.size + 1) / 2) * w;
  }
  packed.storage.assign(std::size_t(words) + 16, 0u);
  std::uint32_t* data = packed.data();
  for (std::size_t bi = 0; bi < blocks.size(); ++bi) {
    const std::int64_t o = blocks[bi].offset, n = blocks[bi].size, pairs = (n + 1) / 2;
    for (std::int64_t i = 0; i < n; ++i)
      for (std::int64_t j = 0; j < n; ++j)
        data[packed.block_first[bi] + (j / w) * pairs * w + (i / 2) * w + j % w] |=
            std::uint32_t(float_bits(m[(o + i) * dim + o + j]) >> 16) << (16 * (i % 2));
  }
  return packed;
}

}  // namespace

const PairPanelPacks& RotationData::pair_panel_packs() const {
  std::call_once(lazy_pair_panel_packs_->once, [&] {
    PairPanelPacks& packs = lazy_pair_panel_packs_->packs;
    packs.bf16_exact = kind == Rotation::Kind::dense &&
                       std::all_of(dense_a.begin(), dense_a.end(), bf16_dot_exact) &&
                       std::all_of(dense_b.begin(), dense_b.end(), bf16_dot_exact);
    if (!packs.bf16_exact) return;
    if (!dense_a.empty()) packs.a = pack_pair_panels(dense_a, rotary_dim, dense_blocks);
    packs.b = pack_pair_panels(dense_b, rotary_dim, dense_blocks);
  });
  return lazy_pair_panel_packs_->packs;
}

std::uint64_t next_rotation_uid() noexcept {
  static std::atomic<std::uint64_t> next{1};
  return next.fetch_add(1, std::memory_order_relaxed);
}

}  // namespace detail

namespace {

using detail::RotationData;
using detail::SignedPermutation;

void require_dim(const char* argument, std::int64_t dim, std::int64_t multiple) {
  if (dim <= 0 || dim % multiple != 0 || dim > (std::int64_t(1) << 24))
    fail(Status::invalid_argument, argument,
         "a positive multiple of " + std::to_string(multiple) + " (at most 2^24)",
         std::to_string(dim));
}

// RotationData::lane_frequency of a signed permutation (empty when lanes do not pair up).
std::vector<std::int32_t> lane_frequencies(const RotationData& d) {
  const std::int64_t rd = d.rotary_dim;
  std::vector<std::int32_t> partner(std::size_t(rd), -1);
  for (std::int64_t j = 0; j < rd; ++j) {
    if (d.b.sign[j] == 0) return {};
    const std::int32_t m = d.a_t.src[std::size_t(d.b.src[j])];  // the output lane A fills from it
    if (d.a_t.sign[std::size_t(d.b.src[j])] == 0 || m == j) return {};
    partner[j] = m;
  }
  std::vector<std::int32_t> index(std::size_t(rd), -1);
  std::int32_t next = 0;
  for (std::int64_t j = 0; j < rd; ++j) {
    const std::int32_t m = partner[j];
    // y_j = u_j·c + b_j·a_m·u_m·s with u = x·A: a rotation of (u_j, u_m) needs opposite signs.
    if (partner[m] != j || d.b.sign[j] * d.a.sign[m] != -d.b.sign[m] * d.a.sign[j]) return {};
    if (index[j] < 0) index[j] = index[m] = next++;
  }
  return index;
}

void finish_permutation(RotationData& d) {
  d.kind = Rotation::Kind::signed_permutation;
  d.a_identity = d.a.is_identity();
  d.a_t = d.a.transposed();
  d.b_t = d.b.transposed();
  auto plans = [&](int width, bool two) {
    return detail::PermutePlans{detail::VectorPermutePlan::build(d.a, width, two),
                                detail::VectorPermutePlan::build(d.b, width, two)};
  };
  d.avx2 = plans(8, false);
  d.avx512 = plans(16, true);
  auto sign_bits = [&](const SignedPermutation& p) {
    std::vector<std::uint32_t> bits(std::size_t(d.rotary_dim), 0u);
    for (std::size_t j = 0; j < bits.size(); ++j)
      if (p.sign[j] < 0) bits[j] = 0x80000000u;
    return bits;
  };
  d.cos_sign_bits = sign_bits(d.a);
  d.sin_sign_bits = sign_bits(d.b);
  auto even_odd_16 = [](const std::vector<std::uint32_t>& bits) {
    std::vector<std::uint32_t> split;
    if (bits.empty() || bits.size() % 16 != 0) return split;
    split.resize(bits.size());
    detail::split_even_odd_16(bits.data(), std::int64_t(bits.size()), split.data());
    return split;
  };
  d.cos_sign_bits_even_odd_16 = even_odd_16(d.cos_sign_bits);
  d.sin_sign_bits_even_odd_16 = even_odd_16(d.sin_sign_bits);
  d.lane_frequency = lane_frequencies(d);
  d.frequency_count = std::int64_t(d.lane_frequency.size()) / 2;
  d.lane_frequency_halves = d.frequency_count > 0;
  for (std::size_t j = 0; j < d.lane_frequency.size(); ++j)
    d.lane_frequency_halves =
        d.lane_frequency_halves && d.lane_frequency[j] == std::int64_t(j) % d.frequency_count;
}

std::shared_ptr<RotationData> permutation_rotation(std::int64_t dim, SignedPermutation a,
                                                   SignedPermutation b) {
  auto d = std::make_shared<RotationData>();
  d->head_dim = d->rotary_dim = dim;
  d->a = std::move(a);
  d->b = std::move(b);
  finish_permutation(*d);
  return d;
}

SignedPermutation half_permutation(std::int64_t dim, std::int64_t offset = 0) {
  SignedPermutation b;
  b.src.resize(dim);
  b.sign.resize(dim);
  const std::int64_t h = dim / 2;
  for (std::int64_t j = 0; j < dim; ++j) {
    b.src[j] = std::int32_t(offset + (j < h ? j + h : j - h));
    b.sign[j] = j < h ? -1 : 1;
  }
  return b;
}

// Reads a dense matrix as a signed permutation when every column holds at most one ±1 and
// every row is read at most once (so its transpose is one too); otherwise returns false.
bool as_signed_permutation(std::span<const float> m, std::int64_t dim, SignedPermutation& out) {
  out.src.assign(dim, 0);
  out.sign.assign(dim, 0);
  std::vector<char> row_used(dim, 0);
  for (std::int64_t j = 0; j < dim; ++j) {
    for (std::int64_t i = 0; i < dim; ++i) {
      const float v = m[i * dim + j];
      if (v == 0.0f) continue;
      if ((v != 1.0f && v != -1.0f) || out.sign[j] != 0 || row_used[i]) return false;
      out.src[j] = std::int32_t(i);
      out.sign[j] = v > 0 ? 1 : -1;
      row_used[i] = 1;
    }
  }
  return true;
}

std::vector<float> permutation_to_dense(const SignedPermutation& p) {
  const std::int64_t dim = std::int64_t(p.src.size());
  std::vector<float> m(dim * dim, 0.0f);
  for (std::int64_t j = 0; j < dim; ++j)
    if (p.sign[j] != 0) m[p.src[j] * dim + j] = float(p.sign[j]);
  return m;
}

// Splits [0, dim) into the smallest diagonal blocks that hold every nonzero of a and b (a may
// be empty: the identity, which is block diagonal at any split).
std::vector<RotationData::Block> diagonal_blocks(std::span<const float> a, std::span<const float> b,
                                                 std::int64_t dim) {
  // reach[i]: the furthest index that row i or column i connects to.
  std::vector<std::int64_t> reach(dim);
  for (std::int64_t i = 0; i < dim; ++i) reach[i] = i;
  for (std::int64_t i = 0; i < dim; ++i)
    for (std::int64_t j = 0; j < dim; ++j)
      if (b[i * dim + j] != 0.0f || (!a.empty() && a[i * dim + j] != 0.0f)) {
        reach[i] = std::max(reach[i], j);
        reach[j] = std::max(reach[j], i);
      }
  std::vector<RotationData::Block> blocks;
  for (std::int64_t start = 0; start < dim;) {
    std::int64_t end = reach[start];
    for (std::int64_t i = start; i <= end; ++i) end = std::max(end, reach[i]);
    blocks.push_back({start, end + 1 - start});
    start = end + 1;
  }
  return blocks;
}

void require_matrix(const char* argument, std::span<const float> m, std::int64_t dim) {
  require_dim("dim", dim, 2);
  if (std::int64_t(m.size()) != dim * dim)
    fail(Status::invalid_argument, argument,
         std::to_string(dim * dim) + " values (a " + std::to_string(dim) + "x" +
             std::to_string(dim) + " matrix)",
         std::to_string(m.size()) + " values");
  for (float v : m)
    if (!std::isfinite(v))
      fail(Status::invalid_argument, argument, "finite entries", "a NaN or infinite entry");
}

}  // namespace

Rotation Rotation::half(std::int64_t dim) {
  require_dim("dim", dim, 2);
  return Rotation(
      permutation_rotation(dim, SignedPermutation::identity(dim), half_permutation(dim)));
}

Rotation Rotation::interleave(std::int64_t dim) {
  require_dim("dim", dim, 2);
  SignedPermutation b;
  b.src.resize(dim);
  b.sign.resize(dim);
  for (std::int64_t j = 0; j < dim; j += 2) {
    b.src[j] = std::int32_t(j + 1);
    b.sign[j] = -1;
    b.src[j + 1] = std::int32_t(j);
    b.sign[j + 1] = 1;
  }
  return Rotation(permutation_rotation(dim, SignedPermutation::identity(dim), std::move(b)));
}

Rotation Rotation::quarter(std::int64_t dim) {
  require_dim("dim", dim, 4);
  SignedPermutation b;
  for (std::int64_t offset = 0; offset < dim; offset += dim / 2) {
    SignedPermutation h = half_permutation(dim / 2, offset);
    b.src.insert(b.src.end(), h.src.begin(), h.src.end());
    b.sign.insert(b.sign.end(), h.sign.begin(), h.sign.end());
  }
  return Rotation(permutation_rotation(dim, SignedPermutation::identity(dim), std::move(b)));
}

Rotation Rotation::interleave_half(std::int64_t dim) {
  require_dim("dim", dim, 2);
  // Output lane j holds de-interleaved lane d(j): evens first, then odds. With z = x·A the
  // de-interleaved head, y = z ⊙ C + rotate_half(z) ⊙ S, so B = A · half.
  const std::int64_t h = dim / 2;
  SignedPermutation a = SignedPermutation::identity(dim);
  for (std::int64_t j = 0; j < dim; ++j) a.src[j] = std::int32_t(j < h ? 2 * j : 2 * (j - h) + 1);
  SignedPermutation half = half_permutation(dim), b;
  b.src.resize(dim);
  b.sign.resize(dim);
  for (std::int64_t j = 0; j < dim; ++j) {
    b.src[j] = a.src[half.src[j]];
    b.sign[j] = half.sign[j];
  }
  return Rotation(permutation_rotation(dim, std::move(a), std::move(b)));
}

Rotation Rotation::dense(std::span<const float> b, std::int64_t dim) {
  require_matrix("b", b, dim);
  return dense(permutation_to_dense(SignedPermutation::identity(dim)), b, dim);
}

Rotation Rotation::dense(std::span<const float> a, std::span<const float> b, std::int64_t dim) {
  require_matrix("b", b, dim);
  require_matrix("a", a, dim);
  SignedPermutation pa, pb;
  if (as_signed_permutation(a, dim, pa) && as_signed_permutation(b, dim, pb))
    return Rotation(permutation_rotation(dim, std::move(pa), std::move(pb)));
  return Rotation(dense_rotation(a, b, dim));
}

Rotation Rotation::as_dense() const {
  const std::int64_t rd = rotary_dim();
  const std::vector<float> a = to_dense_a(), b = to_dense_b();
  Rotation dense(dense_rotation(a, b, rd));
  return head_dim() == rd && lane_offset() == 0 ? dense : dense.partial(head_dim(), lane_offset());
}

std::shared_ptr<RotationData> Rotation::dense_rotation(std::span<const float> a,
                                                       std::span<const float> b, std::int64_t dim) {
  auto d = std::make_shared<RotationData>();
  d->head_dim = d->rotary_dim = dim;
  d->kind = Kind::dense;
  d->a_identity = a.size() == 0 || permutation_to_dense(SignedPermutation::identity(dim)) ==
                                       std::vector<float>(a.begin(), a.end());
  if (!d->a_identity) d->dense_a.assign(a.begin(), a.end());
  d->dense_b.assign(b.begin(), b.end());
  d->dense_blocks = diagonal_blocks(d->a_identity ? std::span<const float>{} : a, b, dim);
  return d;
}

Rotation Rotation::block_diag(std::initializer_list<Rotation> blocks) {
  return block_diag(std::span<const Rotation>(blocks.begin(), blocks.size()));
}

Rotation Rotation::block_diag(std::span<const Rotation> blocks) {
  if (blocks.empty()) fail(Status::invalid_argument, "blocks", "at least one block", "none");
  std::int64_t dim = 0;
  bool all_permutations = true;
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    const RotationData& b = blocks[i].data();
    if (b.rotary_dim != b.head_dim)
      fail(Status::invalid_argument, "blocks[" + std::to_string(i) + "]",
           "a full (non-partial) rotation",
           "a partial rotation of " + std::to_string(b.rotary_dim) + " of " +
               std::to_string(b.head_dim) + " lanes");
    all_permutations &= b.kind == Kind::signed_permutation;
    dim += b.head_dim;
  }
  require_dim("blocks (total dimension)", dim, 2);
  if (all_permutations) {
    SignedPermutation a, b;
    std::int32_t offset = 0;
    for (const Rotation& r : blocks) {
      const RotationData& d = r.data();
      for (std::size_t j = 0; j < d.a.src.size(); ++j) {
        a.src.push_back(d.a.src[j] + offset);
        a.sign.push_back(d.a.sign[j]);
        b.src.push_back(d.b.src[j] + offset);
        b.sign.push_back(d.b.sign[j]);
      }
      offset += std::int32_t(d.head_dim);
    }
    return Rotation(permutation_rotation(dim, std::move(a), std::move(b)));
  }
  std::vector<float> a(dim * dim, 0.0f), b(dim * dim, 0.0f);
  std::int64_t offset = 0;
  for (const Rotation& r : blocks) {
    const std::int64_t n = r.head_dim();
    const std::vector<float> ba = r.to_dense_a(), bb = r.to_dense_b();
    for (std::int64_t i = 0; i < n; ++i)
      for (std::int64_t j = 0; j < n; ++j) {
        a[(offset + i) * dim + offset + j] = ba[i * n + j];
        b[(offset + i) * dim + offset + j] = bb[i * n + j];
      }
    offset += n;
  }
  return dense(a, b, dim);
}

Rotation Rotation::partial(std::int64_t head_dim, std::int64_t lane_offset) const {
  if (data_->rotary_dim != data_->head_dim)
    fail(Status::invalid_argument, "rotation", "a full rotation to make partial",
         "a rotation that is already partial");
  if (lane_offset < 0 || lane_offset > (std::int64_t(1) << 24))
    fail(Status::invalid_argument, "lane_offset", "a lane offset in [0, 2^24]",
         std::to_string(lane_offset));
  if (head_dim < data_->rotary_dim + lane_offset || head_dim % 2 != 0 ||
      head_dim > (std::int64_t(1) << 24))
    fail(Status::invalid_argument, "head_dim",
         "an even size of at least lane_offset + rotary_dim = " +
             std::to_string(lane_offset + data_->rotary_dim),
         std::to_string(head_dim));
  auto narrowed =
      std::make_shared<RotationData>(*data_);  // shares the lazily built tile and panel packs
  narrowed->head_dim = head_dim - lane_offset;
  if (lane_offset == 0) return Rotation(std::move(narrowed));
  auto d = std::make_shared<RotationData>(*narrowed);
  d->head_dim = head_dim;
  d->lane_offset = lane_offset;
  d->unshifted = std::move(narrowed);
  return Rotation(std::move(d));
}

Rotation Rotation::unshifted() const {
  return data_->unshifted ? Rotation(data_->unshifted) : *this;
}

std::int64_t Rotation::lane_offset() const noexcept {
  return data_->lane_offset;
}

std::int64_t Rotation::head_dim() const noexcept {
  return data_->head_dim;
}
std::int64_t Rotation::rotary_dim() const noexcept {
  return data_->rotary_dim;
}
Rotation::Kind Rotation::kind() const noexcept {
  return data_->kind;
}
bool Rotation::a_is_identity() const noexcept {
  return data_->a_identity;
}

std::vector<float> Rotation::to_dense_a() const {
  if (data_->kind == Kind::signed_permutation) return permutation_to_dense(data_->a);
  if (data_->a_identity)
    return permutation_to_dense(SignedPermutation::identity(data_->rotary_dim));
  return data_->dense_a;
}

std::vector<float> Rotation::to_dense_b() const {
  if (data_->kind == Kind::signed_permutation) return permutation_to_dense(data_->b);
  return data_->dense_b;
}

}  // namespace rome
