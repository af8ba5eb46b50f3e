// A small persistent pool. Work is split statically (item ranges depend only on the item count
// and thread count), so results are deterministic; the caller runs the first range itself.
#pragma once

#include <cstdint>

#include "rome/rope.hpp"

namespace rome::detail {

using RangeFn = void (*)(void* context, std::int64_t begin, std::int64_t end);

// Runs fn over [0, items) on up to `threads` threads. If the pool is busy with another caller's
// work, runs everything on the calling thread instead of waiting (no nesting, no deadlock).
void parallel_for(std::int64_t items, int threads, RangeFn fn, void* context);

template <typename F>
void parallel_for(std::int64_t items, int threads, F&& f) {
  parallel_for(
      items, threads, [](void* c, std::int64_t b, std::int64_t e) { (*static_cast<F*>(c))(b, e); },
      &f);
}

// The same on the host's pool when the caller gave one (ExecOptions::parallel_for), else on
// RoME's own; one thread (or one item) runs inline without waking anybody.
template <typename F>
void parallel_for(const ExecOptions& options, std::int64_t items, int threads, F&& f) {
  if (items <= 0) return;
  if (threads <= 1 || items == 1) return f(std::int64_t(0), items);
  auto body = [](void* c, std::int64_t b, std::int64_t e) { (*static_cast<F*>(c))(b, e); };
  if (options.parallel_for)
    options.parallel_for(items, threads, body, &f);
  else
    parallel_for(items, threads, body, &f);
}

// Calls that move fewer bytes (reads + writes) stay on the calling thread. Waking a second thread
// and joining it cost about 7 us through torch's OpenMP pool and more through RoME's own on the
// AMX Xeon VM (BENCHMARKS.md): vLLM-shaped decode (q [T, 32·128], k [T, 8·128] bf16), 1 vs 2
// threads, T = 4: 7.0 vs 13.5-14.2 us, T = 16: 16-17 vs 18-21 us, T = 24: 2 threads ahead. T = 16
// moves 320 KiB, T = 24 480 KiB.
constexpr std::int64_t kMinParallelBytes = 384 * 1024;
// The backward pass does more work per byte (gradients of the tables and matrices too).
constexpr std::int64_t kMinParallelBytesBackward = 256 * 1024;

// The threads for a call moving `bytes`: `threads`, or 1 below the options' threshold (-1: the
// caller's default).
inline int threads_for_bytes(const ExecOptions& options, std::int64_t bytes, int threads,
                             std::int64_t default_floor = kMinParallelBytes) {
  const std::int64_t floor =
      options.min_parallel_bytes < 0 ? default_floor : options.min_parallel_bytes;
  return bytes < floor ? 1 : threads;
}

int hardware_threads() noexcept;

}  // namespace rome::detail
