// Index walking shared by the forward and backward executors.
#pragma once

#include <algorithm>
#include <cstdint>

#include "plan.hpp"

namespace rome::detail {

constexpr int kRowBatch = 64;  // rows per batch of the dense backward

inline void unravel(std::int64_t index, const std::int64_t* size, int count, std::int64_t* out) {
  for (int i = count - 1; i >= 0; --i) {
    out[i] = index % size[i];
    index /= size[i];
  }
}

// Calls f(in_offset, out_offset) (elements) for inner rows [begin, end) in row-major order.
template <typename F>
void walk_rows(const InnerAxes& axes, std::int64_t begin, std::int64_t end, F&& f) {
  if (begin >= end) return;  // also keeps unravel away from axes of size 0
  std::int64_t idx[kMaxRank] = {};
  unravel(begin, axes.size, axes.count, idx);
  std::int64_t in = 0, out = 0;
  for (int i = 0; i < axes.count; ++i) {
    in += idx[i] * axes.in_stride[i];
    out += idx[i] * axes.out_stride[i];
  }
  for (std::int64_t r = begin; r < end; ++r) {
    f(in, out);
    for (int i = axes.count - 1; i >= 0; --i) {
      in += axes.in_stride[i];
      out += axes.out_stride[i];
      if (++idx[i] < axes.size[i]) break;
      in -= axes.in_stride[i] * axes.size[i];
      out -= axes.out_stride[i] * axes.size[i];
      idx[i] = 0;
    }
  }
}

// Calls f(in_offset, out_offset, length) for inner rows [begin, end) in row-major order, one call
// per run of rows along the innermost axis (consecutive rows `in_stride[count-1]` apart).
template <typename F>
void walk_runs(const InnerAxes& axes, std::int64_t begin, std::int64_t end, F&& f) {
  if (axes.count == 0) {
    if (begin < end) f(std::int64_t(0), std::int64_t(0), end - begin);
    return;
  }
  const int last = axes.count - 1;
  std::int64_t idx[kMaxRank] = {};
  for (std::int64_t r = begin; r < end;) {
    unravel(r, axes.size, axes.count, idx);
    std::int64_t in = 0, out = 0;
    for (int i = 0; i < axes.count; ++i) {
      in += idx[i] * axes.in_stride[i];
      out += idx[i] * axes.out_stride[i];
    }
    const std::int64_t length = std::min(axes.size[last] - idx[last], end - r);
    f(in, out, length);
    r += length;
  }
}

}  // namespace rome::detail
