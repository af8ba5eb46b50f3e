// rome::exact_cos_sin_rows: table-free RoPE's cos/sin written out as table rows.
#include <algorithm>
#include <string>
#include <vector>

#include "dispatch.hpp"
#include "plan.hpp"
#include "rome/error.hpp"
#include "rome/rope.hpp"

namespace rome {

void exact_cos_sin_rows(std::span<const std::int64_t> positions,
                        std::span<const double> frequencies, double amplitude, bool pairs_layout,
                        float* cos, float* sin) {
  const std::int64_t n = std::int64_t(frequencies.size());
  if (n == 0) fail(Status::invalid_argument, "frequencies", "at least one frequency", "none");
  const double largest =
      detail::check_frequency_values(frequencies, amplitude, "frequencies", "amplitude");
  for (std::size_t r = 0; r < positions.size(); ++r)
    if (!detail::angle_in_range(positions[r], largest))
      detail::fail_angle(positions[r], largest, "index " + std::to_string(r));
  if (positions.empty() || !cos || !sin) return;  // null outputs: validation only
  const kernels::CosSinFn kernel = detail::active_kernels().cos_sin;
  if (!pairs_layout && n % 8 == 0) {
    // Half layout in whole vectors (8 divides n: a multiple of every ISA's lanes): the kernel
    // writes each row's first half in place and one copy makes the second, instead of staging
    // rows and copying both halves (the copies cost a third of the kernel's time).
    thread_local std::vector<double> row_position;
    if (row_position.size() < std::size_t(n)) row_position.resize(std::size_t(n));
    for (std::size_t r = 0; r < positions.size(); ++r) {
      std::fill(row_position.begin(), row_position.begin() + n, double(positions[r]));
      float* co = cos + std::int64_t(r) * 2 * n;
      float* so = sin + std::int64_t(r) * 2 * n;
      kernel(n, row_position.data(), frequencies.data(), amplitude, co, so);
      std::copy(co, co + n, co + n);
      std::copy(so, so + n, so + n);
    }
    return;
  }
  // A few rows per kernel call: positions repeated per frequency, frequencies per row. Buffers
  // for no more rows than there are (one decode position: n of each, not 32·n).
  constexpr std::int64_t kMaxRows = 32;
  const std::int64_t rows = std::int64_t(positions.size());
  const std::int64_t block_rows = std::min(kMaxRows, rows);
  // Per thread, reused: callers pass a few rows at a time, and four fresh buffers a call cost
  // about as much as the rows' cos/sin.
  thread_local std::vector<double> p, f;
  thread_local std::vector<float> c, s;
  const std::size_t size = std::size_t(block_rows * n);
  if (p.size() < size) {
    p.resize(size);
    f.resize(size);
    c.resize(size);
    s.resize(size);
  }
  for (std::int64_t r = 0; r < block_rows; ++r)
    std::copy(frequencies.begin(), frequencies.end(), f.begin() + r * n);
  for (std::int64_t r0 = 0; r0 < rows; r0 += block_rows) {
    const std::int64_t m = std::min(block_rows, rows - r0);
    for (std::int64_t r = 0; r < m; ++r)
      std::fill(p.begin() + r * n, p.begin() + (r + 1) * n, double(positions[r0 + r]));
    kernel(m * n, p.data(), f.data(), amplitude, c.data(), s.data());
    for (std::int64_t r = 0; r < m; ++r) {
      const float* cr = c.data() + r * n;
      const float* sr = s.data() + r * n;
      float* co = cos + (r0 + r) * 2 * n;
      float* so = sin + (r0 + r) * 2 * n;
      if (pairs_layout) {
        for (std::int64_t i = 0; i < n; ++i) {
          co[2 * i] = co[2 * i + 1] = cr[i];
          so[2 * i] = so[2 * i + 1] = sr[i];
        }
      } else {
        std::copy(cr, cr + n, co);
        std::copy(cr, cr + n, co + n);
        std::copy(sr, sr + n, so);
        std::copy(sr, sr + n, so + n);
      }
    }
  }
}

}  // namespace rome
