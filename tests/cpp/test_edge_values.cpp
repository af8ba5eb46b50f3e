// Non-finite and extreme values on every ISA, against the double reference: NaN and Inf reach
// only the lanes the rotation pairs, fp16 overflow rounds to ±inf as the exact value does, and
// subnormal inputs and results are kept.
#include <gtest/gtest.h>

#include <limits>

#include "isa_testing.hpp"
#include "reference.hpp"
#include "rome/rome.hpp"

namespace rome::testing {
namespace {

class EdgeValues : public ::testing::TestWithParam<std::tuple<Isa, DType>> {};

TEST_P(EdgeValues, MatchReference) {
  const auto [isa, dtype] = GetParam();
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
  tables.cos = TestTensor::make(DType::f32, {4, 32});
  tables.sin = TestTensor::make(DType::f32, {4, 32});
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
  if (dtype == DType::f16) EXPECT_TRUE(std::isinf(out.get({2, 16})) && out.get({2, 16}) > 0);
}

INSTANTIATE_TEST_SUITE_P(AllIsas, EdgeValues,
                         ::testing::Combine(::testing::ValuesIn(isas_under_test()),
                                            ::testing::Values(DType::f32, DType::f16,
                                                              DType::bf16)));

}  // namespace
}  // namespace rome::testing
