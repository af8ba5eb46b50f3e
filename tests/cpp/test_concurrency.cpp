// Concurrency: many application threads calling RoME at once on shared read-only tables, with
// and without the internal pool (a second concurrent caller runs inline), while another thread
// changes the ISA and the thread count. Results must be bit-identical to a serial run (of the
// ISA in use). Built with -DROME_TSAN=ON this is also the ThreadSanitizer test (`make tsan`).
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "core/convert.hpp"
#include "isa_testing.hpp"
#include "rome/rome.hpp"

namespace {

using namespace rome;
using std::int64_t;

template <typename P>
BasicView<P> view(P data, DType dtype, const std::vector<int64_t>& shape) {
  BasicView<P> v;
  v.data = data;
  v.dtype = dtype;
  v.rank = int(shape.size());
  int64_t stride = 1;
  for (int i = v.rank - 1; i >= 0; --i) {
    v.shape[i] = shape[i];
    v.strides[i] = stride;
    stride *= shape[i];
  }
  return v;
}

int64_t numel(const std::vector<int64_t>& s) {
  int64_t n = 1;
  for (auto v : s) n *= v;
  return n;
}

void fill(std::vector<std::uint8_t>& bytes, DType dtype, int64_t n, std::mt19937_64& rng) {
  std::uniform_real_distribution<float> u(-3.0f, 3.0f);
  bytes.resize(n * dtype_size(dtype));
  for (int64_t i = 0; i < n; ++i) {
    const float f = u(rng);
    if (dtype == DType::f32) {
      std::memcpy(bytes.data() + 4 * i, &f, 4);
    } else {
      const std::uint16_t h =
          dtype == DType::bf16 ? detail::float_to_bf16(f) : detail::float_to_fp16(f);
      std::memcpy(bytes.data() + 2 * i, &h, 2);
    }
  }
}

// One call configuration with its own (read-only, shared) inputs and tables.
struct Config {
  std::string name;
  Rotation rotation;
  DType dtype;
  bool cache;  // bf16 half-width cache gathered by int64 positions, else direct fp32 [S, rd]
  std::vector<int64_t> q_shape, k_shape;  // k_shape empty: q only
  std::vector<std::uint8_t> q, k;
  std::vector<float> cos, sin;
  std::vector<std::uint16_t> cache_cos, cache_sin;
  std::vector<int64_t> positions;

  int64_t q_bytes() const { return numel(q_shape) * dtype_size(dtype); }
  int64_t k_bytes() const { return k_shape.empty() ? 0 : numel(k_shape) * dtype_size(dtype); }

  Tables tables() const {
    Tables t;
    const int64_t rd = rotation.rotary_dim(), s = q_shape[2];
    if (cache) {
      const int64_t rows = int64_t(cache_cos.size()) / (rd / 2);
      t.cos = view<const void*>(cache_cos.data(), DType::bf16, {rows, rd / 2});
      t.sin = view<const void*>(cache_sin.data(), DType::bf16, {rows, rd / 2});
      t.positions = view<const void*>(positions.data(), DType::i64, {q_shape[0], 1, s});
      t.width = TableWidth::halves;
    } else {
      t.cos = view<const void*>(cos.data(), DType::f32, {s, rd});
      t.sin = view<const void*>(sin.data(), DType::f32, {s, rd});
    }
    return t;
  }

  // Out of place into q_out/k_out, or (in_place) copies the input there first and rotates it.
  void run(std::uint8_t* q_out, std::uint8_t* k_out, int threads, bool in_place) const {
    if (in_place) {
      std::memcpy(q_out, q.data(), q.size());
      if (k_out) std::memcpy(k_out, k.data(), k.size());
    }
    const Tables t = tables();
    const ExecOptions options =
        rome::testing::split_across(threads);  // small tensors: the pool still runs
    const Operand qo{view<const void*>(in_place ? q_out : q.data(), dtype, q_shape),
                     view<void*>(q_out, dtype, q_shape)};
    if (k_shape.empty()) {
      rope_forward(rotation, t, qo, nullptr, options);
    } else {
      const Operand ko{view<const void*>(in_place ? k_out : k.data(), dtype, k_shape),
                       view<void*>(k_out, dtype, k_shape)};
      rope_forward(rotation, t, qo, &ko, options);
    }
  }
};

std::vector<float> random_dense(int64_t d, std::mt19937_64& rng) {
  std::vector<float> m(d * d);
  std::uniform_int_distribution<int> u(-8, 8);
  for (auto& v : m) v = float(u(rng)) / 8.0f;
  return m;
}

// 7 rotations × 3 dtypes, alternating direct tables and gathered caches, some with GQA k.
std::vector<std::unique_ptr<Config>> make_configs() {
  std::mt19937_64 rng(1234);
  std::vector<std::pair<std::string, Rotation>> rotations = {
      {"half", Rotation::half(64)},
      {"interleave", Rotation::interleave(64)},
      {"quarter", Rotation::quarter(64)},
      {"interleave_half", Rotation::interleave_half(64)},
      {"block_diag",
       Rotation::block_diag({Rotation::half(22), Rotation::half(22), Rotation::half(20)})},
      {"partial", Rotation::half(32).partial(64)},
      {"dense", Rotation::dense(random_dense(32, rng), 32)},
  };
  std::vector<std::unique_ptr<Config>> configs;
  int index = 0;
  for (auto& [name, rotation] : rotations)
    for (DType dtype : {DType::f32, DType::bf16, DType::f16}) {
      auto c = std::make_unique<Config>(Config{name + "_" + dtype_name(dtype),
                                               rotation,
                                               dtype,
                                               index % 2 == 1,
                                               {},
                                               {},
                                               {},
                                               {},
                                               {},
                                               {},
                                               {},
                                               {},
                                               {}});
      const int64_t d = rotation.head_dim(), rd = rotation.rotary_dim(), s = 128;
      c->q_shape = {2, 8, s, d};  // ≥ 256 KiB moved: the pool is used when allowed
      if (index % 3 == 0) c->k_shape = {2, 2, s, d};  // GQA
      fill(c->q, dtype, numel(c->q_shape), rng);
      if (!c->k_shape.empty()) fill(c->k, dtype, numel(c->k_shape), rng);
      std::uniform_real_distribution<float> u(-1.0f, 1.0f);
      if (c->cache) {
        const int64_t rows = 300;
        for (int64_t i = 0; i < rows * rd / 2; ++i) {
          c->cache_cos.push_back(detail::float_to_bf16(u(rng)));
          c->cache_sin.push_back(detail::float_to_bf16(u(rng)));
        }
        for (int64_t i = 0; i < 2 * s; ++i) c->positions.push_back(int64_t(rng() % rows));
      } else {
        for (int64_t i = 0; i < s * rd; ++i) c->cos.push_back(u(rng)), c->sin.push_back(u(rng));
      }
      configs.push_back(std::move(c));
      ++index;
    }
  return configs;
}

struct Expected {
  std::vector<std::uint8_t> q, k;
};

// Serial results (num_threads 1, calling thread) of every config on the current ISA.
std::vector<Expected> serial_results(const std::vector<std::unique_ptr<Config>>& configs) {
  std::vector<Expected> out(configs.size());
  for (std::size_t i = 0; i < configs.size(); ++i) {
    out[i].q.resize(configs[i]->q_bytes());
    out[i].k.resize(configs[i]->k_bytes());
    configs[i]->run(out[i].q.data(), out[i].k.empty() ? nullptr : out[i].k.data(), 1, false);
  }
  return out;
}

struct Failures {
  std::atomic<int> count{0};
  std::mutex mutex;
  std::string first;
  void add(const std::string& what) {
    if (count.fetch_add(1) == 0) {
      std::lock_guard<std::mutex> lock(mutex);
      first = what;
    }
  }
};

constexpr int kThreads = 8;
constexpr int kCallsPerThread = 24;

TEST(Concurrency, ParallelCallersMatchSerialRun) {
  const auto configs = make_configs();
  const std::vector<Expected> expected = serial_results(configs);
  Failures failures;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&, t] {
      std::vector<std::uint8_t> q_out, k_out;
      for (int call = 0; call < kCallsPerThread; ++call) {
        const std::size_t i = std::size_t(t * 7 + call * 5) % configs.size();
        const Config& c = *configs[i];
        const int num_threads = 1 + (t + call) % 2;  // 1, or 2 (pool, or inline when it is busy)
        const bool in_place = (call / 2) % 2 == 1;
        q_out.assign(c.q_bytes(), 0xA5);
        k_out.assign(c.k_bytes(), 0xA5);
        try {
          c.run(q_out.data(), k_out.empty() ? nullptr : k_out.data(), num_threads, in_place);
        } catch (const std::exception& e) {
          failures.add(c.name + ": threw " + e.what());
          continue;
        }
        if (q_out != expected[i].q || k_out != expected[i].k)
          failures.add(c.name + ": differs from the serial run (thread " + std::to_string(t) +
                       ", call " + std::to_string(call) + ", num_threads " +
                       std::to_string(num_threads) + (in_place ? ", in place)" : ")"));
      }
    });
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures.count.load(), 0) << failures.first;
  std::printf("[ rome ] %d threads x %d calls over %zu configs on %s\n", kThreads, kCallsPerThread,
              configs.size(), isa_name(active_isa()));
}

TEST(Concurrency, IsaAndThreadCountChangedDuringCalls) {
  const auto configs = make_configs();
  const std::vector<Isa> isas = rome::testing::isas_under_test();
  std::vector<std::vector<Expected>> expected;  // per ISA
  for (Isa isa : isas) {
    rome::testing::ScopedIsa scoped(isa);
    expected.push_back(serial_results(configs));
  }
  Failures failures;
  std::atomic<bool> stop{false};
  std::atomic<int> changes{0}, calls{0};
  std::thread changer([&] {
    for (int i = 0; !stop.load(); ++i) {
      set_max_isa(isas[std::size_t(i) % isas.size()]);
      set_num_threads(i % 4);  // 0 (default), 1, 2, 3
      changes.fetch_add(1);
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  });
  std::vector<std::thread> workers;
  for (int t = 0; t < kThreads - 2; ++t)
    workers.emplace_back([&, t] {
      std::vector<std::uint8_t> q_out, k_out;
      for (int call = 0; call < kCallsPerThread; ++call) {
        const std::size_t i = std::size_t(t * 5 + call * 3) % configs.size();
        const Config& c = *configs[i];
        q_out.assign(c.q_bytes(), 0xA5);
        k_out.assign(c.k_bytes(), 0xA5);
        try {
          // num_threads 0: the count set_num_threads is changing.
          c.run(q_out.data(), k_out.empty() ? nullptr : k_out.data(), call % 3 == 0 ? 2 : 0,
                call % 2 == 1);
        } catch (const std::exception& e) {
          failures.add(c.name + ": threw " + e.what());
          continue;
        }
        calls.fetch_add(1);
        bool matches = false;
        for (const auto& per_isa : expected)
          matches |= q_out == per_isa[i].q && k_out == per_isa[i].k;
        if (!matches) failures.add(c.name + ": matches the serial run of no ISA");
      }
    });
  for (auto& w : workers) w.join();
  stop = true;
  changer.join();
  set_max_isa(Isa::amx);
  set_num_threads(0);
  EXPECT_EQ(failures.count.load(), 0) << failures.first;
  std::printf("[ rome ] %d calls during %d ISA/thread-count changes over %zu ISAs\n", calls.load(),
              changes.load(), isas.size());
}

// Every ISA gives the same bytes (the SIMD kernels keep the scalar kernel's operation order), so
// a result does not depend on which ISA a concurrent set_max_isa left active.
TEST(Concurrency, EveryIsaGivesTheSameBytes) {
  const auto configs = make_configs();
  const std::vector<Isa> isas = rome::testing::isas_under_test();
  std::vector<std::vector<Expected>> expected;
  for (Isa isa : isas) {
    rome::testing::ScopedIsa scoped(isa);
    expected.push_back(serial_results(configs));
  }
  for (std::size_t a = 1; a < isas.size(); ++a)
    for (std::size_t i = 0; i < configs.size(); ++i) {
      EXPECT_TRUE(expected[a][i].q == expected[0][i].q && expected[a][i].k == expected[0][i].k)
          << configs[i]->name << ": " << isa_name(isas[a]) << " differs from " << isa_name(isas[0]);
    }
}

TEST(Concurrency, ParallelBackwardCallersMatchSerialRun) {
  std::mt19937_64 rng(99);
  const Rotation rotation = Rotation::interleave_half(64);
  const std::vector<int64_t> shape = {2, 8, 128, 64};
  const int64_t n = numel(shape);
  std::vector<std::uint8_t> grad, x;
  fill(grad, DType::bf16, n, rng);
  fill(x, DType::bf16, n, rng);
  std::vector<float> cos(128 * 64), sin(128 * 64);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (auto& v : cos) v = u(rng);
  for (auto& v : sin) v = u(rng);
  Tables tables;
  tables.cos = view<const void*>(cos.data(), DType::f32, {128, 64});
  tables.sin = view<const void*>(sin.data(), DType::f32, {128, 64});
  struct Out {
    std::vector<std::uint8_t> dx;
    std::vector<float> dcos, dsin, da;
  };
  auto run = [&](Out& o, int threads) {
    o.dx.assign(n * 2, 0);
    o.dcos.assign(cos.size(), 0.0f);
    o.dsin.assign(sin.size(), 0.0f);
    o.da.assign(64 * 64, 0.0f);
    Gradients g;
    g.dx = view<void*>(o.dx.data(), DType::bf16, shape);
    g.dcos = view<void*>(o.dcos.data(), DType::f32, {128, 64});
    g.dsin = view<void*>(o.dsin.data(), DType::f32, {128, 64});
    g.da = o.da.data();
    const ExecOptions options =
        rome::testing::split_across(threads);  // small tensors: the pool still runs
    rope_backward(rotation, tables, view<const void*>(grad.data(), DType::bf16, shape),
                  view<const void*>(x.data(), DType::bf16, shape), g, options);
  };
  Out serial;
  run(serial, 1);
  Failures failures;
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&, t] {
      for (int call = 0; call < 3; ++call) {
        Out o;
        try {
          run(o, 1 + (t + call) % 2);
        } catch (const std::exception& e) {
          failures.add(std::string("threw ") + e.what());
          continue;
        }
        if (o.dx != serial.dx || o.dcos != serial.dcos || o.dsin != serial.dsin ||
            o.da != serial.da)
          failures.add("backward differs from the serial run");
      }
    });
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures.count.load(), 0) << failures.first;
}

}  // namespace
