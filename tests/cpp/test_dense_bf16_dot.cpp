// The avx512 ISA's bf16 dot-product path (vdpbf16ps, CPUs with AVX512-BF16): bf16 x times
// matrices whose every entry is exact in bf16. The products are exact but the instruction sums
// them in its own order and flushes subnormals, so the path is held to the fp32 dot-product
// bound against the fp64 reference (the FMA path's bound, tighter than the tile unit's), not to
// the scalar kernel's bits. A matrix with one entry not exact in bf16 keeps the FMA path, which is
// the scalar kernel bit for bit. The core picks this kernel table only where vdpbf16ps is as fast
// as an fma (AMD); the tests install it on any CPU with AVX512-BF16.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <random>

#include "core/convert.hpp"
#include "core/dispatch.hpp"
#include "isa_testing.hpp"
#include "kernels/kernel_api.hpp"
#include "reference.hpp"
#include "rome/rome.hpp"

namespace rome::testing {
namespace {

// Why this machine cannot run the path; empty when it can.
std::string dot_path_unavailable() {
  const std::vector<Isa> isas = isas_under_test();
  if (std::find(isas.begin(), isas.end(), Isa::avx512) == isas.end())
    return "the avx512 ISA is not available here (build, CPU or ROME_MAX_ISA)";
  if (!detail::cpu_features().avx512_bf16) return "this CPU has no AVX512-BF16";
  return "";
}

// The avx512 kernel table with the dot-product dense kernel (whatever the core would pick on this
// CPU; nullptr where the build has no AVX-512).
const kernels::KernelTable* dot_path_kernels() {
#ifdef ROME_TEST_HAVE_AVX512
  return &kernels::avx512_kernels(true, true);
#else
  return nullptr;
#endif
}

float to_bf16(float v) {
  return detail::bf16_to_float(detail::float_to_bf16(v));
}

// n × n values in [-scale, scale], rounded to bf16; zero outside the diagonal blocks `sizes`.
std::vector<float> bf16_matrix(std::int64_t n, std::uint64_t seed,
                               std::vector<std::int64_t> sizes = {}, float scale = 1.0f) {
  if (sizes.empty()) sizes = {n};
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-scale, scale);
  std::vector<float> m(n * n, 0.0f);
  std::int64_t o = 0;
  for (const std::int64_t size : sizes) {
    for (std::int64_t i = o; i < o + size; ++i)
      for (std::int64_t j = o; j < o + size; ++j) m[i * n + j] = to_bf16(u(rng));
    o += size;
  }
  return m;
}

struct DotCase {
  std::string name;
  std::function<Rotation()> make;
};

const std::vector<DotCase>& dot_cases() {
  static const std::vector<DotCase> cases = {
      {"dense_128", [] { return Rotation::dense(bf16_matrix(128, 1), 128); }},
      {"two_matrices_64",
       [] { return Rotation::dense(bf16_matrix(64, 2), bf16_matrix(64, 3), 64); }},
      {"blocks_44_44_40",
       [] {
         return Rotation::dense(bf16_matrix(128, 4, {44, 44, 40}), 128);
       }},
      {"blocks_18_22",
       [] {
         return Rotation::dense(bf16_matrix(40, 5, {18, 22}), 40);
       }},
      // Odd blocks: each is padded with a zero lane to whole pairs; with A = I the epilogue reads
      // x at the blocks' own offsets, not the staged ones.
      {"blocks_19_21",
       [] {
         return Rotation::dense(bf16_matrix(40, 10, {19, 21}), 40);
       }},
      {"blocks_19_21_two_matrices",
       [] {
         return Rotation::dense(bf16_matrix(40, 6, {19, 21}), bf16_matrix(40, 7, {19, 21}), 40);
       }},
      // Dense A: panels of 12 and 8 columns take one vector per row.
      {"blocks_44_44_40_two_matrices",
       [] {
         return Rotation::dense(bf16_matrix(128, 11, {44, 44, 40}),
                                bf16_matrix(128, 12, {44, 44, 40}), 128);
       }},
      {"one_block_of_2", [] { return Rotation::dense(bf16_matrix(2, 8), 2); }},
      {"partial_dense_50_of_64",
       [] { return Rotation::dense(bf16_matrix(50, 9), 50).partial(64); }},
      {"partial_two_matrices_50_of_64",
       [] { return Rotation::dense(bf16_matrix(50, 13), bf16_matrix(50, 14), 50).partial(64); }},
  };
  return cases;
}

// x's leading shape [batch, heads, seq] for 1, 7, 33, 126 and 96 rows. The executor hands the
// kernel one head's tokens per call (BNSD) or one token's heads (BSND): 1 to 21 rows, and 48
// (four whole groups of 12 rows, eight of 6) for the last shape's BNSD layouts.
const std::vector<std::int64_t> kRowShapes[] = {
    {1, 1, 1}, {1, 7, 1}, {1, 3, 11}, {2, 3, 21}, {1, 2, 48}};

const Layout kLayouts[] = {
    Layout{},              // contiguous
    Layout{{0, 2, 1, 3}},  // BSND memory: heads strided
    Layout{{}, 4, 1, 3},   // padded rows, heads reversed, shifted start
};

class Bf16Dot : public ::testing::TestWithParam<std::tuple<int, int, int, bool>> {};

TEST_P(Bf16Dot, MatchesReferenceWithinFmaBound) {
  const std::string unavailable = dot_path_unavailable();
  if (!unavailable.empty()) GTEST_SKIP() << unavailable;
  const auto [index, rows_index, layout_index, in_place] = GetParam();
  const Rotation rotation = dot_cases()[index].make();
  ASSERT_EQ(rotation.kind(), Rotation::Kind::dense);
  ASSERT_TRUE(rotation.data().pair_panel_packs().bf16_exact) << "the case must take the dot path";
  const std::vector<std::int64_t>& lead = kRowShapes[rows_index];
  const Layout& layout = kLayouts[layout_index];
  std::mt19937_64 rng(100 * index + 10 * rows_index + layout_index);
  TestTensor x =
      TestTensor::make(DType::bf16, {lead[0], lead[1], lead[2], rotation.head_dim()}, layout);
  x.fill_random(rng, -2, 2);
  TestTables tables;
  tables.cos = TestTensor::make(DType::f32, {lead[2], rotation.rotary_dim()});
  tables.sin = TestTensor::make(DType::f32, {lead[2], rotation.rotary_dim()});
  tables.cos.fill_random(rng, -1, 1);
  tables.sin.fill_random(rng, -1, 1);
  const Reference ref = reference(rotation, tables, x);
  ScopedKernels dot_path(dot_path_kernels());
  TestTensor out = in_place ? x : TestTensor::make(DType::bf16, x.shape, layout);
  rope_forward(rotation, tables.view(), Operand{in_place ? out.cview() : x.cview(), out.view()});
  const Comparison c = compare(out, ref.y, ref.bound);
  EXPECT_TRUE(c.ok) << dot_cases()[index].name << ": " << c.first_failure;
  EXPECT_TRUE(out.outside_view_untouched());
}

// Parameters: case, row shape, layout, in place.
std::string dot_test_name(const ::testing::TestParamInfo<std::tuple<int, int, int, bool>>& info) {
  static const char* const kRows[] = {"1", "7", "33", "126", "96"};
  static const char* const kLayoutNames[] = {"contiguous", "bsnd", "padded_reversed"};
  return dot_cases()[std::get<0>(info.param)].name + "_rows_" + kRows[std::get<1>(info.param)] +
         "_" + kLayoutNames[std::get<2>(info.param)] + (std::get<3>(info.param) ? "_in_place" : "");
}

INSTANTIATE_TEST_SUITE_P(Dense, Bf16Dot,
                         ::testing::Combine(::testing::Range(0, int(dot_cases().size())),
                                            ::testing::Range(0, 5), ::testing::Range(0, 3),
                                            ::testing::Bool()),
                         dot_test_name);

// Outputs that are fp32 subnormals: vcvtne2ps2bf16 would flush them to zero, so whole panels with
// one take the exact narrowing. x ~ 2^-100 times tables of 2^-30 puts every output near 2^-130,
// below fp32's smallest normal, where bf16 still has 7 bits of subnormal spacing 2^-133: a
// flushed output would be 8 or more bf16 ulps off.
TEST(Bf16Dot, SubnormalOutputsAreRoundedNotFlushed) {
  const std::string unavailable = dot_path_unavailable();
  if (!unavailable.empty()) GTEST_SKIP() << unavailable;
  const Rotation rotation = Rotation::dense(bf16_matrix(128, 31, {}, 0.5f), 128);
  ASSERT_TRUE(rotation.data().pair_panel_packs().bf16_exact);
  std::mt19937_64 rng(32);
  std::uniform_real_distribution<double> u(1.0, 2.0);
  TestTensor x = TestTensor::make(DType::bf16, {1, 2, 24, 128});
  x.fill([&](const auto&) { return (rng() % 2 ? 1 : -1) * u(rng) * 0x1p-100; });
  TestTables tables;
  tables.cos = TestTensor::make(DType::f32, {24, 128});
  tables.sin = TestTensor::make(DType::f32, {24, 128});
  tables.cos.fill([](const auto&) { return 0x1p-30; });
  tables.sin.fill([](const auto&) { return 0x1p-30; });
  const Reference ref = reference(rotation, tables, x);
  std::int64_t subnormal = 0;
  for (const double y : ref.y) subnormal += y != 0 && std::abs(y) < 0x1p-126;
  ASSERT_GT(subnormal, x.numel() / 2) << "the case must produce fp32 subnormal outputs";
  ScopedKernels dot_path(dot_path_kernels());
  for (const bool in_place : {false, true}) {
    TestTensor out = in_place ? x : TestTensor::make(DType::bf16, x.shape);
    rope_forward(rotation, tables.view(), Operand{in_place ? out.cview() : x.cview(), out.view()});
    const Comparison c = compare(out, ref.y, ref.bound);
    EXPECT_TRUE(c.ok) << (in_place ? "in place: " : "out of place: ") << c.first_failure;
  }
}

// One entry not exact in bf16 sends the whole matrix to the FMA path, the scalar kernel's bits.
// Output lane 7 is that entry alone times x[5] (sin 1, cos 0): were the entry rounded to bf16
// (1.0) for the dot path, lane 7 would be x[5] itself, half a bf16 ulp or more off in most rows.
TEST(Bf16Dot, OneInexactEntryFallsBackToFmaPath) {
  const std::string unavailable = dot_path_unavailable();
  if (!unavailable.empty()) GTEST_SKIP() << unavailable;
  const std::int64_t d = 64;
  std::vector<float> m = bf16_matrix(d, 21, {}, 0.25f);
  for (std::int64_t i = 0; i < d; ++i) m[i * d + 7] = 0.0f;
  m[5 * d + 7] = 1.0f + 0x1p-8f - 0x1p-16f;  // bf16 rounds it to 1.0
  ASSERT_NE(to_bf16(m[5 * d + 7]), m[5 * d + 7]);
  const Rotation rotation = Rotation::dense(m, d);
  ASSERT_FALSE(rotation.data().pair_panel_packs().bf16_exact);
  std::mt19937_64 rng(22);
  TestTensor x = TestTensor::make(DType::bf16, {1, 3, 42, d});
  x.fill_random(rng, 0.5, 2);
  TestTables tables;
  tables.cos = TestTensor::make(DType::f32, {42, d});
  tables.sin = TestTensor::make(DType::f32, {42, d});
  tables.cos.fill([](const auto&) { return 0.0; });
  tables.sin.fill([](const auto&) { return 1.0; });
  for (const bool in_place : {false, true}) {
    TestTensor want = in_place ? x : TestTensor::make(DType::bf16, x.shape), got = want;
    {
      ScopedIsa scoped(Isa::scalar);
      rope_forward(rotation, tables.view(),
                   Operand{in_place ? want.cview() : x.cview(), want.view()});
    }
    {
      ScopedKernels dot_path(dot_path_kernels());
      rope_forward(rotation, tables.view(),
                   Operand{in_place ? got.cview() : x.cview(), got.view()});
    }
    std::int64_t mismatches = 0, first = -1;
    for (std::int64_t e = 0; e < x.numel(); ++e)
      if (std::memcmp(want.at(x.unravel(e)), got.at(x.unravel(e)), 2) != 0 && !mismatches++)
        first = e;
    EXPECT_EQ(mismatches, 0) << (in_place ? "in place" : "out of place")
                             << ": differs from the scalar kernel first at lane " << first % d
                             << " of row " << first / d;
    // The test would see a rounded entry: lane 7 differs from x[5] in over a third of the rows.
    int rows_off_x5 = 0;
    for (std::int64_t h = 0; h < 3; ++h)
      for (std::int64_t s = 0; s < 42; ++s)
        rows_off_x5 += want.get({0, h, s, 7}) != x.get({0, h, s, 5});
    EXPECT_GT(rows_off_x5, 42);
  }
}

}  // namespace
}  // namespace rome::testing
