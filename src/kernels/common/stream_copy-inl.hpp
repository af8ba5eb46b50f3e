// KernelTable::stream_copy, written once over an ISA's traits (permute-inl.hpp's I::copy_bytes,
// which streams to a destination aligned to the ISA's vector): the bytes before dst's first
// 64-byte boundary plain, the rest through copy_bytes. The full-width vector stores matter: 16-byte
// non-temporal stores of SSE2 copied 7-15% slower on the Zen 3 VM of BENCHMARKS.md.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>

namespace rome::kernels {
namespace {

template <class I>
void stream_copy_with(void* dst, const void* src, std::size_t n) {
  auto* d = static_cast<char*>(dst);
  const auto* s = static_cast<const char*>(src);
  const std::size_t head = std::min(n, std::size_t(-reinterpret_cast<std::uintptr_t>(d) & 63));
  std::memcpy(d, s, head);
  I::copy_bytes(d + head, s + head, std::int64_t(n - head), true);
}

}  // namespace
}  // namespace rome::kernels
