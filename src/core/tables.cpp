#include "rome/tables.hpp"

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <numbers>
#include <sstream>
#include <string>

#include "convert.hpp"
#include "dispatch.hpp"
#include "rome/error.hpp"

namespace rome::tables {
namespace {

constexpr int64_t kInt64Max = std::numeric_limits<int64_t>::max();

std::string show(double value) {
  std::ostringstream out;
  out.precision(17);
  out << value;
  return out.str();
}

std::string show(std::span<const int64_t> values) {
  std::string text = "[";
  for (size_t i = 0; i < values.size(); ++i) {
    if (i > 0) text += ", ";
    text += std::to_string(values[i]);
  }
  return text + "]";
}

[[noreturn]] void bad(const std::string& argument, const std::string& expected,
                      const std::string& given) {
  fail(Status::invalid_argument, argument, expected, given);
}

void check_dim(int64_t dim, const std::string& argument) {
  if (dim <= 0 || dim % 2 != 0) bad(argument, "an even dimension > 0", std::to_string(dim));
}

void check_positive(double value, const std::string& argument) {
  if (!(value > 0.0) || !std::isfinite(value)) bad(argument, "a finite value > 0", show(value));
}

void check_finite(double value, const std::string& argument) {
  if (!std::isfinite(value)) bad(argument, "a finite value", show(value));
}

void check_count(int64_t count, const std::string& argument) {
  if (count < 0) bad(argument, "a count >= 0", std::to_string(count));
}

// Non-negative a * b, or an error naming `argument` when it does not fit in int64_t.
int64_t checked_product(int64_t a, int64_t b, const std::string& argument) {
  if (b != 0 && a > kInt64Max / b) {
    bad(argument, "a size that fits in int64", std::to_string(a) + " * " + std::to_string(b));
  }
  return a * b;
}

void check_inv_freq(std::span<const double> inv_freq) {
  if (inv_freq.empty()) bad("inv_freq", "at least one frequency", "an empty list");
  for (double f : inv_freq) check_finite(f, "inv_freq");
}

// One frequency of a table: its angle is position[axis] * inv_freq, and its cos/sin go to two
// lanes (the same lane twice for tables without duplication).
struct FrequencyLanes {
  int axis;
  double inv_freq;
  int64_t lane_a;
  int64_t lane_b;
};

struct Plan {
  int64_t width = 0;
  std::vector<FrequencyLanes> frequencies;
};

// Appends a block of 2 * inv_freq.size() lanes for `axis`, laid out as the rotation expects.
void append_block(Plan& plan, std::span<const double> inv_freq, int axis, Layout layout) {
  const auto n = static_cast<int64_t>(inv_freq.size());
  for (int64_t k = 0; k < n; ++k) {
    const int64_t a = layout == Layout::half ? k : 2 * k;
    const int64_t b = layout == Layout::half ? k + n : 2 * k + 1;
    plan.frequencies.push_back({axis, inv_freq[k], plan.width + a, plan.width + b});
  }
  plan.width += 2 * n;
}

// Positions of row r along axis a are data[r * row_stride + a * axis_stride].
struct PositionView {
  const int64_t* data;
  int64_t rows;
  int64_t row_stride;
  int64_t axis_stride;
};

// rows * width, or an error when it overflows or cannot be allocated as one vector.
int64_t checked_table_size(int64_t rows, int64_t width) {
  const int64_t size = checked_product(rows, width, "table size");
  if (static_cast<uint64_t>(size) > std::vector<float>().max_size()) {
    bad("table size", "at most " + std::to_string(std::vector<float>().max_size()) + " elements",
        std::to_string(size));
  }
  return size;
}

Table build(const Plan& plan, PositionView positions, double amplitude) {
  check_finite(amplitude, "amplitude");
  const int64_t size = checked_table_size(positions.rows, plan.width);
  Table table{positions.rows, plan.width, std::vector<float>(static_cast<size_t>(size)),
              std::vector<float>(static_cast<size_t>(size))};
  for (int64_t r = 0; r < positions.rows; ++r) {
    const int64_t* row = positions.data + r * positions.row_stride;
    float* cos_row = table.cos.data() + r * plan.width;
    float* sin_row = table.sin.data() + r * plan.width;
    for (const FrequencyLanes& f : plan.frequencies) {
      // Double angle and trig: float32 angles lose ~pos * 1e-7 rad, visible at long context.
      const double angle = static_cast<double>(row[f.axis * positions.axis_stride]) * f.inv_freq;
      const auto c = static_cast<float>(std::cos(angle) * amplitude);
      const auto s = static_cast<float>(std::sin(angle) * amplitude);
      cos_row[f.lane_a] = cos_row[f.lane_b] = c;
      sin_row[f.lane_a] = sin_row[f.lane_b] = s;
    }
  }
  return table;
}

std::vector<int64_t> iota_positions(int64_t count, const std::string& argument) {
  check_count(count, argument);
  std::vector<int64_t> positions(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) positions[static_cast<size_t>(i)] = i;
  return positions;
}

// transformers' get_mscale: YaRN's amplitude for a context stretched by `scale`.
double yarn_mscale(double scale, double mscale) {
  if (scale <= 1.0) return 1.0;
  return 0.1 * mscale * std::log(scale) + 1.0;
}

double yarn_amplitude(const Scaling& s) {
  if (s.attention_factor) {
    check_positive(*s.attention_factor, "scaling.attention_factor");
    return *s.attention_factor;
  }
  // transformers tests `if mscale and mscale_all_dim`, so 0 means "not set".
  if (s.mscale != 0.0 && s.mscale_all_dim != 0.0) {
    return yarn_mscale(s.factor, s.mscale) / yarn_mscale(s.factor, s.mscale_all_dim);
  }
  return yarn_mscale(s.factor, 1.0);
}

// transformers' find_correction_dim: the dimension whose wavelength makes `rotations` turns over
// the original context.
double yarn_correction_dim(double rotations, int64_t dim, double base, int64_t original_max) {
  return (static_cast<double>(dim) *
          std::log(static_cast<double>(original_max) / (rotations * 2.0 * std::numbers::pi))) /
         (2.0 * std::log(base));
}

std::vector<double> yarn_inv_freq(int64_t dim, double base, const Scaling& s) {
  check_positive(s.beta_fast, "scaling.beta_fast");
  check_positive(s.beta_slow, "scaling.beta_slow");
  if (base == 1.0) bad("theta", "a base != 1 for YaRN (its correction range divides by log)", "1");
  check_finite(s.mscale, "scaling.mscale");
  check_finite(s.mscale_all_dim, "scaling.mscale_all_dim");

  double low = yarn_correction_dim(s.beta_fast, dim, base, s.original_max_position_embeddings);
  double high = yarn_correction_dim(s.beta_slow, dim, base, s.original_max_position_embeddings);
  if (s.truncate) {
    low = std::floor(low);
    high = std::ceil(high);
  }
  low = std::max(low, 0.0);
  high = std::min(high, static_cast<double>(dim - 1));
  if (low == high) high += 0.001;  // as transformers: avoid a zero-width ramp

  const int64_t n = dim / 2;
  std::vector<double> inv_freq(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const double ramp = std::clamp((static_cast<double>(i) - low) / (high - low), 0.0, 1.0);
    const double extrapolation_weight = 1.0 - ramp;
    const double pos_freq = std::pow(base, static_cast<double>(2 * i) / static_cast<double>(dim));
    const double extrapolation = 1.0 / pos_freq;
    const double interpolation = 1.0 / (s.factor * pos_freq);
    inv_freq[static_cast<size_t>(i)] =
        interpolation * (1.0 - extrapolation_weight) + extrapolation * extrapolation_weight;
  }
  return inv_freq;
}

std::vector<double> llama3_inv_freq(int64_t dim, double theta, const Scaling& s) {
  check_positive(s.low_freq_factor, "scaling.low_freq_factor");
  check_positive(s.high_freq_factor, "scaling.high_freq_factor");
  if (!(s.high_freq_factor > s.low_freq_factor)) {
    bad("scaling.high_freq_factor", "a value > low_freq_factor (" + show(s.low_freq_factor) + ")",
        show(s.high_freq_factor));
  }
  const auto old_context = static_cast<double>(s.original_max_position_embeddings);
  const double low_freq_wavelen = old_context / s.low_freq_factor;
  const double high_freq_wavelen = old_context / s.high_freq_factor;
  std::vector<double> inv_freq = inverse_frequencies(dim, theta);
  for (double& f : inv_freq) {
    const double wavelen = 2.0 * std::numbers::pi / f;
    if (wavelen < high_freq_wavelen) continue;  // high frequencies: unchanged
    if (wavelen > low_freq_wavelen) {           // low frequencies: interpolated
      f /= s.factor;
      continue;
    }
    // In between: blend the two smoothly.
    const double smooth =
        (old_context / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
    f = (1.0 - smooth) * f / s.factor + smooth * f;
  }
  return inv_freq;
}

// Base of the NTK-aware schemes: theta * scale^(dim / (dim - 2)).
double ntk_base(int64_t dim, double theta, double scale) {
  if (dim <= 2) bad("dim", "an even dimension > 2 for NTK scaling", std::to_string(dim));
  return theta * std::pow(scale, static_cast<double>(dim) / static_cast<double>(dim - 2));
}

void check_axes(const Axes& axes) {
  if (axes.dims.empty()) bad("axes.dims", "at least one axis", "an empty list");
  if (axes.dims.size() > static_cast<size_t>(std::numeric_limits<int>::max())) {
    bad("axes.dims", "fewer axes", std::to_string(axes.dims.size()));
  }
  for (size_t a = 0; a < axes.dims.size(); ++a) {
    check_dim(axes.dims[a], "axes.dims[" + std::to_string(a) + "]");
  }
  if (axes.thetas.size() != 1 && axes.thetas.size() != axes.dims.size()) {
    bad("axes.thetas", "1 or " + std::to_string(axes.dims.size()) + " values",
        std::to_string(axes.thetas.size()) + " values");
  }
  for (size_t a = 0; a < axes.thetas.size(); ++a) {
    check_positive(axes.thetas[a], "axes.thetas[" + std::to_string(a) + "]");
  }
}

Plan axes_plan(const Axes& axes, Layout layout) {
  check_axes(axes);
  Plan plan;
  for (size_t a = 0; a < axes.dims.size(); ++a) {
    const double theta = axes.thetas.size() == 1 ? axes.thetas[0] : axes.thetas[a];
    append_block(plan, inverse_frequencies(axes.dims[a], theta), static_cast<int>(a), layout);
  }
  return plan;
}

void check_sections(std::span<const int64_t> sections, Mrope mode) {
  if (sections.empty()) bad("sections", "at least one section", "an empty list");
  if (mode == Mrope::interleaved && sections.size() != 3) {
    bad("sections", "3 sections (t, h, w) for interleaved MRoPE", show(sections));
  }
  int64_t total = 0;
  for (int64_t s : sections) {
    if (s < 0 || s > kInt64Max / 4 - total) bad("sections", "sizes >= 0", show(sections));
    total += s;
  }
  if (total == 0) bad("sections", "a sum > 0 (head_dim / 2)", show(sections));
}

}  // namespace

// ---------------------------------------------------------------------------------------------

std::vector<double> inverse_frequencies(int64_t dim, double theta) {
  check_dim(dim, "dim");
  check_positive(theta, "theta");
  std::vector<double> inv_freq(static_cast<size_t>(dim / 2));
  for (int64_t i = 0; i < dim / 2; ++i) {
    inv_freq[static_cast<size_t>(i)] =
        1.0 / std::pow(theta, static_cast<double>(2 * i) / static_cast<double>(dim));
  }
  return inv_freq;
}

Scaling Scaling::linear(double factor) {
  Scaling s;
  s.kind = Kind::linear;
  s.factor = factor;
  return s;
}

Scaling Scaling::dynamic_ntk(double factor, int64_t max_position_embeddings, int64_t seq_len) {
  Scaling s;
  s.kind = Kind::dynamic_ntk;
  s.factor = factor;
  s.original_max_position_embeddings = max_position_embeddings;
  s.seq_len = seq_len;
  return s;
}

Scaling Scaling::ntk(double factor) {
  Scaling s;
  s.kind = Kind::ntk;
  s.factor = factor;
  return s;
}

Scaling Scaling::yarn(double factor, int64_t original_max_position_embeddings) {
  Scaling s;
  s.kind = Kind::yarn;
  s.factor = factor;
  s.original_max_position_embeddings = original_max_position_embeddings;
  return s;
}

Scaling Scaling::llama3(double factor, int64_t original_max_position_embeddings,
                        double low_freq_factor, double high_freq_factor) {
  Scaling s;
  s.kind = Kind::llama3;
  s.factor = factor;
  s.original_max_position_embeddings = original_max_position_embeddings;
  s.low_freq_factor = low_freq_factor;
  s.high_freq_factor = high_freq_factor;
  return s;
}

Frequencies scaled_frequencies(int64_t dim, double theta, const Scaling& scaling) {
  check_dim(dim, "dim");
  check_positive(theta, "theta");
  if (scaling.kind == Scaling::Kind::none) return {inverse_frequencies(dim, theta), 1.0};
  check_positive(scaling.factor, "scaling.factor");
  const bool uses_original = scaling.kind == Scaling::Kind::dynamic_ntk ||
                             scaling.kind == Scaling::Kind::yarn ||
                             scaling.kind == Scaling::Kind::llama3;
  if (uses_original && scaling.original_max_position_embeddings <= 0) {
    bad("scaling.original_max_position_embeddings", "a length > 0",
        std::to_string(scaling.original_max_position_embeddings));
  }

  switch (scaling.kind) {
    case Scaling::Kind::none: break;
    case Scaling::Kind::linear: {
      std::vector<double> inv_freq = inverse_frequencies(dim, theta);
      for (double& f : inv_freq) f /= scaling.factor;
      return {std::move(inv_freq), 1.0};
    }
    case Scaling::Kind::ntk:
      return {inverse_frequencies(dim, ntk_base(dim, theta, scaling.factor)), 1.0};
    case Scaling::Kind::dynamic_ntk: {
      check_count(scaling.seq_len, "scaling.seq_len");
      // Shorter sequences than the model's length keep the original base.
      const auto max_len = static_cast<double>(scaling.original_max_position_embeddings);
      const double seq_len = std::max(static_cast<double>(scaling.seq_len), max_len);
      const double scale = scaling.factor * seq_len / max_len - (scaling.factor - 1.0);
      return {inverse_frequencies(dim, ntk_base(dim, theta, scale)), 1.0};
    }
    case Scaling::Kind::yarn: {
      const double amplitude = yarn_amplitude(scaling);
      return {yarn_inv_freq(dim, theta, scaling), amplitude};
    }
    case Scaling::Kind::llama3: return {llama3_inv_freq(dim, theta, scaling), 1.0};
  }
  bad("scaling.kind", "a known scaling kind", std::to_string(static_cast<int>(scaling.kind)));
}

// ---------------------------------------------------------------------------------------------

Table rope_table(std::span<const int64_t> positions, std::span<const double> inv_freq,
                 Layout layout, double amplitude) {
  check_inv_freq(inv_freq);
  Plan plan;
  append_block(plan, inv_freq, 0, layout);
  return build(plan, {positions.data(), static_cast<int64_t>(positions.size()), 1, 0}, amplitude);
}

Table rope_table(int64_t num_positions, std::span<const double> inv_freq, Layout layout,
                 double amplitude) {
  check_count(num_positions, "num_positions");
  check_inv_freq(inv_freq);
  checked_table_size(num_positions, 2 * static_cast<int64_t>(inv_freq.size()));
  const std::vector<int64_t> positions = iota_positions(num_positions, "num_positions");
  return rope_table(positions, inv_freq, layout, amplitude);
}

Table frequency_table(int64_t num_positions, std::span<const double> inv_freq, double amplitude) {
  check_count(num_positions, "num_positions");
  check_inv_freq(inv_freq);
  checked_table_size(num_positions, static_cast<int64_t>(inv_freq.size()));
  const std::vector<int64_t> positions = iota_positions(num_positions, "num_positions");
  Plan plan;
  for (size_t k = 0; k < inv_freq.size(); ++k) {
    const auto lane = static_cast<int64_t>(k);
    plan.frequencies.push_back({0, inv_freq[k], lane, lane});
  }
  plan.width = static_cast<int64_t>(inv_freq.size());
  return build(plan, {positions.data(), num_positions, 1, 0}, amplitude);
}

CosSinCache cos_sin_cache(int64_t max_positions, std::span<const double> inv_freq,
                          double amplitude) {
  check_count(max_positions, "max_positions");
  const Table half = frequency_table(max_positions, inv_freq, amplitude);
  const int64_t width = checked_product(half.width, 2, "cos_sin_cache width");
  CosSinCache cache{half.rows, width, {}};
  cache.data.resize(static_cast<size_t>(checked_product(half.rows, width, "cos_sin_cache size")));
  for (int64_t r = 0; r < half.rows; ++r) {
    const auto src = half.cos.begin() + r * half.width;
    const auto dst = cache.data.begin() + r * width;
    std::copy(src, src + half.width, dst);
    std::copy(half.sin.begin() + r * half.width, half.sin.begin() + (r + 1) * half.width,
              dst + half.width);
  }
  return cache;
}

// ---------------------------------------------------------------------------------------------

Table grid_table(const Axes& axes, std::span<const int64_t> sizes, Layout layout,
                 std::span<const int64_t> starts) {
  const Plan plan = axes_plan(axes, layout);
  const auto n_axes = static_cast<int64_t>(axes.dims.size());
  if (static_cast<int64_t>(sizes.size()) != n_axes) {
    bad("sizes", std::to_string(n_axes) + " sizes (one per axis)", show(sizes));
  }
  if (!starts.empty() && static_cast<int64_t>(starts.size()) != n_axes) {
    bad("starts", "none or " + std::to_string(n_axes) + " starts (one per axis)", show(starts));
  }
  int64_t rows = 1;
  for (int64_t a = 0; a < n_axes; ++a) {
    if (sizes[a] <= 0) bad("sizes", "every size > 0 (a non-empty grid)", show(sizes));
    const int64_t start = starts.empty() ? 0 : starts[a];
    if (start > kInt64Max - sizes[a]) bad("starts", "positions that fit in int64", show(starts));
    rows = checked_product(rows, sizes[a], "grid size");
  }
  checked_table_size(rows, plan.width);  // fail before allocating the positions

  // Row-major coordinates: the last axis runs fastest.
  std::vector<int64_t> positions(static_cast<size_t>(checked_product(rows, n_axes, "grid size")));
  std::vector<int64_t> coord(static_cast<size_t>(n_axes), 0);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t a = 0; a < n_axes; ++a) {
      positions[static_cast<size_t>(r * n_axes + a)] = (starts.empty() ? 0 : starts[a]) + coord[a];
    }
    for (int64_t a = n_axes - 1; a >= 0; --a) {
      if (++coord[a] < sizes[a]) break;
      coord[a] = 0;
    }
  }
  return build(plan, {positions.data(), rows, n_axes, 1}, 1.0);
}

Table axes_table(const Axes& axes, std::span<const int64_t> positions, Layout layout) {
  const Plan plan = axes_plan(axes, layout);
  const auto n_axes = static_cast<int64_t>(axes.dims.size());
  const auto count = static_cast<int64_t>(positions.size());
  if (count % n_axes != 0) {
    bad("positions", "[n_tokens][" + std::to_string(n_axes) + "] values",
        std::to_string(count) + " values");
  }
  return build(plan, {positions.data(), count / n_axes, n_axes, 1}, 1.0);
}

// ---------------------------------------------------------------------------------------------

std::vector<int> mrope_frequency_axis(std::span<const int64_t> sections, Mrope mode) {
  check_sections(sections, mode);
  int64_t total = 0;
  for (int64_t s : sections) total += s;
  std::vector<int> axis(static_cast<size_t>(total), 0);
  if (mode == Mrope::sectioned) {
    // Qwen2-VL: freq.split(mrope_section) and chunk i takes axis i % 3.
    size_t k = 0;
    for (size_t i = 0; i < sections.size(); ++i) {
      for (int64_t j = 0; j < sections[i]; ++j) axis[k++] = static_cast<int>(i % 3);
    }
    return axis;
  }
  // Qwen3-VL: start from t, then overwrite h at slice(1, 3*sections[1], 3) and w at
  // slice(2, 3*sections[2], 3); slices stop at the end like Python's.
  for (int a = 1; a <= 2; ++a) {
    const int64_t end = std::min(3 * sections[static_cast<size_t>(a)], total);
    for (int64_t k = a; k < end; k += 3) axis[static_cast<size_t>(k)] = a;
  }
  return axis;
}

std::vector<int> mrope_column_axis(std::span<const int64_t> sections, Mrope mode) {
  std::vector<int> axis = mrope_frequency_axis(sections, mode);
  const size_t n = axis.size();
  axis.resize(2 * n);
  std::copy_n(axis.begin(), n, axis.begin() + static_cast<std::ptrdiff_t>(n));
  return axis;
}

Table mrope_table(std::span<const int64_t> positions, std::span<const double> inv_freq,
                  std::span<const int64_t> sections, Mrope mode, double amplitude) {
  check_inv_freq(inv_freq);
  const std::vector<int> axis = mrope_frequency_axis(sections, mode);
  if (axis.size() != inv_freq.size()) {
    bad("sections", "sizes summing to " + std::to_string(inv_freq.size()) + " (head_dim / 2)",
        show(sections));
  }
  const auto count = static_cast<int64_t>(positions.size());
  if (count % 3 != 0) {
    bad("positions", "[3][T] values (t, h, w rows)", std::to_string(count) + " values");
  }
  const int64_t tokens = count / 3;
  Plan plan;
  append_block(plan, inv_freq, 0, Layout::half);
  for (size_t k = 0; k < axis.size(); ++k) plan.frequencies[k].axis = axis[k];
  return build(plan, {positions.data(), tokens, 1, tokens}, amplitude);
}

// ---------------------------------------------------------------------------------------------

// The public conversions are the ones every kernel uses (src/core/convert.hpp), so the
// exhaustive conversion tests cover the kernels too.
uint16_t bf16_bits(float value) noexcept {
  return detail::float_to_bf16(value);
}
uint16_t fp16_bits(float value) noexcept {
  return detail::float_to_fp16(value);
}
float float_from_bf16_bits(uint16_t bits) noexcept {
  return detail::bf16_to_float(bits);
}
float float_from_fp16_bits(uint16_t bits) noexcept {
  return detail::fp16_to_float(bits);
}

// Through the active ISA's kernel: the table-free builder narrows every row it writes.
void to_bf16_bits(std::span<const float> values, uint16_t* out) noexcept {
  detail::active_kernels().narrow_bf16(std::int64_t(values.size()), values.data(), out);
}

void to_fp16_bits(std::span<const float> values, uint16_t* out) noexcept {
  for (std::size_t i = 0; i < values.size(); ++i) out[i] = detail::float_to_fp16(values[i]);
}

std::vector<uint16_t> to_bf16_bits(std::span<const float> values) {
  std::vector<uint16_t> out(values.size());
  to_bf16_bits(values, out.data());
  return out;
}

std::vector<uint16_t> to_fp16_bits(std::span<const float> values) {
  std::vector<uint16_t> out(values.size());
  to_fp16_bits(values, out.data());
  return out;
}

}  // namespace rome::tables
