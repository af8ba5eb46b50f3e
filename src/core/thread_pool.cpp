#include "thread_pool.hpp"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace rome::detail {
namespace {

// Spin, then sleep. A sleeping worker is woken through the kernel, and in a VM a halted vCPU
// through the hypervisor: on the AMX VM that took tens of microseconds, so two threads were
// slower than one up to T = 64 tokens of vLLM-shaped decode (65 vs 81 us; BENCHMARKS.md).
// Workers spin a while for the next job and the caller spins for the workers, as OpenMP's
// default wait policy does, and sleep only when nothing comes.
constexpr auto kWorkerSpin = std::chrono::microseconds(200);
constexpr auto kCallerSpin = std::chrono::milliseconds(2);

// Spins on done() for up to `limit`, pausing between looks; true if it became true.
inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#elif defined(__aarch64__)
  __asm__ volatile("yield");
#endif
}

template <class Done>
bool spin_until(Done done, std::chrono::steady_clock::duration limit) {
  const auto start = std::chrono::steady_clock::now();
  for (int spin = 1;; ++spin) {
    if (done()) return true;
    cpu_relax();
    if (spin % 64 == 0 && std::chrono::steady_clock::now() - start > limit) return done();
  }
}

class Pool {
 public:
  ~Pool() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
      generation_.fetch_add(1, std::memory_order_release);
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
      // After the job's fields: a spinning worker that sees the new generation reads them.
      generation_.fetch_add(1, std::memory_order_release);
    }
    wake_.notify_all();
    fn(context, 0, items / threads);
    auto finished = [&] { return pending_.load(std::memory_order_acquire) == 0; };
    if (!spin_until(finished, kCallerSpin)) {
      std::unique_lock<std::mutex> lock(mutex_);
      done_.wait(lock, finished);
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

  void loop(int index) {
    std::uint64_t seen = 0;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      seen = generation_.load(std::memory_order_relaxed);
      // A worker created for the current job must still take part in it.
      if (parts_ > index && pending_.load() > 0) seen -= 1;
    }
    // Only a worker the last job used spins for the next: one it did not need (a pool grown by a
    // wider job) would keep a core busy for nothing.
    bool took_part = true;
    for (;;) {
      auto posted = [&] { return generation_.load(std::memory_order_acquire) != seen; };
      RangeFn fn;
      void* context;
      std::int64_t items;
      int parts;
      {
        if (!(took_part && spin_until(posted, kWorkerSpin))) {
          std::unique_lock<std::mutex> lock(mutex_);
          wake_.wait(lock, posted);
        }
        std::lock_guard<std::mutex> lock(mutex_);
        seen = generation_.load(std::memory_order_relaxed);
        if (stopping_) return;
        fn = fn_;
        context = context_;
        items = items_;
        parts = parts_;
      }
      took_part = index < parts;
      if (!took_part) continue;
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
