// The copy floor both benchmark programs compare RoME with: memcpy of every input byte to its
// output plus a read pass over the table bytes the call reads, cut into `threads` cache-line
// aligned pieces run on RoME's own thread pool. The streaming form copies with non-temporal
// stores instead (detail::stream_copy): glibc switches to them only above its
// x86_non_temporal_threshold (192 MB on the Zen 3 VM of BENCHMARKS.md, from the 256 MB of shared
// cache the VM reports), so below that memcpy reads every destination line before writing it, and
// a floor the hardware beats flatters RoME.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "core/dispatch.hpp"
#include "core/thread_pool.hpp"

namespace rome::bench {

struct CopyJob {
  struct Span {
    const char* src;
    char* dst;  // nullptr: read only
    std::size_t bytes;
  };
  std::vector<Span> spans;

  std::size_t bytes() const {
    std::size_t total = 0;
    for (const Span& s : spans) total += s.bytes;
    return total;
  }
};

// Read-only spans fold into this, so the compiler cannot drop the reads.
inline std::uint64_t copy_sink = 0;

inline void copy_piece(const CopyJob& job, std::size_t begin, std::size_t end,
                       bool stream = false) {
  std::uint64_t acc = 0;
  std::size_t at = 0;
  for (const CopyJob::Span& s : job.spans) {
    const std::size_t lo = std::max(begin, at), hi = std::min(end, at + s.bytes);
    if (lo < hi) {
      const char* src = s.src + (lo - at);
      if (s.dst) {
        if (stream)
          rome::detail::stream_copy(s.dst + (lo - at), src, hi - lo);
        else
          std::memcpy(s.dst + (lo - at), src, hi - lo);
      } else {
        const auto* w = reinterpret_cast<const std::uint64_t*>(src);
        std::uint64_t a0 = 0, a1 = 0, a2 = 0, a3 = 0;
        const std::size_t words = (hi - lo) / 8;
        std::size_t i = 0;
        for (; i + 4 <= words; i += 4) a0 ^= w[i], a1 ^= w[i + 1], a2 ^= w[i + 2], a3 ^= w[i + 3];
        for (; i < words; ++i) a0 ^= w[i];
        acc ^= a0 ^ a1 ^ a2 ^ a3;
      }
    }
    at += s.bytes;
  }
  __atomic_fetch_xor(&copy_sink, acc, __ATOMIC_RELAXED);
}

inline void run_copy(const CopyJob& job, int threads, bool stream = false) {
  const std::size_t total = job.bytes();
  const std::int64_t pieces = std::max(1, threads);
  if (pieces == 1) return copy_piece(job, 0, total, stream);
  rome::detail::parallel_for(pieces, int(pieces), [&](std::int64_t b, std::int64_t e) {
    for (std::int64_t p = b; p < e; ++p) {
      const std::size_t lo = total * std::size_t(p) / std::size_t(pieces) / 64 * 64;
      const std::size_t hi =
          p + 1 == pieces ? total : total * std::size_t(p + 1) / std::size_t(pieces) / 64 * 64;
      copy_piece(job, lo, hi, stream);
    }
  });
}

}  // namespace rome::bench
