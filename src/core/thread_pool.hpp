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

// Calls that move fewer bytes (reads + writes) stay on the calling thread: waking a second thread
// and joining it costs more than it saves. vLLM-shaped decode (q [T, 32·128] and k [T, 8·128]
// bf16) through torch's OpenMP pool, 1 vs 2 threads: on an AVX-512 Zen 4, T = 12 (240 KiB) 9.0 vs
// 9.0 us, T = 16 (320 KiB) 11.1 vs 8.8 us (BENCHMARKS.md, twenty-fifth session); on a Zen 3 with
// the AVX2 kernels T = 12 20-27 vs 17-25 us, T = 16 18-28 vs 13-15 us (twenty-first session). An
// AMX Xeon VM woke threads more slowly (T = 16: 16-17 vs 18-21 us; an earlier session) and would
// rather split from 384 KiB.
constexpr std::int64_t kMinParallelBytes = 256 * 1024;
// The backward pass does more work per byte (gradients of the tables and matrices too).
constexpr std::int64_t kMinParallelBytesBackward = 256 * 1024;

// The threads for a call moving `bytes`: `threads`, or 1 below the options' threshold (-1: the
// caller's default, else kMinParallelBytes).
inline int threads_for_bytes(const ExecOptions& options, std::int64_t bytes, int threads,
                             std::int64_t default_floor = -1) {
  const std::int64_t floor = options.min_parallel_bytes >= 0 ? options.min_parallel_bytes
                             : default_floor >= 0            ? default_floor
                                                             : kMinParallelBytes;
  return bytes < floor ? 1 : threads;
}

int hardware_threads() noexcept;

}  // namespace rome::detail
