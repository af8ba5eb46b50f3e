// Test tensors: any dtype, logical shape and physical layout (axis order, padding, offset,
// negative strides), with storage pre-filled with NaN so untouched elements show.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "core/convert.hpp"
#include "rome/tensor.hpp"

namespace rome::testing {

inline double to_double(DType d, const void* p) {
  switch (d) {
    case DType::f32: return *static_cast<const float*>(p);
    case DType::f16: return detail::fp16_to_float(*static_cast<const std::uint16_t*>(p));
    case DType::bf16: return detail::bf16_to_float(*static_cast<const std::uint16_t*>(p));
    case DType::i32: return *static_cast<const std::int32_t*>(p);
    case DType::i64: return double(*static_cast<const std::int64_t*>(p));
  }
  return 0;
}

inline void from_double(DType d, void* p, double v) {
  switch (d) {
    case DType::f32: *static_cast<float*>(p) = float(v); break;
    case DType::f16: *static_cast<std::uint16_t*>(p) = detail::float_to_fp16(float(v)); break;
    case DType::bf16: *static_cast<std::uint16_t*>(p) = detail::float_to_bf16(float(v)); break;
    case DType::i32: *static_cast<std::int32_t*>(p) = std::int32_t(v); break;
    case DType::i64: *static_cast<std::int64_t*>(p) = std::int64_t(v); break;
  }
}

// How a tensor sits in memory. order lists logical axes from outermost to innermost physical
// axis (empty: row-major); pad adds unused elements after each physical row of the last axis
// group; flip negates the stride of one logical axis (-1: none); offset shifts the start.
struct Layout {
  std::vector<int> order;
  std::int64_t pad = 0;
  int flip = -1;
  std::int64_t offset = 0;
  std::int64_t pad_outer_rows = 0;  // extra head-sized rows per step of the outermost axis
};

struct TestTensor {
  DType dtype = DType::f32;
  std::vector<std::int64_t> shape, strides;
  std::int64_t base = 0;  // element offset of index 0 into storage
  std::vector<unsigned char> storage;

  static TestTensor make(DType dtype, std::vector<std::int64_t> shape, const Layout& layout = {}) {
    TestTensor t;
    t.dtype = dtype;
    t.shape = shape;
    const int rank = int(shape.size());
    std::vector<int> order = layout.order;
    if (order.empty())
      for (int i = 0; i < rank; ++i) order.push_back(i);
    t.strides.assign(rank, 0);
    std::int64_t stride = 1;
    for (int p = rank - 1; p >= 0; --p) {
      const int axis = order[p];
      t.strides[axis] = stride;
      stride *= shape[axis];
      if (p == rank - 1) stride += layout.pad;  // padding after each innermost row
      if (p == 1) stride += layout.pad_outer_rows * shape[rank - 1];
    }
    std::int64_t extent = 1;
    for (int i = 0; i < rank; ++i) extent += (shape[i] > 0 ? shape[i] - 1 : 0) * t.strides[i];
    t.base = layout.offset;
    if (layout.flip >= 0 && shape[layout.flip] > 1) {
      t.base += (shape[layout.flip] - 1) * t.strides[layout.flip];
      t.strides[layout.flip] = -t.strides[layout.flip];
    }
    t.storage.assign((extent + layout.offset + 1) * dtype_size(dtype), 0);
    t.fill_nan();
    return t;
  }

  void fill_nan() {
    const std::int64_t n = std::int64_t(storage.size()) / dtype_size(dtype);
    for (std::int64_t i = 0; i < n; ++i)
      from_double(dtype, storage.data() + i * dtype_size(dtype), std::nan(""));
  }

  std::int64_t numel() const {
    std::int64_t n = 1;
    for (auto s : shape) n *= s;
    return n;
  }
  std::int64_t offset_of(const std::vector<std::int64_t>& idx) const {
    std::int64_t o = base;
    for (std::size_t i = 0; i < idx.size(); ++i) o += idx[i] * strides[i];
    return o;
  }
  void* at(const std::vector<std::int64_t>& idx) {
    return storage.data() + offset_of(idx) * dtype_size(dtype);
  }
  const void* at(const std::vector<std::int64_t>& idx) const {
    return storage.data() + offset_of(idx) * dtype_size(dtype);
  }
  double get(const std::vector<std::int64_t>& idx) const { return to_double(dtype, at(idx)); }
  void set(const std::vector<std::int64_t>& idx, double v) { from_double(dtype, at(idx), v); }

  // The logical index after idx in row-major order (an odometer: whole-tensor loops then
  // allocate nothing per element, which under ASan cost more than the kernels they test).
  void next_index(std::vector<std::int64_t>& idx) const {
    for (int i = int(shape.size()) - 1; i >= 0; --i) {
      if (++idx[i] < shape[i]) return;
      idx[i] = 0;
    }
  }

  std::vector<std::int64_t> unravel(std::int64_t linear) const {
    std::vector<std::int64_t> idx(shape.size());
    for (int i = int(shape.size()) - 1; i >= 0; --i) {
      idx[i] = linear % shape[i];
      linear /= shape[i];
    }
    return idx;
  }

  // Every storage element outside the logical view still holds the NaN it was made with.
  bool outside_view_untouched() const {
    const std::int64_t es = dtype_size(dtype), n = std::int64_t(storage.size()) / es;
    std::vector<bool> inside(n, false);
    std::vector<std::int64_t> idx(shape.size(), 0);
    for (std::int64_t e = 0; e < numel(); ++e, next_index(idx)) inside[offset_of(idx)] = true;
    for (std::int64_t i = 0; i < n; ++i)
      if (!inside[i] && !std::isnan(to_double(dtype, storage.data() + i * es))) return false;
    return true;
  }

  template <typename F>
  void fill(F&& f) {
    std::vector<std::int64_t> idx(shape.size(), 0);
    for (std::int64_t e = 0; e < numel(); ++e, next_index(idx)) set(idx, f(std::as_const(idx)));
  }
  void fill_random(std::mt19937_64& rng, double lo, double hi) {
    std::uniform_real_distribution<double> u(lo, hi);
    fill([&](const auto&) { return u(rng); });
  }

  template <typename P>
  BasicView<P> view_as() const {
    BasicView<P> v;
    v.data = const_cast<unsigned char*>(storage.data()) + base * dtype_size(dtype);
    v.dtype = dtype;
    v.rank = int(shape.size());
    for (int i = 0; i < v.rank; ++i) {
      v.shape[i] = shape[i];
      v.strides[i] = strides[i];
    }
    return v;
  }
  ConstTensorView cview() const { return view_as<const void*>(); }
  TensorView view() { return view_as<void*>(); }
};

// Distance in units in the last place between two values of a float dtype (NaN = NaN is 0).
inline std::int64_t ulp_distance(DType dtype, double a, double b) {
  if (std::isnan(a) && std::isnan(b)) return 0;
  if (std::isnan(a) || std::isnan(b)) return std::int64_t(1) << 40;
  auto ordered = [&](double v) -> std::int64_t {
    std::int64_t bits;
    if (dtype == DType::f32) {
      std::int32_t b32;
      const float f = float(v);
      std::memcpy(&b32, &f, 4);
      bits = b32;
      return bits < 0 ? std::int64_t(INT32_MIN) - bits : bits;
    }
    const std::uint16_t h =
        dtype == DType::bf16 ? detail::float_to_bf16(float(v)) : detail::float_to_fp16(float(v));
    bits = std::int16_t(h);
    return bits < 0 ? std::int64_t(INT16_MIN) - bits : bits;
  };
  const std::int64_t d = ordered(a) - ordered(b);
  return d < 0 ? -d : d;
}

}  // namespace rome::testing
