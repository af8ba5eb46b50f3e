#include "thread_pool.hpp"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace rome::detail {
namespace {

class Pool {
 public:
  ~Pool() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
      ++generation_;
    }
    wake_.notify_all();
    for (auto& t : workers_) t.join();
  }

  // Returns false when another caller holds the pool.
  bool run(std::int64_t items, int threads, RangeFn fn, void* context) {
    std::unique_lock<std::mutex> busy(run_mutex_, std::try_to_lock);
    if (!busy.owns_lock()) return false;
    grow(threads - 1);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      fn_ = fn;
      context_ = context;
      items_ = items;
      parts_ = threads;
      pending_.store(threads - 1, std::memory_order_relaxed);
      ++generation_;
    }
    wake_.notify_all();
    fn(context, 0, items / threads);
    // Short spin first: a worker typically finishes within microseconds of the caller.
    for (int spin = 0; pending_.load(std::memory_order_acquire) != 0; ++spin) {
      if (spin > 2000) {
        std::unique_lock<std::mutex> lock(mutex_);
        done_.wait(lock, [&] { return pending_.load(std::memory_order_acquire) == 0; });
        break;
      }
    }
    return true;
  }

 private:
  void grow(int workers) {
    while (int(workers_.size()) < workers) {
      const int index = int(workers_.size()) + 1;
      workers_.emplace_back([this, index] { loop(index); });
    }
  }

  // Polls for the next job for up to 100 us before sleeping: waking a sleeping worker goes
  // through the kernel, slow on a VM, and back-to-back calls (a decode loop) find it still
  // polling. rome_timer, q [1, 32, 64, 128] + k [1, 8, 64, 128] bf16 in place, 2 threads, old and
  // new alternately: 52-60 -> 44 us (one thread: 69-75 us). OpenMP runtimes poll longer.
  void spin_for_next_job(std::uint64_t seen) const {
    using Clock = std::chrono::steady_clock;
    const Clock::time_point until = Clock::now() + std::chrono::microseconds(kSpinMicroseconds);
    for (int i = 1;; ++i) {
      if (generation_.load(std::memory_order_acquire) != seen) return;
      pause();
      if (i % 64 == 0 && Clock::now() > until) return;
    }
  }

  static void pause() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
  }

  static constexpr int kSpinMicroseconds = 100;

  void loop(int index) {
    std::uint64_t seen = 0;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      seen = generation_.load(std::memory_order_relaxed);
      // A worker created for the current job must still take part in it.
      if (parts_ > index && pending_.load() > 0) seen -= 1;
    }
    for (;;) {
      RangeFn fn;
      void* context;
      std::int64_t items;
      int parts;
      spin_for_next_job(seen);
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return generation_.load(std::memory_order_relaxed) != seen; });
        seen = generation_.load(std::memory_order_relaxed);
        if (stopping_) return;
        fn = fn_;
        context = context_;
        items = items_;
        parts = parts_;
      }
      if (index >= parts) continue;
      fn(context, items * index / parts, items * (index + 1) / parts);
      if (pending_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
        std::lock_guard<std::mutex> lock(mutex_);
        done_.notify_all();
      }
    }
  }

  std::mutex run_mutex_;
  std::mutex mutex_;
  std::condition_variable wake_, done_;
  std::vector<std::thread> workers_;
  // Written under mutex_ (the condition variable's predicate), read without it by spinning workers.
  std::atomic<std::uint64_t> generation_{0};
  bool stopping_ = false;
  RangeFn fn_ = nullptr;
  void* context_ = nullptr;
  std::int64_t items_ = 0;
  int parts_ = 0;
  std::atomic<int> pending_{0};
};

Pool& pool() {
  static Pool instance;
  return instance;
}

}  // namespace

int hardware_threads() noexcept {
  const unsigned n = std::thread::hardware_concurrency();
  return n == 0 ? 1 : int(n);
}

void parallel_for(std::int64_t items, int threads, RangeFn fn, void* context) {
  if (items <= 0) return;
  if (threads > items) threads = int(items);
  if (threads <= 1 || !pool().run(items, threads, fn, context)) fn(context, 0, items);
}

}  // namespace rome::detail
