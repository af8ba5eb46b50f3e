// Sizes past 32-bit indexing.
//
// Huge.Bf16OverTwoTo31Elements: x = [1, 1, 2^24 + 7, 128] bf16 (2^31 + 896 elements, 4.3 GB),
// rotated in place on the active ISA with an fp32 cache gathered by int64 positions; rows at the
// start, around element 2^31 and at the far end are checked against a double reference. It runs
// by default when the machine has the memory (about 4.5 GB; it takes a few seconds); it is
// skipped, with the reason printed, under sanitizers, when MemAvailable is below 7 GB, or when
// ROME_HUGE_TESTS=0. ROME_HUGE_TESTS=1 forces it (it then fails instead of skipping).
//
// Huge.PositionsNearInt32MaxAreRejected: int64 positions around INT32_MAX, 2^32, INT64_MIN/MAX
// against a small cache raise out_of_range naming positions (never wrap or truncate).
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "core/convert.hpp"
#include "rome/rome.hpp"

namespace {

using namespace rome;
using std::int64_t;

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr bool kSanitized = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
constexpr bool kSanitized = true;
#else
constexpr bool kSanitized = false;
#endif
#else
constexpr bool kSanitized = false;
#endif

int64_t mem_available_bytes() {
  std::ifstream f("/proc/meminfo");
  std::string key;
  int64_t value = 0;
  std::string unit;
  while (f >> key >> value >> unit)
    if (key == "MemAvailable:") return value * 1024;
  return -1;  // unknown
}

// The value of x[s, j]: a bf16-exact number in [-2, 2) that varies along both axes.
inline std::uint16_t x_bits(const std::uint16_t* table, int64_t s, int64_t j) {
  return table[std::uint64_t(s * 131 + j * 7) % 255];
}
inline int64_t position_of(int64_t s, int64_t rows) {
  return int64_t(std::uint64_t(s) * 2654435761u % std::uint64_t(rows));
}

struct FreeDeleter {
  void operator()(std::uint16_t* p) const { std::free(p); }
};

TEST(Huge, Bf16OverTwoTo31Elements) {
  const char* env = std::getenv("ROME_HUGE_TESTS");
  const bool forced = env && std::string(env) == "1";
  if (env && std::string(env) == "0") GTEST_SKIP() << "ROME_HUGE_TESTS=0";
  if (kSanitized && !forced)
    GTEST_SKIP() << "skipped under sanitizers (4.3 GB x); ROME_HUGE_TESTS=1 forces it";
  const int64_t avail = mem_available_bytes();
  if (!forced && avail >= 0 && avail < (int64_t(7) << 30))
    GTEST_SKIP() << "needs ~4.5 GB, MemAvailable is " << (avail >> 20)
                 << " MiB; ROME_HUGE_TESTS=1 forces it";

  const auto t0 = std::chrono::steady_clock::now();
  constexpr int64_t D = 128, S = (int64_t(1) << 24) + 7, rows = 4096;
  const int64_t n = S * D;
  ASSERT_GT(n, int64_t(1) << 31);
  std::unique_ptr<std::uint16_t, FreeDeleter> x(
      static_cast<std::uint16_t*>(std::malloc(std::size_t(n) * 2)));
  ASSERT_NE(x, nullptr) << "could not allocate " << n * 2 << " bytes";

  std::uint16_t values[255];
  for (int i = 0; i < 255; ++i) values[i] = detail::float_to_bf16(float(i - 127) / 64.0f);
  std::vector<int64_t> positions(S);
  {  // fill x (its rows repeat every 255) and positions on every core
    std::vector<std::uint16_t> period(255 * D);
    for (int64_t s = 0; s < 255; ++s)
      for (int64_t j = 0; j < D; ++j) period[s * D + j] = x_bits(values, s, j);
    const int workers = int(std::max(1u, std::thread::hardware_concurrency()));
    std::vector<std::thread> threads;
    for (int w = 0; w < workers; ++w)
      threads.emplace_back([&, w] {
        for (int64_t s = S * w / workers; s < S * (w + 1) / workers; ++s) {
          std::memcpy(x.get() + s * D, period.data() + (s % 255) * D, D * 2);
          positions[s] = position_of(s, rows);
        }
      });
    for (auto& t : threads) t.join();
  }
  std::vector<float> cos(rows * D), sin(rows * D);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < D; ++j) {
      const double angle = double(r) * std::pow(10000.0, -2.0 * double(j % (D / 2)) / double(D));
      cos[r * D + j] = float(std::cos(angle));
      sin[r * D + j] = float(std::sin(angle));
    }
  const auto t1 = std::chrono::steady_clock::now();

  const Rotation rotation = Rotation::half(D);
  Tables tables;
  tables.cos = make_view<const void*>(cos.data(), DType::f32, {rows, D});
  tables.sin = make_view<const void*>(sin.data(), DType::f32, {rows, D});
  tables.positions = make_view<const void*>(positions.data(), DType::i64, {1, 1, S});
  const auto xv = make_view<void*>(x.get(), DType::bf16, {1, 1, S, D});
  rope_forward(rotation, tables, Operand{as_const(xv), xv});
  const auto t2 = std::chrono::steady_clock::now();

  // Rows: the start, the rows around element 2^31 (row 2^24 starts there), the far end.
  std::vector<int64_t> check = {0, 1, 2, 4095, 4096};
  for (int64_t s = (int64_t(1) << 24) - 3; s < S; ++s) check.push_back(s);
  for (int64_t s = (int64_t(1) << 23) - 2; s < (int64_t(1) << 23) + 2; ++s)
    check.push_back(s);  // 2^30
  for (int64_t k = 1; k <= 64; ++k) check.push_back(S * k / 65);
  int bad = 0;
  for (int64_t s : check) {
    const int64_t p = position_of(s, rows);
    for (int64_t j = 0; j < D; ++j) {
      const double xj = detail::bf16_to_float(x_bits(values, s, j));
      const double partner =
          detail::bf16_to_float(x_bits(values, s, j < D / 2 ? j + D / 2 : j - D / 2));
      const double rotated = j < D / 2 ? -partner : partner;
      const double c = cos[p * D + j], sn = sin[p * D + j];
      const double want = xj * c + rotated * sn;
      const double got = detail::bf16_to_float(x.get()[s * D + j]);
      const double tol = (std::fabs(xj * c) + std::fabs(rotated * sn)) * 0x1p-8 + 1e-30;
      if (!(std::fabs(got - want) <= tol) && bad++ < 5)
        ADD_FAILURE() << "row " << s << " (element " << s * D + j << ") lane " << j << ": got "
                      << got << ", want " << want;
    }
  }
  EXPECT_EQ(bad, 0);
  const auto ms = [](auto a, auto b) {
    return std::chrono::duration<double, std::milli>(b - a).count();
  };
  std::printf(
      "[ rome ] x [1, 1, %lld, 128] bf16 = %lld elements (%.2f GB) on %s: fill %.0f ms, "
      "rope_forward %.0f ms (%.1f GB/s), %zu rows checked\n",
      (long long)S, (long long)n, double(n) * 2 / 1e9, isa_name(active_isa()), ms(t0, t1),
      ms(t1, t2), 2.0 * double(n) * 2 / 1e9 / (ms(t1, t2) / 1e3), check.size());
}

TEST(Huge, PositionsNearInt32MaxAreRejected) {
  constexpr int64_t D = 64, rows = 16, S = 4;
  std::vector<float> cos(rows * D, 0.5f), sin(rows * D, 0.25f);
  std::vector<float> x(S * D, 1.0f), out(S * D, -7.0f);
  const std::vector<float> untouched = out;
  const Rotation rotation = Rotation::half(D);
  auto call = [&](const void* positions, DType dtype) {
    Tables t;
    t.cos = make_view<const void*>(cos.data(), DType::f32, {rows, D});
    t.sin = make_view<const void*>(sin.data(), DType::f32, {rows, D});
    t.positions = make_view<const void*>(positions, dtype, {1, 1, S});
    rope_forward(rotation, t,
                 Operand{make_view<const void*>(x.data(), DType::f32, {1, 1, S, D}),
                         make_view<void*>(out.data(), DType::f32, {1, 1, S, D})});
  };
  const int64_t i32max = std::numeric_limits<std::int32_t>::max();
  const int64_t bad_values[] = {i32max,
                                i32max - 1,
                                i32max + 1,              // INT32_MIN if truncated
                                (int64_t(1) << 32),      // 0 if truncated to 32 bits
                                (int64_t(1) << 32) + 3,  // 3 if truncated
                                -(int64_t(1) << 32),     // 0 if truncated
                                rows,
                                -1,
                                std::numeric_limits<int64_t>::max(),
                                std::numeric_limits<int64_t>::min(),
                                std::numeric_limits<int64_t>::min() + 5};  // 5 if truncated
  for (int64_t bad : bad_values)
    for (int at = 0; at < S; ++at) {
      std::vector<int64_t> positions = {0, 1, 2, 3};
      positions[at] = bad;
      try {
        call(positions.data(), DType::i64);
        ADD_FAILURE() << "position " << bad << " at index " << at << " was accepted";
      } catch (const Error& e) {
        EXPECT_EQ(e.status(), Status::out_of_range) << e.what();
        EXPECT_EQ(e.argument(), "positions") << e.what();
        EXPECT_NE(std::string(e.what()).find(std::to_string(bad)), std::string::npos)
            << "the message should show the bad value: " << e.what();
      }
      EXPECT_EQ(out, untouched) << "written before the error (position " << bad << ")";
    }
  // int32 positions at the int32 limits.
  for (std::int32_t bad :
       {std::numeric_limits<std::int32_t>::max(), std::numeric_limits<std::int32_t>::min()}) {
    std::vector<std::int32_t> positions = {0, bad, 2, 3};
    try {
      call(positions.data(), DType::i32);
      ADD_FAILURE() << "int32 position " << bad << " was accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.status(), Status::out_of_range) << e.what();
      EXPECT_EQ(e.argument(), "positions") << e.what();
    }
    EXPECT_EQ(out, untouched);
  }
  // Control: the last row of the cache is fine.
  std::vector<int64_t> positions = {0, rows - 1, 2, 3};
  EXPECT_NO_THROW(call(positions.data(), DType::i64));
  EXPECT_FLOAT_EQ(out[D], 1.0f * 0.5f - 1.0f * 0.25f);
}

}  // namespace
