// Non-finite and extreme values on every ISA, against the double reference: NaN and Inf reach
// only the lanes the rotation pairs, fp16 overflow rounds to ±inf as the exact value does, and
// subnormal inputs and results are kept.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "core/dispatch.hpp"
#include "isa_testing.hpp"
#include "kernels/kernel_api.hpp"
#include "reference.hpp"
#include "rome/rome.hpp"

namespace rome::testing {
namespace {

// x dtype and table dtype: 16-bit x takes the one-fma epilogue (kernel_api.hpp's
// single_fma_epilogue; exact products with 16-bit tables), fp32 x the compensated one.
class EdgeValues : public ::testing::TestWithParam<std::tuple<Isa, DType, DType>> {};

TEST_P(EdgeValues, MatchReference) {
  const auto [isa, dtype, table_dtype] = GetParam();
  ScopedIsa scoped(isa);
  const Rotation rotation = Rotation::half(32);
  TestTensor x = TestTensor::make(dtype, {4, 32});
  const double inf = std::numeric_limits<double>::infinity();
  // fp16: 60000·1.5 + 60000·0.75 is past 65504, while fp32 intermediates stay finite. (For fp32
  // and bf16 storage the math is fp32: an fp32 intermediate overflow is inf by definition, so
  // the row stays below it.)
  const double big = dtype == DType::f16 ? 60000.0 : 1.0e38;
  const double tiny = dtype == DType::f16 ? 3.0e-7 : dtype == DType::bf16 ? 1.0e-39 : 1.0e-42;
  x.fill([&](const auto& i) {
    const std::int64_t r = i[0], j = i[1];
    if (r == 0 && j == 3) return std::nan("");
    if (r == 1 && j == 20) return -inf;
    if (r == 2) return big;
    if (r == 3) return tiny * double(j + 1);
    return 0.25 * double(j % 7) - 0.5;
  });
  TestTables tables;
  tables.cos = TestTensor::make(table_dtype, {4, 32});
  tables.sin = TestTensor::make(table_dtype, {4, 32});
  tables.cos.fill([](const auto& i) { return i[0] == 2 ? 1.5 : 0.5 + 0.01 * double(i[1]); });
  tables.sin.fill([](const auto& i) { return i[0] == 2 ? 0.75 : 0.3 - 0.01 * double(i[1]); });
  const std::vector<double> ref = reference_forward(rotation, tables, x);
  TestTensor out = TestTensor::make(dtype, x.shape);
  rope_forward(rotation, tables.view(), Operand{x.cview(), out.view()});
  const Comparison c = compare(out, ref);
  EXPECT_TRUE(c.ok) << c.first_failure;
  // NaN in lane 3 of row 0 reaches lanes 3 and 19 (its half partner) only.
  for (std::int64_t j = 0; j < 32; ++j)
    EXPECT_EQ(std::isnan(out.get({0, j})), j == 3 || j == 19) << "lane " << j;
  // fp16: beyond 65504 the result is ±inf, as the exact value rounded to fp16.
  if (dtype == DType::f16) {
    EXPECT_TRUE(std::isinf(out.get({2, 16})) && out.get({2, 16}) > 0);
  }
}

INSTANTIATE_TEST_SUITE_P(AllIsas, EdgeValues,
                         ::testing::Combine(::testing::ValuesIn(isas_under_test()),
                                            ::testing::Values(DType::f32, DType::f16, DType::bf16),
                                            ::testing::Values(DType::f32, DType::f16,
                                                              DType::bf16)));

// The one-fma epilogue (16-bit x), the compensated one of fp32 x (its guard for an infinite or
// NaN x·c) and the bf16 narrowing without a NaN case (bf16 x, and bf16 tables or even/odd rows
// the core prepared from fp32 / fp16 tables, NaN low bits cleared), bit for bit against the
// scalar kernel on every ISA, with NaNs (signalling, payloads, both
// signs) in x and in either table, infinities, inf·0, subnormal products, cancelling terms and
// overflow. One NaN source per output lane, so no result depends on which NaN an fma keeps. An
// fp16 table NaN with every payload bit set would round to -0 or to another payload if a
// kernel skipped the NaN case where it must not.
struct SpecialCase {
  DType x_dtype, table_dtype;
  Rotation rotation;
  const char* name;
  bool deinterleaved = false;  // A moves x's lane l to lane l / 2, odd lanes after the evens
};

class OneFmaEpilogue : public ::testing::TestWithParam<std::tuple<Isa, int>> {};

std::vector<SpecialCase> special_cases() {
  std::vector<SpecialCase> cases;
  const std::pair<Rotation, const char*> rotations[] = {
      {Rotation::half(32), "half32"},
      {Rotation::interleave(32), "interleave32"},
      {Rotation::quarter(64), "quarter64"},
      {Rotation::half(24), "half24"},
      // AVX2's shifted_two rows (bf16: 16 lanes at a time); AVX-512's compiled plans
      {Rotation::block_diag({Rotation::half(44), Rotation::half(44), Rotation::half(40)}),
       "half3d_44_44_40"},
      {Rotation::block_diag({Rotation::half(44), Rotation::half(42), Rotation::half(42)}),
       "half3d_44_42_42"},
      {Rotation::interleave_half(64), "interleave_half64"},
      {Rotation::interleave_half(128), "interleave_half128"}};
  for (DType x : {DType::bf16, DType::f16, DType::f32})
    for (DType t : {DType::bf16, DType::f16, DType::f32})
      for (const auto& [rotation, name] : rotations)
        cases.push_back({x, t, rotation, name, std::string(name).starts_with("interleave_half")});
  return cases;
}

// The storage bits of element e.
std::uint32_t bits_at(const TestTensor& t, std::int64_t e) {
  const auto* p = static_cast<const unsigned char*>(t.at(t.unravel(e)));
  std::uint32_t u = 0;
  std::memcpy(&u, p, std::size_t(dtype_size(t.dtype)));
  return u;
}

void set_bits(TestTensor& t, const std::vector<std::int64_t>& idx, std::uint32_t u) {
  std::memcpy(t.at(idx), &u, std::size_t(dtype_size(t.dtype)));
}

// A NaN of the dtype with every payload bit set (quiet), negative, or signalling with one bit.
std::uint32_t nan_bits(DType d, int which) {
  switch (d) {
    case DType::bf16: return which == 0 ? 0x7fffu : which == 1 ? 0xffc1u : 0x7f81u;
    case DType::f16: return which == 0 ? 0x7fffu : which == 1 ? 0xfe01u : 0x7c01u;
    default: return which == 0 ? 0x7fffffffu : which == 1 ? 0xffc12345u : 0x7f800001u;
  }
}

TEST_P(OneFmaEpilogue, SpecialValuesMatchScalarBitForBit) {
  const auto [isa, index] = GetParam();
  const SpecialCase c = special_cases()[std::size_t(index)];
  const std::int64_t rd = c.rotation.rotary_dim(), rows = 9;
  const double inf = std::numeric_limits<double>::infinity();
  TestTensor x = TestTensor::make(c.x_dtype, {rows, rd});
  TestTables tables;
  tables.cos = TestTensor::make(c.table_dtype, {rows, rd});
  tables.sin = TestTensor::make(c.table_dtype, {rows, rd});
  x.fill([&](const auto& i) { return 0.25 * double((i[0] * 7 + i[1]) % 11) - 1.125; });
  tables.cos.fill([&](const auto& i) { return 0.9 - 0.02 * double(i[1]); });
  tables.sin.fill([&](const auto& i) { return 0.1 + 0.015 * double(i[1]); });
  // The output lane x's lane l reaches through A (its cosine term).
  auto through_a = [&](std::int64_t l) { return c.deinterleaved ? (l % 2) * rd / 2 + l / 2 : l; };
  // Lanes 1, 5 and 9 are nobody's partner of each other in these rotations.
  set_bits(x, {1, 1}, nan_bits(c.x_dtype, 2));
  x.set({1, 9}, -inf);
  set_bits(tables.cos, {2, 5}, nan_bits(c.table_dtype, 0));
  set_bits(tables.sin, {3, 9}, nan_bits(c.table_dtype, 1));
  // Signalling, its payload in the low 16 bits (fp32) or in the bits an fp32 widening puts there
  // (fp16): bf16 rows that narrow without a NaN case must still give a NaN, not an infinity.
  set_bits(tables.cos, {3, 1}, nan_bits(c.table_dtype, 2));
  tables.sin.set({2, 1}, inf);
  x.set({4, 5}, inf);
  tables.cos.set({4, through_a(5)}, 0.0);  // inf·0: the default NaN
  for (std::int64_t j = 0; j < rd; ++j) {
    x.set({5, j}, (j % 2 ? -1.0 : 1.0) * 1.5e-38 * double(j + 1));  // subnormal products
    tables.cos.set({5, j}, 0.0078125 * double(j % 5 + 1));
    x.set({6, j}, j % 3 ? 3.0e38 : -2.0e38);  // overflow past fp32 (bf16) or fp16
    tables.cos.set({6, j}, 1.5);
    x.set({7, j}, 1.0 + double(j) / 64.0);  // terms that cancel: xa·c ≈ -xb·s
    tables.cos.set({7, j}, 0.5);
    tables.sin.set({7, j}, -0.5);
    // Terms that cancel where xa·c is not exact (fp32 tables): the one fma and the compensated
    // sum differ in the 16-bit result, so a kernel taking the other form shows.
    x.set({8, j}, 1.5);
    tables.cos.set({8, j}, 0.1);
    tables.sin.set({8, j}, (j % 2 ? -0.1 : 0.1) + 1e-7);
  }
  auto run = [&](Isa run_isa) {
    ScopedIsa scoped(run_isa);
    TestTensor out = TestTensor::make(c.x_dtype, x.shape);
    rope_forward(c.rotation, tables.view(), Operand{x.cview(), out.view()});
    TestTensor in_place = x;
    rope_forward(c.rotation, tables.view(), Operand{in_place.cview(), in_place.view()});
    return std::make_pair(out, in_place);
  };
  const auto expected = run(Isa::scalar);
  const auto got = run(isa);
  for (std::int64_t e = 0; e < x.numel(); ++e) {
    ASSERT_EQ(bits_at(got.first, e), bits_at(expected.first, e))
        << c.name << " element " << e << " (out of place)";
    ASSERT_EQ(bits_at(got.second, e), bits_at(expected.second, e))
        << c.name << " element " << e << " (in place)";
  }
  // The NaN sources reach their lanes; a NaN in x is kept quiet with its payload.
  EXPECT_TRUE(std::isnan(expected.first.get({1, through_a(1)})));
  EXPECT_TRUE(std::isnan(expected.first.get({2, 5})));
  EXPECT_TRUE(std::isnan(expected.first.get({3, 9})));
  EXPECT_TRUE(std::isnan(expected.first.get({3, 1})));
  EXPECT_TRUE(std::isnan(expected.first.get({4, through_a(5)})));
  if (c.x_dtype == DType::bf16) {
    EXPECT_EQ(bits_at(expected.first, 1 * rd + through_a(1)), 0x7fc1u);
  }
}

INSTANTIATE_TEST_SUITE_P(AllIsas, OneFmaEpilogue,
                         ::testing::Combine(::testing::ValuesIn(isas_under_test()),
                                            ::testing::Range(0, int(special_cases().size()))),
                         [](const auto& info) {
                           const SpecialCase c =
                               special_cases()[std::size_t(std::get<1>(info.param))];
                           return std::string(isa_name(std::get<0>(info.param))) + "_" +
                                  dtype_name(c.x_dtype) + "_x_" + dtype_name(c.table_dtype) +
                                  "_tables_" + c.name;
                         });

struct NamedRotation {
  const char* name;
  Rotation rotation;
};

// Every rotation on `tables` (kernel tables of `isa`) gives the scalar kernel's bits: x and tables
// in every dtype, in place and out of place, a round with a NaN, an infinity and a row of
// subnormal products, the plan cache switching rotation on every call.
void expect_bits_of_scalar(
    const std::vector<NamedRotation>& cases, Isa isa,
    const std::vector<std::pair<const kernels::KernelTable*, const char*>>& tables) {
  std::mt19937_64 rng(11);
  for (int round = 0; round < 2; ++round)
    for (DType xd : {DType::f32, DType::f16, DType::bf16})
      for (DType td : {DType::f32, DType::bf16})
        for (const NamedRotation& c : cases) {
          const std::int64_t hd = c.rotation.head_dim(), rd = c.rotation.rotary_dim(), rows = 37;
          TestTensor x = TestTensor::make(xd, {rows, hd});
          x.fill_random(rng, -2.0, 2.0);
          if (round == 1) {
            x.set({3, 7}, std::numeric_limits<double>::quiet_NaN());
            x.set({4, 9}, std::numeric_limits<double>::infinity());
            for (std::int64_t j = 0; j < hd; ++j) x.set({5, j}, 1e-39 * double(j + 1));
          }
          TestTables t;
          t.cos = TestTensor::make(td, {rows, rd});
          t.sin = TestTensor::make(td, {rows, rd});
          t.cos.fill_random(rng, -1.0, 1.0);
          t.sin.fill_random(rng, -1.0, 1.0);
          auto run = [&](Isa run_isa, const kernels::KernelTable* table, bool in_place) {
            ScopedIsa scoped_isa(run_isa);
            ScopedKernels scoped_kernels(table);
            TestTensor out = in_place ? x : TestTensor::make(xd, x.shape);
            rope_forward(c.rotation, t.view(),
                         Operand{in_place ? out.cview() : x.cview(), out.view()});
            return out;
          };
          const TestTensor want = run(Isa::scalar, nullptr, false);
          for (const auto& [table, label] : tables)
            for (bool in_place : {false, true}) {
              const TestTensor got = run(isa, table, in_place);
              for (std::int64_t e = 0; e < x.numel(); ++e)
                ASSERT_EQ(bits_at(got, e), bits_at(want, e))
                    << c.name << ", x " << dtype_name(xd) << ", tables " << dtype_name(td) << ", "
                    << label << (in_place ? ", in place" : "") << ", element " << e;
            }
        }
}

// AVX2's 3D rotations (shifted_two): bf16 rows run 16 lanes at a time on even/odd tables when
// every 16 lanes take B from at most two offsets, and keep the fp32 row otherwise; rows of
// 44/44/40 and 44/42/42 in every dtype stay in registers on compiled layouts (also inside wider
// heads); every way gives the scalar kernel's bits, as do near misses of the compiled layouts (the
// same blocks in another order), which run on the row copies.
TEST(Avx2ShiftedRows, EvenOddTablesWhereSixteenLanesTakeTwoOffsetsAndEveryWayMatchesScalar) {
  const std::vector<Isa> isas = isas_under_test();
  if (std::find(isas.begin(), isas.end(), Isa::avx2) == isas.end())
    GTEST_SKIP() << "AVX2 is not under test";
  struct Case {
    NamedRotation named;
    bool even_odd;  // bf16 rows on even/odd tables
  };
  auto halves = [](int a, int b, int c) {
    return Rotation::block_diag({Rotation::half(a), Rotation::half(b), Rotation::half(c)});
  };
  const Case cases[] = {
      {{"halves_44_44_40", halves(44, 44, 40)}, true},
      {{"halves_44_42_42", halves(44, 42, 42)}, true},
      {{"halves_16_56_56", halves(16, 56, 56)}, true},
      {{"halves_40_44_44", halves(40, 44, 44)}, true},
      {{"halves_42_44_42", halves(42, 44, 42)}, true},
      {{"halves_44_44_40_of_192", halves(44, 44, 40).partial(192)}, true},
      {{"halves_44_42_42_of_160", halves(44, 42, 42).partial(160)}, true},
      // 256 lanes: the row copies live in the thread's scratch buffer, not on the stack.
      {{"halves_88_88_80", halves(88, 88, 80)}, true},
      // Lanes 0-15 take B from offsets +6, -6 and +10 (two per 8-lane vector): the fp32 row.
      {{"halves_12_20_96", halves(12, 20, 96)}, false},
  };
  std::vector<NamedRotation> named;
  for (const Case& c : cases) {
    const kernels::TableLayoutFn layout = kernels::avx2_kernels().permute_table_layout;
    ASSERT_NE(layout, nullptr);
    EXPECT_EQ(layout(c.named.rotation.data(), DType::bf16) == kernels::TableLayout::even_odd_16,
              c.even_odd)
        << c.named.name;
    EXPECT_EQ(layout(c.named.rotation.data(), DType::f32), kernels::TableLayout::natural)
        << c.named.name;
    named.push_back(c.named);
  }
  expect_bits_of_scalar(named, Isa::avx2, {{&kernels::avx2_kernels(), "avx2"}});
}

// AVX2's interleave-half rows: output vector pairs (u, u + 1 and H + u, H + u + 1) stored at once,
// then the last vector of each half alone when H is odd (48, 80 lanes), in and out of place.
TEST(Avx2Deinterleave, VectorPairsAndTheOddVectorMatchScalar) {
  const std::vector<Isa> isas = isas_under_test();
  if (std::find(isas.begin(), isas.end(), Isa::avx2) == isas.end())
    GTEST_SKIP() << "AVX2 is not under test";
  expect_bits_of_scalar({{"interleave_half_48", Rotation::interleave_half(48)},
                         {"interleave_half_80", Rotation::interleave_half(80)},
                         {"interleave_half_128", Rotation::interleave_half(128)},
                         {"interleave_half_64_of_96", Rotation::interleave_half(64).partial(96)}},
                        Isa::avx2, {{&kernels::avx2_kernels(), "avx2"}});
}

#ifdef ROME_TEST_HAVE_AVX512
// The permutations compiled into the AVX-512 kernels: each is picked for its own rotation and for
// no near miss (those run on the per-rotation tables); and every kind on both AVX-512 tables
// (bf16 narrowed by AVX512-BF16's instructions or in integer arithmetic) gives the scalar kernel's
// bits, the plan cache switching rotation on every call.
TEST(CompiledPermutes, PickedForTheirRotationsOnlyAndEveryKindMatchesScalar) {
  const std::vector<Isa> isas = isas_under_test();
  if (std::find(isas.begin(), isas.end(), Isa::avx512) == isas.end())
    GTEST_SKIP() << "AVX-512 is not under test";
  const Rotation halves_44_44_40 =
      Rotation::block_diag({Rotation::half(44), Rotation::half(44), Rotation::half(40)});
  const Rotation il64 = Rotation::interleave_half(64);
  std::vector<float> flipped = halves_44_44_40.to_dense_b(), one_lane_empty = flipped;
  for (float& v : flipped) v = -v;
  for (int i = 0; i < 128; ++i) one_lane_empty[i * 128 + 5] = 0.0f;
  std::vector<float> a_lane0_empty = il64.to_dense_a();
  for (int i = 0; i < 64; ++i) a_lane0_empty[i * 64] = 0.0f;  // its source would read as lane 0
  struct Case {
    NamedRotation named;
    int plan;  // kernels::avx512_compiled_plan
  };
  const Case cases[] = {
      {{"halves_44_44_40", halves_44_44_40}, 1},
      {{"halves_44_42_42",
        Rotation::block_diag({Rotation::half(44), Rotation::half(42), Rotation::half(42)})},
       2},
      {{"interleave_half_64", il64}, 3},
      {{"interleave_half_128", Rotation::interleave_half(128)}, 4},
      {{"signs_flipped", Rotation::dense(flipped, 128)}, 1},  // signs live in the tables
      {{"interleave_half_128_of_256", Rotation::interleave_half(128).partial(256)}, 4},
      {{"halves_40_44_44",
        Rotation::block_diag({Rotation::half(40), Rotation::half(44), Rotation::half(44)})},
       0},
      {{"one_lane_empty", Rotation::dense(one_lane_empty, 128)}, 0},
      {{"a_lane0_empty", Rotation::dense(a_lane0_empty, il64.to_dense_b(), 64)}, 0},
      {{"b_of_interleave_half_a_identity", Rotation::dense(il64.to_dense_b(), 64)}, 0},
      {{"b_of_3d_a_deinterleave", Rotation::dense(Rotation::interleave_half(128).to_dense_a(),
                                                  halves_44_44_40.to_dense_b(), 128)},
       0},
      {{"interleave_half_32", Rotation::interleave_half(32)}, 0},
      {{"interleave_half_64_at_32_of_128", il64.partial(128, 32)}, -1},  // plan of the shifted form
      // AVX-512's other kinds, on the table the core installs without AVX512-BF16 too: only
      // this test runs them there on a CPU that has the instructions.
      {{"half_128", Rotation::half(128)}, -1},
      {{"half_64", Rotation::half(64)}, -1},
      {{"half_256", Rotation::half(256)}, -1},
      {{"half_80", Rotation::half(80)}, -1},
      {{"interleave_128", Rotation::interleave(128)}, -1},
      {{"quarter_128", Rotation::quarter(128)}, -1},
      {{"halves_64_64", Rotation::block_diag({Rotation::half(64), Rotation::half(64)})}, -1},
      {{"halves_16_56_56",
        Rotation::block_diag({Rotation::half(16), Rotation::half(56), Rotation::half(56)})},
       -1},
      {{"half_64_of_128", Rotation::half(64).partial(128)}, -1},
      {{"interleave_half_96", Rotation::interleave_half(96)}, -1},
  };
  std::vector<NamedRotation> named;
  for (const Case& c : cases) {
    if (c.plan >= 0) {
      EXPECT_EQ(kernels::avx512_compiled_plan(c.named.rotation.data()), c.plan) << c.named.name;
    }
    named.push_back(c.named);
  }
  std::vector<std::pair<const kernels::KernelTable*, const char*>> tables{
      {&kernels::avx512_kernels(false), "integer bf16 narrowing"}};
  if (detail::cpu_features().avx512_bf16)
    tables.push_back({&kernels::avx512_kernels(true), "AVX512-BF16"});
  expect_bits_of_scalar(named, Isa::avx512, tables);
}
#endif

// The dense forward's epilogue where xa·c overflows fp32 from finite inputs: fp32 x's compensated
// epilogue guards its error term there (inf, where the unguarded form would give inf − inf = NaN),
// bf16 x's one fma gives inf as well. Bit for bit against the scalar kernel on every ISA, 16 lanes
// at a time (AVX2 bf16 narrows pairs) and the last lanes alone, with a table NaN whose pair must
// take the NaN-aware narrowing. The matrix has an entry not exact in bf16, so every ISA takes its
// FMA products (AMX's tile unit, which sums in its own order, is left out for bf16 x).
TEST(DenseEpilogue, OverflowingProductsMatchScalarBitForBit) {
  const std::int64_t rd = 40, rows = 7;
  std::vector<float> b = Rotation::half(rd).to_dense_b();
  b[std::size_t(3 * rd + 23)] = 1.0009765625f;  // 1 + 2^-10
  const Rotation rotation = Rotation::dense(b, rd);
  for (DType dtype : {DType::f32, DType::bf16}) {
    TestTensor x = TestTensor::make(dtype, {rows, rd});
    TestTables tables;
    tables.cos = TestTensor::make(DType::f32, {rows, rd});
    tables.sin = TestTensor::make(DType::f32, {rows, rd});
    x.fill([](const auto& i) {
      const std::int64_t r = i[0], j = i[1];
      if (r == 1) return j % 3 ? 3.0e38 : -2.0e38;  // xa·c past FLT_MAX
      if (r == 3 && j == 37) return 3.0e38;         // one overflow among the last lanes
      if (r == 6) return 1.5;
      return 0.25 * double((r * 5 + j) % 9) - 1.0;
    });
    // Row 6: terms that cancel where xa·c is not exact, so the epilogue's form shows in bf16.
    tables.cos.fill([](const auto& i) {
      return i[0] == 6 ? 0.1 : i[0] % 2 ? 1.5 : 0.9 - 0.01 * double(i[1]);
    });
    tables.sin.fill([](const auto& i) {
      return i[0] == 6  ? (i[1] < 20 ? 0.1 : -0.1) + 1e-7
             : i[0] % 2 ? 0.75
                        : 0.2 + 0.01 * double(i[1]);
    });
    // A NaN with low payload bits: its pair takes the NaN-aware narrowing, which quietens it
    // with those bits dropped as the scalar conversion does.
    const std::uint32_t nan = 0x7f80ffffu;
    std::memcpy(tables.cos.at({4, 5}), &nan, sizeof nan);
    auto run = [&](Isa isa) {
      ScopedIsa scoped(isa);
      TestTensor out = TestTensor::make(dtype, x.shape);
      rope_forward(rotation, tables.view(), Operand{x.cview(), out.view()});
      return out;
    };
    const TestTensor expected = run(Isa::scalar);
    EXPECT_TRUE(std::isinf(expected.get({1, 0})));
    EXPECT_TRUE(std::isinf(expected.get({3, 37})));
    EXPECT_TRUE(std::isnan(expected.get({4, 5})));
    for (Isa isa : isas_under_test()) {
      if (isa == Isa::amx && dtype == DType::bf16) continue;
      const TestTensor got = run(isa);
      for (std::int64_t e = 0; e < x.numel(); ++e)
        ASSERT_EQ(bits_at(got, e), bits_at(expected, e))
            << isa_name(isa) << " " << dtype_name(dtype) << " element " << e;
    }
  }
}

}  // namespace
}  // namespace rome::testing
