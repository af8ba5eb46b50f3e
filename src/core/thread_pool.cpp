#include "thread_pool.hpp"

#include <atomic>
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

  void loop(int index) {
    std::uint64_t seen = 0;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      seen = generation_;
      // A worker created for the current job must still take part in it.
      if (parts_ > index && pending_.load() > 0) seen = generation_ - 1;
    }
    for (;;) {
      RangeFn fn;
      void* context;
      std::int64_t items;
      int parts;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return generation_ != seen; });
        seen = generation_;
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
  std::uint64_t generation_ = 0;
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
