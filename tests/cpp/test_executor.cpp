// The tiled forward executor: tile boundaries on every layout (tokens not a multiple of the tile,
// one token, tables broadcast on each axis, positions, GQA, strided slices of a fused buffer, in
// place and out of place), forced tile sizes and thread counts 1-8 through RoME's own pool and
// through a host's parallel_for. Every run must equal the scalar kernel on one thread with the
// default tiles bit for bit over the whole output buffer (NaN-filled padding included), and that
// run must match the double reference.
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <cstdio>
#include <random>
#include <span>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "isa_testing.hpp"
#include "reference.hpp"
#include "rome/rome.hpp"

namespace rome::testing {
namespace {

// The last-level cache share that decides streaming (outgrows_cache_share) comes from sysconf
// (CPUID) unless sysfs lists a smaller one: a VM may report its host's L3.
TEST(CacheSizes, SysfsSizesAndCpuListsParse) {
  EXPECT_EQ(detail::sysfs_cache_bytes("32768K"), std::int64_t(32) << 20);
  EXPECT_EQ(detail::sysfs_cache_bytes("32M"), std::int64_t(32) << 20);
  EXPECT_EQ(detail::sysfs_cache_bytes("512"), 512);
  for (const char* bad : {"", "K", "-4K", "12X", "0K"})
    EXPECT_EQ(detail::sysfs_cache_bytes(bad), 0) << bad;
  EXPECT_EQ(detail::cpu_list_count("0"), 1);
  EXPECT_EQ(detail::cpu_list_count("0-1"), 2);
  EXPECT_EQ(detail::cpu_list_count("0-3,8-11,16"), 9);
  for (const char* bad : {"", "a", "3-1", "0-", "0;1", "-1"})
    EXPECT_EQ(detail::cpu_list_count(bad), 0) << bad;
}

TEST(CacheSizes, L3ShareIsNoLargerThanSysfsLists) {
  const detail::CacheSizes& sizes = detail::cache_sizes();
  EXPECT_GT(sizes.l3_per_thread, 0);
  EXPECT_LE(sizes.l3_per_thread, sizes.l3);
  const auto [bytes, sharing] = detail::sysfs_l3();
  std::printf(
      "sysfs L3: %lld bytes shared by %d CPUs (0: not listed); RoME's share per thread: %lld\n",
      static_cast<long long>(bytes), sharing, static_cast<long long>(sizes.l3_per_thread));
  if (bytes > 0 && sharing > 0) EXPECT_LE(sizes.l3_per_thread, bytes / sharing);
}

struct ExecutorCase {
  std::string name;
  std::vector<std::int64_t> q_shape, k_shape;  // k_shape empty: no k
  Layout q_layout, k_layout;
  std::vector<std::int64_t> table_shape;  // direct tables; empty with a cache
  std::int64_t cache_rows = 0;            // > 0: a [cache_rows, rd] cache gathered by positions
  std::vector<std::int64_t> positions_shape;
};

// q and k [B, N, S, D] unless the name says otherwise; D = 64. Permute kernels walk BNSD tiles of
// at least 32 tokens head-major, four heads per call (the default tiles of the bnsd cases on one
// thread, and the 33- and 40-token tiles), and smaller tiles token by token over all heads (the
// other forced ones, and the default tiles of several threads, cut to 5-10 tokens).
const std::vector<ExecutorCase>& cases() {
  static const std::vector<ExecutorCase> c = {
      {"bnsd_gqa", {2, 6, 37, 64}, {2, 2, 37, 64}, {}, {}, {37, 64}},
      {"bnsd_batch_tables", {2, 3, 33, 64}, {2, 1, 33, 64}, {}, {}, {2, 1, 33, 64}},
      // Head-major tiles of two full groups of heads and one more (q), and a part group (k).
      {"bnsd_nine_heads", {1, 9, 35, 64}, {1, 3, 35, 64}, {}, {}, {35, 64}},
      {"bnsd_one_token", {1, 8, 1, 64}, {1, 2, 1, 64}, {}, {}, {1, 64}},
      // BSND: [B, S, N, D] with tables [1, S, 1, D].
      {"bsnd_gqa", {2, 37, 6, 64}, {2, 37, 3, 64}, {}, {}, {1, 37, 1, 64}},
      // Token-major [T, N, D] slices of a fused qkv buffer (rows of other heads in between).
      {"packed_qkv_slices",
       {45, 4, 64},
       {45, 2, 64},
       Layout{{}, 0, -1, 0, 5},
       Layout{{}, 0, -1, 3, 7},
       {},
       70,
       {45, 1}},
      // Tables that vary per head too: every row has its own table row.
      {"bnsd_tables_per_head", {1, 3, 21, 64}, {}, {}, {}, {1, 3, 21, 64}},
      // Tokens laid out backwards: negative token steps, token by token over all heads (small
      // tiles) and over groups of heads (head-major tiles).
      {"bnsd_tokens_reversed",
       {1, 6, 41, 64},
       {1, 2, 41, 64},
       Layout{{}, 0, 2},
       Layout{{}, 0, 2},
       {41, 64},
       0,
       {}},
      // A transposed view (BSND memory read as BNSD) and positions per batch.
      {"bnsd_view_of_bsnd_positions",
       {2, 5, 19, 64},
       {2, 5, 19, 64},
       Layout{{0, 2, 1, 3}},
       Layout{{0, 2, 1, 3}},
       {},
       40,
       {2, 1, 19}},
  };
  return c;
}

struct Rot {
  const char* name;
  Rotation (*make)();
};
const Rot kRotations[] = {
    {"half", [] { return Rotation::half(64); }},
    {"interleave", [] { return Rotation::interleave(64); }},
    {"quarter", [] { return Rotation::quarter(64); }},
    {"3d_24_24_16",
     [] {
       return Rotation::block_diag({Rotation::half(24), Rotation::half(24), Rotation::half(16)});
     }},
    {"partial_32_of_64", [] { return Rotation::half(32).partial(64); }},
};

struct Inputs {
  TestTensor q, k, q_out, k_out;
  TestTables tables;
};

Inputs make_inputs(const ExecutorCase& c, const Rotation& rot, DType dtype, bool in_place,
                   std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  Inputs in;
  in.q = TestTensor::make(dtype, c.q_shape, c.q_layout);
  in.q.fill_random(rng, -2, 2);
  if (!c.k_shape.empty()) {
    in.k = TestTensor::make(dtype, c.k_shape, c.k_layout);
    in.k.fill_random(rng, -2, 2);
  }
  if (!in_place) {
    in.q_out = TestTensor::make(dtype, c.q_shape, c.q_layout);
    if (!c.k_shape.empty()) in.k_out = TestTensor::make(dtype, c.k_shape, c.k_layout);
  }
  const std::int64_t rd = rot.rotary_dim();
  if (c.cache_rows > 0) {
    in.tables.cos = TestTensor::make(DType::f32, {c.cache_rows, rd});
    in.tables.sin = TestTensor::make(DType::f32, {c.cache_rows, rd});
    in.tables.positions = TestTensor::make(DType::i64, c.positions_shape);
    std::uniform_int_distribution<std::int64_t> pos(0, c.cache_rows - 1);
    in.tables.positions.fill([&](const auto&) { return double(pos(rng)); });
  } else {
    std::vector<std::int64_t> shape = c.table_shape;
    shape.back() = rd;
    in.tables.cos = TestTensor::make(DType::f32, shape);
    in.tables.sin = TestTensor::make(DType::f32, shape);
  }
  in.tables.cos.fill_random(rng, -1, 1);
  in.tables.sin.fill_random(rng, -1, 1);
  return in;
}

void run(Inputs& in, const Rotation& rot, bool in_place, const ExecOptions& options) {
  const bool has_k = !in.k.shape.empty();
  Operand q{in.q.cview(), in_place ? in.q.view() : in.q_out.view()};
  Operand k;
  if (has_k) k = {in.k.cview(), in_place ? in.k.view() : in.k_out.view()};
  rope_forward(rot, in.tables.view(), q, has_k ? &k : nullptr, options);
}

// A host pool in the style of at::parallel_for: contiguous chunks, each on its own std::thread.
std::atomic<int> g_host_chunks{0};
void host_parallel_for(std::int64_t items, int threads, RangeBody body, void* context) {
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    const std::int64_t b = items * t / threads, e = items * (t + 1) / threads;
    if (b < e) pool.emplace_back([=] { body(context, b, e); });
  }
  g_host_chunks += int(pool.size());
  for (auto& t : pool) t.join();
}

std::vector<unsigned char> result_bytes(const Inputs& in, bool in_place) {
  std::vector<unsigned char> bytes = in_place ? in.q.storage : in.q_out.storage;
  const auto& k = in_place ? in.k.storage : in.k_out.storage;
  bytes.insert(bytes.end(), k.begin(), k.end());
  return bytes;
}

TEST(Executor, TilesThreadsAndHostPoolsAreBitIdentical) {
  // Tile sizes x thread counts x pools, as pairs rather than a full product (the suite also runs
  // under ASan): every tile size, every thread count and both pools occur.
  struct Setting {
    std::int64_t tile;
    int threads;
    bool host;
  };
  // 33 and 40: head-major tiles (at least 32 tokens) whose rows are cut into parts for the
  // threads, so groups of heads start inside a run of heads.
  const Setting all_settings[] = {{0, 1, false},  {1, 2, false},  {3, 3, true},
                                  {16, 8, false}, {7, 8, true},   {0, 2, true},
                                  {1, 1, true},   {33, 2, false}, {40, 3, true}};
  // Under the sanitizers three: one-token and odd tiles, 1, 2 and 8 threads, both pools.
  const Setting sanitized_settings[] = {{1, 2, false}, {7, 8, true}, {0, 1, false}};
  const std::span<const Setting> settings = kSanitized
                                                ? std::span<const Setting>(sanitized_settings)
                                                : std::span<const Setting>(all_settings);
  int checked = 0;
  for (const ExecutorCase& c : cases()) {
    for (const Rot& r : kRotations) {
      const Rotation rot = r.make();
      for (DType dtype : {DType::bf16, DType::f16, DType::f32}) {
        for (bool in_place : {true, false}) {
          const std::string what = c.name + "/" + r.name + "/" + dtype_name(dtype) +
                                   (in_place ? "/in_place" : "/out_of_place");
          const std::uint64_t seed = std::hash<std::string>()(what);
          // Baseline: scalar kernel, one thread, default tiles; checked against the reference.
          Inputs base = make_inputs(c, rot, dtype, in_place, seed);
          const Inputs original = base;
          {
            ScopedIsa scalar(Isa::scalar);
            ExecOptions one;
            one.num_threads = 1;
            run(base, rot, in_place, one);
          }
          const Comparison cq = compare(in_place ? base.q : base.q_out,
                                        reference_forward(rot, original.tables, original.q));
          ASSERT_TRUE(cq.ok) << what << ": q " << cq.first_failure;
          if (!base.k.shape.empty()) {
            const Comparison ck = compare(in_place ? base.k : base.k_out,
                                          reference_forward(rot, original.tables, original.k));
            ASSERT_TRUE(ck.ok) << what << ": k " << ck.first_failure;
          }
          const std::vector<unsigned char> expected = result_bytes(base, in_place);
          for (Isa isa : isas_under_test()) {
            ScopedIsa scoped(isa);
            for (const Setting& set : settings) {
              Inputs in = original;
              ExecOptions options = split_across(set.threads);  // the test tensors are small
              options.tile_tokens = set.tile;
              if (set.host) options.parallel_for = host_parallel_for;
              run(in, rot, in_place, options);
              ASSERT_TRUE(result_bytes(in, in_place) == expected)
                  << what << " on " << isa_name(isa) << ", tile_tokens " << set.tile << ", "
                  << set.threads << " threads" << (set.host ? " on a host pool" : "");
              ++checked;
            }
          }
        }
      }
    }
  }
  std::printf("[ rome ] executor: %d runs bit-identical to the scalar kernel on one thread\n",
              checked);
}

// q and k as head slices of one packed [T, (Hq + Hk + Hv) * D] buffer (vLLM's qkv). Where k's
// heads directly follow q's, in and out, the executor joins them into one operand (a kernel call
// per tile instead of two per token); single heads (MQA's k, or a one-head q) join too. Modes: in
// place (joined), out of place into adjacent slices of an output buffer (joined), into separate
// outputs (not joined), from inputs with v between q and k into adjacent outputs, and from
// adjacent inputs into output slices with v's place between them (neither joined). On every ISA and
// a few tile/thread settings each must equal q and k rotated as separate tensors, bit for bit, and
// leave every other element as it was (NaN in the outputs).
TEST(Executor, QAndKSlicesOfAPackedBufferMatchSeparateTensors) {
  const std::int64_t T = 37, hv = 2, d = 64;
  const Rotation rot =
      Rotation::block_diag({Rotation::half(24), Rotation::half(24), Rotation::half(16)});
  const char* const kModes[] = {"in place", "adjacent out", "separate out", "inputs apart",
                                "outputs apart"};
  for (auto [hq, hk] : {std::pair<std::int64_t, std::int64_t>{6, 2}, {4, 1}, {1, 3}})
    for (DType dtype : {DType::bf16, DType::f32})
      for (int mode = 0; mode < 5; ++mode) {
        const std::int64_t width = (hq + hk + hv) * d;
        const std::int64_t k_in_head = mode == 3 ? hq + hv : hq;   // k's first head in the input
        const std::int64_t k_out_head = mode == 4 ? hq + hv : hq;  // and in the output buffer
        const std::string what = std::string(dtype_name(dtype)) + " " + kModes[mode] + " hq " +
                                 std::to_string(hq) + " hk " + std::to_string(hk);
        std::mt19937_64 rng(std::hash<std::string>()(what));
        TestTensor packed = TestTensor::make(dtype, {T, width});
        packed.fill_random(rng, -2, 2);
        TestTables tables;
        tables.cos = TestTensor::make(DType::f32, {T, 1, d});
        tables.sin = TestTensor::make(DType::f32, {T, 1, d});
        tables.cos.fill_random(rng, -1, 1);
        tables.sin.fill_random(rng, -1, 1);
        // Heads [first, first + count) of every token of a packed buffer, as a [T, count, d] view.
        auto heads = [&](TestTensor& buffer, std::int64_t first, std::int64_t count) {
          return make_view<void*>(buffer.at({0, first * d}), dtype, {T, count, d}, {width, d, 1});
        };
        // Expected: q and k copied out as contiguous tensors, rotated separately (scalar kernel).
        TestTensor q_alone = TestTensor::make(dtype, {T, hq, d});
        TestTensor k_alone = TestTensor::make(dtype, {T, hk, d});
        for (std::int64_t t = 0; t < T; ++t)
          for (std::int64_t j = 0; j < d; ++j) {
            for (std::int64_t h = 0; h < hq; ++h)
              q_alone.set({t, h, j}, packed.get({t, h * d + j}));
            for (std::int64_t h = 0; h < hk; ++h)
              k_alone.set({t, h, j}, packed.get({t, (k_in_head + h) * d + j}));
          }
        {
          ScopedIsa scalar(Isa::scalar);
          rope_forward(rot, tables.view(), Operand{q_alone.cview(), q_alone.view()}, nullptr);
          rope_forward(rot, tables.view(), Operand{k_alone.cview(), k_alone.view()}, nullptr);
        }
        for (Isa isa : isas_under_test())
          for (int threads : {1, 2, 3}) {
            ScopedIsa scoped(isa);
            ExecOptions options = split_across(threads);
            options.tile_tokens = threads == 3 ? 5 : 0;
            TestTensor in = packed;
            TestTensor out = TestTensor::make(dtype, {T, width});  // NaN-filled
            TestTensor q_out = TestTensor::make(dtype, {T, hq, d});
            TestTensor k_out = TestTensor::make(dtype, {T, hk, d});
            TestTensor& dst = mode == 0 ? in : out;
            Operand q{as_const(heads(in, 0, hq)), heads(dst, 0, hq)};
            Operand k{as_const(heads(in, k_in_head, hk)),
                      heads(dst, mode == 0 ? k_in_head : k_out_head, hk)};
            if (mode == 2) q.out = q_out.view(), k.out = k_out.view();
            rope_forward(rot, tables.view(), q, &k, options);
            const std::string where =
                what + " on " + isa_name(isa) + ", " + std::to_string(threads) + " threads";
            // Where q and k went, and what every element of `in` and `out` must hold.
            auto rotated = [&](std::int64_t t, std::int64_t h, std::int64_t j, std::int64_t k0,
                               double& value) {
              if (h < hq) return value = q_alone.get({t, h, j}), true;
              if (h >= k0 && h < k0 + hk) return value = k_alone.get({t, h - k0, j}), true;
              return false;
            };
            for (std::int64_t t = 0; t < T; ++t)
              for (std::int64_t h = 0; h < hq + hk + hv; ++h)
                for (std::int64_t j = 0; j < d; ++j) {
                  double want = 0;
                  const bool in_qk = rotated(t, h, j, k_in_head, want);
                  const double in_now = in.get({t, h * d + j});
                  const double in_want = mode == 0 && in_qk ? want : packed.get({t, h * d + j});
                  ASSERT_EQ(in_now, in_want) << where << " input token " << t << " head " << h;
                  if (mode == 0) continue;
                  const double out_now = out.get({t, h * d + j});
                  if (mode != 2 && rotated(t, h, j, k_out_head, want)) {
                    ASSERT_EQ(out_now, want) << where << " token " << t << " head " << h;
                  } else {
                    ASSERT_TRUE(std::isnan(out_now)) << where << " output head " << h;
                  }
                  if (mode == 2 && h < hq) {
                    ASSERT_EQ(q_out.get({t, h, j}), q_alone.get({t, h, j})) << where << " q_out";
                  }
                  if (mode == 2 && h < hk) {
                    ASSERT_EQ(k_out.get({t, h, j}), k_alone.get({t, h, j})) << where << " k_out";
                  }
                }
          }
      }
}

// Random fp32 tables [tokens, 128] for the thread-count tests.
TestTables random_tables(std::int64_t tokens, std::mt19937_64& rng) {
  TestTables t;
  t.cos = TestTensor::make(DType::f32, {tokens, 128});
  t.sin = TestTensor::make(DType::f32, {tokens, 128});
  t.cos.fill_random(rng, -1, 1);
  t.sin.fill_random(rng, -1, 1);
  return t;
}

// Work big enough to be split: RoME's pool and a host pool each run it on the threads asked
// for, and a tiny call (one decode token) stays on the calling thread.
TEST(Executor, ThreadCountsTakeEffect) {
  const Rotation rot = Rotation::half(128);
  TestTensor q = TestTensor::make(DType::f32, {1, 8, 512, 128});
  std::mt19937_64 rng(3);
  q.fill_random(rng, -1, 1);
  const TestTables t = random_tables(512, rng);
  const Operand op{q.cview(), q.view()};
  for (int threads : {1, 2, 4}) {
    ExecOptions options;
    options.num_threads = threads;
    rope_forward(rot, t.view(), op, nullptr, options);
    EXPECT_EQ(last_call_threads(), threads) << "RoME's pool";
    options.parallel_for = host_parallel_for;
    g_host_chunks = 0;
    rope_forward(rot, t.view(), op, nullptr, options);
    EXPECT_EQ(last_call_threads(), threads) << "host pool";
    EXPECT_EQ(g_host_chunks.load(), threads == 1 ? 0 : threads) << "host pool chunks";
  }
  TestTensor decode = TestTensor::make(DType::bf16, {1, 32, 1, 128});
  decode.fill_random(rng, -1, 1);
  const TestTables one = random_tables(1, rng);
  ExecOptions options;
  options.num_threads = 8;
  options.parallel_for = host_parallel_for;
  g_host_chunks = 0;
  rope_forward(rot, one.view(), Operand{decode.cview(), decode.view()}, nullptr, options);
  EXPECT_EQ(last_call_threads(), 1);
  EXPECT_EQ(g_host_chunks.load(), 0) << "a decode step must not wake a pool";
}

// Below min_parallel_bytes a call stays on the calling thread; 0 splits any call; -1 is RoME's
// threshold (256 KiB); anything below -1 is refused before a write.
TEST(Executor, MinParallelBytesDecidesTheSplit) {
  const Rotation rot = Rotation::half(128);
  TestTensor q = TestTensor::make(DType::bf16, {1, 32, 12, 128});  // 192 KiB moved
  std::mt19937_64 rng(5);
  q.fill_random(rng, -1, 1);
  const TestTables t = random_tables(12, rng);
  const Operand op{q.cview(), q.view()};
  ExecOptions options;
  options.num_threads = 2;
  rope_forward(rot, t.view(), op, nullptr, options);
  EXPECT_EQ(last_call_threads(), 1) << "below RoME's threshold";
  options.min_parallel_bytes = 0;
  rope_forward(rot, t.view(), op, nullptr, options);
  EXPECT_EQ(last_call_threads(), 2) << "threshold 0";
  options.min_parallel_bytes = 192 * 1024 + 1;
  rope_forward(rot, t.view(), op, nullptr, options);
  EXPECT_EQ(last_call_threads(), 1) << "one byte over the call";
  options.min_parallel_bytes = 192 * 1024;
  rope_forward(rot, t.view(), op, nullptr, options);
  EXPECT_EQ(last_call_threads(), 2) << "exactly the call";
  const TestTensor before = q;
  options.min_parallel_bytes = -2;
  try {
    rope_forward(rot, t.view(), op, nullptr, options);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("options.min_parallel_bytes"), std::string::npos)
        << e.what();
  }
  EXPECT_TRUE(q.storage == before.storage);
}

// RoME's default threshold on every ISA: a vLLM-shaped decode step of 16 tokens (320 KiB) splits,
// one of 12 (240 KiB) stays on the caller.
TEST(Executor, DefaultThresholdSplitsSixteenTokensNotTwelve) {
  const Rotation rot = Rotation::half(128);
  for (std::int64_t tokens : {12, 16}) {
    TestTensor q = TestTensor::make(DType::bf16, {1, 32, tokens, 128});
    TestTensor k = TestTensor::make(DType::bf16, {1, 8, tokens, 128});
    std::mt19937_64 rng(6);
    q.fill_random(rng, -1, 1);
    k.fill_random(rng, -1, 1);
    const TestTables t = random_tables(tokens, rng);
    const Operand oq{q.cview(), q.view()}, ok{k.cview(), k.view()};
    ExecOptions options;
    options.num_threads = 2;
    for (Isa isa : isas_under_test()) {
      ScopedIsa scoped(isa);
      rope_forward(rot, t.view(), oq, &ok, options);
      EXPECT_EQ(last_call_threads(), tokens == 16 ? 2 : 1) << isa_name(isa) << ", T = " << tokens;
    }
  }
}

TEST(Executor, RejectsBadTileTokens) {
  TestTensor q = TestTensor::make(DType::f32, {1, 1, 4, 8});
  q.fill([](const auto&) { return 1.0; });
  TestTables t;
  t.cos = TestTensor::make(DType::f32, {4, 8});
  t.sin = TestTensor::make(DType::f32, {4, 8});
  t.cos.fill([](const auto&) { return 1.0; });
  t.sin.fill([](const auto&) { return 0.0; });
  const TestTensor before = q;
  ExecOptions options;
  options.tile_tokens = -1;
  try {
    rope_forward(Rotation::half(8), t.view(), Operand{q.cview(), q.view()}, nullptr, options);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("options.tile_tokens"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(q.storage == before.storage);
}

}  // namespace
}  // namespace rome::testing
