#include "plan.hpp"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>

#include "convert.hpp"
#include "dispatch.hpp"
#include "rome/error.hpp"

namespace rome::detail {
namespace {

// Set by MetadataOnly (rope_check): no data pointer is required or compared, no value is read.
thread_local bool t_metadata_only = false;

using std::int64_t;
using std::to_string;

constexpr int64_t kMaxElements = int64_t(1) << 60;

std::string number_string(double v) {
  char buffer[32];
  std::snprintf(buffer, sizeof buffer, "%.9g", v);
  return buffer;
}

std::string dims_string(const int64_t* shape, int rank) {
  std::string s = "[";
  for (int i = 0; i < rank; ++i) s += (i ? ", " : "") + to_string(shape[i]);
  return s + "]";
}

template <typename P>
int64_t checked_numel(const char* name, const BasicView<P>& v) {
  // Overflow checks by multiplication: a 64-bit division per axis was a visible part of a
  // decode call.
  int64_t n = 1;
  for (int i = 0; i < v.rank; ++i) {
    if (v.shape[i] < 0) fail(Status::invalid_argument, name, "non-negative sizes", shape_string(v));
    if (__builtin_mul_overflow(n, v.shape[i], &n) || n > kMaxElements)
      fail(Status::out_of_range, name, "at most 2^60 elements", shape_string(v));
  }
  return n;
}

// Lowest and one-past-highest element offsets a view touches (empty views touch nothing).
template <typename P>
void element_span(const BasicView<P>& v, int64_t& lo, int64_t& hi) {
  lo = 0;
  hi = 1;
  for (int i = 0; i < v.rank; ++i) {
    if (v.shape[i] == 0) {  // no elements: an empty span, whatever earlier axes reached
      lo = hi = 0;
      return;
    }
    const int64_t reach = v.strides[i] * (v.shape[i] - 1);
    (reach < 0 ? lo : hi) += reach;
  }
}

// Conservative: true when the byte ranges two views span intersect (views of any dtypes).
template <typename P1, typename P2>
bool bytes_may_overlap(const BasicView<P1>& a, const BasicView<P2>& b) {
  if (!a.data || !b.data) return false;
  int64_t alo, ahi, blo, bhi;
  element_span(a, alo, ahi);
  element_span(b, blo, bhi);
  if (ahi <= alo || bhi <= blo) return false;
  const auto abase = reinterpret_cast<std::intptr_t>(a.data);
  const auto bbase = reinterpret_cast<std::intptr_t>(b.data);
  const int ea = dtype_size(a.dtype), eb = dtype_size(b.dtype);
  return abase + ahi * ea > bbase + blo * eb && bbase + bhi * eb > abase + alo * ea;
}

// An output must not share memory with anything the call still reads after writing it.
template <typename P>
void require_disjoint(const TensorView& out, const char* out_name, const BasicView<P>& in,
                      const char* in_name) {
  if (bytes_may_overlap(out, in))
    fail(Status::invalid_argument, out_name, std::string("memory disjoint from ") + in_name,
         "an overlap");
}

template <typename P>
void check_strides(const char* name, const BasicView<P>& v) {
  // |stride| · (size-1) summed must fit in 2^60 elements, with room for byte offsets.
  int64_t reach = 0;
  for (int i = 0; i < v.rank; ++i) {
    if (v.shape[i] <= 1) continue;
    int64_t step = 0;
    const bool negatable = v.strides[i] != INT64_MIN;
    const int64_t s = !negatable ? 0 : v.strides[i] < 0 ? -v.strides[i] : v.strides[i];
    if (!negatable || __builtin_mul_overflow(s, v.shape[i] - 1, &step) ||
        step > kMaxElements - reach)
      fail(Status::out_of_range, name, "strides whose extent fits in 2^60 elements",
           "strides " + dims_string(v.strides, v.rank));
    reach += step;
  }
}

// True when no two indices of v address the same element: sorted by |stride|, each stride must
// step past everything the smaller ones reach.
bool has_distinct_elements(const TensorView& v) {
  int64_t stride[kMaxRank], size[kMaxRank];
  int n = 0;
  for (int i = 0; i < v.rank; ++i)
    if (v.shape[i] > 1) {
      stride[n] = v.strides[i] < 0 ? -v.strides[i] : v.strides[i];
      size[n++] = v.shape[i];
    }
  for (int i = 0; i < n; ++i)
    for (int j = i + 1; j < n; ++j)
      if (stride[j] < stride[i]) std::swap(stride[i], stride[j]), std::swap(size[i], size[j]);
  int64_t reach = 0;
  for (int i = 0; i < n; ++i) {
    if (stride[i] <= reach) return false;
    reach += stride[i] * (size[i] - 1);
  }
  return true;
}

// Conservative overlap test of two views of one element size: true unless disjointness is
// proven. Views of different columns of one buffer (q and k slices of a fused qkv tensor) share
// their outer axes; those are peeled off, and when every step of them clears the window the
// remaining axes cover, the two residual spans decide.
template <typename P1, typename P2>
bool may_overlap(const BasicView<P1>& a, const BasicView<P2>& b, int element_size) {
  int64_t alo, ahi, blo, bhi;
  element_span(a, alo, ahi);
  element_span(b, blo, bhi);
  if (ahi <= alo || bhi <= blo) return false;
  const auto abytes = reinterpret_cast<std::intptr_t>(a.data);
  const auto bbytes = reinterpret_cast<std::intptr_t>(b.data);
  if (abytes + ahi * element_size <= bbytes + blo * element_size ||
      bbytes + bhi * element_size <= abytes + alo * element_size)
    return false;
  if (a.rank != b.rank || (abytes - bbytes) % element_size != 0) return true;
  const int64_t delta = (bbytes - abytes) / element_size;
  // Candidates: axes with equal size and equal positive stride. One whose stride does not clear
  // the window covered by the other axes goes back to the residual, until none is left to move.
  bool shared[kMaxRank] = {};
  for (int i = 0; i < a.rank; ++i)
    shared[i] = a.shape[i] == b.shape[i] && a.strides[i] == b.strides[i] && a.strides[i] > 0 &&
                a.shape[i] > 1;
  int64_t window = 0;
  for (;;) {
    ConstTensorView ra, rb;
    for (int i = 0; i < a.rank; ++i) {
      if (shared[i]) continue;
      ra.shape[ra.rank] = a.shape[i];
      ra.strides[ra.rank++] = a.strides[i];
      rb.shape[rb.rank] = b.shape[i];
      rb.strides[rb.rank++] = b.strides[i];
    }
    element_span(ra, alo, ahi);
    element_span(rb, blo, bhi);
    window = std::max(ahi, delta + bhi) - std::min(alo, delta + blo);
    int smallest = -1;
    for (int i = 0; i < a.rank; ++i)
      if (shared[i] && (smallest < 0 || a.strides[i] < a.strides[smallest])) smallest = i;
    if (smallest < 0) return true;  // nothing shared: the spans already intersect
    if (a.strides[smallest] >= window) break;
    shared[smallest] = false;
  }
  // The shared axes form a lattice whose cells (one window each) never meet.
  int64_t reach = window;
  for (int pass = 0; pass < a.rank; ++pass) {
    int next = -1;
    for (int i = 0; i < a.rank; ++i)
      if (shared[i] && (next < 0 || a.strides[i] < a.strides[next])) next = i;
    if (next < 0) break;
    if (a.strides[next] < reach) return true;
    reach += a.strides[next] * (a.shape[next] - 1);
    shared[next] = false;
  }
  return ahi > delta + blo && delta + bhi > alo;
}

// The data pointer of a view with `numel` elements: non-null unless the view is empty, and a
// multiple of the element size (kernels and the scalar path load through typed pointers: a
// misaligned address is undefined behaviour, and a split load on some CPUs).
void check_data_pointer(const char* name, const void* data, DType dtype, int64_t numel) {
  if (numel == 0 || t_metadata_only) return;
  if (data == nullptr) fail(Status::invalid_argument, name, "a data pointer", "null");
  const int es = dtype_size(dtype);
  const auto address = reinterpret_cast<std::uintptr_t>(data);
  if (es > 1 && address % es != 0) {
    char hex[32];
    std::snprintf(hex, sizeof hex, "%#llx", static_cast<unsigned long long>(address));
    fail(Status::invalid_argument, name,
         "a data pointer aligned to " + to_string(es) + " bytes (" + dtype_name(dtype) +
             " elements)",
         std::string("address ") + hex);
  }
}

struct CheckedOperand {
  bool in_place = false;
};

// Names are C strings in these checks: the std::string of a message is built only on failure (a
// decode step built a few dozen short strings on the way to its kernel).
void check_tensor(const char* name, const ConstTensorView& v, int64_t head_dim) {
  if (v.rank < 2 || v.rank > kMaxRank)
    fail(Status::invalid_argument, name, "rank 2 to 5 with the head dimension last",
         "rank " + to_string(v.rank));
  const int64_t n = checked_numel(name, v);
  if (!is_floating(v.dtype))
    fail(Status::invalid_argument, std::string(name) + ".dtype", "float32, float16 or bfloat16",
         dtype_name(v.dtype));
  if (v.shape[v.rank - 1] != head_dim)
    fail(Status::invalid_argument, name,
         "a last axis of " + to_string(head_dim) + " (the rotation's head_dim)", shape_string(v));
  check_data_pointer(name, v.data, v.dtype, n);
  if (head_dim > 1 && n > 0 && v.strides[v.rank - 1] != 1)  // an empty view has no layout
    fail(Status::invalid_argument, name, "a contiguous last axis (stride 1)",
         "stride " + to_string(v.strides[v.rank - 1]));
  check_strides(name, v);
}

// Whether two views are the same view: data, dtype, rank, shape and strides.
template <typename P1, typename P2>
bool same_view(const BasicView<P1>& a, const BasicView<P2>& b) {
  if (static_cast<const void*>(a.data) != static_cast<const void*>(b.data) || a.dtype != b.dtype ||
      a.rank != b.rank)
    return false;
  for (int i = 0; i < a.rank; ++i)
    if (a.shape[i] != b.shape[i] || a.strides[i] != b.strides[i]) return false;
  return true;
}

// out_name: name + "_out".
CheckedOperand check_operand(const char* name, const char* out, const Operand& op, int64_t head_dim,
                             bool written = true) {
  check_tensor(name, op.in, head_dim);
  if (!written) return {};
  // In place (out is in, field for field) out passes exactly the checks in passed.
  if (!same_view(op.in, op.out)) check_tensor(out, as_const(op.out), head_dim);
  if (op.out.dtype != op.in.dtype)
    fail(Status::invalid_argument, std::string(out) + ".dtype", dtype_name(op.in.dtype),
         dtype_name(op.out.dtype));
  if (op.out.rank != op.in.rank || !std::equal(op.in.shape, op.in.shape + op.in.rank, op.out.shape))
    fail(Status::invalid_argument, out,
         std::string("the shape of ") + name + " " + shape_string(op.in), shape_string(op.out));
  CheckedOperand c;
  if (op.in.numel() == 0) return c;
  if (!has_distinct_elements(op.out))
    fail(Status::invalid_argument, out, "strides that give every element its own address",
         "strides " + dims_string(op.out.strides, op.out.rank) + " for shape " +
             shape_string(op.out));
  if (t_metadata_only) return c;
  c.in_place = op.out.data == op.in.data;
  for (int i = 0; c.in_place && i < op.in.rank; ++i)
    c.in_place = op.in.shape[i] <= 1 || op.in.strides[i] == op.out.strides[i];
  if (!c.in_place && may_overlap(op.in, op.out, dtype_size(op.in.dtype)))
    fail(Status::invalid_argument, out,
         std::string("memory disjoint from ") + name + " or exactly " + name + " (in place)",
         "a partial overlap");
  return c;
}

int64_t expected_columns(const RotationData& r, TableWidth width) {
  return width == TableWidth::full ? r.rotary_dim : r.rotary_dim / 2;
}

const char* width_name(TableWidth w) {
  return w == TableWidth::full ? "full" : w == TableWidth::halves ? "halves" : "pairs";
}

// Calls check(value, index) on every element of the (possibly broadcast, strided) positions view.
template <typename Index, typename Check>
void for_each_position(const ConstTensorView& p, Check&& check) {
  const auto* base = static_cast<const Index*>(p.data);
  int64_t idx[kMaxRank] = {};
  const int64_t n = p.numel();
  int64_t offset = 0;
  for (int64_t e = 0; e < n; ++e) {
    check(int64_t(base[offset]), idx);
    for (int i = p.rank - 1; i >= 0; --i) {
      if (p.shape[i] <= 1) continue;  // any stride is allowed on a size-1 axis: never step it
      if (++idx[i] < p.shape[i]) {
        offset += p.strides[i];
        break;
      }
      offset -= p.strides[i] * (p.shape[i] - 1);
      idx[i] = 0;
    }
  }
}

std::string index_string(const int64_t* idx, int rank) {
  std::string at = "[";
  for (int i = 0; i < rank; ++i) at += (i ? ", " : "") + to_string(idx[i]);
  return at + "]";
}

template <typename Index>
void check_positions_range(const ConstTensorView& p, int64_t cache_rows) {
  for_each_position<Index>(p, [&](int64_t value, const int64_t* idx) {
    if (value < 0 || value >= cache_rows)
      fail(Status::out_of_range, "positions",
           "values in [0, " + to_string(cache_rows) + ") (rows of the cos/sin cache)",
           to_string(value) + " at index " + index_string(idx, p.rank));
  });
}

template <typename Index>
void check_positions_angle(const ConstTensorView& p, double largest_frequency) {
  for_each_position<Index>(p, [&](int64_t value, const int64_t* idx) {
    if (!angle_in_range(value, largest_frequency))
      fail_angle(value, largest_frequency, "index " + index_string(idx, p.rank));
  });
}

// Table-free tables against the rotation; returns the largest |frequency|.
double check_frequencies(const RotationData& rot, const Tables& tables) {
  if (rot.kind != Rotation::Kind::signed_permutation || rot.lane_frequency.empty())
    fail(Status::invalid_argument, "rotation",
         "a rotation that turns pairs of lanes (half, interleave, quarter, interleave_half, "
         "their blocks) for table-free tables",
         rot.kind == Rotation::Kind::dense ? "a dense rotation"
                                           : "a signed permutation that does not pair lanes");
  if (int64_t(tables.frequencies.size()) != rot.frequency_count)
    fail(Status::invalid_argument, "tables.frequencies",
         to_string(rot.frequency_count) + " values (one per lane pair of rotary_dim " +
             to_string(rot.rotary_dim) + ")",
         to_string(tables.frequencies.size()) + " values");
  const double largest = check_frequency_values(tables.frequencies, tables.amplitude,
                                                "tables.frequencies", "tables.amplitude");
  if (tables.cos.data || tables.sin.data || tables.cos.rank > 0 || tables.sin.rank > 0)
    fail(Status::invalid_argument, "cos",
         "empty (table-free tables compute cos and sin from the frequencies)", "a tensor");
  if (!tables.is_cache())
    fail(Status::invalid_argument, "positions", "a tensor (table-free tables need positions)",
         "none");
  return largest;
}

}  // namespace

// The kernel reduces angles exactly while |position × frequency| < 2^51; 2^50 leaves room.
constexpr double kMaxAngle = 0x1p50;

double check_frequency_values(std::span<const double> frequencies, double amplitude,
                              const char* frequencies_name, const char* amplitude_name) {
  double largest = 0.0;
  for (std::size_t i = 0; i < frequencies.size(); ++i) {
    if (!std::isfinite(frequencies[i]))
      fail(Status::invalid_argument, frequencies_name, "finite values",
           number_string(frequencies[i]) + " at index " + to_string(i));
    largest = std::max(largest, std::fabs(frequencies[i]));
  }
  if (!std::isfinite(amplitude))
    fail(Status::invalid_argument, amplitude_name, "a finite value", number_string(amplitude));
  return largest;
}

bool angle_in_range(int64_t position, double largest_frequency) {
  return std::fabs(double(position)) * largest_frequency < kMaxAngle;
}

void fail_angle(int64_t position, double largest_frequency, const std::string& at) {
  fail(Status::out_of_range, "positions",
       "values whose angles |position × frequency| stay below 2^50 (|position| < " +
           number_string(kMaxAngle / largest_frequency) + " for the largest frequency " +
           number_string(largest_frequency) + ")",
       to_string(position) + " at " + at);
}

ForwardPlan plan_forward(const Rotation& rotation, const Tables& tables, const Operand& q,
                         const Operand* k, bool q_written) {
  const RotationData& rot = rotation.data();
  ForwardPlan plan;
  plan.rotation = &rot;
  const CheckedOperand cq =
      check_operand(q_written ? "q" : "grad", "q_out", q, rot.head_dim, q_written);
  plan.dtype = q.in.dtype;
  const int rank = q.in.rank;
  const int axes = rank - 1;  // every axis but the head
  CheckedOperand ck;
  if (k) {
    ck = check_operand("k", "k_out", *k, rot.head_dim);
    if (k->in.rank != rank)
      fail(Status::invalid_argument, "k", "rank " + to_string(rank) + " (the rank of q)",
           "rank " + to_string(k->in.rank));
    if (k->in.dtype != q.in.dtype)
      fail(Status::invalid_argument, "k.dtype",
           std::string(dtype_name(q.in.dtype)) + " (the dtype of q)", dtype_name(k->in.dtype));
    const int es = dtype_size(plan.dtype);
    if (k->in.numel() > 0 && q.in.numel() > 0 && !t_metadata_only) {
      if (may_overlap(q.out, k->out, es))
        fail(Status::invalid_argument, "k_out", "memory disjoint from q_out", "an overlap");
      // Both in place (each out is its in): these are the test above again.
      const bool both_in_place = same_view(q.in, q.out) && same_view(k->in, k->out);
      if (!both_in_place && may_overlap(q.in, k->out, es))
        fail(Status::invalid_argument, "k_out", "memory disjoint from q", "an overlap");
      if (!both_in_place && may_overlap(k->in, q.out, es))
        fail(Status::invalid_argument, "q_out", "memory disjoint from k", "an overlap");
    }
  }

  // Tables.
  const ConstTensorView& cos = tables.cos;
  const ConstTensorView& sin = tables.sin;
  if (tables.width != TableWidth::full && tables.width != TableWidth::halves &&
      tables.width != TableWidth::pairs)
    fail(Status::invalid_argument, "tables.width", "full, halves or pairs",
         "value " + to_string(int(tables.width)));
  const bool table_free = tables.is_table_free();
  const int64_t columns = table_free ? rot.frequency_count : expected_columns(rot, tables.width);
  double largest_frequency = 0.0;
  if (table_free) {
    largest_frequency = check_frequencies(rot, tables);
  } else if (tables.width != TableWidth::full && rot.rotary_dim % 2 != 0) {
    fail(Status::invalid_argument, "tables.width", "full for an odd rotary_dim",
         width_name(tables.width));
  }
  for (const auto* t : {&cos, &sin}) {
    if (table_free) break;
    const char* name = t == &cos ? "cos" : "sin";
    if (t->rank < 1 || t->rank > kMaxRank)
      fail(Status::invalid_argument, name, "rank 1 to 5", "rank " + to_string(t->rank));
    checked_numel(name, *t);
    check_strides(name, *t);
    if (!is_floating(t->dtype))
      fail(Status::invalid_argument, std::string(name) + ".dtype", "float32, float16 or bfloat16",
           dtype_name(t->dtype));
    if (t->shape[t->rank - 1] != columns)
      fail(Status::invalid_argument, name,
           "a last axis of " + to_string(columns) + " (" + width_name(tables.width) +
               " width for rotary_dim " + to_string(rot.rotary_dim) + ")",
           shape_string(*t));
    check_data_pointer(name, t->data, t->dtype, t->numel());
  }
  if (!table_free &&
      (cos.rank != sin.rank || !std::equal(cos.shape, cos.shape + cos.rank, sin.shape)))
    fail(Status::invalid_argument, "sin", "the shape of cos " + shape_string(cos),
         shape_string(sin));

  TablePlan& tp = plan.tables;
  tp.cos = static_cast<const char*>(cos.data);
  tp.sin = static_cast<const char*>(sin.data);
  tp.dtype_cos = cos.dtype;
  tp.dtype_sin = sin.dtype;
  if (!table_free) {  // table-free tables have no cos/sin views (rank 0)
    tp.cos_lane = cos.strides[cos.rank - 1];
    tp.sin_lane = sin.strides[sin.rank - 1];
  }
  tp.width = tables.width;
  tp.negate_sin = tables.inverse;
  tp.columns = columns;
  tp.spread_even_odd_16 = active_kernels().spread_even_odd_16;
  if (table_free) {
    tp.frequencies = tables.frequencies.data();
    tp.lane_frequency = rot.lane_frequency.data();
    tp.amplitude = tables.amplitude;
    tp.cos_sin = active_kernels().cos_sin;
    tp.cos_sin_rows = active_kernels().cos_sin_rows;
  }

  // For each axis of x (but the head): does the table row change along it? Strides of the
  // table source along that axis go to the outer plan.
  bool varies[kMaxRank] = {};
  int64_t cos_stride[kMaxRank] = {}, sin_stride[kMaxRank] = {}, pos_stride[kMaxRank] = {};
  auto check_broadcast = [&](const char* name, const ConstTensorView& t, int t_axes) {
    if (t_axes > axes)
      fail(Status::invalid_argument, name,
           "at most " + to_string(axes) + " axes before the last (x has rank " + to_string(rank) +
               ")",
           shape_string(t));
    for (int i = 0; i < t_axes; ++i) {
      const int xi = axes - t_axes + i;
      const int64_t ts = t.shape[i];
      const bool fits_q = ts == 1 || ts == q.in.shape[xi];
      const bool fits_k = !k || ts == 1 || ts == k->in.shape[xi];
      if (!fits_q || !fits_k)
        fail(Status::invalid_argument, name,
             "a shape broadcastable to " +
                 std::string(!fits_q ? "q " + shape_string(q.in) : "k " + shape_string(k->in)),
             shape_string(t));
    }
  };
  if (!tables.is_cache()) {
    if (!tables.column_axis.empty())
      fail(Status::invalid_argument, "tables.column_axis", "empty for direct tables",
           to_string(tables.column_axis.size()) + " entries");
    check_broadcast("cos", cos, cos.rank - 1);
    for (int i = 0; i < cos.rank - 1; ++i) {
      const int xi = axes - (cos.rank - 1) + i;
      if (cos.shape[i] != 1) varies[xi] = true;
      cos_stride[xi] = cos.strides[i];
      sin_stride[xi] = sin.strides[i];
    }
    tp.direct_fp32_rows = cos.dtype == DType::f32 && sin.dtype == DType::f32 &&
                          tables.width == TableWidth::full && tp.cos_lane == 1 && tp.sin_lane == 1;
  } else {
    const ConstTensorView& p = tables.positions;
    if (!table_free && cos.rank != 2)
      fail(Status::invalid_argument, "cos", "a [P, width] cache (rank 2) when positions are given",
           shape_string(cos));
    if (!table_free && cos.shape[0] < 1)
      fail(Status::invalid_argument, "cos", "a cache with at least one row", shape_string(cos));
    if (p.dtype != DType::i32 && p.dtype != DType::i64)
      fail(Status::invalid_argument, "positions.dtype", "int32 or int64", dtype_name(p.dtype));
    const bool multi_axis = !tables.column_axis.empty();
    const int want_rank = axes + (multi_axis ? 1 : 0);
    if (p.rank != want_rank || p.rank < 1)
      fail(Status::invalid_argument, "positions",
           "rank " + to_string(want_rank) + " (x's axes before the head" +
               (multi_axis ? ", plus one axis of per-axis positions)" : ")"),
           "rank " + to_string(p.rank) + " " + shape_string(p));
    checked_numel("positions", p);
    check_strides("positions", p);
    check_broadcast("positions", p, axes);
    if (multi_axis) {
      const int64_t n_axes = p.shape[p.rank - 1];
      if (int64_t(tables.column_axis.size()) != columns)
        fail(Status::invalid_argument, "tables.column_axis",
             to_string(columns) +
                 (table_free ? " entries (one per frequency)" : " entries (one per table column)"),
             to_string(tables.column_axis.size()));
      for (std::size_t c = 0; c < tables.column_axis.size(); ++c)
        if (tables.column_axis[c] < 0 || tables.column_axis[c] >= n_axes)
          fail(Status::invalid_argument, "tables.column_axis",
               "entries in [0, " + to_string(n_axes) + ") (the last axis of positions)",
               to_string(tables.column_axis[c]) + " at column " + to_string(c));
      tp.column_axis = tables.column_axis.data();
      tp.positions_axis_stride = p.strides[p.rank - 1];
    }
    check_data_pointer("positions", p.data, p.dtype, p.numel());
    for (int i = 0; i < axes; ++i) {
      if (p.shape[i] != 1) varies[i] = true;
      pos_stride[i] = p.strides[i];
    }
    if (t_metadata_only) {
      // Position values are checked when the call runs.
    } else if (table_free) {
      if (p.dtype == DType::i32)
        check_positions_angle<std::int32_t>(p, largest_frequency);
      else
        check_positions_angle<std::int64_t>(p, largest_frequency);
    } else if (p.dtype == DType::i32) {
      check_positions_range<std::int32_t>(p, cos.shape[0]);
    } else {
      check_positions_range<std::int64_t>(p, cos.shape[0]);
    }
    tp.positions = static_cast<const char*>(p.data);
    tp.positions_dtype = p.dtype;
    tp.cos_row = cos.strides[0];
    tp.sin_row = sin.strides[0];
  }

  for (int i = 0; i < axes; ++i) {
    if (!varies[i]) continue;
    if (k && k->in.shape[i] != q.in.shape[i])
      fail(Status::invalid_argument, "k",
           "size " + to_string(q.in.shape[i]) + " on axis " + to_string(i) +
               " where the tables vary (the size of q)",
           shape_string(k->in));
    const int o = plan.outer_count++;
    plan.outer_size[o] = q.in.shape[i];
    plan.outer_total *= q.in.shape[i];
    tp.cos_outer[o] = cos_stride[i];
    tp.sin_outer[o] = sin_stride[i];
    tp.positions_outer[o] = pos_stride[i];
  }
  for (int i = 0; i < axes; ++i) plan.outer_axis[i] = varies[i];
  plan.q = split_operand(plan, q.in, q_written ? q.out.data : nullptr, q.out.strides);
  plan.q.in_place = cq.in_place;
  if (k) {
    plan.has_k = true;
    plan.k = split_operand(plan, k->in, k->out.data, k->out.strides);
    plan.k.in_place = ck.in_place;
  }
  auto outputs_clear_of_tables = [&](const TensorView& out, const char* name) {
    if (t_metadata_only) return;
    if (!table_free) {
      require_disjoint(out, name, cos, "cos");
      require_disjoint(out, name, sin, "sin");
    }
    if (tables.is_cache()) require_disjoint(out, name, tables.positions, "positions");
  };
  if (q_written && q.in.numel() > 0) outputs_clear_of_tables(q.out, "q_out");
  if (k && k->in.numel() > 0) outputs_clear_of_tables(k->out, "k_out");
  const int64_t es = dtype_size(plan.dtype);
  plan.bytes_moved = 2 * es * (q.in.numel() + (k ? k->in.numel() : 0));
  return plan;
}

OperandPlan split_operand(const ForwardPlan& plan, const ConstTensorView& in, void* out,
                          const std::int64_t* out_strides) {
  OperandPlan op;
  op.in_base = static_cast<const char*>(in.data);
  op.out_base = static_cast<char*>(out);
  int o = 0;
  for (int i = 0; i < in.rank - 1; ++i) {
    if (in.shape[i] == 0) op.inner.rows = 0;
    if (plan.outer_axis[i]) {
      op.outer_in[o] = in.strides[i];
      op.outer_out[o++] = out ? out_strides[i] : 0;
    } else if (in.shape[i] != 1) {
      InnerAxes& a = op.inner;
      a.size[a.count] = in.shape[i];
      a.in_stride[a.count] = in.strides[i];
      a.out_stride[a.count++] = out ? out_strides[i] : 0;
      a.rows *= in.shape[i];
    }
  }
  return op;
}

BackwardPlan plan_backward(const Rotation& rotation, const Tables& tables,
                           const ConstTensorView& grad, const ConstTensorView& x,
                           const Gradients& out) {
  const RotationData& rot = rotation.data();
  BackwardPlan bp;
  bp.want_dx = out.dx.data != nullptr;
  const bool want_tables = out.dcos.data != nullptr || out.dsin.data != nullptr;
  const bool want_x = want_tables || out.da || out.db;
  Operand g{grad, out.dx};
  bp.forward = plan_forward(rotation, tables, g, nullptr, bp.want_dx);
  if (want_x) {
    check_tensor("x", x, rot.head_dim);
    if (x.rank != grad.rank || !std::equal(x.shape, x.shape + x.rank, grad.shape))
      fail(Status::invalid_argument, "x", "the shape of grad " + shape_string(grad),
           shape_string(x));
    bp.x = split_operand(bp.forward, x, nullptr, nullptr);
    bp.x_dtype = x.dtype;
  }
  if (want_tables) {
    if (tables.is_cache())
      fail(Status::unsupported, out.dcos.data ? "dcos" : "dsin",
           "direct tables (a cache gathered by positions has no table gradient)", "a cache");
    const ConstTensorView& cos = tables.cos;
    for (const TensorView* d : {&out.dcos, &out.dsin}) {
      if (!d->data) continue;
      const std::string name = d == &out.dcos ? "dcos" : "dsin";
      if (d->rank != cos.rank || !std::equal(cos.shape, cos.shape + cos.rank, d->shape))
        fail(Status::invalid_argument, name, "the shape of cos " + shape_string(cos),
             shape_string(*d));
      if (!is_floating(d->dtype))
        fail(Status::invalid_argument, name + ".dtype", "float32, float16 or bfloat16",
             dtype_name(d->dtype));
      check_strides(name.c_str(), *d);
      check_data_pointer(name.c_str(), d->data, d->dtype, d->numel());
      if (!has_distinct_elements(*d))
        fail(Status::invalid_argument, name, "strides that give every element its own address",
             "strides " + dims_string(d->strides, d->rank));
    }
    // The plan's outer axes are exactly the table's axes of size > 1, in order.
    int o = 0;
    for (int i = 0; i < cos.rank - 1; ++i) {
      if (cos.shape[i] == 1) continue;
      if (out.dcos.data) bp.dcos_outer[o] = out.dcos.strides[i];
      if (out.dsin.data) bp.dsin_outer[o] = out.dsin.strides[i];
      ++o;
    }
    bp.dcos = out.dcos;
    bp.dsin = out.dsin;
  }
  // Every output is written while inputs are still read: no output may overlap an input or
  // another output (dx over grad exactly, in place, was checked with the forward plan).
  const int64_t rd = rot.rotary_dim;
  auto matrix_view = [&](float* m) {
    TensorView v = make_view<void*>(m, DType::f32, {rd * rd});
    if (!m) v.data = nullptr;
    return v;
  };
  const TensorView da = matrix_view(out.da), db = matrix_view(out.db);
  if (out.da) check_data_pointer("da", out.da, DType::f32, rd * rd);
  if (out.db) check_data_pointer("db", out.db, DType::f32, rd * rd);
  const std::pair<TensorView, const char*> outputs[] = {
      {out.dx, "dx"}, {out.dcos, "dcos"}, {out.dsin, "dsin"}, {da, "da"}, {db, "db"}};
  for (const auto& [o, name] : outputs) {
    if (!o.data) continue;
    if (want_x) require_disjoint(o, name, x, "x");
    if (std::string(name) != "dx") {
      require_disjoint(o, name, grad, "grad");
      require_disjoint(o, name, tables.cos, "cos");
      require_disjoint(o, name, tables.sin, "sin");
    }
    for (const auto& [other, other_name] : outputs)
      if (&other != &o && other.data && std::string(other_name) < std::string(name))
        require_disjoint(o, name, other, other_name);
  }
  bp.da = out.da;
  bp.db = out.db;
  return bp;
}

namespace {

// `n` table values from `row` (element stride `lane`) as fp32; the dtype is switched on once.
template <DType D>
void load_columns_typed(const char* row, int64_t lane, int64_t n, float* out) {
  const auto* p = reinterpret_cast<const typename Storage<D>::type*>(row);
  if (lane == 1)
    for (int64_t c = 0; c < n; ++c) out[c] = load_float<D>(p + c);
  else
    for (int64_t c = 0; c < n; ++c) out[c] = load_float<D>(p + c * lane);
}

void load_columns(const char* row, DType dtype, int64_t lane, int64_t n, float* out) {
  switch (dtype) {
    case DType::f32: return load_columns_typed<DType::f32>(row, lane, n, out);
    case DType::f16: return load_columns_typed<DType::f16>(row, lane, n, out);
    case DType::bf16: return load_columns_typed<DType::bf16>(row, lane, n, out);
    default:
      for (int64_t c = 0; c < n; ++c) out[c] = load_any(row, dtype, c * lane);
  }
}

// One lane per column (full), or half-width columns spread over rotary_dim lanes: halves
// [c0..c(w-1), c0..c(w-1)], pairs [c0, c0, c1, c1, ...]. `columns` holds the w values.
void expand_columns(const float* columns, TableWidth width, int64_t w, int64_t rd, float* out) {
  switch (width) {
    case TableWidth::full: std::memcpy(out, columns, std::size_t(rd) * 4); return;
    case TableWidth::halves:
      for (int64_t j = 0; j < rd; j += w) std::memcpy(out + j, columns, std::size_t(w) * 4);
      return;
    case TableWidth::pairs:
      for (int64_t c = 0; c < w; ++c) out[2 * c] = out[2 * c + 1] = columns[c];
      return;
  }
}

// A cos or sin row of `columns` values at `row` into rotary_dim lanes of `out` (`scratch`
// holds rotary_dim floats).
void load_row(const char* row, DType dtype, int64_t lane, const TablePlan& t, int64_t rd,
              float* scratch, float* out) {
  if (t.width == TableWidth::full) return load_columns(row, dtype, lane, rd, out);
  load_columns(row, dtype, lane, t.columns, scratch);
  expand_columns(scratch, t.width, t.columns, rd, out);
}

int64_t position_at(const TablePlan& t, int64_t offset) {
  return t.positions_dtype == DType::i32
             ? int64_t(reinterpret_cast<const std::int32_t*>(t.positions)[offset])
             : reinterpret_cast<const std::int64_t*>(t.positions)[offset];
}

// Offset of the token's entry in positions (with column_axis: of its first axis).
int64_t positions_offset(const ForwardPlan& plan, const int64_t* outer) {
  int64_t op = 0;
  for (int i = 0; i < plan.outer_count; ++i) op += outer[i] * plan.tables.positions_outer[i];
  return op;
}

// The cos and sin cache rows at position p.
struct CacheRows {
  const char* cos;
  const char* sin;
};
CacheRows cache_rows(const TablePlan& t, int64_t p) {
  return {t.cos + p * t.cos_row * dtype_size(t.dtype_cos),
          t.sin + p * t.sin_row * dtype_size(t.dtype_sin)};
}

// The cos and sin rows of direct tables (no positions) for the token at `outer`.
CacheRows direct_rows(const ForwardPlan& plan, const int64_t* outer) {
  const TablePlan& t = plan.tables;
  int64_t oc = 0, os = 0;
  for (int i = 0; i < plan.outer_count; ++i) {
    oc += outer[i] * t.cos_outer[i];
    os += outer[i] * t.sin_outer[i];
  }
  return {t.cos + oc * dtype_size(t.dtype_cos), t.sin + os * dtype_size(t.dtype_sin)};
}

// cos/sin of every frequency at the token's position(s), then spread over the lanes.
TableRow table_free_row(const ForwardPlan& plan, const int64_t* outer, float* cos, float* sin) {
  const TablePlan& t = plan.tables;
  const int64_t rd = plan.rotation->rotary_dim, n = t.columns;
  const int64_t op = positions_offset(plan, outer);
  if (!t.column_axis && plan.rotation->lane_frequency_halves && rd == 2 * n) {
    // Half: each frequency's values straight into the row's two halves.
    const double position = double(position_at(t, op));
    t.cos_sin_rows(1, &position, n, t.frequencies, t.amplitude, true, nullptr, nullptr, rd, cos,
                   sin);
    return {cos, sin};
  }
  constexpr int64_t kStack = 256;
  double stack_position[kStack];
  float stack_values[2 * kStack];
  std::vector<double> heap_position;
  std::vector<float> heap_values;
  double* position = stack_position;
  float* values = stack_values;
  if (n > kStack) {
    heap_position.resize(std::size_t(n));
    heap_values.resize(std::size_t(2 * n));
    position = heap_position.data();
    values = heap_values.data();
  }
  if (t.column_axis) {
    for (int64_t c = 0; c < n; ++c)
      position[c] = double(position_at(t, op + t.column_axis[c] * t.positions_axis_stride));
  } else {
    std::fill(position, position + n, double(position_at(t, op)));
  }
  float* cos_f = values;
  float* sin_f = values + n;
  t.cos_sin(n, position, t.frequencies, t.amplitude, cos_f, sin_f);
  for (int64_t j = 0; j < rd; ++j) {
    cos[j] = cos_f[t.lane_frequency[j]];
    sin[j] = sin_f[t.lane_frequency[j]];
  }
  return {cos, sin};
}

TableRow load_table_row_as_given(const ForwardPlan& plan, const int64_t* outer, float* cos,
                                 float* sin) {
  const TablePlan& t = plan.tables;
  const int64_t rd = plan.rotation->rotary_dim;
  auto column = [&](int64_t lane) -> int64_t {
    switch (t.width) {
      case TableWidth::full: return lane;
      case TableWidth::halves: return lane % t.columns;
      case TableWidth::pairs: return lane / 2;
    }
    return lane;
  };
  if (t.frequencies) return table_free_row(plan, outer, cos, sin);
  const int ecs = dtype_size(t.dtype_cos), ess = dtype_size(t.dtype_sin);
  const char* crow = nullptr;
  const char* srow = nullptr;
  if (!t.positions) {
    const CacheRows rows = direct_rows(plan, outer);
    crow = rows.cos;
    srow = rows.sin;
    if (t.direct_fp32_rows)
      return {reinterpret_cast<const float*>(crow), reinterpret_cast<const float*>(srow)};
  } else {
    const int64_t op = positions_offset(plan, outer);
    if (t.column_axis) {
      // One position per axis (MRoPE, grids): each column reads its own row.
      for (int64_t j = 0; j < rd; ++j) {
        const int64_t c = column(j);
        const int64_t p = position_at(t, op + t.column_axis[c] * t.positions_axis_stride);
        cos[j] = load_any(t.cos + p * t.cos_row * ecs, t.dtype_cos, c * t.cos_lane);
        sin[j] = load_any(t.sin + p * t.sin_row * ess, t.dtype_sin, c * t.sin_lane);
      }
      return {cos, sin};
    }
    const CacheRows rows = cache_rows(t, position_at(t, op));
    crow = rows.cos;
    srow = rows.sin;
    if (t.dtype_cos == DType::f32 && t.dtype_sin == DType::f32 && t.width == TableWidth::full &&
        t.cos_lane == 1 && t.sin_lane == 1)
      return {reinterpret_cast<const float*>(crow), reinterpret_cast<const float*>(srow)};
  }
  // Half-width columns are read into a buffer, then spread over the lanes.
  constexpr int64_t kStack = 512;
  float stack[kStack];
  std::vector<float> heap;
  float* buffer = stack;
  if (t.width != TableWidth::full && t.columns > kStack) {
    heap.resize(std::size_t(t.columns));
    buffer = heap.data();
  }
  load_row(crow, t.dtype_cos, t.cos_lane, t, rd, buffer, cos);
  load_row(srow, t.dtype_sin, t.sin_lane, t, rd, buffer, sin);
  return {cos, sin};
}

}  // namespace

TableRow load_table_row(const ForwardPlan& plan, const int64_t* outer, float* cos, float* sin) {
  const TableRow row = load_table_row_as_given(plan, outer, cos, sin);
  if (!plan.tables.negate_sin) return row;
  const int64_t rd = plan.rotation->rotary_dim;
  for (int64_t j = 0; j < rd; ++j) sin[j] = -row.sin[j];  // row.sin may be sin itself
  return {row.cos, sin};
}

namespace {

// 32-bit lanes that may alias the fp32 tables: sign folding is an xor on their bits.
typedef std::uint32_t bits32 __attribute__((may_alias));

// out[j] = in[j] ^ signs[j] ^ flip (signs null: in[j] ^ flip, a copy when flip is 0); out may be
// in. Plain loops the compiler vectorises.
void fold_signs(const float* in, const std::uint32_t* signs, std::uint32_t flip, int64_t n,
                float* out) {
  const auto* src = reinterpret_cast<const bits32*>(in);
  auto* dst = reinterpret_cast<bits32*>(out);
  if (signs) {
    for (int64_t j = 0; j < n; ++j) dst[j] = src[j] ^ signs[j] ^ flip;
    return;
  }
  if (in == out && flip == 0) return;
  for (int64_t j = 0; j < n; ++j) dst[j] = src[j] ^ flip;
}

}  // namespace

bool table_nans_low_bits_zero(const ForwardPlan& plan, kernels::TableLayout layout) {
  const TablePlan& t = plan.tables;
  return layout == kernels::TableLayout::even_odd_16 ||
         (t.cos != nullptr && t.dtype_cos == DType::bf16 && t.dtype_sin == DType::bf16);
}

// Cache rows gathered by position are random reads: asks for the rows of token `ahead` tokens
// later while this one is prepared, so their misses overlap (only the one-position-per-token
// gather; MRoPE's per-column rows and table-free rows are left as they are). Rows whose lanes
// are not contiguous are not prefetched: a lane stride is any value where a row has one column
// (columns × stride overflowed; fuzz_rope).
void prefetch_cache_rows(const ForwardPlan& plan, const int64_t* outer) {
  const TablePlan& t = plan.tables;
  if (t.cos_lane != 1 || t.sin_lane != 1) return;
  const CacheRows rows = cache_rows(t, position_at(t, positions_offset(plan, outer)));
  const int64_t columns = t.width == TableWidth::full ? plan.rotation->rotary_dim : t.columns;
  const int64_t cbytes = columns * dtype_size(t.dtype_cos);
  const int64_t sbytes = columns * dtype_size(t.dtype_sin);
  for (int64_t b = 0; b < cbytes; b += 64) __builtin_prefetch(rows.cos + b);
  for (int64_t b = 0; b < sbytes; b += 64) __builtin_prefetch(rows.sin + b);
}

namespace {

// One table row of dtype D (columns `lane` elements apart) spread over rd lanes as
// load_table_row spreads it, sin negated when asked (flip: the sign bit, as `-x` flips it) and
// the signs folded in, in one pass: out[j] = bits(value of lane j) ^ signs[j] ^ flip. Pure data
// movement, so the bits are those of load_table_row + fold_signs; a decode step spent most of its
// table time in their three passes over a scratch row. kUnitLane lets the compiler vectorise the
// common case; complex tables' real and imaginary views (lane 2) take the other.
template <DType D, bool kSigns, bool kUnitLane>
void spread_row_typed(const char* row, int64_t lane, TableWidth width, int64_t w, int64_t rd,
                      const std::uint32_t* __restrict signs, std::uint32_t flip,
                      std::uint32_t* __restrict out) {
  const auto* __restrict p = reinterpret_cast<const typename Storage<D>::type*>(row);
  auto value = [&](int64_t c) -> std::uint32_t {
    const auto* at = p + (kUnitLane ? c : c * lane);
    if constexpr (D == DType::f32) {
      std::uint32_t u;
      std::memcpy(&u, at, 4);
      return u;
    } else {
      return float_bits(load_float<D>(at));
    }
  };
  auto sign = [&](int64_t j) -> std::uint32_t {
    if constexpr (kSigns)
      return signs[j] ^ flip;
    else
      return flip;
  };
  switch (width) {
    case TableWidth::full:
      for (int64_t j = 0; j < rd; ++j) out[j] = value(j) ^ sign(j);
      return;
    case TableWidth::halves:  // rd == 2 w
      for (int64_t c = 0; c < w; ++c) {
        const std::uint32_t v = value(c);
        out[c] = v ^ sign(c);
        out[w + c] = v ^ sign(w + c);
      }
      return;
    case TableWidth::pairs:  // rd == 2 w
      for (int64_t c = 0; c < w; ++c) {
        const std::uint32_t v = value(c);
        out[2 * c] = v ^ sign(2 * c);
        out[2 * c + 1] = v ^ sign(2 * c + 1);
      }
      return;
  }
}

template <bool kSigns, bool kUnitLane>
void spread_row(const char* row, DType dtype, int64_t lane, TableWidth width, int64_t w, int64_t rd,
                const std::uint32_t* signs, std::uint32_t flip, float* out) {
  // The table buffers are only ever written through these 32-bit lanes before the kernels read
  // them as floats.
  auto* dst = reinterpret_cast<std::uint32_t*>(out);
  switch (dtype) {
    case DType::f32:
      return spread_row_typed<DType::f32, kSigns, kUnitLane>(row, lane, width, w, rd, signs, flip,
                                                             dst);
    case DType::f16:
      return spread_row_typed<DType::f16, kSigns, kUnitLane>(row, lane, width, w, rd, signs, flip,
                                                             dst);
    default:
      return spread_row_typed<DType::bf16, kSigns, kUnitLane>(row, lane, width, w, rd, signs, flip,
                                                              dst);
  }
}

void spread_row(const char* row, DType dtype, int64_t lane, TableWidth width, int64_t w, int64_t rd,
                const std::uint32_t* signs, std::uint32_t flip, float* out) {
  if (signs)
    lane == 1 ? spread_row<true, true>(row, dtype, lane, width, w, rd, signs, flip, out)
              : spread_row<true, false>(row, dtype, lane, width, w, rd, signs, flip, out);
  else
    lane == 1 ? spread_row<false, true>(row, dtype, lane, width, w, rd, signs, flip, out)
              : spread_row<false, false>(row, dtype, lane, width, w, rd, signs, flip, out);
}

}  // namespace

void prepare_table_tile(const ForwardPlan& plan, int64_t* outer, int64_t tokens, int64_t stride,
                        kernels::TableLayout layout, float* cos, float* sin, float* row_cos,
                        float* row_sin) {
  const RotationData& r = *plan.rotation;
  const int64_t rd = r.rotary_dim;
  const bool fold = r.kind == Rotation::Kind::signed_permutation;
  const bool even_odd = layout == kernels::TableLayout::even_odd_16;
  const std::uint32_t* cos_bits = fold && !r.a_identity ? r.cos_sign_bits.data() : nullptr;
  const std::uint32_t* sin_bits = fold ? r.sin_sign_bits.data() : nullptr;
  const int last = plan.outer_count - 1;
  const int64_t first = last >= 0 ? outer[last] : 0;
  const TablePlan& t = plan.tables;
  // A call whose rows all share one position (no outer axis: a decode step's single token) is
  // a gather too; it was left to the row-by-row path, about 1,500 instructions of a
  // 10,000-instruction decode call (twenty-second session).
  const bool gather = t.positions && !t.column_axis && !t.frequencies;
  // 8 tokens ahead: 4, 6, 8 and 12 gave the same time on a Zen 3, 16 no better (random positions
  // into a 59 MB cache, 1 thread: 32.3 ms without, 24.4 ms with). The lookahead stops at the
  // tile's end: the next tile's first rows are not asked for early.
  constexpr int64_t kAhead = 8;
  if (gather && last >= 0)
    for (int64_t i = 0; i < std::min(kAhead, tokens); ++i) {
      outer[last] = first + i;
      prefetch_cache_rows(plan, outer);
    }
  // Rows gathered by one position per token from a float cache (vLLM's cos_sin_cache), or direct
  // rows that cannot be used as they are (16-bit, half width, strided: complex tables' real and
  // imaginary views): read, spread, negated and sign-folded in one pass (spread_row).
  const bool direct = !t.positions && !t.frequencies && !t.direct_fp32_rows;
  const bool spread = (gather || direct) && is_floating(t.dtype_cos) && is_floating(t.dtype_sin) &&
                      (t.width == TableWidth::full || rd == 2 * t.columns);
  const std::uint32_t sin_flip = t.negate_sin ? 0x80000000u : 0u;
  // Rows gathered or direct that go to the even/odd layout in one pass, split as well (the
  // kernels' spread_even_odd_16, in place of four passes and a scratch row: 3-5% of a bf16 call in
  // cache, BENCHMARKS.md, nineteenth session): fp32 and bf16 only (whose fp32 bits are a move;
  // fp16 needs a conversion), unit lanes, rotary_dim whole 16-lane chunks (the signs in even/odd
  // order exist), and half-width rows whose half is whole chunks too, so that no chunk straddles
  // the two halves.
  auto one_pass_dtype = [](DType d) { return d == DType::f32 || d == DType::bf16; };
  const bool even_odd_in_one_pass =
      even_odd && fold && (gather || (!t.positions && !t.frequencies)) &&
      one_pass_dtype(t.dtype_cos) && one_pass_dtype(t.dtype_sin) && t.cos_lane == 1 &&
      t.sin_lane == 1 && !r.sin_sign_bits_even_odd_16.empty() &&
      (t.width == TableWidth::full ||
       (t.width == TableWidth::halves && rd == 2 * t.columns && t.columns % 16 == 0));
  const int64_t period = t.width == TableWidth::full ? rd : t.columns;
  // Cos sign words only where A is not the identity (all zero otherwise: nothing to fold).
  const std::uint32_t* cos_signs_even_odd = cos_bits ? r.cos_sign_bits_even_odd_16.data() : nullptr;
  // Table-free half rows, one position per token: the rows kernel writes them into the tile a
  // block of tokens per call (row by row it waited on each row's latency), finished: it xors in
  // the signs (inverse tables' flip included) as it stores. For the even/odd layout each half
  // must be whole 16-lane chunks: then every chunk of the second half holds the frequencies of
  // its twin in the first, and the kernel takes them in the even/odd order. The pass over the
  // rows this saves was about 10% of a table-free bf16 call (BENCHMARKS.md, twenty-second
  // session). Other table-free rows go row by row (load_table_row).
  const bool free_rows =
      t.frequencies && !t.column_axis && r.lane_frequency_halves && rd == 2 * t.columns &&
      (!even_odd || (fold && !r.sin_sign_bits_even_odd_16.empty() && t.columns % 16 == 0));
  if (free_rows) {
    const double* frequencies = t.frequencies;
    const std::uint32_t* cos_signs = !cos_bits  ? nullptr
                                     : even_odd ? r.cos_sign_bits_even_odd_16.data()
                                                : cos_bits;
    const std::uint32_t* sin_signs = even_odd ? r.sin_sign_bits_even_odd_16.data() : sin_bits;
    thread_local std::vector<double> reordered;
    thread_local std::vector<std::uint32_t> flipped;
    if (even_odd) {
      reordered.resize(std::size_t(t.columns));
      split_even_odd_16(t.frequencies, t.columns, reordered.data());
      frequencies = reordered.data();
    }
    if (sin_flip) {  // not negated frequencies: sin(-0) would be +0, not the flip's -0
      flipped.resize(std::size_t(rd));
      for (int64_t j = 0; j < rd; ++j) flipped[j] = (sin_signs ? sin_signs[j] : 0u) ^ sin_flip;
      sin_signs = flipped.data();
    }
    constexpr int64_t kBlock = 32;
    double block[kBlock];
    for (int64_t i0 = 0; i0 < tokens; i0 += kBlock) {
      const int64_t m = std::min(kBlock, tokens - i0);
      for (int64_t i = 0; i < m; ++i) {
        if (last >= 0) outer[last] = first + i0 + i;
        block[i] = double(position_at(t, positions_offset(plan, outer)));
      }
      t.cos_sin_rows(m, block, t.columns, frequencies, t.amplitude, true, cos_signs, sin_signs,
                     stride, cos + i0 * stride, sin + i0 * stride);
    }
  }
  for (int64_t i = 0; i < tokens; ++i) {
    if (gather && last >= 0 && i + kAhead < tokens) {
      outer[last] = first + i + kAhead;
      prefetch_cache_rows(plan, outer);
    }
    if (last >= 0) outer[last] = first + i;
    float* c = cos + i * stride;
    float* s = sin + i * stride;
    // Otherwise the even/odd layout goes through the scratch rows (load_table_row may have
    // returned them: the signs are folded in place first), then is split into the tile.
    float* folded_cos = even_odd ? row_cos : c;
    float* folded_sin = even_odd ? row_sin : s;
    if (even_odd_in_one_pass || spread) {
      const CacheRows rows = gather ? cache_rows(t, position_at(t, positions_offset(plan, outer)))
                                    : direct_rows(plan, outer);
      if (even_odd_in_one_pass) {
        t.spread_even_odd_16(rows.cos, t.dtype_cos, period, cos_signs_even_odd, 0u, rd, c);
        t.spread_even_odd_16(rows.sin, t.dtype_sin, period, r.sin_sign_bits_even_odd_16.data(),
                             sin_flip, rd, s);
      } else {
        spread_row(rows.cos, t.dtype_cos, t.cos_lane, t.width, t.columns, rd, cos_bits, 0u,
                   folded_cos);
        spread_row(rows.sin, t.dtype_sin, t.sin_lane, t.width, t.columns, rd, sin_bits, sin_flip,
                   folded_sin);
      }
    } else if (free_rows) {
      // Written whole by the rows kernel above.
    } else {
      const TableRow row = load_table_row(plan, outer, row_cos, row_sin);
      fold_signs(row.cos, cos_bits, 0u, rd, folded_cos);
      fold_signs(row.sin, sin_bits, 0u, rd, folded_sin);
    }
    if (even_odd && !even_odd_in_one_pass && !free_rows) {
      t.spread_even_odd_16(row_cos, DType::f32, rd, nullptr, 0u, rd, c);
      t.spread_even_odd_16(row_sin, DType::f32, rd, nullptr, 0u, rd, s);
    }
    std::fill(c + rd, c + stride, 0.0f);
    std::fill(s + rd, s + stride, 0.0f);
  }
  if (last >= 0) outer[last] = first;
}

namespace {

template <typename P>
BasicView<P> narrowed_view(BasicView<P> v, int64_t lane_offset) {
  if (v.data)
    v.data = static_cast<
                 std::conditional_t<std::is_const_v<std::remove_pointer_t<P>>, const char*, char*>>(
                 v.data) +
             lane_offset * v.strides[v.rank - 1] * dtype_size(v.dtype);
  v.shape[v.rank - 1] -= lane_offset;
  return v;
}

}  // namespace

NarrowedOperand narrow_operand(const std::string& name, const Operand& op, int64_t head_dim,
                               int64_t lane_offset, bool written) {
  const std::string out = name + "_out";
  const CheckedOperand c = check_operand(name.c_str(), out.c_str(), op, head_dim, written);
  NarrowedOperand n;
  n.operand.in = narrowed_view(op.in, lane_offset);
  if (written) n.operand.out = narrowed_view(op.out, lane_offset);
  n.in_place = c.in_place;
  return n;
}

ConstTensorView narrow_lanes(const std::string& name, const ConstTensorView& v, int64_t head_dim,
                             int64_t lane_offset) {
  check_tensor(name.c_str(), v, head_dim);
  return narrowed_view(v, lane_offset);
}

TensorView narrow_lanes(const std::string& name, const TensorView& v, int64_t head_dim,
                        int64_t lane_offset) {
  check_tensor(name.c_str(), as_const(v), head_dim);
  return narrowed_view(v, lane_offset);
}

void copy_leading_lanes(const ConstTensorView& in, const TensorView& out, int64_t lanes) {
  if (in.numel() == 0 || lanes == 0) return;
  const int rows_rank = in.rank - 1;
  const int64_t bytes = lanes * dtype_size(in.dtype);
  int64_t index[kMaxRank] = {};
  const int64_t rows = in.numel() / in.shape[rows_rank];
  for (int64_t r = 0; r < rows; ++r) {
    int64_t oi = 0, oo = 0;
    for (int i = 0; i < rows_rank; ++i) {
      oi += index[i] * in.strides[i];
      oo += index[i] * out.strides[i];
    }
    std::memcpy(static_cast<char*>(out.data) + oo * dtype_size(out.dtype),
                static_cast<const char*>(in.data) + oi * dtype_size(in.dtype), std::size_t(bytes));
    for (int i = rows_rank - 1; i >= 0 && ++index[i] == in.shape[i]; --i) index[i] = 0;
  }
}

void require_disjoint_views(const TensorView& out, const std::string& out_name,
                            const ConstTensorView& in, const std::string& in_name) {
  require_disjoint(out, out_name.c_str(), in, in_name.c_str());
}

void check_head_tensor(const std::string& name, const ConstTensorView& v, int64_t head_dim) {
  check_tensor(name.c_str(), v, head_dim);
}

void require_distinct_elements(const std::string& name, const TensorView& v) {
  if (v.numel() > 0 && !has_distinct_elements(v))
    fail(Status::invalid_argument, name, "strides that give every element its own address",
         "strides " + dims_string(v.strides, v.rank) + " for shape " + shape_string(v));
}

bool views_may_overlap(const ConstTensorView& a, const ConstTensorView& b) {
  if (a.dtype != b.dtype) return bytes_may_overlap(a, b);
  return may_overlap(a, b, dtype_size(a.dtype));
}

bool metadata_only() noexcept {
  return t_metadata_only;
}

MetadataOnly::MetadataOnly() : previous_(t_metadata_only) {
  t_metadata_only = true;
}
MetadataOnly::~MetadataOnly() {
  t_metadata_only = previous_;
}

}  // namespace rome::detail
