// Strided tensor views: the only way data crosses RoME's public API.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>

namespace rome {

enum class DType : std::uint8_t { f32, f16, bf16, i32, i64 };

constexpr int dtype_size(DType dtype) noexcept {
  return dtype == DType::f32 || dtype == DType::i32 ? 4 : dtype == DType::i64 ? 8 : 2;
}
const char* dtype_name(DType dtype) noexcept;
constexpr bool is_floating(DType dtype) noexcept {
  return dtype == DType::f32 || dtype == DType::f16 || dtype == DType::bf16;
}

constexpr int kMaxRank = 5;

// A non-owning view. Strides count elements (not bytes) and may be zero or negative;
// RoME validates them before use.
template <typename Pointer>
struct BasicView {
  Pointer data = nullptr;
  DType dtype = DType::f32;
  int rank = 0;
  std::int64_t shape[kMaxRank] = {};
  std::int64_t strides[kMaxRank] = {};

  bool empty_view() const noexcept { return data == nullptr && rank == 0; }
  std::int64_t numel() const noexcept {
    std::int64_t n = 1;
    for (int i = 0; i < rank; ++i) n *= shape[i];
    return n;
  }
};

using TensorView = BasicView<void*>;
using ConstTensorView = BasicView<const void*>;

inline ConstTensorView as_const(const TensorView& v) noexcept {
  ConstTensorView c;
  c.data = v.data;
  c.dtype = v.dtype;
  c.rank = v.rank;
  for (int i = 0; i < kMaxRank; ++i) {
    c.shape[i] = v.shape[i];
    c.strides[i] = v.strides[i];
  }
  return c;
}

// Builds a view; strides default to row-major contiguous.
template <typename Pointer>
BasicView<Pointer> make_view(Pointer data, DType dtype, std::initializer_list<std::int64_t> shape,
                             std::initializer_list<std::int64_t> strides = {}) {
  BasicView<Pointer> v;
  v.data = data;
  v.dtype = dtype;
  v.rank = static_cast<int>(shape.size());
  int i = 0;
  for (auto s : shape) v.shape[i++] = s;
  if (strides.size() == shape.size()) {
    i = 0;
    for (auto s : strides) v.strides[i++] = s;
  } else {
    std::int64_t stride = 1;
    for (int d = v.rank - 1; d >= 0; --d) {
      v.strides[d] = stride;
      stride *= v.shape[d];
    }
  }
  return v;
}

// "[2, 8, 16, 64]", used in error messages.
template <typename Pointer>
std::string shape_string(const BasicView<Pointer>& v) {
  std::string s = "[";
  for (int i = 0; i < v.rank; ++i) s += (i ? ", " : "") + std::to_string(v.shape[i]);
  return s + "]";
}

}  // namespace rome
