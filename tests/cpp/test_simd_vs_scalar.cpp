// The SIMD kernels must match the scalar kernel bit for bit (all but the AMX tile products of
// dense rotations, held to their error bound by test_amx.cpp). Seeded randomized cases through the
// public API (rome::rope_forward): every rotation family (half, interleave, quarter,
// interleave_half, block diagonals of random even blocks, partial rotary, dense matrices that are
// signed permutations, with or without empty columns, dense blocks of random values with one or
// two matrices), any even D (2..300 and 4094), f32 / f16 /
// bf16, rank 2..5, strided / padded / misaligned / negative-stride views, in place and out of
// place, direct tables of random broadcast shape, dtype and width, caches gathered by positions,
// and Q + K with fewer K heads. The whole output buffer (padding included) is compared, so a
// kernel writing outside its lanes shows too.
//
// Set ROME_SIMD_SEED to replay one seed, ROME_SIMD_CASES to change the number of cases.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "core/convert.hpp"
#include "isa_testing.hpp"
#include "rome/rome.hpp"

namespace rome::testing {
namespace {

using Rng = std::mt19937_64;

std::uint64_t env_u64(const char* name, std::uint64_t fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::strtoull(v, nullptr, 0) : fallback;
}

int uniform(Rng& rng, int lo, int hi) {
  return std::uniform_int_distribution<int>(lo, hi)(rng);
}
bool chance(Rng& rng, double p) {
  return std::bernoulli_distribution(p)(rng);
}

// ---------------------------------------------------------------------------------------------
// Rotations

std::vector<float> signed_permutation_matrix(Rng& rng, std::int64_t n, double drop) {
  std::vector<int> p(n);
  for (int i = 0; i < n; ++i) p[i] = i;
  std::shuffle(p.begin(), p.end(), rng);
  std::vector<float> m(n * n, 0.0f);
  for (std::int64_t j = 0; j < n; ++j)
    if (!chance(rng, drop)) m[p[j] * n + j] = chance(rng, 0.5) ? 1.0f : -1.0f;
  return m;
}

// A full rotation of `dim` lanes (dim even, > 0).
Rotation random_block(Rng& rng, std::int64_t dim, std::string& desc) {
  switch (uniform(rng, 0, dim % 4 == 0 ? 3 : 2)) {
    case 0: desc += "half(" + std::to_string(dim) + ")"; return Rotation::half(dim);
    case 1: desc += "interleave(" + std::to_string(dim) + ")"; return Rotation::interleave(dim);
    case 2:
      desc += "interleave_half(" + std::to_string(dim) + ")";
      return Rotation::interleave_half(dim);
    default: desc += "quarter(" + std::to_string(dim) + ")"; return Rotation::quarter(dim);
  }
}

std::vector<float> random_matrix_values(Rng& rng, std::int64_t n) {
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> m(n * n);
  const float scale = 1.0f / std::sqrt(float(n));
  for (auto& v : m) v = u(rng) * scale;
  return m;
}

// Dense blocks of random values (one matrix or two), ragged sizes: every output lane is a real
// sum, so a kernel summing in another order than the scalar kernel's shows.
Rotation random_dense_values(Rng& rng, std::int64_t rd, std::string& desc) {
  std::vector<std::int64_t> sizes;
  if (rd == 128 && chance(rng, 0.4)) {
    sizes = {44, 44, 40};
  } else if (rd == 40 && chance(rng, 0.5)) {
    sizes = {18, 22};
  } else if (chance(rng, 0.3)) {
    sizes = {rd};
  } else {
    for (std::int64_t left = rd; left > 0;) {
      const std::int64_t s = 2 * std::int64_t(uniform(rng, 1, int(left / 2)));
      sizes.push_back(s);
      left -= s;
    }
  }
  std::vector<Rotation> blocks;
  desc += "dense values(";
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    const std::int64_t n = sizes[i];
    const bool two = chance(rng, 0.4);
    desc += (i ? ", " : "") + std::string(two ? "A,B " : "B ") + std::to_string(n);
    blocks.push_back(
        two ? Rotation::dense(random_matrix_values(rng, n), random_matrix_values(rng, n), n)
            : Rotation::dense(random_matrix_values(rng, n), n));
  }
  desc += ")";
  return blocks.size() == 1 ? blocks[0] : Rotation::block_diag(blocks);
}

Rotation random_rotation(Rng& rng, std::int64_t rd, std::string& desc) {
  const int kind = uniform(rng, 0, 11);
  if (kind >= 10 && rd <= 300) return random_dense_values(rng, rd, desc);
  if (kind <= 3) return random_block(rng, rd, desc);
  if (kind <= 6) {
    // Block diagonal: fixed model splits when they fit, else random even blocks.
    std::vector<std::int64_t> sizes;
    if (rd == 128 && chance(rng, 0.5)) {
      const int which = uniform(rng, 0, 2);
      sizes = which == 0   ? std::vector<std::int64_t>{44, 44, 40}
              : which == 1 ? std::vector<std::int64_t>{16, 56, 56}
                           : std::vector<std::int64_t>{64, 64};
    } else if (rd == 8 && chance(rng, 0.5)) {
      sizes = {2, 6};
    } else {
      std::int64_t left = rd;
      while (left > 0) {
        const std::int64_t s =
            left <= 4
                ? left
                : 2 * std::int64_t(uniform(rng, 1, int(std::min<std::int64_t>(left, 120) / 2)));
        sizes.push_back(s);
        left -= s;
      }
    }
    std::vector<Rotation> blocks;
    desc += "block_diag(";
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      if (i) desc += ", ";
      blocks.push_back(random_block(rng, sizes[i], desc));
    }
    desc += ")";
    return Rotation::block_diag(blocks);
  }
  // Dense matrices that are signed permutations, sometimes with empty columns.
  if (rd > 300) return Rotation::half(rd);
  const double drop = chance(rng, 0.25) ? 0.2 : 0.0;
  const std::vector<float> b = signed_permutation_matrix(rng, rd, drop);
  if (chance(rng, 0.5)) {
    desc += "dense(B signed permutation" + std::string(drop > 0 ? " with empty columns" : "") +
            ", " + std::to_string(rd) + ")";
    return Rotation::dense(b, rd);
  }
  const std::vector<float> a = signed_permutation_matrix(rng, rd, drop);
  desc += "dense(A, B signed permutations" + std::string(drop > 0 ? " with empty columns" : "") +
          ", " + std::to_string(rd) + ")";
  return Rotation::dense(a, b, rd);
}

// ---------------------------------------------------------------------------------------------
// Strided buffers

struct Strided {
  std::vector<std::uint8_t> storage;
  std::int64_t offset = 0;  // elements from the start of storage to element [0, ..., 0]
  int rank = 0;
  std::int64_t shape[kMaxRank] = {};
  std::int64_t strides[kMaxRank] = {};
  DType dtype = DType::f32;
  std::string layout;

  void* data() { return storage.data() + offset * dtype_size(dtype); }
  TensorView view() {
    TensorView v;
    v.data = data();
    v.dtype = dtype;
    v.rank = rank;
    for (int i = 0; i < rank; ++i) v.shape[i] = shape[i], v.strides[i] = strides[i];
    return v;
  }
};

// A random physical layout of `shape`: the last axis contiguous unless `lane_stride` says
// otherwise; outer axes in a random memory order, padded, some with negative strides; the start
// possibly misaligned by one element.
Strided make_strided(Rng& rng, DType dtype, int rank, const std::int64_t* shape, bool fancy,
                     std::int64_t lane_stride = 1) {
  Strided t;
  t.dtype = dtype;
  t.rank = rank;
  for (int i = 0; i < rank; ++i) t.shape[i] = shape[i];
  std::vector<int> order;  // memory order of the outer axes, innermost first
  for (int i = rank - 2; i >= 0; --i) order.push_back(i);
  if (fancy && chance(rng, 0.3)) std::shuffle(order.begin(), order.end(), rng);
  t.strides[rank - 1] = lane_stride;
  std::int64_t extent = lane_stride * shape[rank - 1];
  for (int i : order) {
    const std::int64_t pad = fancy && chance(rng, 0.35) ? uniform(rng, 1, 9) : 0;
    t.strides[i] = extent + pad;
    extent = t.strides[i] * std::max<std::int64_t>(shape[i], 1);
  }
  std::int64_t lo = 0, hi = 1;
  for (int i = 0; i < rank; ++i) {
    if (fancy && i < rank - 1 && shape[i] > 1 && chance(rng, 0.2)) t.strides[i] = -t.strides[i];
    const std::int64_t reach = t.strides[i] * (std::max<std::int64_t>(shape[i], 1) - 1);
    (reach < 0 ? lo : hi) += reach;
  }
  const std::int64_t shift = fancy && chance(rng, 0.4) ? 1 : 0;
  const std::int64_t margin = 17;
  t.offset = margin + shift - lo;
  const std::int64_t elements = t.offset + hi + margin;
  t.storage.resize(std::size_t(elements * dtype_size(dtype)));
  t.layout = "strides [";
  for (int i = 0; i < rank; ++i) t.layout += (i ? ", " : "") + std::to_string(t.strides[i]);
  t.layout += "] offset " + std::to_string(t.offset);
  return t;
}

// Special values. `finite`: zeros, subnormals (fp32, bf16 and fp16), values that overflow fp16
// or fp32 in the result. `nonfinite`: also ±inf and one NaN bit pattern per case (sign, payload
// and quiet/signalling chosen per case), so that when two NaNs meet in one fma they are the same
// NaN and the result does not depend on which operand x86 propagates.
enum class Specials { none, finite, nonfinite };

struct ValueGen {
  Specials specials = Specials::none;
  std::uint32_t nan_bits = 0x7fc00000u;
};

float random_value(Rng& rng, const ValueGen& g) {
  if (g.specials != Specials::none && chance(rng, 0.08)) {
    static const float kFinite[] = {0.0f,          -0.0f,    1e-45f,   -1e-39f,  1e-41f,
                                    6.0e-8f,       -3.0e-5f, 65504.0f, 65519.0f, -70000.0f,
                                    3.3895314e38f, -2.5e38f, 1.0e-38f};
    const int n = int(std::size(kFinite));
    const int pick = uniform(rng, 0, g.specials == Specials::nonfinite ? n + 2 : n - 1);
    if (pick < n) return kFinite[pick];
    if (pick == n) return std::numeric_limits<float>::infinity();
    if (pick == n + 1) return -std::numeric_limits<float>::infinity();
    return detail::bits_float(g.nan_bits);
  }
  // Ordinary values are never (near) zero, so inf · table is never NaN.
  const float mag = std::ldexp(1.0f, uniform(rng, -6, 3));
  const float v = std::uniform_real_distribution<float>(-mag, mag)(rng);
  return std::abs(v) < mag / 1024 ? mag / 2 : v;
}

// Fills every element of storage: the view's elements and the padding around them.
void fill(Rng& rng, Strided& t, const ValueGen& g) {
  const int es = dtype_size(t.dtype);
  const std::int64_t n = std::int64_t(t.storage.size()) / es;
  for (std::int64_t i = 0; i < n; ++i) {
    const float v = random_value(rng, g);
    std::uint8_t* p = t.storage.data() + i * es;
    if (t.dtype == DType::f32) {
      std::memcpy(p, &v, 4);
    } else {
      // Keep the NaN pattern's sign and top payload bits in 16-bit storage too.
      std::uint16_t h =
          t.dtype == DType::bf16 ? detail::float_to_bf16(v) : detail::float_to_fp16(v);
      if (std::isnan(v)) {
        const std::uint32_t u = detail::float_bits(v);
        h = t.dtype == DType::bf16
                ? std::uint16_t(u >> 16)
                : std::uint16_t(((u >> 16) & 0x8000u) | 0x7c00u | ((u >> 13) & 0x3ffu));
      }
      std::memcpy(p, &h, 2);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// One random case

struct Case {
  std::string desc;
  Rotation rotation = Rotation::half(2);
  DType dtype = DType::f32;
  Strided q_in, q_out, k_in, k_out;
  bool in_place = false, has_k = false;
  Strided cos, sin, positions;
  Tables tables;
  int threads = 1;
};

const char* short_name(DType d) {
  return d == DType::f32 ? "f32" : d == DType::f16 ? "f16" : d == DType::bf16 ? "bf16" : "int";
}

std::string shape_text(int rank, const std::int64_t* shape) {
  std::string s = "[";
  for (int i = 0; i < rank; ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

Case make_case(Rng& rng) {
  Case c;
  // Head and rotary dims: the specialised sizes often, any even size otherwise.
  std::int64_t hd;
  const int pick = uniform(rng, 0, 99);
  if (pick < 3) {
    hd = 4094;
  } else if (pick < 30) {
    static const std::int64_t kCommon[] = {64, 128, 256, 128, 80, 96, 192};
    hd = kCommon[uniform(rng, 0, 6)];
  } else {
    hd = 2 * uniform(rng, 1, 150);
  }
  std::int64_t rd = hd;
  if (chance(rng, 0.3)) rd = 2 * uniform(rng, 1, int(hd / 2));
  if (chance(rng, 0.1) && hd >= 128) rd = 64 * uniform(rng, 1, int(hd / 64));
  std::string rot_desc;
  Rotation base = random_rotation(rng, rd, rot_desc);
  c.rotation = rd < hd ? base.partial(hd) : base;
  if (rd < hd) rot_desc += ".partial(" + std::to_string(hd) + ")";

  c.dtype = std::array<DType, 3>{DType::f32, DType::f16, DType::bf16}[uniform(rng, 0, 2)];
  ValueGen xgen, tgen;
  const int special_pick = uniform(rng, 0, 19);
  if (special_pick == 0) {
    xgen.specials = tgen.specials = Specials::finite;
  } else if (special_pick == 1) {
    xgen.specials = Specials::nonfinite;
    static const std::uint32_t kNan[] = {0x7fc00000u, 0xffc00000u, 0x7fe12000u, 0xffa34000u,
                                         0x7f812000u};
    xgen.nan_bits = kNan[uniform(rng, 0, 4)];
  }

  // Shape: rank 2..5, rows limited so a case stays small.
  const int rank = uniform(rng, 2, 5);
  std::int64_t shape[kMaxRank];
  shape[rank - 1] = hd;
  const std::int64_t max_rows = hd > 1000 ? 6 : std::max<std::int64_t>(8, 24000 / hd);
  std::int64_t rows = 1;
  for (int i = rank - 2; i >= 0; --i) {
    std::int64_t s = uniform(rng, 1, chance(rng, 0.2) ? 40 : 7);
    while (s > 1 && rows * s > max_rows) s /= 2;
    shape[i] = s;
    rows *= s;
  }

  // Tables: direct (random broadcast shape, dtype, width, lane stride) or a cache + positions.
  const bool cache = chance(rng, 0.35);
  const int width_pick = uniform(rng, 0, 5);
  c.tables.width = width_pick == 4   ? TableWidth::halves
                   : width_pick == 5 ? TableWidth::pairs
                                     : TableWidth::full;
  const std::int64_t columns = c.tables.width == TableWidth::full ? rd : rd / 2;
  const DType tdtype =
      std::array<DType, 4>{DType::f32, DType::f32, DType::bf16, DType::f16}[uniform(rng, 0, 3)];
  const std::int64_t lane_stride = chance(rng, 0.15) ? 2 : 1;
  bool varies[kMaxRank] = {};
  std::string table_desc;
  if (!cache) {
    const int trank = uniform(rng, 1, rank);
    std::int64_t tshape[kMaxRank];
    for (int i = 0; i < trank - 1; ++i) {
      const int xi = rank - 1 - (trank - 1) + i;
      tshape[i] = chance(rng, 0.5) ? shape[xi] : 1;
      varies[xi] = tshape[i] != 1;
    }
    tshape[trank - 1] = columns;
    c.cos = make_strided(rng, tdtype, trank, tshape, true, lane_stride);
    c.sin = make_strided(rng, tdtype, trank, tshape, true, lane_stride);
    fill(rng, c.cos, tgen);
    fill(rng, c.sin, tgen);
    c.tables.cos = as_const(c.cos.view());
    c.tables.sin = as_const(c.sin.view());
    table_desc = std::string("direct ") + short_name(tdtype) + " " + shape_text(trank, tshape);
  } else {
    const std::int64_t P = uniform(rng, 1, 50);
    const std::int64_t cshape[2] = {P, columns};
    c.cos = make_strided(rng, tdtype, 2, cshape, false, lane_stride);
    c.sin = make_strided(rng, tdtype, 2, cshape, false, lane_stride);
    fill(rng, c.cos, tgen);
    fill(rng, c.sin, tgen);
    std::int64_t pshape[kMaxRank];
    for (int i = 0; i < rank - 1; ++i) {
      pshape[i] = chance(rng, 0.5) ? shape[i] : 1;
      varies[i] = pshape[i] != 1;
    }
    const DType pdtype = chance(rng, 0.5) ? DType::i32 : DType::i64;
    c.positions = make_strided(rng, pdtype, rank - 1, pshape, true);
    const std::int64_t n = std::int64_t(c.positions.storage.size()) / dtype_size(pdtype);
    for (std::int64_t i = 0; i < n; ++i) {
      const std::int64_t p = uniform(rng, 0, int(P - 1));
      if (pdtype == DType::i32) {
        const std::int32_t v = std::int32_t(p);
        std::memcpy(c.positions.storage.data() + 4 * i, &v, 4);
      } else {
        std::memcpy(c.positions.storage.data() + 8 * i, &p, 8);
      }
    }
    c.tables.cos = as_const(c.cos.view());
    c.tables.sin = as_const(c.sin.view());
    TensorView pv = c.positions.view();
    c.tables.positions = as_const(pv);
    table_desc = std::string("cache ") + short_name(tdtype) + " [" + std::to_string(P) + ", " +
                 std::to_string(columns) + "] positions " + short_name(pdtype) + " " +
                 shape_text(rank - 1, pshape);
  }
  if (c.tables.width != TableWidth::full)
    table_desc += c.tables.width == TableWidth::halves ? " halves" : " pairs";
  if (lane_stride != 1) table_desc += " lane stride 2";

  // Q, and K with fewer "heads" on an axis the tables do not vary along.
  c.q_in = make_strided(rng, c.dtype, rank, shape, true);
  fill(rng, c.q_in, xgen);
  c.in_place = chance(rng, 0.4);
  if (!c.in_place) {
    c.q_out = make_strided(rng, c.dtype, rank, shape, true);
    fill(rng, c.q_out, {});
  }
  std::int64_t kshape[kMaxRank];
  std::copy(shape, shape + rank, kshape);
  c.has_k = chance(rng, 0.3);
  if (c.has_k) {
    std::vector<int> free_axes;
    for (int i = 0; i < rank - 1; ++i)
      if (!varies[i]) free_axes.push_back(i);
    if (!free_axes.empty()) {
      const int axis = free_axes[uniform(rng, 0, int(free_axes.size()) - 1)];
      kshape[axis] = uniform(rng, 1, int(std::max<std::int64_t>(shape[axis], 1)));
    }
    c.k_in = make_strided(rng, c.dtype, rank, kshape, true);
    fill(rng, c.k_in, xgen);
    if (!c.in_place) {
      c.k_out = make_strided(rng, c.dtype, rank, kshape, true);
      fill(rng, c.k_out, {});
    }
  }
  c.threads = chance(rng, 0.3) ? 2 : 1;

  c.desc = rot_desc + ", " + short_name(c.dtype) + " q " + shape_text(rank, shape) + " " +
           c.q_in.layout + (c.in_place ? ", in place" : ", out " + c.q_out.layout);
  if (c.has_k) c.desc += ", k " + shape_text(rank, kshape) + " " + c.k_in.layout;
  c.desc += ", tables " + table_desc +
            (xgen.specials == Specials::finite      ? ", finite special values"
             : xgen.specials == Specials::nonfinite ? ", inf/NaN in x"
                                                    : "") +
            ", " + std::to_string(c.threads) + " thread(s)";
  return c;
}

// The buffers a run writes: q (and k) output storage after the call.
struct Outputs {
  std::vector<std::uint8_t> q, k;
};

Outputs run(const Case& c) {
  Strided q_in = c.q_in, q_out = c.in_place ? Strided{} : c.q_out;
  Strided k_in = c.k_in, k_out = c.in_place ? Strided{} : c.k_out;
  Operand q{as_const(q_in.view()), c.in_place ? q_in.view() : q_out.view()};
  Operand k;
  if (c.has_k) k = Operand{as_const(k_in.view()), c.in_place ? k_in.view() : k_out.view()};
  rope_forward(c.rotation, c.tables, q, c.has_k ? &k : nullptr, split_across(c.threads));
  Outputs out;
  out.q = c.in_place ? q_in.storage : q_out.storage;
  if (c.has_k) out.k = c.in_place ? k_in.storage : k_out.storage;
  return out;
}

std::uint32_t element_bits(const std::vector<std::uint8_t>& s, std::int64_t i, DType d) {
  if (d == DType::f32) {
    std::uint32_t u;
    std::memcpy(&u, s.data() + 4 * i, 4);
    return u;
  }
  std::uint16_t h;
  std::memcpy(&h, s.data() + 2 * i, 2);
  return h;
}

// Describes where storage element `e` lies in the view (multi-index, or padding).
std::string locate(const Strided& t, std::int64_t e) {
  if (t.rank == 0)
    return "element " + std::to_string(e) + " of the window (64 bytes of margin, then the tensor)";
  std::int64_t idx[kMaxRank] = {};
  const std::int64_t n = [&] {
    std::int64_t m = 1;
    for (int i = 0; i < t.rank; ++i) m *= t.shape[i];
    return m;
  }();
  for (std::int64_t flat = 0; flat < n; ++flat) {
    std::int64_t rem = flat, off = t.offset;
    for (int i = t.rank - 1; i >= 0; --i) {
      idx[i] = rem % t.shape[i];
      rem /= t.shape[i];
      off += idx[i] * t.strides[i];
    }
    if (off == e) {
      std::string s =
          "element " + shape_text(t.rank, idx) + ", lane " + std::to_string(idx[t.rank - 1]);
      return s;
    }
  }
  return "padding at storage element " + std::to_string(e) + " (outside the view)";
}

// Compares every storage element bit for bit (NaNs included: see ValueGen).
::testing::AssertionResult same_bits(const std::vector<std::uint8_t>& want,
                                     const std::vector<std::uint8_t>& got, const Strided& layout,
                                     DType d) {
  const std::int64_t n = std::int64_t(want.size()) / dtype_size(d);
  for (std::int64_t i = 0; i < n; ++i) {
    const std::uint32_t a = element_bits(want, i, d), b = element_bits(got, i, d);
    if (a == b) continue;
    char buf[160];
    std::snprintf(buf, sizeof buf, "scalar 0x%0*x (%.9g), simd 0x%0*x (%.9g)",
                  d == DType::f32 ? 8 : 4, a,
                  d == DType::f32 ? double(detail::bits_float(a)) : detail::load_any(&a, d, 0),
                  d == DType::f32 ? 8 : 4, b,
                  d == DType::f32 ? double(detail::bits_float(b)) : detail::load_any(&b, d, 0));
    return ::testing::AssertionFailure() << locate(layout, i) << ": " << buf;
  }
  return ::testing::AssertionSuccess();
}

std::vector<Isa> simd_isas() {
  std::vector<Isa> out;
  for (Isa isa : isas_under_test())
    if (isa != Isa::scalar) out.push_back(isa);
  return out;
}

TEST(SimdVsScalar, RandomizedBitExact) {
  const std::vector<Isa> isas = simd_isas();
  if (isas.empty()) GTEST_SKIP() << "no SIMD ISA compiled and supported here";
  const std::uint64_t seed = env_u64("ROME_SIMD_SEED", 0x5eed2024);
  const std::int64_t cases = std::int64_t(env_u64("ROME_SIMD_CASES", 2500));
  std::printf("[ rome ] seed 0x%llx, %lld cases, ISAs:", (unsigned long long)seed,
              (long long)cases);
  for (Isa isa : isas) std::printf(" %s", isa_name(isa));
  std::printf("\n");
  Rng master(seed);
  int failures = 0;
  for (std::int64_t n = 0; n < cases && failures < 5; ++n) {
    const std::uint64_t case_seed = master();
    Rng rng(case_seed);
    const Case c = make_case(rng);
    Outputs want;
    {
      ScopedIsa scoped(Isa::scalar);
      want = run(c);
    }
    for (Isa isa : isas) {
      // The tile unit sums in its own order and flushes bf16 subnormals: dense rotations of 16-bit
      // x on AMX are held to their error bound instead (test_amx.cpp), not to scalar's bits.
      if (isa == Isa::amx && c.rotation.kind() == Rotation::Kind::dense && c.dtype != DType::f32)
        continue;
      // So are avx512's bf16 dot products (test_dense_bf16_dot.cpp).
      if (takes_bf16_dot_path(isa, c.rotation, c.dtype)) continue;
      ScopedIsa scoped(isa);
      ASSERT_EQ(active_isa(), isa);
      const Outputs got = run(c);
      const Strided& qlayout = c.in_place ? c.q_in : c.q_out;
      auto q_ok = same_bits(want.q, got.q, qlayout, c.dtype);
      EXPECT_TRUE(q_ok) << "ISA " << isa_name(isa) << ", q mismatch, seed 0x" << std::hex << seed
                        << " case " << std::dec << n << " (case seed 0x" << std::hex << case_seed
                        << std::dec << "): " << c.desc;
      bool ok = bool(q_ok);
      if (c.has_k) {
        const Strided& klayout = c.in_place ? c.k_in : c.k_out;
        auto k_ok = same_bits(want.k, got.k, klayout, c.dtype);
        EXPECT_TRUE(k_ok) << "ISA " << isa_name(isa) << ", k mismatch, seed 0x" << std::hex << seed
                          << " case " << std::dec << n << " (case seed 0x" << std::hex << case_seed
                          << std::dec << "): " << c.desc;
        ok = ok && bool(k_ok);
      }
      failures += ok ? 0 : 1;
    }
  }
}

// Every D in 2..70 with each rotation family (and a partial one), edge values in every dtype;
// the only NaN is the default NaN, which inf · 0 also produces.
TEST(SimdVsScalar, EveryDimAndFamily) {
  const std::vector<Isa> isas = simd_isas();
  if (isas.empty()) GTEST_SKIP() << "no SIMD ISA compiled and supported here";
  Rng rng(12345);
  for (std::int64_t d = 2; d <= 70; d += 2) {
    for (int family = 0; family < 5; ++family) {
      if (family == 2 && d % 4 != 0) continue;
      const Rotation full = family == 0   ? Rotation::half(d)
                            : family == 1 ? Rotation::interleave(d)
                            : family == 2 ? Rotation::quarter(d)
                            : family == 3 ? Rotation::interleave_half(d)
                                          : Rotation::half(d).partial(d + 2 * (d % 7));
      for (DType dtype : {DType::f32, DType::f16, DType::bf16}) {
        const std::int64_t rows = 5, hd = full.head_dim(), rd = full.rotary_dim();
        const std::int64_t shape[2] = {rows, hd}, tshape[2] = {rows, rd};
        Strided x = make_strided(rng, dtype, 2, shape, false);
        Strided y = make_strided(rng, dtype, 2, shape, false);
        Strided cs = make_strided(rng, DType::f32, 2, tshape, false);
        Strided sn = make_strided(rng, DType::f32, 2, tshape, false);
        fill(rng, x, ValueGen{Specials::nonfinite, 0xffc00000u});
        fill(rng, y, {});
        fill(rng, cs, ValueGen{Specials::finite});
        fill(rng, sn, ValueGen{Specials::finite});
        Tables t;
        t.cos = as_const(cs.view());
        t.sin = as_const(sn.view());
        std::vector<std::uint8_t> want;
        {
          ScopedIsa scoped(Isa::scalar);
          Strided out = y;
          rope_forward(full, t, Operand{as_const(x.view()), out.view()});
          want = out.storage;
        }
        for (Isa isa : isas) {
          ScopedIsa scoped(isa);
          Strided out = y;
          rope_forward(full, t, Operand{as_const(x.view()), out.view()});
          EXPECT_TRUE(same_bits(want, out.storage, y, dtype))
              << isa_name(isa) << " D " << d << " family " << family << " " << short_name(dtype);
        }
      }
    }
  }
}

// Permutations with structure the kernels take shortcuts for: whole vectors moved (blocks of
// half(32), half, quarter), one source vector per output vector with a lane shuffle, pair swaps,
// and the same with signs and empty lanes; sizes with and without a fixed-size path, in place and
// out of place.
TEST(SimdVsScalar, StructuredPermutations) {
  const std::vector<Isa> isas = simd_isas();
  if (isas.empty()) GTEST_SKIP() << "no SIMD ISA compiled and supported here";
  Rng rng(4242);
  for (std::int64_t d : {64, 128, 256, 96, 192, 200, 32, 48}) {
    std::vector<std::pair<std::string, Rotation>> rotations;
    if (d % 32 == 0) {
      std::vector<Rotation> blocks(std::size_t(d / 32), Rotation::half(32));
      rotations.emplace_back("half(32) blocks", Rotation::block_diag(blocks));
    }
    if (d % 16 == 0) {
      std::vector<Rotation> blocks(std::size_t(d / 16), Rotation::half(16));
      rotations.emplace_back("half(16) blocks", Rotation::block_diag(blocks));
    }
    rotations.emplace_back("half", Rotation::half(d));
    if (d % 4 == 0) rotations.emplace_back("quarter", Rotation::quarter(d));
    rotations.emplace_back("interleave", Rotation::interleave(d));
    // Whole 16-lane groups swapped by index xor (d / 64 · 4) groups: for d = 192 a partner 48
    // lanes away by xor, not by addition (group 1 pairs with 2, not 4); the half and quarter
    // moves pair vector v with v + K and must not take it.
    if (d % 64 == 0) {
      const std::int64_t step = d / 4;
      std::vector<float> b(d * d, 0.0f);
      for (std::int64_t j = 0; j < d; ++j) b[(j ^ step) * d + j] = (j & step) ? 1.0f : -1.0f;
      rotations.emplace_back("lanes xor " + std::to_string(step), Rotation::dense(b, d));
    }
    // Output lane j reads lane 15 - j % 16 of a neighbouring group of 16 (or 8) lanes.
    for (int group : {16, 8}) {
      if (d % (2 * group) != 0) continue;
      for (int empty = 0; empty < 2; ++empty) {
        std::vector<float> b(d * d, 0.0f);
        for (std::int64_t j = 0; j < d; ++j) {
          if (empty && j % 5 == 3) continue;
          const std::int64_t src = ((j / group) ^ 1) * group + (group - 1 - j % group);
          b[src * d + j] = (j % 3 == 0) ? -1.0f : 1.0f;
        }
        rotations.emplace_back("reversed neighbour groups of " + std::to_string(group) +
                                   (empty ? " with empty lanes" : ""),
                               Rotation::dense(b, d));
      }
    }
    for (const auto& [name, rotation] : rotations) {
      for (DType dtype : {DType::f32, DType::f16, DType::bf16}) {
        for (bool in_place : {false, true}) {
          const std::int64_t shape[3] = {3, 5, d}, tshape[2] = {5, d};
          Strided x = make_strided(rng, dtype, 3, shape, true);
          Strided y = make_strided(rng, dtype, 3, shape, true);
          Strided cs = make_strided(rng, DType::f32, 2, tshape, false);
          Strided sn = make_strided(rng, DType::f32, 2, tshape, false);
          fill(rng, x, ValueGen{Specials::finite});
          fill(rng, y, {});
          fill(rng, cs, {});
          fill(rng, sn, {});
          Tables t;
          t.cos = as_const(cs.view());
          t.sin = as_const(sn.view());
          auto run_once = [&](Isa isa) {
            ScopedIsa scoped(isa);
            Strided in = x, out = y;
            rope_forward(rotation, t,
                         Operand{as_const(in.view()), in_place ? in.view() : out.view()});
            return in_place ? in.storage : out.storage;
          };
          const std::vector<std::uint8_t> want = run_once(Isa::scalar);
          for (Isa isa : isas)
            EXPECT_TRUE(same_bits(want, run_once(isa), in_place ? x : y, dtype))
                << isa_name(isa) << " D " << d << " " << name << " " << short_name(dtype)
                << (in_place ? " in place" : " out of place");
        }
      }
    }
  }
}

// A contiguous tensor whose first element sits `misalign` bytes past a 64-byte boundary (copies
// keep that placement), with 64 bytes of margin on both sides.
struct Placed {
  std::vector<std::uint8_t> raw;
  std::size_t bytes = 0, misalign = 0;
  Placed(std::size_t n, std::size_t mis) : raw(n + 256), bytes(n), misalign(mis) {}
  Placed(const Placed& o) : raw(o.raw.size()), bytes(o.bytes), misalign(o.misalign) {
    std::memcpy(data() - 64, o.data() - 64, bytes + 128);  // margins included
  }
  // The tensor and its margins.
  std::vector<std::uint8_t> window() const {
    return std::vector<std::uint8_t>(data() - 64, data() + bytes + 64);
  }
  std::uint8_t* data() {
    const auto a = reinterpret_cast<std::uintptr_t>(raw.data());
    return raw.data() + 64 + (64 - a % 64) % 64 + misalign;
  }
  const std::uint8_t* data() const { return const_cast<Placed*>(this)->data(); }
};

// The rotation families LargeTensorsStreaming runs for its config-th layout and dtype: one in
// turn; always the 3D blocks 44/44/40 and 44/42/42 (families 2 and 6: AVX2's rows in registers,
// with 32-, 16- and fp32 streaming stores); for bf16 also 3D blocks AVX2 cannot take 16 lanes at
// a time (family 4: shifted_two's paired narrowing and 32-byte streaming stores) and
// interleave-half (family 5: the same stores from the deinterleave kind).
std::vector<int> families(int config, DType dtype) {
  const int cycled = config % 4;
  std::vector<int> out{cycled, 6};
  if (cycled != 2) out.push_back(2);
  if (dtype == DType::bf16) out.insert(out.end(), {4, 5});
  return out;
}

// Tensors of MiBs: the kernels prefetch ahead and, with the L3 share reported as 1 MiB (the core
// streams outputs over 3/4 of it), write out of place with non-temporal stores, as they do past
// tens of MiB on a real CPU ([.., S, D] layouts spread each batch over MiBs; [.., S, H, D]
// layouts form long runs of contiguous batches). 64-byte aligned and misaligned outputs, in place
// and not, partial rotary.
TEST(SimdVsScalar, LargeTensorsStreaming) {
  const std::vector<Isa> isas = simd_isas();
  if (isas.empty()) GTEST_SKIP() << "no SIMD ISA compiled and supported here";
  detail::CacheSizes small_l3 = detail::cache_sizes();
  small_l3.l3 = small_l3.l3_per_thread = 1 << 20;
  ScopedCacheSizes scoped_caches(small_l3);
  Rng rng(777);
  struct Layout {
    const char* name;
    std::int64_t shape[4];
    int seq_axis;
  };
  // Under the sanitizers half the tokens: bf16 BNSD is still 1.5 MiB, twice the streaming bound.
  constexpr std::int64_t kSeq = kSanitized ? 1024 : 2048;
  const Layout layouts[] = {{"bnsd", {1, 6, kSeq, 128}, 2}, {"bsnd", {1, kSeq, 8, 128}, 1}};
  int config = 0;
  for (const Layout& layout : layouts) {
    for (DType dtype : {DType::bf16, DType::f16, DType::f32})
      for (const int family : families(config++, dtype)) {
        const Rotation rotation =
            family == 0   ? Rotation::half(128)
            : family == 1 ? Rotation::interleave(128)
            : family == 2
                ? Rotation::block_diag({Rotation::half(44), Rotation::half(44), Rotation::half(40)})
            : family == 3 ? Rotation::half(64).partial(128)
            : family == 4
                ? Rotation::block_diag({Rotation::half(12), Rotation::half(20), Rotation::half(96)})
            : family == 5 ? Rotation::interleave_half(128)
                          : Rotation::block_diag(
                                {Rotation::half(44), Rotation::half(42), Rotation::half(42)});
        const std::int64_t rd = rotation.rotary_dim(), seq = layout.shape[layout.seq_axis];
        // [S, rd] tables for BNSD, [S, 1, rd] for BSND.
        std::vector<float> cos(seq * rd), sin(seq * rd);
        for (float& v : cos) v = random_value(rng, {});
        for (float& v : sin) v = random_value(rng, {});
        Tables t;
        if (layout.seq_axis == 2) {
          t.cos = make_view<const void*>(cos.data(), DType::f32, {seq, rd});
          t.sin = make_view<const void*>(sin.data(), DType::f32, {seq, rd});
        } else {
          t.cos = make_view<const void*>(cos.data(), DType::f32, {seq, 1, rd});
          t.sin = make_view<const void*>(sin.data(), DType::f32, {seq, 1, rd});
        }
        const std::int64_t n = layout.shape[0] * layout.shape[1] * layout.shape[2] * 128;
        const int es = dtype_size(dtype);
        for (int variant = 0; variant < 3; ++variant) {
          // 0: out of place, aligned; 1: out of place, output misaligned; 2: in place, aligned.
          Placed x(std::size_t(n * es), 0),
              y(std::size_t(n * es), variant == 1 ? std::size_t(es) : 0);
          for (Placed* p : {&x, &y})
            for (std::size_t i = 0; i < p->bytes + 128; ++i)
              (p->data() - 64)[i] = std::uint8_t(rng());
          for (std::int64_t i = 0; i < n; ++i)
            detail::store_any(x.data(), dtype, i, random_value(rng, {}));
          auto view = [&](Placed& p) {
            const auto& s = layout.shape;
            return make_view<void*>(p.data(), dtype, {s[0], s[1], s[2], s[3]});
          };
          auto run_once = [&](Isa isa, int threads) {
            ScopedIsa scoped(isa);
            Placed in = x, out = y;
            const TensorView iv = view(in), ov = variant == 2 ? iv : view(out);
            rope_forward(rotation, t, Operand{as_const(iv), ov}, nullptr, split_across(threads));
            return variant == 2 ? in.window() : out.window();
          };
          Strided layout_for_messages;  // whole-buffer offsets only
          layout_for_messages.dtype = dtype;
          const std::vector<std::uint8_t> want = run_once(Isa::scalar, 1);
          for (Isa isa : isas)
            for (int threads : {1, 2}) {
              const std::vector<std::uint8_t> got = run_once(isa, threads);
              EXPECT_TRUE(want == got)
                  << isa_name(isa) << " " << layout.name << " " << short_name(dtype) << " rotary "
                  << rd << " variant " << variant << " threads " << threads << ": "
                  << same_bits(want, got, layout_for_messages, dtype).message();
            }
        }
      }
  }
}

}  // namespace
}  // namespace rome::testing
