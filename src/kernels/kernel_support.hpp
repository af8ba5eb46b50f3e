// Portable helpers shared by the SIMD kernels: scratch buffers, the rows of a tile.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <new>

#include "kernel_api.hpp"

#define ROME_INLINE inline __attribute__((always_inline))
// A lambda always inlined, as ROME_INLINE functions are (row bodies).
#define ROME_INLINE_LAMBDA __attribute__((always_inline))

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

// Whether the tile's token runs follow each other in memory without gaps (a step of 0: one run
// walked along its rows). The same for every token of a tile.
ROME_INLINE bool token_runs_adjoin(const ForwardTile& tile) {
  return tile.x_token_step == 0 || tile.x_token_step == tile.count * tile.x_step;
}

// How far ahead of a row its x bytes are asked for. Where a tile's tokens follow each other
// without gaps, 4 KiB further along the rows (one core stalled on x's loads with only the
// hardware prefetchers; AVX-512 permute kernel, seed tensor in place, 1 thread: 32.2 -> 27.7 ms;
// BENCHMARKS.md). Else the same head of the token about 16 rows later: 4 KiB further along a
// packed qkv token lands on its v heads, which nobody reads, and when BNSD tiles went token by
// token over all their heads, 4 KiB (16 tokens) along each head was 384 rows ahead, evicted from
// L1 before they were read (3D 44/44/40 in place, 1 thread: 1.90-2.03x the copy, one token ahead
// 1.33-1.69x). Head-major tiles of 4 heads per call ask 4 tokens ahead along each head.
// The permute kernels prefetch into L2 (prefetcht1): into L1 the prefetches hold L1's few miss
// buffers. Where the hardware prefetchers lose the stream they did not help: on an AVX-512 Zen 4,
// rows of 8 KiB with 2 KiB between them (packed qkv's q and k around v; any gap of 512 bytes or
// more) read at half the contiguous speed, with prefetcht0 one token ahead just as slowly and
// with prefetcht1 at 0.6x that time. Paired, packed qkv T 28800, q 24 + k 8 heads, 1 thread:
// 0.58x the time in place and 0.71x out of place (0.66x / 0.72x for the AVX2 kernels on the same
// CPU); BSND and BNSD 0.95-1.02x. The QK-norm rows, read twice (sum of squares, then the
// rotation), prefetch into L2 only where runs lie apart (norm_rope-inl.hpp: norm_rows). The
// distance is the same for every token of a tile.
ROME_INLINE std::int64_t prefetch_distance(const ForwardTile& tile) {
  constexpr std::int64_t kBytes = 4096, kRows = 16;
  const std::int64_t step = tile.x_token_step;
  if (token_runs_adjoin(tile)) return tile.x_step < 0 ? -kBytes : kBytes;
  const std::int64_t count = tile.count > 1 ? tile.count : 1;
  return step * ((kRows + count - 1) / count);
}

// One row of a tile as storage type T: its x, y and table rows (signs folded in, padded to
// whole vectors).
template <typename T>
struct TileRow {
  const T* x;
  T* y;
  const float* C;
  const float* S;
};

template <typename T>
ROME_INLINE TileRow<T> tile_row(const ForwardTile& tile, std::int64_t n) {
  return {static_cast<const T*>(tile.x_row(n)), static_cast<T*>(tile.y_row(n)), tile.cos_row(n),
          tile.sin_row(n)};
}

}  // namespace rome::kernels
