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

int hardware_threads() noexcept;

}  // namespace rome::detail
