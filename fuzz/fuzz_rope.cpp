// libFuzzer target over RoME's public entry points: rope_forward (q, q+k) and rope_backward, and
// rope_check against rope_forward.
//
// The input is decoded byte by byte (a zero byte, or the end of the input, always picks the
// plainest option) into one call: a rotation (half, interleave, quarter, interleave_half,
// block_diag, partial, dense, dense signed permutation), x of rank 2..5 in any float dtype (or a
// wrong one), strided views (contiguous, padded, permuted, negative, zero, overlapping,
// overflowing, misaligned), direct tables with any broadcast shape or a cache with positions
// (i32/i64, multi-axis with column_axis), every table width, in place / out of place / partially
// overlapping outputs, q and k sharing memory, and for backward every combination of dx, dcos,
// dsin, dA, dB; forward calls also with Tables::inverse and rotated lanes at an offset.
//
// Every tensor lives in an arena of exactly the bytes its view may touch (allocated with
// std::vector, so ASan knows the exact edge); an arena may be shared to alias views. A view the
// fuzzer cannot allocate is one the library must reject (its extent overflows 2^60 elements).
//
// Oracle:
//  * a model of the contract says whether the call is valid;
//  * the call throws rome::Error: every arena is byte-identical to before (no write on error);
//  * the call succeeds: the model must have said valid, and every arena equals the pre-call
//    state with the outputs replaced by a reference (forward: bit-exact, the rows gathered by
//    the harness run contiguously through the scalar kernel; backward: a double reference with
//    a tolerance);
//  * the same call under rome::set_max_isa(Isa::scalar) with another thread count gives the
//    same bytes (forward: bit for bit; backward: bit for bit, it does not depend on threads).
// Any other exception, crash or sanitizer report is a bug.
//
// Environment: ROME_FUZZ_SKIP=feature,... turns off generators of known bugs so fuzzing can go on
// (features: alias_dx_x, alias_tables, alias_positions, alias_dcos_dsin, alias_da_db, bad_enum,
// huge_min, huge_size1, zero_backward; ROME_FUZZ_SKIP=alias skips every alias_*); ROME_FUZZ_STATS=1
// prints at exit how often each error (status, argument) was raised; ROME_FUZZ_STRICT=1 (or =TEXT:
// only messages holding TEXT) also fails when a call the model thinks valid is rejected.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <numeric>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/convert.hpp"
#include "core/dispatch.hpp"
#include "core/rotation_data.hpp"
#include "rome/rome.hpp"

using namespace rome;
using i64 = std::int64_t;
using i128 = __int128;

namespace {

constexpr i64 kMaxArenaBytes = i64(64) << 20;
constexpr i128 kMaxReach = i128(1) << 60;  // plan.cpp: extents must fit in 2^60 elements
constexpr i64 kMaxElements = 1 << 16;

// ------------------------------------------------------------------------------------------
// Input decoding and data generation

struct Reader {
  const std::uint8_t* data;
  std::size_t size, pos = 0;
  std::uint8_t u8() { return pos < size ? data[pos++] : 0; }
  std::uint32_t u32() {
    std::uint32_t v = 0;
    for (int i = 0; i < 4; ++i) v |= std::uint32_t(u8()) << (8 * i);
    return v;
  }
  int below(int n) { return n <= 1 ? (u8(), 0) : u8() % n; }
  // About k/256; never on a zero byte, so short inputs decode to plain calls.
  bool rare(int k = 12) { return u8() >= 256 - k; }
};

struct Rng {
  std::uint64_t s;
  std::uint64_t next() {
    std::uint64_t z = (s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  i64 below(i64 n) { return n <= 0 ? 0 : i64(next() % std::uint64_t(n)); }
  double unit() { return double(next() >> 11) * 0x1p-53; }
};

bool enabled(const char* feature) {
  static const std::string skip = [] {
    const char* e = std::getenv("ROME_FUZZ_SKIP");
    return std::string(e ? e : "");
  }();
  // "alias" turns off every alias_* feature.
  return skip.find(feature) == std::string::npos &&
         !(std::string(feature).rfind("alias_", 0) == 0 &&
           (skip == "alias" || skip.find("alias,") != std::string::npos ||
            (skip.size() > 6 && skip.compare(skip.size() - 6, 6, ",alias") == 0)));
}

std::map<std::string, long>& stats() {
  static auto* s = new std::map<std::string, long>;  // leaked: printed from atexit
  return *s;
}
void print_stats() {
  for (auto& [k, v] : stats()) std::fprintf(stderr, "  %8ld  %s\n", v, k.c_str());
}

// ------------------------------------------------------------------------------------------
// Tensors, arenas, the case

struct TensorDesc {
  const char* name = "";
  bool used = false;
  bool output = false;
  int arena = -1;
  i64 delta = 0;   // bytes from the arena origin (before placement)
  i64 offset = 0;  // bytes from the arena start (after placement)
  i64 front = 0;   // misalignment bytes in front of the lowest element
  DType dtype = DType::f32;
  int rank = 0;       // the real rank of shape/strides (1..5)
  int view_rank = 0;  // what the view reports (may be a bad rank)
  i64 shape[kMaxRank] = {}, strides[kMaxRank] = {};
  bool null_data = false;
  bool allocatable = true;
  i64 lo = 0, hi = 0;  // bytes relative to the data pointer
  int es() const { return dtype_size(dtype); }
  i64 numel() const {
    i64 n = 1;
    for (int i = 0; i < rank; ++i) n *= shape[i] < 0 ? 0 : shape[i];
    return n;
  }
};

enum Slot { Q_IN, Q_OUT, K_IN, K_OUT, COS, SIN, POS, GRAD, X, DX, DCOS, DSIN, DA, DB, NSLOTS };

struct Case {
  int op = 0;  // 0 forward q, 1 forward q+k, 2 backward
  std::optional<Rotation> rot;
  i64 hd = 0, rd = 0;
  bool perm = true, a_identity = true;
  std::vector<float> A, B;  // rd × rd
  TableWidth width = TableWidth::full;
  int width_raw = 0;
  bool inverse = false;  // Tables::inverse (forward only: the backward reference has no −θ)
  bool cache = false;  // positions are passed: a cache, even with a null pointer (then an error if
                       // it has elements)
  bool gather() const { return cache; }
  std::vector<int> column_axis;
  int num_threads = 0;
  TensorDesc t[NSLOTS];
  int arenas = 0;
  std::vector<i64> arena_size;
  bool specials = false;  // x holds NaN / inf / huge values
  std::string log;
};

using World = std::vector<std::vector<std::uint8_t>>;

std::string describe(const Case& c) {
  std::string s = "op=" + std::to_string(c.op) + " " + c.log + " hd=" + std::to_string(c.hd) +
                  " rd=" + std::to_string(c.rd) + " width=" + std::to_string(c.width_raw) +
                  " threads=" + std::to_string(c.num_threads) + "\n";
  for (int i = 0; i < NSLOTS; ++i) {
    const TensorDesc& d = c.t[i];
    if (!d.used) continue;
    s += std::string("  ") + d.name + " " + dtype_name(d.dtype) + " rank " +
         std::to_string(d.view_rank) + " shape [";
    for (int a = 0; a < d.rank; ++a) s += (a ? ", " : "") + std::to_string(d.shape[a]);
    s += "] strides [";
    for (int a = 0; a < d.rank; ++a) s += (a ? ", " : "") + std::to_string(d.strides[a]);
    s += "] arena " + std::to_string(d.arena) + " offset " + std::to_string(d.offset) +
         (d.null_data ? " NULL" : "") + (d.allocatable ? "" : " UNALLOCATABLE") + "\n";
  }
  if (!c.column_axis.empty()) {
    s += "  column_axis [";
    for (std::size_t i = 0; i < c.column_axis.size(); ++i)
      s += (i ? ", " : "") + std::to_string(c.column_axis[i]);
    s += "]\n";
  }
  return s;
}

const Case* g_case = nullptr;

[[noreturn]] void bug(const std::string& what) {
  std::fprintf(stderr, "\n==== RoME fuzz BUG: %s\n", what.c_str());
  if (g_case) std::fprintf(stderr, "%s\n", describe(*g_case).c_str());
  std::fflush(stderr);
  std::abort();
}

i128 reach_of(const TensorDesc& d) {  // as plan.cpp's check_strides counts it
  i128 r = 0;
  for (int i = 0; i < d.rank; ++i)
    if (d.shape[i] > 1)
      r += (d.strides[i] < 0 ? -i128(d.strides[i]) : i128(d.strides[i])) * (d.shape[i] - 1);
  return r;
}

void compute_span(TensorDesc& d) {
  i128 lo = 0, hi = 1;
  bool empty = false;
  for (int i = 0; i < d.rank; ++i) {
    if (d.shape[i] <= 0) {
      empty = true;
      continue;
    }
    const i128 reach = i128(d.strides[i]) * (d.shape[i] - 1);
    (reach < 0 ? lo : hi) += reach;
  }
  if (empty) lo = 0, hi = 1;
  d.allocatable = (hi - lo) * d.es() <= kMaxArenaBytes;
  if (!d.allocatable) lo = 0, hi = 1;
  d.lo = i64(lo * d.es());
  d.hi = i64(hi * d.es());
}

template <typename F>
void for_each_index(int rank, const i64* shape, F&& f) {
  i64 idx[kMaxRank] = {};
  for (int i = 0; i < rank; ++i)
    if (shape[i] <= 0) return;
  for (;;) {
    f(static_cast<const i64*>(idx));
    int i = rank - 1;
    for (; i >= 0; --i) {
      if (++idx[i] < shape[i]) break;
      idx[i] = 0;
    }
    if (i < 0) return;
  }
}

i64 elem_offset(const TensorDesc& d, const i64* idx) {  // bytes from the arena start
  i64 o = 0;
  for (int i = 0; i < d.rank; ++i) o += idx[i] * d.strides[i];
  return d.offset + o * d.es();
}

// Element byte offsets of a view (arena-relative), for overlap and distinctness checks.
std::vector<i64> elements(const TensorDesc& d) {
  std::vector<i64> out;
  if (!d.allocatable) return out;
  for_each_index(d.rank, d.shape, [&](const i64* idx) { out.push_back(elem_offset(d, idx)); });
  return out;
}

bool distinct(const TensorDesc& d) {
  std::vector<i64> e = elements(d);
  std::sort(e.begin(), e.end());
  for (std::size_t i = 1; i < e.size(); ++i)
    if (e[i] - e[i - 1] < d.es()) return false;
  return true;
}

bool overlaps(const Case& c, const TensorDesc& a, const TensorDesc& b) {
  if (!a.used || !b.used || a.arena != b.arena || a.null_data || b.null_data) return false;
  std::vector<std::uint8_t> mark(c.arena_size[a.arena], 0);
  for (i64 o : elements(a)) std::fill(mark.begin() + o, mark.begin() + o + a.es(), 1);
  for (i64 o : elements(b))
    for (int k = 0; k < b.es(); ++k)
      if (mark[o + k]) return true;
  return false;
}

bool exact_in_place(const TensorDesc& in, const TensorDesc& out) {
  if (in.arena != out.arena || in.offset != out.offset || in.null_data || out.null_data)
    return false;
  for (int i = 0; i < in.rank; ++i)
    if (in.shape[i] > 1 && in.strides[i] != out.strides[i]) return false;
  return true;
}

// ------------------------------------------------------------------------------------------
// Generation

DType float_dtype(Reader& R, bool allow_bad) {
  if (allow_bad && R.rare(8)) return R.below(2) ? DType::i32 : DType::i64;
  static const DType d[4] = {DType::f32, DType::bf16, DType::f16, DType::f32};
  return d[R.below(4)];
}

std::vector<float> random_matrix(Rng& rng, i64 dim, bool bad) {
  std::vector<float> m(dim * dim);
  for (auto& v : m) v = rng.below(10) < 6 ? 0.0f : float(rng.below(129) - 64) / 32.0f;
  if (bad) m[rng.below(dim * dim)] = rng.below(2) ? NAN : INFINITY;
  return m;
}

// A signed partial permutation as a dense matrix: column j holds one ±1 (row perm[j]) or nothing.
std::vector<float> signed_permutation(Rng& rng, i64 dim, int empty_percent) {
  std::vector<int> perm(dim);
  std::iota(perm.begin(), perm.end(), 0);
  for (i64 i = dim - 1; i > 0; --i) std::swap(perm[i], perm[rng.below(i + 1)]);
  std::vector<float> m(dim * dim, 0.0f);
  for (i64 j = 0; j < dim; ++j)
    if (rng.below(100) >= empty_percent) m[perm[j] * dim + j] = rng.below(2) ? 1.0f : -1.0f;
  return m;
}

bool g_allow_lane_offset = false;  // set per case before its rotation is drawn

Rotation build_rotation(Reader& R, Rng& rng, std::string& log, int depth) {
  auto even = [&](int halves) -> i64 {
    i64 d = 2 * (1 + R.below(halves));
    if (R.rare(4)) {
      static const i64 bad[] = {0, -2, 3, 1, (i64(1) << 24) + 2};
      d = bad[R.below(5)];
    }
    return d;
  };
  const int kind = depth > 1 ? 0 : R.below(9);
  switch (kind) {
    case 0: {
      const i64 d = even(32);
      log += "half(" + std::to_string(d) + ")";
      return Rotation::half(d);
    }
    case 1: {
      const i64 d = even(32);
      log += "interleave(" + std::to_string(d) + ")";
      return Rotation::interleave(d);
    }
    case 2: {
      i64 d = 4 * (1 + R.below(16));
      if (R.rare(4)) d = R.below(2) ? 6 : 2;
      log += "quarter(" + std::to_string(d) + ")";
      return Rotation::quarter(d);
    }
    case 3: {
      const i64 d = even(32);
      log += "interleave_half(" + std::to_string(d) + ")";
      return Rotation::interleave_half(d);
    }
    case 4: {
      const int n = 1 + R.below(4);
      std::vector<Rotation> blocks;
      log += "block_diag(";
      for (int b = 0; b < n; ++b) {
        if (b) log += ", ";
        const int k = R.below(5);
        if (k == 4) {
          const i64 d = 1 + R.below(8);
          log += "dense(" + std::to_string(d) + ")";
          blocks.push_back(Rotation::dense(random_matrix(rng, d, false), d));
        } else if (k == 2) {
          const i64 d = 4 * (1 + R.below(6));
          log += "quarter(" + std::to_string(d) + ")";
          blocks.push_back(Rotation::quarter(d));
        } else {
          const i64 d = 2 * (1 + R.below(12));
          log += (k == 0   ? "half("
                  : k == 1 ? "interleave("
                           : "interleave_half(") +
                 std::to_string(d) + ")";
          blocks.push_back(k == 0   ? Rotation::half(d)
                           : k == 1 ? Rotation::interleave(d)
                                    : Rotation::interleave_half(d));
        }
        if (R.rare(6)) {
          log += ".partial";
          blocks.back() = blocks.back().partial(blocks.back().head_dim() + 2);
        }
      }
      log += ")";
      return Rotation::block_diag(blocks);
    }
    case 5: {
      log += "partial(";
      Rotation base = build_rotation(R, rng, log, depth + 1);
      i64 hd = base.rotary_dim() + 2 * R.below(8) + (base.rotary_dim() % 2);
      if (R.rare(6)) hd = R.below(2) ? base.rotary_dim() - 2 : hd + 1;
      // Rotated lanes at an offset (forward only: the backward reference assumes offset 0).
      const i64 offset = g_allow_lane_offset && R.rare(3) ? 2 * R.below(6) : 0;
      log += ", " + std::to_string(hd + offset) + ", offset " + std::to_string(offset) + ")";
      return base.partial(hd + offset, offset);
    }
    case 6:
    case 7: {
      i64 d = 1 + R.below(24);
      if (R.rare(4)) d = R.below(2) ? 0 : -1;
      const bool bad = R.rare(4);
      log += std::string(kind == 6 ? "dense_b(" : "dense_ab(") + std::to_string(d) +
             (bad ? ", non-finite" : "") + ")";
      if (d <= 0) return Rotation::dense(std::vector<float>{}, d);
      std::vector<float> b = random_matrix(rng, d, bad);
      if (kind == 6) return Rotation::dense(b, d);
      std::vector<float> a = random_matrix(rng, d, false);
      if (R.rare(8)) a.pop_back();  // wrong size
      return Rotation::dense(a, b, d);
    }
    default: {
      const i64 d = 1 + R.below(32);
      const int amode = R.below(3);
      const bool a_empty = amode == 2;
      log += "dense_perm(" + std::to_string(d) +
             (amode == 0 ? ", A=I"
              : a_empty  ? ", A with empty columns"
                         : ", A=perm") +
             ")";
      std::vector<float> b = signed_permutation(rng, d, 20);
      std::vector<float> a =
          amode == 0 ? signed_permutation(rng, d, 0) : signed_permutation(rng, d, a_empty ? 25 : 0);
      if (amode == 0) {
        std::fill(a.begin(), a.end(), 0.0f);
        for (i64 i = 0; i < d; ++i) a[i * d + i] = 1.0f;
      }
      return Rotation::dense(a, b, d);
    }
  }
}

// Strides for d.shape: plain row-major, padded, permuted, one negative / zero / overlapping axis,
// a misaligned start, or (rare) an overflowing stride or a non-unit last stride.
void make_layout(Reader& R, TensorDesc& d, bool xlike) {
  const int r = d.rank;
  const int mode = R.below(16);
  std::vector<int> order(r);
  std::iota(order.begin(), order.end(), 0);
  i64 pad = 0;
  const int movable = xlike ? r - 1 : r;
  if (mode == 6 || mode == 7) pad = 1 + R.below(8);
  if (mode == 8 || mode == 9)
    for (int i = movable - 1; i > 0; --i) std::swap(order[i], order[R.below(i + 1)]);
  i64 stride = 1;
  for (int p = r - 1; p >= 0; --p) {
    const int a = order[p];
    d.strides[a] = stride;
    stride *= std::max<i64>(d.shape[a], 1);
    if (p == r - 1) stride += pad;
  }
  auto axis = [&](bool nonlast) {
    const int n = nonlast ? r - 1 : r;
    return n > 0 ? R.below(n) : -1;
  };
  switch (mode) {
    case 10:
    case 11: {
      const int a = axis(xlike);
      if (a >= 0) d.strides[a] = -d.strides[a];
      break;
    }
    case 12: d.front = (1 + R.below(7)) * d.es(); break;
    case 13: {
      const int a = axis(xlike);
      if (a >= 0) d.strides[a] = 0;
      break;
    }
    case 14: {
      const int a = axis(xlike);
      if (a >= 0) d.strides[a] = R.below(2) ? std::max<i64>(1, d.strides[a] / 2) : 1;
      break;
    }
    case 15:
      if (R.below(2)) {
        static const i64 huge[] = {(i64(1) << 60) + 1, i64(1) << 61,      i64(1) << 62,
                                   INT64_MAX,          INT64_MIN,         -(i64(1) << 62),
                                   -INT64_MAX,         (i64(1) << 59) + 7};
        const int a = axis(false);
        const i64 v = huge[R.below(8)];
        if (a >= 0 && (v != INT64_MIN || enabled("huge_min")) &&
            (d.shape[a] > 1 || enabled("huge_size1")))
          d.strides[a] = v;
      } else {
        static const i64 last[] = {0, 2, -1, 3, -2, 1 << 10};
        d.strides[r - 1] = last[R.below(6)];
      }
      break;
    default: break;
  }
  compute_span(d);
  // A view the library may legally accept must be allocatable; fall back to row-major.
  if (!d.allocatable && reach_of(d) <= kMaxReach) {
    stride = 1;
    for (int a = r - 1; a >= 0; --a) d.strides[a] = stride, stride *= std::max<i64>(d.shape[a], 1);
    compute_span(d);
  }
}

void init_desc(TensorDesc& d, const char* name, DType dtype, int rank, const i64* shape,
               bool output = false) {
  d = TensorDesc{};
  d.name = name;
  d.used = true;
  d.output = output;
  d.dtype = dtype;
  d.rank = d.view_rank = rank;
  for (int i = 0; i < rank; ++i) d.shape[i] = shape[i];
}

// Same memory and layout as `src` (in place), with a new name.
void alias_of(TensorDesc& d, const TensorDesc& src, const char* name, bool output) {
  d = src;
  d.name = name;
  d.output = output;
}

int new_arena(Case& c) {
  return c.arenas++;
}

// An output of shape `in`'s, separate or overlapping `in`'s memory in one of several ways.
void make_output(Reader& R, Case& c, TensorDesc& out, const TensorDesc& in, const char* name,
                 int mode) {
  switch (mode) {
    case 0:  // own buffer, own layout
    default:
      init_desc(out, name, in.dtype, in.rank, in.shape, true);
      if (R.rare(6)) out.dtype = out.dtype == DType::f32 ? DType::bf16 : DType::f32;
      if (R.rare(6) && out.rank > 1) out.shape[R.below(out.rank - 1)] += 1;
      make_layout(R, out, true);
      out.arena = new_arena(c);
      break;
    case 1:  // in place
      alias_of(out, in, name, true);
      break;
    case 2: {  // same layout, shifted inside in's buffer
      alias_of(out, in, name, true);
      const i64 span = (in.hi - in.lo) / in.es();
      const i64 shifts[] = {1, std::max<i64>(1, c.hd / 2), c.hd, -1, -c.hd, span, span + 1, -span};
      out.delta += shifts[R.below(8)] * in.es();
      break;
    }
    case 3:  // same start, another layout
      alias_of(out, in, name, true);
      make_layout(R, out, true);
      break;
  }
}

void fill_values(Case& c, World& w, Rng& rng, const TensorDesc& d, bool specials) {
  if (!d.used || d.null_data || !d.allocatable) return;
  for_each_index(d.rank, d.shape, [&](const i64* idx) {
    std::uint8_t* p = w[d.arena].data() + elem_offset(d, idx);
    double v = rng.unit() * 8.0 - 4.0;
    if (specials && rng.below(16) == 0) {
      static const double sp[] = {NAN, INFINITY, -INFINITY, -0.0, 1e30, -7e4, 1e-40, 3e-8};
      v = sp[rng.below(8)];
    }
    switch (d.dtype) {
      case DType::f32: {
        const float f = float(v);
        std::memcpy(p, &f, 4);
        break;
      }
      case DType::bf16: {
        const auto h = detail::float_to_bf16(float(v));
        std::memcpy(p, &h, 2);
        break;
      }
      case DType::f16: {
        const auto h = detail::float_to_fp16(float(v));
        std::memcpy(p, &h, 2);
        break;
      }
      case DType::i32: {
        const auto i = std::int32_t(rng.next());
        std::memcpy(p, &i, 4);
        break;
      }
      case DType::i64: {
        const auto i = std::int64_t(rng.next());
        std::memcpy(p, &i, 8);
        break;
      }
    }
  });
}

void place_arenas(Case& c) {
  std::vector<i64> lo(c.arenas, INT64_MAX), hi(c.arenas, INT64_MIN), front(c.arenas, 0);
  for (auto& d : c.t) {
    if (!d.used) continue;
    lo[d.arena] = std::min(lo[d.arena], d.delta + d.lo);
    hi[d.arena] = std::max(hi[d.arena], d.delta + d.hi);
    front[d.arena] = std::max(front[d.arena], d.front);
  }
  c.arena_size.assign(c.arenas, 0);
  for (int a = 0; a < c.arenas; ++a)
    if (lo[a] != INT64_MAX) c.arena_size[a] = std::max<i64>(1, hi[a] - lo[a] + front[a]);
  for (auto& d : c.t)
    if (d.used) d.offset = d.delta - lo[d.arena] + front[d.arena];
}

// Decodes one case; returns false when a rotation constructor rejected its arguments.
bool generate(Reader& R, Case& c, World& w) {
  Rng rng{R.u32()};
  c.op = R.below(3);
  g_allow_lane_offset = c.op != 2;
  c.rot.emplace(build_rotation(R, rng, c.log, 0));
  const Rotation& rot = *c.rot;
  c.hd = rot.head_dim();
  c.rd = rot.rotary_dim();
  c.perm = rot.kind() == Rotation::Kind::signed_permutation;
  c.a_identity = rot.a_is_identity();
  c.A = rot.to_dense_a();
  c.B = rot.to_dense_b();
  // x (q, or grad for backward).
  const DType xdt = float_dtype(R, true);
  const int rank = 2 + R.below(4);
  i64 shape[kMaxRank] = {};
  static const i64 sizes[16] = {1, 2, 3, 4, 1, 5, 8, 2, 7, 16, 1, 3, 32, 6, 64, 1};
  for (int i = 0; i < rank - 1; ++i) shape[i] = sizes[R.below(16)];
  shape[rank - 1] = c.hd;
  for (;;) {
    i64 n = 1, big = 0;
    for (int i = 0; i < rank; ++i) {
      n *= shape[i];
      if (i < rank - 1 && shape[i] > shape[big]) big = i;
    }
    if (n <= kMaxElements || shape[big] <= 1) break;
    shape[big] = (shape[big] + 1) / 2;
  }
  for (int i = 0; i < rank - 1; ++i)
    if (R.rare(6)) shape[i] = R.rare(64) ? -1 : c.op == 2 && !enabled("zero_backward") ? 1 : 0;
  if (R.rare(4)) shape[rank - 1] = R.below(2) ? c.hd + 2 : c.hd - 1;
  const int axes = rank - 1;

  TensorDesc& q = c.t[Q_IN];
  init_desc(q, c.op == 2 ? "grad" : "q", xdt, rank, shape);
  if (R.rare(4)) {
    static const int bad[] = {0, 1, 6, -3};
    q.view_rank = bad[R.below(4)];
  }
  if (R.rare(3)) q.null_data = true;

  int kmode = -1;
  if (c.op == 1) kmode = R.below(8);
  if (kmode == 3 || kmode == 4) {
    // Fused qkv: q heads then k heads along axis h of one buffer.
    const int h = R.below(axes);
    const i64 nk = shape[h] > 0 ? 1 + R.below(int(std::min<i64>(shape[h], 64))) : 0;
    TensorDesc phys;
    i64 pshape[kMaxRank];
    std::copy(shape, shape + rank, pshape);
    pshape[h] = shape[h] + nk;
    init_desc(phys, "qkv", xdt, rank, pshape);
    make_layout(R, phys, true);
    q.arena = new_arena(c);
    std::copy(phys.strides, phys.strides + rank, q.strides);
    compute_span(q);
    TensorDesc& k = c.t[K_IN];
    init_desc(k, "k", xdt, rank, shape);
    k.shape[h] = nk;
    std::copy(phys.strides, phys.strides + rank, k.strides);
    compute_span(k);
    k.arena = q.arena;
    // (an unallocatable layout keeps k at q's start: the library must reject it anyway)
    const i128 delta = i128(shape[h]) * phys.strides[h] * q.es();
    k.delta =
        phys.allocatable && delta > -kMaxArenaBytes && delta < kMaxArenaBytes ? i64(delta) : 0;
    if (kmode == 3) {  // both in place
      alias_of(c.t[Q_OUT], q, "q_out", true);
      alias_of(c.t[K_OUT], k, "k_out", true);
    } else {  // a second fused buffer for the outputs
      TensorDesc& qo = c.t[Q_OUT];
      TensorDesc& ko = c.t[K_OUT];
      alias_of(qo, q, "q_out", true);
      alias_of(ko, k, "k_out", true);
      qo.arena = ko.arena = new_arena(c);
      qo.front = 0;
    }
    c.log += kmode == 3 ? " fused-qkv-in-place" : " fused-qkv-out";
  } else {
    make_layout(R, q, true);
    q.arena = new_arena(c);
    if (c.op != 2) make_output(R, c, c.t[Q_OUT], q, "q_out", R.below(8) % 4 == 0 ? 0 : R.below(4));
  }
  if (c.op == 1 && kmode != 3 && kmode != 4) {
    TensorDesc& k = c.t[K_IN];
    if (kmode <= 2) {
      i64 kshape[kMaxRank];
      std::copy(shape, shape + rank, kshape);
      if (R.below(2) && axes > 0) {  // GQA / MQA
        const int a = R.below(axes);
        if (kshape[a] > 0) kshape[a] = 1 + R.below(int(std::min<i64>(kshape[a], 64)));
      }
      init_desc(k, "k", xdt, rank, kshape);
      if (R.rare(8)) k.dtype = xdt == DType::f32 ? DType::f16 : DType::f32;
      if (R.rare(8)) k.view_rank = rank == 5 ? 4 : rank + 1;
      make_layout(R, k, true);
      k.arena = new_arena(c);
      make_output(R, c, c.t[K_OUT], k, "k_out", R.below(3));
    } else if (kmode == 5) {  // k reads q's memory (valid)
      alias_of(k, q, "k", false);
      make_output(R, c, c.t[K_OUT], k, "k_out", 0);
    } else if (kmode == 6) {  // k writes over q_out (or q)
      init_desc(k, "k", xdt, rank, shape);
      make_layout(R, k, true);
      k.arena = new_arena(c);
      alias_of(c.t[K_OUT], R.below(2) ? c.t[Q_OUT] : q, "k_out", true);
      c.t[K_OUT].dtype = xdt;
    } else {  // k reads q_out (invalid)
      alias_of(k, c.t[Q_OUT], "k", false);
      make_output(R, c, c.t[K_OUT], k, "k_out", 0);
    }
  }

  // Backward: x, dx, and later dcos/dsin/dA/dB.
  int dxmode = 0;
  if (c.op == 2) {
    TensorDesc& x = c.t[X];
    i64 xshape[kMaxRank];
    std::copy(shape, shape + rank, xshape);
    if (R.rare(8) && axes > 0) xshape[0] += 1;
    init_desc(x, "x", float_dtype(R, true), rank, xshape);
    make_layout(R, x, true);
    x.arena = new_arena(c);
    dxmode = R.below(6);
    if (dxmode == 5 && !enabled("alias_dx_x")) dxmode = 1;
    if (dxmode == 1 || dxmode == 2) make_output(R, c, c.t[DX], q, "dx", 0);
    if (dxmode == 3) make_output(R, c, c.t[DX], q, "dx", 1);
    if (dxmode == 4) make_output(R, c, c.t[DX], q, "dx", 2);
    if (dxmode == 5) {  // dx over x (an output overlapping an input the contract does not name)
      x.dtype = xdt;
      std::copy(q.shape, q.shape + rank, x.shape);
      compute_span(x);
      make_output(R, c, c.t[DX], x, "dx", 1);
    }
  }

  // Tables.
  c.cache = R.below(3) == 0;
  c.width_raw = R.below(3);
  c.inverse = c.op != 2 && R.below(4) == 0;
  if (R.rare(3) && enabled("bad_enum")) c.width_raw = 3 + R.below(253);
  c.width = static_cast<TableWidth>(c.width_raw);
  const i64 columns = c.width_raw == 0 ? c.rd : c.rd / 2;
  TensorDesc& cos = c.t[COS];
  TensorDesc& sin = c.t[SIN];
  const DType cdt = float_dtype(R, true), sdt = R.below(2) ? cdt : float_dtype(R, true);
  i64 tshape[kMaxRank] = {};
  int trank = 0;
  if (!c.cache) {
    int taxes = R.below(axes + 1);
    if (R.rare(6)) taxes = std::min(axes + 1, 4);
    trank = taxes + 1;
    for (int i = 0; i < taxes; ++i) {
      const int xi = axes - taxes + i;
      const i64 xs = xi >= 0 ? shape[xi] : 1;
      tshape[i] = R.below(3) == 1 ? 1 : xs;
      if (R.rare(8)) tshape[i] = R.below(2) ? xs + 1 : 2;
    }
    tshape[taxes] = columns;
    if (R.rare(8)) c.column_axis.assign(columns, 0);
  } else {
    i64 P = 1 + R.below(64);
    if (R.rare(8)) P = 0;
    trank = 2;
    tshape[0] = P;
    tshape[1] = columns;
    if (R.rare(8)) trank = 3, tshape[2] = columns, tshape[1] = P, tshape[0] = 1;
  }
  if (R.rare(8)) tshape[trank - 1] += R.below(2) ? 1 : -1;
  init_desc(cos, "cos", cdt, trank, tshape);
  init_desc(sin, "sin", sdt, trank, tshape);
  if (R.rare(8)) sin.shape[0] += 1;
  const int tmode = R.below(4);
  if (tmode == 3 && trank == 2 && cdt == sdt && !R.rare(8)) {
    // vLLM cos_sin_cache: one [P, 2·columns] buffer, cos then sin on each row.
    cos.strides[0] = sin.strides[0] = 2 * std::max<i64>(cos.shape[1], 0);
    cos.strides[1] = sin.strides[1] = 1;
    compute_span(cos);
    compute_span(sin);
    cos.arena = sin.arena = new_arena(c);
    sin.delta = std::max<i64>(cos.shape[1], 0) * cos.es();
    c.log += " cos_sin_cache";
  } else {
    make_layout(R, cos, false);
    cos.arena = new_arena(c);
    if (tmode == 1 && sin.rank == cos.rank && sin.shape[0] == cos.shape[0]) {
      std::copy(cos.strides, cos.strides + trank, sin.strides);
      compute_span(sin);
    } else {
      make_layout(R, sin, false);
    }
    sin.arena = new_arena(c);
  }
  if (R.rare(3)) (R.below(2) ? cos : sin).null_data = true;
  if (c.op != 2 && R.rare(4) && enabled("alias_tables")) {
    // A table inside q_out's memory: read while q_out is written.
    TensorDesc& qo = c.t[Q_OUT];
    cos.arena = qo.arena;
    cos.delta = qo.delta + R.below(4) * qo.es();
    c.log += " cos-in-q_out";
  }

  if (c.cache) {
    TensorDesc& pos = c.t[POS];
    const bool multi = R.below(3) == 0;
    const i64 n_axes = 1 + R.below(4);
    DType pdt = R.below(2) ? DType::i64 : DType::i32;
    if (R.rare(6)) pdt = R.below(2) ? DType::f32 : DType::bf16;
    int prank = axes + (multi ? 1 : 0);
    if (R.rare(8)) prank += R.below(2) ? 1 : -1;
    prank = std::clamp(prank, 1, kMaxRank);
    i64 pshape[kMaxRank] = {};
    for (int i = 0; i < prank; ++i) {
      const i64 xs = i < axes ? shape[i] : 1;
      pshape[i] = R.below(3) == 1 ? 1 : xs;
      if (R.rare(8)) pshape[i] = xs + 1;
    }
    if (multi) {
      pshape[prank - 1] = n_axes;
      c.column_axis.resize(columns > 0 ? columns : 0);
      const int cmode = R.below(3);
      for (i64 j = 0; j < i64(c.column_axis.size()); ++j)
        c.column_axis[j] =
            cmode == 0 ? int(rng.below(n_axes)) : int(j * n_axes / std::max<i64>(1, columns));
      if (R.rare(8) && !c.column_axis.empty())
        c.column_axis[rng.below(i64(c.column_axis.size()))] = R.below(2) ? -1 : int(n_axes);
      if (R.rare(8)) c.column_axis.push_back(0);
    }
    init_desc(pos, "positions", pdt, prank, pshape);
    make_layout(R, pos, false);
    pos.arena = new_arena(c);
    if (R.rare(3)) pos.null_data = true;
    if (c.op != 2 && R.rare(4) && enabled("alias_positions")) {
      // Positions inside q_out's memory: validated, then overwritten by the call itself.
      TensorDesc& qo = c.t[Q_OUT];
      pos.arena = qo.arena;
      pos.delta = qo.delta;
      c.log += " positions-in-q_out";
    }
  }

  if (c.op == 2) {
    const bool cache = c.cache;
    for (int s : {DCOS, DSIN}) {
      const int m = R.below(3);
      if (m == 0) continue;
      TensorDesc& d = c.t[s];
      init_desc(d, s == DCOS ? "dcos" : "dsin", float_dtype(R, true), cos.rank, cos.shape, true);
      if (R.rare(8)) d.shape[0] += 1;
      make_layout(R, d, false);
      d.arena = new_arena(c);
      (void)cache;
    }
    if (c.t[DCOS].used && c.t[DSIN].used && R.rare(6) && enabled("alias_dcos_dsin")) {
      c.t[DSIN].arena = c.t[DCOS].arena;  // dcos and dsin in one place
      c.t[DSIN].delta = c.t[DCOS].delta;
      c.t[DSIN].front = c.t[DCOS].front;
      c.log += " dsin-on-dcos";
    }
    const i64 m[2] = {c.rd, c.rd};
    for (int s : {DA, DB})
      if (R.below(3) == 0) {
        init_desc(c.t[s], s == DA ? "da" : "db", DType::f32, 2, m, true);
        make_layout(R, c.t[s], true);
        // da/db are raw float* rd×rd row-major.
        c.t[s].strides[0] = c.rd, c.t[s].strides[1] = 1, c.t[s].front = 0;
        compute_span(c.t[s]);
        c.t[s].arena = new_arena(c);
      }
    if (c.t[DA].used && c.t[DB].used && R.rare(6) && enabled("alias_da_db")) {
      c.t[DB].arena = c.t[DA].arena;
      c.log += " db-on-da";
    }
  }

  static const int threads[8] = {1, 0, 2, 1, 3, 2, 1, 2};
  c.num_threads = threads[R.below(8)];
  if (R.rare(4)) c.num_threads = R.below(2) ? -1 : 7;
  c.specials = R.rare(32);

  place_arenas(c);
  w.assign(c.arenas, {});
  for (int a = 0; a < c.arenas; ++a) w[a].assign(c.arena_size[a], 0xA5);
  for (int s : {Q_IN, K_IN, GRAD, X, COS, SIN})
    fill_values(c, w, rng, c.t[s], s == Q_IN || s == K_IN ? c.specials : false);
  // Positions: valid rows, and now and then one bad value.
  TensorDesc& pos = c.t[POS];
  if (pos.used && !pos.null_data && pos.allocatable) {
    const i64 P = std::max<i64>(cos.shape[0], 0);
    const bool bad = R.rare(24);
    static const i64 bad_values[] = {
        -1,           0,         1,         INT32_MAX,         INT32_MIN, i64(1) << 31,
        i64(1) << 32, INT64_MAX, INT64_MIN, (i64(1) << 32) + 1};
    const i64 bad_value = bad_values[R.below(10)];
    const i64 n = pos.numel(), at = rng.below(n);
    i64 e = 0;
    for_each_index(pos.rank, pos.shape, [&](const i64* idx) {
      i64 v = rng.below(P);
      if (bad && e == at) v = bad_value == 0 ? P : bad_value == 1 ? P + 1 : bad_value;
      ++e;
      std::uint8_t* p = w[pos.arena].data() + elem_offset(pos, idx);
      if (pos.dtype == DType::i32) {
        const auto v32 = std::int32_t(v);
        std::memcpy(p, &v32, 4);
      } else if (pos.dtype == DType::i64)
        std::memcpy(p, &v, 8);
      else if (pos.dtype == DType::f32) {
        const float f = float(v);
        std::memcpy(p, &f, 4);
      } else {
        const auto h = detail::float_to_bf16(float(v));
        std::memcpy(p, &h, 2);
      }
    });
  }
  return true;
}

// ------------------------------------------------------------------------------------------
// The contract, as a model: returns why the call must be rejected (empty: it must succeed).

struct Model {
  std::vector<std::string> reasons;
  void add(const std::string& arg, const std::string& why) { reasons.push_back(arg + ": " + why); }
};

// Arenas come from operator new (16-byte aligned), so a view's alignment is its byte offset's.
bool misaligned(const TensorDesc& d) {
  return !d.null_data && d.numel() > 0 && d.es() > 1 && d.offset % d.es() != 0;
}

void check_xlike(Model& m, const TensorDesc& d, i64 hd) {
  if (d.view_rank < 2 || d.view_rank > kMaxRank) return m.add(d.name, "rank");
  for (int i = 0; i < d.rank; ++i)
    if (d.shape[i] < 0) m.add(d.name, "negative size");
  if (!is_floating(d.dtype)) m.add(d.name, "dtype");
  if (d.shape[d.rank - 1] != hd) m.add(d.name, "head size");
  if (d.numel() > 0 && d.null_data) m.add(d.name, "null");
  if (misaligned(d)) m.add(d.name, "misaligned");
  if (hd > 1 && d.numel() > 0 && d.strides[d.rank - 1] != 1) m.add(d.name, "last stride");
  if (reach_of(d) > kMaxReach) m.add(d.name, "extent overflows");
}

void check_pair(Model& m, const Case& c, const TensorDesc& in, const TensorDesc& out) {
  check_xlike(m, out, c.hd);
  if (out.dtype != in.dtype) m.add(out.name, "dtype differs");
  if (out.view_rank != in.view_rank || !std::equal(in.shape, in.shape + in.rank, out.shape))
    m.add(out.name, "shape differs");
  if (!m.reasons.empty() || in.numel() == 0) return;
  if (!distinct(out)) m.add(out.name, "repeated elements");
  if (!exact_in_place(in, out) && overlaps(c, in, out)) m.add(out.name, "partial overlap");
}

bool check_table(Model& m, const TensorDesc& t, i64 columns) {
  if (t.view_rank < 1 || t.view_rank > kMaxRank) return m.add(t.name, "rank"), false;
  for (int i = 0; i < t.rank; ++i)
    if (t.shape[i] < 0) m.add(t.name, "negative size");
  if (reach_of(t) > kMaxReach) m.add(t.name, "extent overflows");
  if (!is_floating(t.dtype)) m.add(t.name, "dtype");
  if (t.shape[t.rank - 1] != columns) m.add(t.name, "width");
  if (t.numel() > 0 && t.null_data) m.add(t.name, "null");
  if (misaligned(t)) m.add(t.name, "misaligned");
  return true;
}

i64 load_position(const Case& c, const World& w, const i64* idx) {
  const TensorDesc& p = c.t[POS];
  const std::uint8_t* a = w[p.arena].data() + elem_offset(p, idx);
  if (p.dtype == DType::i32) {
    std::int32_t v;
    std::memcpy(&v, a, 4);
    return v;
  }
  i64 v;
  std::memcpy(&v, a, 8);
  return v;
}

Model model(const Case& c, const World& w) {
  Model m;
  const TensorDesc &q = c.t[Q_IN], &k = c.t[K_IN], &cos = c.t[COS], &sin = c.t[SIN];
  check_xlike(m, q, c.hd);
  if (!m.reasons.empty()) return m;  // the rest reads q's shape
  const int rank = q.rank, axes = rank - 1;
  if (c.op != 2) check_pair(m, c, q, c.t[Q_OUT]);
  if (c.op == 2 && c.t[DX].used) check_pair(m, c, q, c.t[DX]);
  if (c.op == 1) {
    check_xlike(m, k, c.hd);
    check_pair(m, c, k, c.t[K_OUT]);
    if (k.view_rank != q.view_rank) m.add("k", "rank differs");
    if (k.dtype != q.dtype) m.add("k", "dtype differs");
    if (m.reasons.empty() && k.numel() > 0 && q.numel() > 0) {
      if (overlaps(c, c.t[Q_OUT], c.t[K_OUT])) m.add("k_out", "overlaps q_out");
      if (overlaps(c, q, c.t[K_OUT])) m.add("k_out", "overlaps q");
      if (overlaps(c, k, c.t[Q_OUT])) m.add("q_out", "overlaps k");
    }
  }
  if (!m.reasons.empty()) return m;
  const i64 columns = c.width_raw == 0 ? c.rd : c.rd / 2;
  if (c.width_raw > 2) m.add("tables.width", "not a TableWidth");
  if (c.width_raw != 0 && c.rd % 2 != 0) m.add("tables.width", "odd rotary_dim");
  bool tables_ok = check_table(m, cos, columns);
  tables_ok &= check_table(m, sin, columns);
  if (!tables_ok) return m;
  if (cos.view_rank != sin.view_rank || !std::equal(cos.shape, cos.shape + cos.rank, sin.shape))
    m.add("sin", "shape differs from cos");
  bool varies[kMaxRank] = {};
  auto broadcast = [&](const TensorDesc& t, int t_axes) {
    if (t_axes > axes) return m.add(t.name, "too many axes");
    for (int i = 0; i < t_axes; ++i) {
      const int xi = axes - t_axes + i;
      const i64 ts = t.shape[i];
      if (ts != 1 && ts != q.shape[xi]) m.add(t.name, "not broadcastable to q");
      if (c.op == 1 && ts != 1 && ts != k.shape[xi]) m.add(t.name, "not broadcastable to k");
    }
  };
  if (!c.gather()) {
    if (!c.column_axis.empty()) m.add("tables.column_axis", "given for direct tables");
    broadcast(cos, cos.rank - 1);
    if (m.reasons.empty())
      for (int i = 0; i < cos.rank - 1; ++i)
        if (cos.shape[i] != 1) varies[axes - (cos.rank - 1) + i] = true;
  } else {
    const TensorDesc& p = c.t[POS];
    if (cos.rank != 2)
      m.add("cos", "cache rank");
    else if (cos.shape[0] < 1)
      m.add("cos", "empty cache");
    if (p.dtype != DType::i32 && p.dtype != DType::i64) m.add("positions", "dtype");
    const bool multi = !c.column_axis.empty();
    if (p.view_rank != axes + (multi ? 1 : 0)) m.add("positions", "rank");
    if (!m.reasons.empty()) return m;
    for (int i = 0; i < p.rank; ++i)
      if (p.shape[i] < 0) m.add("positions", "negative size");
    if (reach_of(p) > kMaxReach) m.add("positions", "extent overflows");
    if (misaligned(p)) m.add("positions", "misaligned");
    broadcast(p, axes);
    if (multi) {
      const i64 n_axes = p.shape[p.rank - 1];
      if (i64(c.column_axis.size()) != columns) m.add("tables.column_axis", "count");
      for (int a : c.column_axis)
        if (a < 0 || a >= n_axes) m.add("tables.column_axis", "entry out of range");
    }
    if (!m.reasons.empty()) return m;
    for_each_index(p.rank, p.shape, [&](const i64* idx) {
      const i64 v = load_position(c, w, idx);
      if (v < 0 || v >= cos.shape[0]) m.add("positions", "out of range");
    });
    for (int i = 0; i < axes; ++i)
      if (p.shape[i] != 1) varies[i] = true;
  }
  if (!m.reasons.empty()) return m;
  if (c.op == 1)
    for (int i = 0; i < axes; ++i)
      if (varies[i] && k.shape[i] != q.shape[i]) m.add("k", "differs from q where tables vary");
  if (c.op == 2) {
    const TensorDesc& x = c.t[X];
    const bool want_tables = c.t[DCOS].used || c.t[DSIN].used;
    if (want_tables || c.t[DA].used || c.t[DB].used) {
      check_xlike(m, x, c.hd);
      if (x.view_rank != q.view_rank || !std::equal(q.shape, q.shape + q.rank, x.shape))
        m.add("x", "shape differs from grad");
    }
    if (want_tables && c.gather()) m.add("dcos", "cache tables have no gradient");
    if (want_tables && !c.gather())
      for (int s : {DCOS, DSIN}) {
        const TensorDesc& d = c.t[s];
        if (!d.used) continue;
        if (!std::equal(cos.shape, cos.shape + cos.rank, d.shape)) m.add(d.name, "shape");
        if (!is_floating(d.dtype)) m.add(d.name, "dtype");
        if (reach_of(d) > kMaxReach) m.add(d.name, "extent overflows");
        if (misaligned(d)) m.add(d.name, "misaligned");
        if (m.reasons.empty() && !distinct(d)) m.add(d.name, "repeated elements");
      }
    for (int s : {DA, DB})
      if (c.t[s].used && c.t[s].offset % 4 != 0) m.add(c.t[s].name, "misaligned");
  }
  return m;
}

// ------------------------------------------------------------------------------------------
// Calling the library

template <typename P>
BasicView<P> view_of(const TensorDesc& d, World& w) {
  BasicView<P> v;
  v.dtype = d.dtype;
  v.rank = d.view_rank;
  for (int i = 0; i < kMaxRank; ++i) v.shape[i] = d.shape[i], v.strides[i] = d.strides[i];
  v.data = d.null_data ? nullptr : w[d.arena].data() + d.offset;
  return v;
}

struct Outcome {
  bool ok = true;
  Status status = Status::ok;
  std::string argument, message;
};

// Errors whose cause needs memory (null or misaligned pointers, aliasing, position values) or
// the execution options: rope_check, which reads nothing and takes no options, does not see them.
bool needs_memory(const std::string& message) {
  for (const char* cause :
       {"data pointer", "disjoint", "overlap", "options.", "positions: expected values"})
    if (message.find(cause) != std::string::npos) return true;
  return false;
}

// rope_check on the same views without data must agree with rope_forward: the same error, or
// none where rope_forward's error needs memory.
void check_agrees_with_forward(const Case& c, World& w, const Tables& tables,
                               const Outcome& forward) {
  auto no_data = [](auto v) {
    v.data = nullptr;
    return v;
  };
  Tables t = tables;
  t.cos.data = t.sin.data = t.positions.data = nullptr;
  std::string check_message;
  try {
    const Operand q{no_data(view_of<const void*>(c.t[Q_IN], w)),
                    no_data(view_of<void*>(c.t[Q_OUT], w))};
    if (c.op == 0) {
      rope_check(*c.rot, t, q);
    } else {
      const Operand k{no_data(view_of<const void*>(c.t[K_IN], w)),
                      no_data(view_of<void*>(c.t[K_OUT], w))};
      rope_check(*c.rot, t, q, &k);
    }
  } catch (const rome::Error& e) {
    check_message = e.what();
  }
  if (check_message.empty()) {
    if (!forward.ok && !needs_memory(forward.message))
      bug("rope_check accepted what rope_forward refused: " + forward.message);
  } else if (forward.ok) {
    bug("rope_check refused what rope_forward ran: " + check_message);
  } else if (check_message != forward.message && !needs_memory(forward.message)) {
    bug("rope_check and rope_forward disagree: " + check_message + " / " + forward.message);
  }
}

Outcome call(const Case& c, World& w, int threads) {
  Outcome o;
  Tables tables;
  tables.cos = view_of<const void*>(c.t[COS], w);
  tables.sin = view_of<const void*>(c.t[SIN], w);
  if (c.cache) tables.positions = view_of<const void*>(c.t[POS], w);
  tables.column_axis = c.column_axis;
  tables.width = c.width;
  tables.inverse = c.inverse;
  ExecOptions options;
  options.num_threads = threads;
  options.min_parallel_bytes = 0;  // small cases: the threaded path still runs
  try {
    if (c.op != 2) {
      const Operand q{view_of<const void*>(c.t[Q_IN], w), view_of<void*>(c.t[Q_OUT], w)};
      if (c.op == 0) {
        rope_forward(*c.rot, tables, q, nullptr, options);
      } else {
        const Operand k{view_of<const void*>(c.t[K_IN], w), view_of<void*>(c.t[K_OUT], w)};
        rope_forward(*c.rot, tables, q, &k, options);
      }
    } else {
      Gradients g;
      if (c.t[DX].used) g.dx = view_of<void*>(c.t[DX], w);
      if (c.t[DCOS].used) g.dcos = view_of<void*>(c.t[DCOS], w);
      if (c.t[DSIN].used) g.dsin = view_of<void*>(c.t[DSIN], w);
      if (c.t[DA].used) g.da = reinterpret_cast<float*>(w[c.t[DA].arena].data() + c.t[DA].offset);
      if (c.t[DB].used) g.db = reinterpret_cast<float*>(w[c.t[DB].arena].data() + c.t[DB].offset);
      rope_backward(*c.rot, tables, view_of<const void*>(c.t[Q_IN], w),
                    view_of<const void*>(c.t[X], w), g, options);
    }
  } catch (const rome::Error& e) {
    o.ok = false;
    o.status = e.status();
    o.argument = e.argument();
    o.message = e.what();
    if (o.message.rfind("rome: ", 0) != 0)
      bug("rome::Error message without the 'rome: ' prefix: " + o.message);
  } catch (const std::exception& e) {
    bug(std::string("exception other than rome::Error: ") + e.what());
  } catch (...) {
    bug("non-standard exception");
  }
  if (c.op != 2) check_agrees_with_forward(c, w, tables, o);
  return o;
}

// ------------------------------------------------------------------------------------------
// References

float load_f(DType dt, const std::uint8_t* p) {
  switch (dt) {
    case DType::f32: {
      float f;
      std::memcpy(&f, p, 4);
      return f;
    }
    case DType::bf16: {
      std::uint16_t h;
      std::memcpy(&h, p, 2);
      return detail::bf16_to_float(h);
    }
    case DType::f16: {
      std::uint16_t h;
      std::memcpy(&h, p, 2);
      return detail::fp16_to_float(h);
    }
    default: return 0.0f;
  }
}
void store_f(DType dt, std::uint8_t* p, float v) {
  switch (dt) {
    case DType::f32: std::memcpy(p, &v, 4); break;
    case DType::bf16: {
      const auto h = detail::float_to_bf16(v);
      std::memcpy(p, &h, 2);
      break;
    }
    case DType::f16: {
      const auto h = detail::float_to_fp16(v);
      std::memcpy(p, &h, 2);
      break;
    }
    default: break;
  }
}

i64 column_of(const Case& c, i64 lane, i64 columns) {
  return c.width == TableWidth::full     ? lane
         : c.width == TableWidth::halves ? lane % columns
                                         : lane / 2;
}

// The byte offsets of C and S of lane j for the x row at idx (x's indices without the head axis).
std::pair<i64, i64> table_element(const Case& c, const World& w, const i64* idx, int axes, i64 j) {
  const TensorDesc &cos = c.t[COS], &sin = c.t[SIN];
  const i64 columns = cos.shape[cos.rank - 1];
  const i64 col = column_of(c, j, columns);
  i64 ci[kMaxRank] = {}, si[kMaxRank] = {};
  if (!c.gather()) {
    const int t_axes = cos.rank - 1;
    for (int i = 0; i < t_axes; ++i) {
      const i64 x = idx[axes - t_axes + i];
      ci[i] = cos.shape[i] == 1 ? 0 : x;
      si[i] = sin.shape[i] == 1 ? 0 : x;
    }
    ci[t_axes] = si[t_axes] = col;
  } else {
    const TensorDesc& p = c.t[POS];
    i64 pi[kMaxRank] = {};
    for (int i = 0; i < axes; ++i) pi[i] = p.shape[i] == 1 ? 0 : idx[i];
    if (!c.column_axis.empty()) pi[axes] = c.column_axis[col];
    ci[0] = si[0] = load_position(c, w, pi);
    ci[1] = si[1] = col;
  }
  return {elem_offset(cos, ci), elem_offset(sin, si)};
}

// C and S for the x row at idx, as fp32.
void table_row(const Case& c, const World& w, const i64* idx, int axes, float* cs, float* sn) {
  const TensorDesc &cos = c.t[COS], &sin = c.t[SIN];
  for (i64 j = 0; j < c.rd; ++j) {
    const auto [co, so] = table_element(c, w, idx, axes, j);
    cs[j] = load_f(cos.dtype, w[cos.arena].data() + co);
    sn[j] = load_f(sin.dtype, w[sin.arena].data() + so);
  }
}

// The same, as the tables' own bytes: the call under test reads them in their dtypes, and so does
// the scalar reference.
void table_row_bytes(const Case& c, const World& w, const i64* idx, int axes, std::uint8_t* cs,
                     std::uint8_t* sn) {
  const TensorDesc &cos = c.t[COS], &sin = c.t[SIN];
  for (i64 j = 0; j < c.rd; ++j) {
    const auto [co, so] = table_element(c, w, idx, axes, j);
    std::memcpy(cs + j * cos.es(), w[cos.arena].data() + co, std::size_t(cos.es()));
    std::memcpy(sn + j * sin.es(), w[sin.arena].data() + so, std::size_t(sin.es()));
  }
}

// Forward reference. The harness gathers every row itself (x through its strides; C and S through
// its own broadcast / positions / column_axis / width logic, in their dtypes) into contiguous
// buffers and runs those through the scalar kernel with plain full-width direct tables, then
// scatters the result through the output's strides. So every stride, broadcast, gather and aliasing
// path of the call under test is checked against independent indexing, while the per-element
// arithmetic is the scalar kernel's (the contract every ISA matches bit for bit; test_rope.cpp
// checks it against a double reference).
void forward_reference(const Case& c, const World& w0, World& expect, int in_slot, int out_slot) {
  const TensorDesc& in = c.t[in_slot];
  const TensorDesc& out = c.t[out_slot];
  const int axes = in.rank - 1;
  const i64 rd = c.rd, hd = c.hd, es = in.es();
  i64 rows = 1;
  for (int i = 0; i < axes; ++i) rows *= in.shape[i];
  if (rows <= 0 || hd <= 0) return;
  std::vector<std::uint8_t> x(rows * hd * es), y(rows * hd * es);
  const TensorDesc &cos = c.t[COS], &sin = c.t[SIN];
  std::vector<std::uint8_t> cs(rows * std::max<i64>(rd, 1) * cos.es()),
      sn(rows * std::max<i64>(rd, 1) * sin.es());
  i64 r = 0, full[kMaxRank] = {};
  for_each_index(axes, in.shape, [&](const i64* idx) {
    table_row_bytes(c, w0, idx, axes, cs.data() + r * rd * cos.es(), sn.data() + r * rd * sin.es());
    std::copy(idx, idx + axes, full);
    for (i64 j = 0; j < hd; ++j) {
      full[axes] = j;
      std::memcpy(x.data() + (r * hd + j) * es, w0[in.arena].data() + elem_offset(in, full), es);
    }
    ++r;
  });
  Tables t;
  t.cos = make_view<const void*>(cs.data(), cos.dtype, {rows, rd});
  t.sin = make_view<const void*>(sn.data(), sin.dtype, {rows, rd});
  t.inverse = c.inverse;
  ExecOptions one;
  one.num_threads = 1;
  set_max_isa(Isa::scalar);
  try {
    rope_forward(*c.rot, t,
                 Operand{make_view<const void*>(x.data(), in.dtype, {rows, hd}),
                         make_view<void*>(y.data(), in.dtype, {rows, hd})},
                 nullptr, one);
  } catch (const std::exception& e) {
    bug(std::string("the contiguous reference call threw: ") + e.what());
  }
  set_max_isa(Isa::amx);
  r = 0;
  for_each_index(axes, in.shape, [&](const i64* idx) {
    std::copy(idx, idx + axes, full);
    for (i64 j = 0; j < hd; ++j) {
      full[axes] = j;
      std::memcpy(expect[out.arena].data() + elem_offset(out, full), y.data() + (r * hd + j) * es,
                  es);
    }
    ++r;
  });
}

// Backward in double: dx, dcos, dsin, dA, dB, per output slot indexed by the element's arena
// byte offset / element size (entries with mag < 0 are not outputs).
struct Approx {
  double ref = 0, mag = -1;
};
using BackwardRef = std::vector<std::vector<Approx>>;  // [slot][byte offset / es]

void backward_reference(const Case& c, const World& w0, BackwardRef& out) {
  const TensorDesc &g = c.t[Q_IN], &x = c.t[X], &cos = c.t[COS];
  const int axes = g.rank - 1;
  const i64 rd = c.rd, hd = c.hd;
  const bool want_x = c.t[DCOS].used || c.t[DSIN].used || c.t[DA].used || c.t[DB].used;
  std::vector<float> cs(rd), sn(rd), gf(hd), xv(rd), u(rd), v(rd);
  out.assign(NSLOTS, {});
  auto at = [&](int s, i64 byte) -> Approx& {
    Approx& a = out[s][byte / c.t[s].es()];
    if (a.mag < 0) a.mag = 0;
    return a;
  };
  for (int s : {DX, DCOS, DSIN, DA, DB})
    if (c.t[s].used) out[s].assign(c.arena_size[c.t[s].arena] / c.t[s].es() + 1, Approx{});
  // Every table gradient element is written (zero when no row reaches it).
  for (int s : {DCOS, DSIN})
    if (c.t[s].used)
      for_each_index(c.t[s].rank, c.t[s].shape,
                     [&](const i64* idx) { at(s, elem_offset(c.t[s], idx)); });
  for (int s : {DA, DB})
    if (c.t[s].used)
      for (i64 e = 0; e < rd * rd; ++e) at(s, c.t[s].offset + 4 * e);
  i64 full[kMaxRank] = {};
  for_each_index(axes, g.shape, [&](const i64* idx) {
    table_row(c, w0, idx, axes, cs.data(), sn.data());
    std::copy(idx, idx + axes, full);
    for (i64 j = 0; j < hd; ++j) {
      full[axes] = j;
      gf[j] = load_f(g.dtype, w0[g.arena].data() + elem_offset(g, full));
      if (want_x && j < rd) xv[j] = load_f(x.dtype, w0[x.arena].data() + elem_offset(x, full));
    }
    for (i64 j = 0; j < rd; ++j) u[j] = gf[j] * cs[j], v[j] = gf[j] * sn[j];
    if (c.t[DX].used) {
      const TensorDesc& dx = c.t[DX];
      for (i64 i = 0; i < hd; ++i) {
        full[axes] = i;
        Approx& a = at(DX, elem_offset(dx, full));
        if (i >= rd) {
          a.ref = gf[i];
          continue;
        }
        for (i64 j = 0; j < rd; ++j) {
          const double t = double(u[j]) * c.A[i * rd + j] + double(v[j]) * c.B[i * rd + j];
          a.ref += t;
          a.mag +=
              std::fabs(double(u[j]) * c.A[i * rd + j]) + std::fabs(double(v[j]) * c.B[i * rd + j]);
        }
      }
    }
    if (!want_x) return;
    const i64 columns = cos.shape[cos.rank - 1];
    for (int s : {DCOS, DSIN}) {
      const TensorDesc& d = c.t[s];
      if (!d.used) continue;
      const std::vector<float>& M = s == DCOS ? c.A : c.B;
      i64 ti[kMaxRank] = {};
      const int t_axes = cos.rank - 1;
      for (int i = 0; i < t_axes; ++i) ti[i] = cos.shape[i] == 1 ? 0 : idx[axes - t_axes + i];
      for (i64 j = 0; j < rd; ++j) {
        double xm = 0;
        for (i64 i = 0; i < rd; ++i) xm += double(xv[i]) * M[i * rd + j];
        ti[t_axes] = column_of(c, j, columns);
        Approx& a = at(s, elem_offset(d, ti));
        a.ref += double(gf[j]) * xm;
        a.mag += std::fabs(double(gf[j]) * xm);
      }
    }
    for (int s : {DA, DB}) {
      if (!c.t[s].used) continue;
      const std::vector<float>& t = s == DA ? u : v;
      for (i64 i = 0; i < rd; ++i)
        for (i64 j = 0; j < rd; ++j) {
          Approx& a = at(s, c.t[s].offset + 4 * (i * rd + j));
          a.ref += double(xv[i]) * t[j];
          a.mag += std::fabs(double(xv[i]) * t[j]);
        }
    }
  });
}

bool close_enough(DType dt, float got, const Approx& a) {
  if (std::isnan(got)) return false;
  const double ulp = dt == DType::f32 ? 0x1p-23 : dt == DType::bf16 ? 0x1p-7 : 0x1p-10;
  if (dt == DType::f16 && std::fabs(a.ref) > 65000.0)
    return std::isinf(got) || std::fabs(got) > 60000.0;
  const double tol = a.mag * 1e-5 + std::fabs(a.ref) * ulp + (dt == DType::f16 ? 0x1p-24 : 1e-37);
  return std::fabs(double(got) - a.ref) <= tol;
}

// Names the element at `byte` of `arena` (the first view holding it) and, given two worlds, its
// value in each.
std::string where(const Case& c, int arena, i64 byte, const World* got = nullptr,
                  const World* want = nullptr) {
  for (int s = 0; s < NSLOTS; ++s) {
    const TensorDesc& d = c.t[s];
    if (!d.used || d.arena != arena || !d.allocatable) continue;
    std::string found;
    for_each_index(d.rank, d.shape, [&](const i64* idx) {
      const i64 o = elem_offset(d, idx);
      if (found.empty() && byte >= o && byte < o + d.es()) {
        found = std::string(d.name) + "[";
        for (int i = 0; i < d.rank; ++i) found += (i ? ", " : "") + std::to_string(idx[i]);
        found += "]";
        if (got && want && is_floating(d.dtype)) {
          char buf[96];
          std::snprintf(buf, sizeof buf, " = %.9g (want %.9g)",
                        load_f(d.dtype, (*got)[arena].data() + o),
                        load_f(d.dtype, (*want)[arena].data() + o));
          found += buf;
        }
      }
    });
    if (!found.empty()) return found;
  }
  return "arena " + std::to_string(arena) + " byte " + std::to_string(byte) +
         " (no element: padding)";
}

void compare_worlds(const Case& c, const World& got, const World& want, const char* what) {
  for (int a = 0; a < c.arenas; ++a) {
    if (got[a] == want[a]) continue;
    for (std::size_t b = 0; b < got[a].size(); ++b)
      if (got[a][b] != want[a][b]) {
        char buf[96];
        std::snprintf(buf, sizeof buf, " (got byte 0x%02x, want 0x%02x)", got[a][b], want[a][b]);
        bug(std::string(what) + " at " + where(c, a, i64(b), &got, &want) + buf);
      }
  }
}

void check_backward(const Case& c, const World& w0, const World& got) {
  BackwardRef ref;
  backward_reference(c, w0, ref);
  std::vector<std::vector<std::uint8_t>> covered(c.arenas);
  for (int a = 0; a < c.arenas; ++a) covered[a].assign(got[a].size(), 0);
  for (int s = 0; s < NSLOTS; ++s) {
    const TensorDesc& d = c.t[s];
    for (std::size_t e = 0; e < ref[s].size(); ++e) {
      const Approx& approx = ref[s][e];
      if (approx.mag < 0) continue;
      const i64 byte = i64(e) * d.es();
      const float value = load_f(d.dtype, got[d.arena].data() + byte);
      if (!close_enough(d.dtype, value, approx)) {
        char buf[160];
        std::snprintf(buf, sizeof buf, ": got %.9g, want %.9g (magnitude %.3g)", value, approx.ref,
                      approx.mag);
        bug(std::string("backward ") + where(c, d.arena, byte) + buf);
      }
      for (int k = 0; k < d.es(); ++k) covered[d.arena][byte + k] = 1;
    }
  }
  for (int a = 0; a < c.arenas; ++a)
    for (std::size_t b = 0; b < got[a].size(); ++b)
      if (!covered[a][b] && got[a][b] != w0[a][b])
        bug("backward wrote outside its outputs at " + where(c, a, i64(b)));
}

// The AVX512-BF16 dot-product kernel (avx512_kernels(.., true)) multiplies bf16 x by a dense
// rotation whose entries are all exact in bf16. It reads subnormal x as zero, flushes subnormal
// products and partial sums, and adds each pair in another order than the FMA kernels: held to an
// error bound around the FMA kernel's bits (test_dense_bf16_dot.cpp checks it against fp64), not
// to them. The bit comparisons of run_one run on the FMA kernels of the same ISA.
bool takes_bf16_dots(const Case& c) {
  if (active_isa() != Isa::avx512 || !detail::cpu_features().fast_bf16_dot || c.op == 2 || !c.rot ||
      c.rot->kind() != Rotation::Kind::dense)
    return false;
  if (c.t[Q_IN].dtype != DType::bf16 && (c.op != 1 || c.t[K_IN].dtype != DType::bf16)) return false;
  return c.rot->data().pair_panel_packs().bf16_exact;  // the library's own rule for the kernel
}

// `dots` (the dot-product kernel's result) against `fma` (the FMA kernel's) for every rotated
// bf16 output element: within twice the fp32 summation bound of Σ|x||M||table|, the flushed
// subnormals (at most 2^-126 per product, input and partial sum) and one bf16 rounding each. The
// element is then given the FMA kernel's bytes, so that the caller can compare the rest exactly.
void check_bf16_dots(const Case& c, const World& w0, World& dots, const World& fma) {
  // Rotated lanes [off, off + rd) of each head (a partial rotation at a lane offset).
  const i64 rd = c.rd, off = c.rot->lane_offset();
  std::vector<float> cs(std::max<i64>(rd, 1)), sn(std::max<i64>(rd, 1)), x(std::max<i64>(c.hd, 1));
  for (const auto [in_slot, out_slot] : {std::pair{Q_IN, Q_OUT}, std::pair{K_IN, K_OUT}}) {
    const TensorDesc &in = c.t[in_slot], &out = c.t[out_slot];
    if (out_slot == K_OUT && c.op != 1) continue;
    if (!in.used || !out.used || in.dtype != DType::bf16 || out.dtype != DType::bf16) continue;
    const int axes = in.rank - 1;
    i64 full[kMaxRank] = {};
    for_each_index(axes, in.shape, [&](const i64* idx) {
      table_row(c, w0, idx, axes, cs.data(), sn.data());
      std::copy(idx, idx + axes, full);
      for (i64 i = 0; i < c.hd; ++i) {
        full[axes] = i;
        x[i] = load_f(in.dtype, w0[in.arena].data() + elem_offset(in, full));
      }
      for (i64 j = 0; j < rd; ++j) {
        double mag = 0, max_a = 0, max_b = 0;
        for (i64 i = 0; i < rd; ++i) {
          const double a = std::fabs(c.A[i * rd + j]), b = std::fabs(c.B[i * rd + j]);
          mag += std::fabs(double(x[off + i])) * (a * std::fabs(cs[j]) + b * std::fabs(sn[j]));
          max_a = std::max(max_a, a), max_b = std::max(max_b, b);
        }
        full[axes] = off + j;
        const i64 at = elem_offset(out, full);
        std::uint8_t* got_bytes = dots[out.arena].data() + at;
        const std::uint8_t* want_bytes = fma[out.arena].data() + at;
        if (std::memcmp(got_bytes, want_bytes, 2) == 0) continue;
        const double got = load_f(DType::bf16, got_bytes), want = load_f(DType::bf16, want_bytes);
        bool close;
        if (!std::isfinite(mag) || mag > 0x1p120) {
          close = std::isnan(got) == std::isnan(want);  // near or past fp32 overflow
        } else {
          const double flush = 0x1p-126 * double(rd) *
                               ((c.a_identity ? 0.0 : 2.0 + max_a) * std::fabs(cs[j]) +
                                (2.0 + max_b) * std::fabs(sn[j]));
          const double tol = 2.0 * double(rd + 2) * 0x1p-24 * mag + flush +
                             0x1p-7 * std::max(std::fabs(got), std::fabs(want)) + 0x1p-133;
          close = std::fabs(got - want) <= tol;
        }
        if (!close)
          bug("the AVX512-BF16 dot kernel is outside its error bound at " +
              where(c, out.arena, at, &dots, &fma));
        std::memcpy(got_bytes, want_bytes, 2);
      }
    });
  }
}

// ------------------------------------------------------------------------------------------

void run_one(const std::uint8_t* data, std::size_t size) {
  Reader R{data, size};
  Case c;
  g_case = &c;
  World w0;
  try {
    generate(R, c, w0);
  } catch (const rome::Error& e) {
    ++stats()[std::string("rotation/") + status_name(e.status()) + " " + e.argument()];
    return;
  }
  const bool backward_inputs_finite = true;
  (void)backward_inputs_finite;
  const Model m = model(c, w0);

  // AMX tile products of dense rotations with 16-bit x are held to an error bound, not to the
  // scalar kernel's bits (test_amx.cpp): that call must write only output elements and may not
  // fail where the bit-exact ISAs succeed; the bit comparisons below run on AVX-512.
  const bool tile_products = active_isa() == Isa::amx && c.op != 2 && c.rot &&
                             c.rot->kind() == Rotation::Kind::dense &&
                             c.t[Q_IN].dtype != DType::f32;
  World tiles = w0;
  const Outcome on_tiles = tile_products ? call(c, tiles, c.num_threads) : Outcome{};
  if (tile_products) set_max_isa(Isa::avx512);
  const bool bf16_dots = takes_bf16_dots(c);
  World dots = w0;
  const Outcome on_dots = bf16_dots ? call(c, dots, c.num_threads) : Outcome{};
  if (bf16_dots)
    detail::override_kernels_for_testing(
        &kernels::avx512_kernels(detail::cpu_features().avx512_bf16, /*bf16_dot=*/false));
  World w1 = w0;
  const Outcome o = call(c, w1, c.num_threads);
  detail::override_kernels_for_testing(nullptr);
  if (bf16_dots) {
    if (on_dots.ok != o.ok)
      bug("the AVX512-BF16 dot kernel and the FMA kernel disagree on whether the call is valid");
    if (o.ok) {
      check_bf16_dots(c, w0, dots, w1);
      compare_worlds(c, dots, w1, "the AVX512-BF16 dot kernel wrote outside its outputs");
    } else {
      compare_worlds(c, dots, w0,
                     ("dot kernel: write before throwing '" + on_dots.message + "'").c_str());
    }
  }
  if (tile_products) {
    set_max_isa(Isa::amx);
    if (on_tiles.ok != o.ok) bug("the tile path and avx512 disagree on whether the call is valid");
    if (o.ok) {
      // Only the output elements may differ from the bit-exact result.
      for (const int s : {Q_OUT, K_OUT}) {
        const TensorDesc& d = c.t[s];
        if (!d.used || d.null_data || !d.allocatable) continue;
        for_each_index(d.rank, d.shape, [&](const i64* idx) {
          const i64 at = elem_offset(d, idx);
          std::memcpy(tiles[d.arena].data() + at, w1[d.arena].data() + at, std::size_t(d.es()));
        });
      }
      compare_worlds(c, tiles, w1, "the tile path wrote outside its outputs");
    } else {
      compare_worlds(c, tiles, w0,
                     ("tile path: write before throwing '" + on_tiles.message + "'").c_str());
    }
  }
  if (!o.ok) {
    ++stats()[std::string(status_name(o.status)) + " " + o.argument];
    compare_worlds(c, w1, w0, ("write before throwing '" + o.message + "'").c_str());
    if (m.reasons.empty()) {
      ++stats()["(over-rejected) " + o.message.substr(0, 100)];
      const char* strict = std::getenv("ROME_FUZZ_STRICT");  // "1", or a substring of the message
      if (strict && (std::string(strict) == "1" || o.message.find(strict) != std::string::npos))
        bug("valid call rejected: " + o.message);
    }
    return;
  }
  ++stats()["ok"];
  if (!m.reasons.empty()) {
    std::string all;
    for (auto& r : m.reasons) all += "\n    " + r;
    bug("call accepted but must be rejected:" + all);
  }
  const bool x_read = c.t[DCOS].used || c.t[DSIN].used || c.t[DA].used || c.t[DB].used;
  for (int s = 0; s < NSLOTS; ++s) {
    const TensorDesc& d = c.t[s];
    // Null positions mean direct tables, and backward reads x only for dcos/dsin/dA/dB.
    if (d.used && !d.null_data && !d.allocatable && d.numel() > 0 && (s != X || x_read))
      bug(std::string("accepted an unallocatable view ") + d.name);
  }

  const int other_threads = c.num_threads == 1 ? 2 : 1;
  if (c.op != 2) {
    World expect = w0;
    forward_reference(c, w0, expect, Q_IN, Q_OUT);
    if (c.op == 1) forward_reference(c, w0, expect, K_IN, K_OUT);
    const Isa fast = tile_products ? Isa::avx512 : active_isa();
    compare_worlds(
        c, w1, expect,
        (std::string("forward on ") + isa_name(fast) + " differs from the reference").c_str());
    // The same call on the scalar kernels (and another thread count) gives the same bytes.
    World w2 = w0;
    set_max_isa(Isa::scalar);
    const Outcome o2 = call(c, w2, other_threads);
    set_max_isa(Isa::amx);
    if (!o2.ok) bug("scalar rerun threw: " + o2.message);
    compare_worlds(c, w2, w1, (std::string("scalar vs ") + isa_name(fast)).c_str());
  } else {
    bool finite = true;
    for (const auto& d : c.t)
      if (d.used && !d.output && is_floating(d.dtype) && !d.null_data && d.allocatable)
        for_each_index(d.rank, d.shape, [&](const i64* idx) {
          if (!std::isfinite(load_f(d.dtype, w0[d.arena].data() + elem_offset(d, idx))))
            finite = false;
        });
    if (finite) check_backward(c, w0, w1);
    World w2 = w0;
    const Outcome o2 = call(c, w2, other_threads);
    if (!o2.ok) bug("backward rerun threw: " + o2.message);
    compare_worlds(c, w2, w1, "backward with another thread count");
  }
}

}  // namespace

// ASan calls this before its report: print the decoded case too.
extern "C" void __asan_on_error() {
  if (g_case) std::fprintf(stderr, "\n==== RoME fuzz case:\n%s\n", describe(*g_case).c_str());
}

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  if (std::getenv("ROME_FUZZ_STATS")) std::atexit(print_stats);
  std::fprintf(stderr, "[rome fuzz] active ISA %s (detected %s)\n", isa_name(active_isa()),
               isa_name(detected_isa()));
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  run_one(data, size);
  return 0;
}
