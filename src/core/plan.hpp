// Validation and planning: turns the public arguments into a checked iteration plan. Nothing is
// written until a plan exists, so every error leaves the outputs untouched.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "../kernels/kernel_api.hpp"
#include "rome/rope.hpp"
#include "rotation_data.hpp"

namespace rome::detail {

// The axes of one operand that share a table row (heads, broadcast batch), flattened into rows.
struct InnerAxes {
  int count = 0;
  std::int64_t size[kMaxRank] = {};
  std::int64_t in_stride[kMaxRank] = {};   // elements
  std::int64_t out_stride[kMaxRank] = {};  // elements
  std::int64_t rows = 1;
};

struct OperandPlan {
  const char* in_base = nullptr;  // byte pointers
  char* out_base = nullptr;
  std::int64_t outer_in[kMaxRank] = {};  // element strides along the outer axes
  std::int64_t outer_out[kMaxRank] = {};
  InnerAxes inner;
  bool in_place = false;
};

struct TablePlan {
  const char* cos = nullptr;
  const char* sin = nullptr;
  DType dtype_cos = DType::f32, dtype_sin = DType::f32;
  std::int64_t cos_outer[kMaxRank] = {},
               sin_outer[kMaxRank] = {};    // direct: strides per outer axis
  std::int64_t cos_row = 0, sin_row = 0;    // cache: stride between cache rows
  std::int64_t cos_lane = 1, sin_lane = 1;  // stride between columns
  TableWidth width = TableWidth::full;
  std::int64_t columns = 0;
  // cache
  const char* positions = nullptr;
  DType positions_dtype = DType::i64;
  std::int64_t positions_outer[kMaxRank] = {};
  std::int64_t positions_axis_stride = 0;
  const int* column_axis = nullptr;  // columns entries, or nullptr for one position per token
  bool direct_fp32_rows = false;     // rows can be used in place: fp32, full width, unit stride
  bool negate_sin = false;           // Tables::inverse
  // table-free (cos, sin null): columns = frequencies, lane j uses lane_frequency[j]
  const double* frequencies = nullptr;
  const std::int32_t* lane_frequency = nullptr;
  double amplitude = 1.0;
  kernels::CosSinFn cos_sin = nullptr;
  kernels::CosSinRowsFn cos_sin_rows = nullptr;
  kernels::SpreadEvenOdd16Fn spread_even_odd_16 = nullptr;  // rows for TableLayout::even_odd_16
};

struct ForwardPlan {
  const RotationData* rotation = nullptr;
  DType dtype = DType::f32;
  bool outer_axis[kMaxRank] = {};  // per axis of x (but the head): the table row changes
  int outer_count = 0;
  std::int64_t outer_size[kMaxRank] = {};
  std::int64_t outer_total = 1;
  OperandPlan q, k;
  bool has_k = false;
  TablePlan tables;
  std::int64_t bytes_moved = 0;  // for the threading decision
};

// Table-free tables: finite frequencies and amplitude (errors name the given arguments); returns
// the largest |frequency|.
double check_frequency_values(std::span<const double> frequencies, double amplitude,
                              const char* frequencies_name, const char* amplitude_name);
// Whether |position × largest_frequency| is in the cos/sin kernel's exact reduction range; else
// fail_angle reports `position` (found at `at`, e.g. "index [0, 3]") for argument "positions".
bool angle_in_range(std::int64_t position, double largest_frequency);
[[noreturn]] void fail_angle(std::int64_t position, double largest_frequency,
                             const std::string& at);

// While one is alive on this thread, the checks use shapes, dtypes and strides only: data
// pointers may be null, and aliasing between views and position values go unchecked (rope_check).
class MetadataOnly {
 public:
  MetadataOnly();
  ~MetadataOnly();
  MetadataOnly(const MetadataOnly&) = delete;
  MetadataOnly& operator=(const MetadataOnly&) = delete;

 private:
  bool previous_;
};

// Whether a MetadataOnly is alive on this thread.
bool metadata_only() noexcept;

// Whether every NaN of the table rows prepare_table_tile gives a kernel wanting `layout` has 16
// zero low bits (kernel_api.hpp: ForwardTile::table_nans_low_bits_zero): bf16 tables, or the
// even/odd layout, whose rows prepare_table_tile clears.
bool table_nans_low_bits_zero(const ForwardPlan& plan, kernels::TableLayout layout);

// q_written = false: q.out is ignored (backward without dx).
ForwardPlan plan_forward(const Rotation& rotation, const Tables& tables, const Operand& q,
                         const Operand* k, bool q_written = true);

// Splits another view with x's shape along the plan's outer/inner axes (out may be null).
OperandPlan split_operand(const ForwardPlan& plan, const ConstTensorView& in, void* out,
                          const std::int64_t* out_strides);

// Backward: q.in = grad, q.out = dx (absent when dx is not wanted); x follows the same split.
struct BackwardPlan {
  ForwardPlan forward;
  bool want_dx = false;
  OperandPlan x;
  DType x_dtype = DType::f32;
  TensorView dcos, dsin;  // empty when not wanted
  std::int64_t dcos_outer[kMaxRank] = {}, dsin_outer[kMaxRank] = {};
  float* da = nullptr;
  float* db = nullptr;
};

BackwardPlan plan_backward(const Rotation& rotation, const Tables& tables,
                           const ConstTensorView& grad, const ConstTensorView& x,
                           const Gradients& out);

// Fills `cos`/`sin` (rotary_dim fp32 each) with the table row of outer index `outer` (a multi
// index of plan.outer_count entries) and returns pointers to use (the buffers, or the table
// itself when it is already fp32, full width and contiguous).
struct TableRow {
  const float* cos;
  const float* sin;
};
TableRow load_table_row(const ForwardPlan& plan, const std::int64_t* outer, float* cos, float* sin);

// The table rows of a tile of `tokens` tokens: token i is the outer index `outer` with its last
// outer axis advanced by i (outer is restored on return). Rows are `stride` floats (a multiple
// of 16, at least rotary_dim) with zero padding; for signed permutations the signs of A and B
// are folded in, and lanes are in the order the kernel asked for (kernel_api.hpp).
// `row_cos`/`row_sin` are rotary_dim floats of scratch.
void prepare_table_tile(const ForwardPlan& plan, std::int64_t* outer, std::int64_t tokens,
                        std::int64_t stride, kernels::TableLayout layout, float* cos, float* sin,
                        float* row_cos, float* row_sin);

// Rotations with a lane offset run on views narrowed to lanes [lane_offset, head_dim). Each
// operand is first checked as a whole against the full head_dim (the errors name the full head);
// `in_place` tells whether the leading lanes still need copying (copy_leading_lanes) after the
// call succeeded.
struct NarrowedOperand {
  Operand operand;
  bool in_place = false;
};
NarrowedOperand narrow_operand(const std::string& name, const Operand& op, std::int64_t head_dim,
                               std::int64_t lane_offset, bool written = true);
ConstTensorView narrow_lanes(const std::string& name, const ConstTensorView& v,
                             std::int64_t head_dim, std::int64_t lane_offset);
TensorView narrow_lanes(const std::string& name, const TensorView& v, std::int64_t head_dim,
                        std::int64_t lane_offset);
// out[..., :lanes] = in[..., :lanes]; both views checked, same shape, disjoint.
void copy_leading_lanes(const ConstTensorView& in, const TensorView& out, std::int64_t lanes);

// Fails (naming out_name) when out may share a byte with in.
void require_disjoint_views(const TensorView& out, const std::string& out_name,
                            const ConstTensorView& in, const std::string& in_name);

// The checks of an operand (rank 2..5, float dtype, last axis head_dim and contiguous, strides,
// data pointer), for views that are not rope_forward operands (caches, values).
void check_head_tensor(const std::string& name, const ConstTensorView& v, std::int64_t head_dim);
void require_distinct_elements(const std::string& name, const TensorView& v);
// Whether two views may share an element (exact for views that step together on an axis, such
// as q, k and v slices of one packed buffer; conservative otherwise).
bool views_may_overlap(const ConstTensorView& a, const ConstTensorView& b);

}  // namespace rome::detail
