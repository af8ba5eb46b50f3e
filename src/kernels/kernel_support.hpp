// Portable helpers shared by the SIMD kernels: scratch buffers and the estimate of how large the
// tensor behind a batch is (prefetching and non-temporal stores only pay on large tensors).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <new>

#include "kernel_api.hpp"

#define ROME_INLINE inline __attribute__((always_inline))

namespace rome::kernels {

// Grows on demand and never shrinks: no allocation in the hot path once warm.
class Scratch {
 public:
  Scratch() = default;
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  ~Scratch() { std::free(data_); }
  void* get(std::size_t bytes) {
    if (bytes > size_) {
      std::free(data_);
      data_ = nullptr;
      size_ = 0;
      const std::size_t rounded = (bytes + 63) / 64 * 64;
      data_ = std::aligned_alloc(64, rounded);
      if (!data_) throw std::bad_alloc();
      size_ = rounded;
    }
    return data_;
  }

 private:
  void* data_ = nullptr;
  std::size_t size_ = 0;
};

// Streaming: how large is the tensor this batch belongs to? The kernel sees one batch, so it
// estimates: the spread of the batch's rows, or the length of a run of batches each starting
// where an earlier one ended (per thread, a few runs at once: q and k alternate).

constexpr std::int64_t kPrefetchExtent = std::int64_t(1) << 20;  // bytes
constexpr std::int64_t kStreamExtent = std::int64_t(4) << 20;
// How far ahead to prefetch, in rows: rows of one batch far apart (one stream per head, the next
// token a row further on), rows of one batch contiguous (hardware prefetchers follow, a little
// help further ahead).
constexpr std::int64_t kPrefetchRows = 4, kPrefetchRowsContiguous = 16;

struct Traffic {
  bool prefetch = false;    // prefetch the next table rows
  bool contiguous = false;  // the batch's rows follow each other
  bool stream = false;
};

// Runs of contiguous batches seen by this thread (q and k alternate, so a few at once).
struct Runs {
  struct Run {
    std::uintptr_t next = 0;
    std::int64_t bytes = 0;
  };
  Run run[4];
  unsigned victim = 0;
};

ROME_INLINE Traffic estimate_traffic(const ForwardBatch& b, std::int64_t row_bytes, Runs& runs) {
  const auto first = reinterpret_cast<std::uintptr_t>(b.rows[0].y);
  const auto last = reinterpret_cast<std::uintptr_t>(b.rows[b.count - 1].y);
  std::int64_t extent;
  const bool contiguous = last == first + std::uintptr_t((b.count - 1) * row_bytes);
  if (contiguous) {
    Runs::Run* run = nullptr;
    for (Runs::Run& r : runs.run)
      if (r.next == first && r.bytes > 0) run = &r;
    if (!run) {
      run = &runs.run[runs.victim++ % 4];
      run->bytes = 0;
    }
    run->bytes += b.count * row_bytes;
    run->next = last + std::uintptr_t(row_bytes);
    extent = run->bytes;
  } else {
    extent = std::int64_t(last > first ? last - first : first - last) + row_bytes;
  }
  const bool large = extent >= kPrefetchExtent;
  return {large, contiguous, extent >= kStreamExtent};
}

}  // namespace rome::kernels
