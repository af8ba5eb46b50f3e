// Shared conversions of the torch front: tensors to RoME views, rotations, tables, errors
// (declared in common.hpp).
#include "common.hpp"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace rome_torch {

rome::ExecOptions exec_options() {
  rome::ExecOptions options;
  if (rome::requested_num_threads() > 0) return options;
  options.num_threads = at::get_num_threads();
  options.parallel_for = [](std::int64_t items, int threads, rome::RangeBody body, void* context) {
    const std::int64_t grain = (items + threads - 1) / threads;
    at::parallel_for(0, items, grain, [&](std::int64_t b, std::int64_t e) { body(context, b, e); });
  };
  return options;
}

using at::Tensor;

[[noreturn]] void rethrow(const rome::Error& e) {
  switch (e.status()) {
    case rome::Status::invalid_argument: TORCH_CHECK_VALUE(false, e.what());
    case rome::Status::out_of_range: TORCH_CHECK_INDEX(false, e.what());
    case rome::Status::unsupported: TORCH_CHECK_NOT_IMPLEMENTED(false, e.what());
    default: TORCH_CHECK(false, e.what());
  }
  TORCH_CHECK(false, e.what());  // unreachable
}

std::string shape_of_sizes(c10::IntArrayRef sizes) {
  std::string s = "[";
  for (std::size_t i = 0; i < sizes.size(); ++i) s += (i ? ", " : "") + std::to_string(sizes[i]);
  return s + "]";
}

std::string shape_of(const Tensor& t) {
  std::string s = "[";
  for (int64_t i = 0; i < t.dim(); ++i) s += (i ? ", " : "") + std::to_string(t.size(i));
  return s + "]";
}

static std::string torch_dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "float32";
    case at::kHalf: return "float16";
    case at::kBFloat16: return "bfloat16";
    case at::kDouble: return "float64";
    case at::kInt: return "int32";
    case at::kLong: return "int64";
    case at::kShort: return "int16";
    case at::kChar: return "int8";
    case at::kByte: return "uint8";
    case at::kBool: return "bool";
    case at::kComplexFloat: return "complex64";
    case at::kComplexDouble: return "complex128";
    default: return c10::toString(t);
  }
}

// Names are C strings: the std::string of an error message is built only when it fails.
static void check_cpu(const Tensor& t, const char* name) {
  if (!t.device().is_cpu())
    rome::fail(rome::Status::invalid_argument, std::string(name) + ".device", "cpu",
               t.device().str());
}

rome::DType float_dtype(const Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat: return rome::DType::f32;
    case at::kHalf: return rome::DType::f16;
    case at::kBFloat16: return rome::DType::bf16;
    default:
      rome::fail(rome::Status::invalid_argument, std::string(name) + ".dtype",
                 "float32, float16 or bfloat16", torch_dtype_name(t.scalar_type()));
  }
}

static rome::DType any_dtype(const Tensor& t, const char* name, bool integer) {
  if (!integer) return float_dtype(t, name);
  switch (t.scalar_type()) {
    case at::kInt: return rome::DType::i32;
    case at::kLong: return rome::DType::i64;
    default:
      rome::fail(rome::Status::invalid_argument, std::string(name) + ".dtype", "int32 or int64",
                 torch_dtype_name(t.scalar_type()));
  }
}

// Meta tensors (the Meta kernels, which only check) give views without data.
template <typename View>
static View make_view(const Tensor& t, const char* name, bool integer) {
  const bool meta = t.is_meta();
  if (!meta) check_cpu(t, name);
  const rome::DType dtype = any_dtype(t, name, integer);
  const c10::IntArrayRef sizes = t.sizes(), strides = t.strides();
  if (sizes.size() > std::size_t(rome::kMaxRank))
    rome::fail(rome::Status::invalid_argument, name,
               "rank at most " + std::to_string(rome::kMaxRank),
               "rank " + std::to_string(t.dim()) + " " + shape_of(t));
  View v;
  using Pointer = decltype(v.data);
  v.data = meta ? nullptr : static_cast<Pointer>(t.data_ptr());
  v.dtype = dtype;
  v.rank = static_cast<int>(sizes.size());
  for (int i = 0; i < v.rank; ++i) {
    v.shape[i] = sizes[std::size_t(i)];
    v.strides[i] = strides[std::size_t(i)];
  }
  return v;
}

rome::ConstTensorView const_view(const Tensor& t, const char* name, bool integer) {
  return make_view<rome::ConstTensorView>(t, name, integer);
}
rome::TensorView mutable_view(const Tensor& t, const char* name) {
  return make_view<rome::TensorView>(t, name, false);
}
rome::ConstTensorView const_view(const Tensor& t, const std::string& name, bool integer) {
  return const_view(t, name.c_str(), integer);
}
rome::TensorView mutable_view(const Tensor& t, const std::string& name) {
  return mutable_view(t, name.c_str());
}

// The input as the core reads it: a contiguous last axis (a copy only when it is not).
Tensor readable(const Tensor& t) {
  if (t.dim() > 0 && t.size(-1) > 1 && t.stride(-1) != 1) return t.contiguous();
  return t;
}

// An output like `t` (empty_like strides), falling back to row-major when the last axis would
// not be contiguous. Used by both the CPU and the Meta kernels, so the two always agree.
Tensor alloc_like(const Tensor& t) {
  Tensor out = at::empty_like(t);
  if (out.dim() > 0 && out.sym_stride(-1) != 1) out = at::empty_symint(t.sym_sizes(), t.options());
  return out;
}

// ----------------------------------------------------------------------------------------------
// Rotations, cached: building one analyses the matrices and builds per-ISA permute plans.

static void check_matrix(const Tensor& m, const std::string& name, int64_t rd) {
  if (!m.is_meta()) check_cpu(m, name.c_str());
  float_dtype(m, name.c_str());
  if (m.dim() != 2 || m.size(0) != rd || m.size(1) != rd)
    rome::fail(rome::Status::invalid_argument, name,
               "a [" + std::to_string(rd) + ", " + std::to_string(rd) +
                   "] matrix (rotary_dim x rotary_dim)",
               shape_of(m));
}

// A meta matrix has no values: the identity stands in (the Meta kernels check shapes only).
static std::vector<float> matrix_values(const Tensor& m, int64_t rd) {
  if (m.is_meta()) {
    std::vector<float> identity(std::size_t(rd * rd), 0.0f);
    for (int64_t i = 0; i < rd; ++i) identity[std::size_t(i * rd + i)] = 1.0f;
    return identity;
  }
  const Tensor f = m.to(at::kFloat).contiguous();
  const float* p = f.data_ptr<float>();
  return std::vector<float>(p, p + rd * rd);
}

namespace {

// A matrix as given: its dtype, strides and the bytes of its values, when they fill one block of
// memory (row- or column-major: a QR factor is column-major). A call that passes the same values
// the same way again is matched by comparing these in place, without converting or copying the
// matrix: a [128, 128] bf16 matrix compares 32 KiB, where the copy, conversion and comparison of
// its float values took most of a decode call's time.
struct MatrixBytes {
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> strides;
  std::vector<unsigned char> bytes;  // empty: not one dense block (compare the float values)
};

bool one_block(const Tensor& m) {
  return !m.is_meta() && m.is_non_overlapping_and_dense();
}

MatrixBytes bytes_of(const Tensor& m) {
  MatrixBytes out;
  out.dtype = m.scalar_type();
  if (!one_block(m)) return out;
  out.strides.assign(m.strides().begin(), m.strides().end());
  const auto* p = static_cast<const unsigned char*>(m.data_ptr());
  out.bytes.assign(p, p + m.numel() * m.element_size());
  return out;
}

bool same_bytes(const MatrixBytes& cached, const Tensor& m) {
  return !cached.bytes.empty() && one_block(m) && m.scalar_type() == cached.dtype &&
         std::size_t(m.numel() * m.element_size()) == cached.bytes.size() &&
         m.strides().equals(cached.strides) &&
         std::memcmp(m.data_ptr(), cached.bytes.data(), cached.bytes.size()) == 0;
}

struct CacheEntry {
  std::string kind;
  std::vector<int64_t> blocks;
  int64_t rotary_dim = 0, head_dim = 0, lane_offset = 0;
  bool has_a = false;
  std::vector<float> a, b;
  MatrixBytes a_bytes, b_bytes;
  std::optional<rome::Rotation> rotation;
};

std::mutex cache_mutex;
std::vector<CacheEntry> cache;  // most recent last
constexpr std::size_t kCacheEntries = 32;
constexpr int64_t kMaxCachedDenseDim = 512;

rome::Rotation named_rotation(const std::string& kind, int64_t dim) {
  if (kind == "half") return rome::Rotation::half(dim);
  if (kind == "interleave") return rome::Rotation::interleave(dim);
  if (kind == "quarter") return rome::Rotation::quarter(dim);
  return rome::Rotation::interleave_half(dim);
}

}  // namespace

// kind: half | interleave | quarter | interleave_half | dense | dense_forced (the matrices run
// as products even when they are a signed permutation: for comparing paths). mat names are used
// in messages.
rome::Rotation build_rotation(const std::string& kind, const std::vector<int64_t>& blocks,
                              int64_t rotary_dim, int64_t head_dim,
                              const std::optional<Tensor>& mat_a,
                              const std::optional<Tensor>& mat_b, const std::string& mat_b_name,
                              int64_t lane_offset) {
  const bool forced = kind == "dense_forced";
  const bool dense = kind == "dense" || forced;
  if (!dense && kind != "half" && kind != "interleave" && kind != "quarter" &&
      kind != "interleave_half")
    rome::fail(rome::Status::invalid_argument, "rotation",
               "one of 'half', 'interleave', 'quarter', 'interleave_half', 'dense', "
               "'dense_forced'",
               "'" + kind + "'");
  if (rotary_dim != -1 && (rotary_dim <= 0 || rotary_dim > head_dim))
    rome::fail(
        rome::Status::invalid_argument, "rotary_dim",
        "-1 (the head dimension) or 1 to " + std::to_string(head_dim) + " (the head dimension)",
        std::to_string(rotary_dim));
  const int64_t rd = rotary_dim == -1 ? head_dim : rotary_dim;
  const bool has_a = mat_a.has_value() && mat_a->defined();
  const bool has_b = mat_b.has_value() && mat_b->defined();
  std::vector<float> a, b;
  if (dense) {
    if (!has_b)
      rome::fail(rome::Status::invalid_argument, mat_b_name,
                 "a [" + std::to_string(rd) + ", " + std::to_string(rd) +
                     "] matrix for rotation '" + kind + "'",
                 "None");
    if (!blocks.empty())
      rome::fail(rome::Status::invalid_argument, "blocks",
                 "no blocks for rotation '" + kind + "' (the matrix carries its structure)",
                 std::to_string(blocks.size()) + " blocks");
    check_matrix(*mat_b, mat_b_name, rd);
    if (has_a) check_matrix(*mat_a, "mat_a", rd);
  } else {
    if (has_a || has_b)
      rome::fail(rome::Status::invalid_argument, has_b ? "mat_b" : "mat_a",
                 "None for rotation '" + kind + "' (matrices are for rotation 'dense')",
                 "a tensor");
    const int64_t multiple = kind == "quarter" ? 4 : 2;
    if (blocks.empty() && rd % multiple != 0)
      rome::fail(rome::Status::invalid_argument, "rotary_dim",
                 "a multiple of " + std::to_string(multiple) + " for rotation '" + kind + "'",
                 std::to_string(rd) + (rotary_dim == -1 ? " (the head dimension)" : ""));
    for (std::size_t i = 0; i < blocks.size(); ++i)
      if (blocks[i] <= 0 || blocks[i] % multiple != 0)
        rome::fail(
            rome::Status::invalid_argument, "blocks[" + std::to_string(i) + "]",
            "a positive multiple of " + std::to_string(multiple) + " for a '" + kind + "' block",
            std::to_string(blocks[i]));
    if (!blocks.empty()) {
      int64_t sum = 0;
      std::string list = "[";
      for (std::size_t i = 0; i < blocks.size(); ++i) {
        sum += blocks[i];
        list += (i ? ", " : "") + std::to_string(blocks[i]);
      }
      if (sum != rd)
        rome::fail(rome::Status::invalid_argument, "blocks",
                   "block sizes summing to rotary_dim " + std::to_string(rd),
                   list + "] (sum " + std::to_string(sum) + ")");
    }
  }
  const bool cacheable = !dense || rd <= kMaxCachedDenseDim;
  auto same_shape = [&](const CacheEntry& e) {
    return e.kind == kind && e.rotary_dim == rd && e.head_dim == head_dim &&
           e.lane_offset == lane_offset && e.blocks == blocks && e.has_a == has_a;
  };
  if (cacheable && dense) {  // the matrices as given, compared in place
    std::lock_guard<std::mutex> lock(cache_mutex);
    for (auto it = cache.rbegin(); it != cache.rend(); ++it)
      if (same_shape(*it) && same_bytes(it->b_bytes, *mat_b) &&
          (!has_a || same_bytes(it->a_bytes, *mat_a)))
        return *it->rotation;
  }
  if (dense) {
    b = matrix_values(*mat_b, rd);
    if (has_a) a = matrix_values(*mat_a, rd);
  }
  if (cacheable) {  // the same values given another way (dtype, strides)
    std::lock_guard<std::mutex> lock(cache_mutex);
    for (auto it = cache.rbegin(); it != cache.rend(); ++it)
      if (same_shape(*it) && it->a == a && it->b == b) return *it->rotation;
  }
  rome::Rotation rotation = [&] {
    if (dense) {
      rome::Rotation r = has_a ? rome::Rotation::dense(a, b, rd) : rome::Rotation::dense(b, rd);
      return forced ? r.as_dense() : r;
    }
    if (blocks.size() <= 1) return named_rotation(kind, rd);
    std::vector<rome::Rotation> parts;
    parts.reserve(blocks.size());
    for (int64_t size : blocks) parts.push_back(named_rotation(kind, size));
    return rome::Rotation::block_diag(parts);
  }();
  if (rd < head_dim) rotation = rotation.partial(head_dim, lane_offset);
  if (cacheable) {
    std::lock_guard<std::mutex> lock(cache_mutex);
    if (cache.size() >= kCacheEntries) cache.erase(cache.begin());
    cache.push_back(CacheEntry{kind, blocks, rd, head_dim, lane_offset, has_a, std::move(a),
                               std::move(b), has_a ? bytes_of(*mat_a) : MatrixBytes{},
                               dense ? bytes_of(*mat_b) : MatrixBytes{}, rotation});
  }
  return rotation;
}

// ----------------------------------------------------------------------------------------------
// Tables

rome::TableWidth table_width(const std::string& width) {
  if (width == "full") return rome::TableWidth::full;
  if (width == "halves") return rome::TableWidth::halves;
  if (width == "pairs") return rome::TableWidth::pairs;
  rome::fail(rome::Status::invalid_argument, "table_width", "one of 'full', 'halves', 'pairs'",
             "'" + width + "'");
}

static Tensor drop_leading_ones(Tensor t, int64_t max_rank) {
  while (t.dim() > max_rank && t.dim() > 1 && t.size(0) == 1) t = t.squeeze(0);
  return t;
}

// Direct tables as the core sees them: leading size-1 axes past x's rank dropped, and cos/sin of
// different (broadcastable) shapes expanded to their common shape.
std::pair<Tensor, Tensor> effective_tables(const Tensor& cos, const Tensor& sin,
                                           c10::IntArrayRef x_sizes) {
  const int64_t x_rank = int64_t(x_sizes.size());
  Tensor c = drop_leading_ones(cos, x_rank), s = drop_leading_ones(sin, x_rank);
  if (c.sizes() != s.sizes()) {
    const int64_t rank = std::max(c.dim(), s.dim());
    std::vector<int64_t> shape(rank);
    for (int64_t i = 0; i < rank; ++i) {
      const int64_t ci = i - (rank - c.dim()), si = i - (rank - s.dim());
      const int64_t cs = ci >= 0 ? c.size(ci) : 1, ss = si >= 0 ? s.size(si) : 1;
      if (cs != ss && cs != 1 && ss != 1)
        rome::fail(rome::Status::invalid_argument, "sin",
                   "the shape of cos " + shape_of(cos) + " or one broadcastable with it",
                   shape_of(sin));
      shape[i] = cs == 1 ? ss : cs;
    }
    // The core sees the expanded pair and would name cos for either: name the one that fails.
    for (const auto& [name, t] : {std::pair<const char*, const Tensor*>{"cos", &c}, {"sin", &s}}) {
      bool ok = t->dim() <= x_rank;
      for (int64_t i = 0; ok && i + 1 < t->dim(); ++i) {
        const int64_t xs = x_sizes[x_rank - t->dim() + i], ts = t->size(i);
        ok = ts == 1 || ts == xs;
      }
      if (!ok)
        rome::fail(rome::Status::invalid_argument, name,
                   "a shape broadcastable to q " + shape_of_sizes(x_sizes),
                   shape_of(name[0] == 'c' ? cos : sin));
    }
    c = drop_leading_ones(c.expand(shape), x_rank);
    s = drop_leading_ones(s.expand(shape), x_rank);
  }
  return {c, s};
}

// positions as the core reads them, with leading axes of size 1 up to `rank`, added on the view
// itself (a torch view or unsqueeze costs about a microsecond, as much as a decode step).
static rome::ConstTensorView positions_view(const Tensor& positions, int rank) {
  rome::ConstTensorView view = const_view(positions, "positions", true);
  if (view.rank >= rank || rank > rome::kMaxRank) return view;
  const int add = rank - view.rank;
  for (int i = view.rank - 1; i >= 0; --i) {
    view.shape[i + add] = view.shape[i];
    view.strides[i + add] = view.strides[i];
  }
  for (int i = 0; i < add; ++i) {
    view.shape[i] = 1;
    view.strides[i] = 0;
  }
  view.rank = rank;
  return view;
}

PreparedTables prepare_tables(const Tensor& cos, const Tensor& sin,
                              const std::optional<Tensor>& positions, const std::string& width,
                              const std::vector<int64_t>& column_axis, c10::IntArrayRef x_sizes) {
  const int64_t x_rank = int64_t(x_sizes.size());
  PreparedTables p;
  p.tables.width = table_width(width);
  const bool cache_tables = positions.has_value() && positions->defined();
  if (cache_tables) {
    p.cos = cos;
    p.sin = sin;
    p.positions = *positions;
    p.tables.positions =
        positions_view(*positions, int(x_rank) - 1 + (column_axis.empty() ? 0 : 1));
  } else {
    std::tie(p.cos, p.sin) = effective_tables(cos, sin, x_sizes);
  }
  p.tables.cos = const_view(p.cos, "cos", false);
  p.tables.sin = const_view(p.sin, "sin", false);
  p.tables.column_axis.assign(column_axis.begin(), column_axis.end());
  return p;
}

std::vector<double> frequencies_of(const Tensor& inv_freq, const Tensor& positions) {
  if (inv_freq.dim() != 1 || !at::isFloatingType(inv_freq.scalar_type()))
    rome::fail(rome::Status::invalid_argument, "inv_freq",
               "a 1-D floating tensor (one frequency per lane pair)",
               std::string(c10::toString(inv_freq.scalar_type())) + " " + shape_of(inv_freq));
  if (inv_freq.device() != positions.device())
    rome::fail(rome::Status::invalid_argument, "inv_freq.device",
               positions.device().str() + " (the device of positions)", inv_freq.device().str());
  if (inv_freq.is_meta()) {  // no values (the Meta kernels check shapes only): any finite ones
    if (inv_freq.numel() == 0)
      rome::fail(rome::Status::invalid_argument, "inv_freq",
                 "at least one frequency (one per lane pair)", shape_of(inv_freq));
    return std::vector<double>(std::size_t(inv_freq.numel()), 1.0);
  }
  // Read in place when fp32/fp64 (a .to(kDouble) costs several microseconds: a decode step).
  auto widen = [&](const auto* f, int64_t step) {
    std::vector<double> out(std::size_t(inv_freq.numel()));
    for (std::size_t i = 0; i < out.size(); ++i) out[i] = double(f[int64_t(i) * step]);
    return out;
  };
  std::vector<double> frequencies;
  if (inv_freq.scalar_type() == at::kFloat) {
    frequencies = widen(inv_freq.data_ptr<float>(), inv_freq.stride(0));
  } else if (inv_freq.scalar_type() == at::kDouble) {
    frequencies = widen(inv_freq.data_ptr<double>(), inv_freq.stride(0));
  } else {
    const Tensor f = inv_freq.to(at::kDouble).contiguous();
    frequencies = widen(f.data_ptr<double>(), 1);
  }
  if (frequencies.empty())
    rome::fail(rome::Status::invalid_argument, "inv_freq",
               "at least one frequency (one per lane pair)", shape_of(inv_freq));
  return frequencies;
}

PreparedTables table_free_tables(const Tensor& positions, const Tensor& inv_freq, double amplitude,
                                 const std::vector<int64_t>& column_axis, c10::IntArrayRef x_sizes,
                                 bool inverse) {
  PreparedTables p;
  p.tables.frequencies = frequencies_of(inv_freq, positions);
  p.tables.amplitude = amplitude;
  p.tables.inverse = inverse;
  p.positions = positions;
  p.tables.positions =
      positions_view(positions, int(x_sizes.size()) - 1 + (column_axis.empty() ? 0 : 1));
  p.tables.column_axis.assign(column_axis.begin(), column_axis.end());
  return p;
}

}  // namespace rome_torch
