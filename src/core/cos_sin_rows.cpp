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
  const kernels::KernelTable& kernels = detail::active_kernels();
  // The rows kernel a block of positions at a time (converted to double once). Half layout: it
  // writes each row's two halves in place; pairs: rows of n values, then each value twice.
  constexpr std::size_t kBlock = 64;
  double block[kBlock];
  thread_local std::vector<float> c, s;  // pairs only; per thread, reused
  if (pairs_layout && c.size() < kBlock * std::size_t(n)) {
    c.resize(kBlock * std::size_t(n));
    s.resize(kBlock * std::size_t(n));
  }
  for (std::size_t r0 = 0; r0 < positions.size(); r0 += kBlock) {
    const std::int64_t m = std::int64_t(std::min(kBlock, positions.size() - r0));
    for (std::int64_t r = 0; r < m; ++r) block[r] = double(positions[r0 + r]);
    float* const co = cos + std::int64_t(r0) * 2 * n;
    float* const so = sin + std::int64_t(r0) * 2 * n;
    if (!pairs_layout) {
      kernels.cos_sin_rows(m, block, n, frequencies.data(), amplitude, true, nullptr, nullptr,
                           2 * n, co, so);
      continue;
    }
    kernels.cos_sin_rows(m, block, n, frequencies.data(), amplitude, false, nullptr, nullptr, n,
                         c.data(), s.data());
    for (std::int64_t e = 0; e < m * n; ++e) {
      co[2 * e] = co[2 * e + 1] = c[std::size_t(e)];
      so[2 * e] = so[2 * e + 1] = s[std::size_t(e)];
    }
  }
}

}  // namespace rome
