// The matrix-unit (AMX) kernel for dense rotations. On CPUs with AMX the main suite runs it on
// the hardware (ISA amx); here its tiling, packing and epilogue run on a software model of the
// tile instructions, through the public rope_forward, on any AVX-512 CPU.
#include <gtest/gtest.h>

#include <random>

#include "core/dispatch.hpp"
#include "isa_testing.hpp"
#include "kernels/dense_kernels.hpp"
#include "reference.hpp"
#include "rome/rome.hpp"

namespace rome::testing {
namespace {

std::vector<float> random_matrix(std::int64_t n, std::uint64_t seed, float scale = 1.0f) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-scale, scale);
  std::vector<float> m(n * n);
  for (auto& v : m) v = u(rng);
  return m;
}

class EmulatedMatrixUnit {
 public:
  EmulatedMatrixUnit() {
#ifdef ROME_TEST_HAVE_AVX512
    if (detected_isa() >= Isa::avx512) {
      detail::override_kernels_for_testing(&kernels::amx_emulated_kernels());
      active_ = true;
    }
#endif
  }
  ~EmulatedMatrixUnit() {
    detail::override_kernels_for_testing(nullptr);
  }
  bool active() const {
    return active_;
  }

 private:
  bool active_ = false;
};

struct DenseCase {
  std::string name;
  std::function<Rotation()> make;
};

const std::vector<DenseCase>& dense_cases() {
  static const std::vector<DenseCase> cases = {
      {"dense_128", [] { return Rotation::dense(random_matrix(128, 1), 128); }},
      {"dense_two_matrix_64",
       [] { return Rotation::dense(random_matrix(64, 2), random_matrix(64, 3), 64); }},
      {"dense_blocks_44_44_40",
       [] {
         return Rotation::block_diag({Rotation::dense(random_matrix(44, 4), 44),
                                      Rotation::dense(random_matrix(44, 5), 44),
                                      Rotation::dense(random_matrix(40, 6), 40)});
       }},
      {"dense_tail_50_partial_of_64",
       [] { return Rotation::dense(random_matrix(50, 7), 50).partial(64); }},
      {"dense_bf16_exact_entries_96",
       [] {
         std::vector<float> m = random_matrix(96, 8);
         for (auto& v : m) v = detail::bf16_to_float(detail::float_to_bf16(v));  // no lo part
         return Rotation::dense(m, 96);
       }},
  };
  return cases;
}

class MatrixUnit : public ::testing::TestWithParam<std::tuple<int, DType, bool>> {};

TEST_P(MatrixUnit, EmulatedTilesMatchReferenceWithinDerivedBound) {
  const auto [index, dtype, in_place] = GetParam();
  EmulatedMatrixUnit emulated;
  if (!emulated.active()) GTEST_SKIP() << "the tile model's epilogue needs AVX-512, absent here";
  const Rotation rotation = dense_cases()[index].make();
  std::mt19937_64 rng(40 + index);
  TestTensor x =
      TestTensor::make(dtype, {2, 3, 21, rotation.head_dim()});  // 126 rows: 7 tiles + 14
  x.fill_random(rng, -2, 2);
  TestTables tables;
  tables.cos = TestTensor::make(DType::f32, {21, rotation.rotary_dim()});
  tables.sin = TestTensor::make(DType::f32, {21, rotation.rotary_dim()});
  tables.cos.fill_random(rng, -1, 1);
  tables.sin.fill_random(rng, -1, 1);
  const Reference ref = reference(rotation, tables, x, /*matrix_unit=*/true);
  TestTensor out = in_place ? x : TestTensor::make(dtype, x.shape);
  rope_forward(rotation, tables.view(), Operand{in_place ? out.cview() : x.cview(), out.view()});
  const Comparison c = compare(out, ref.y, ref.bound);
  EXPECT_TRUE(c.ok) << dense_cases()[index].name << ": " << c.first_failure;
}

INSTANTIATE_TEST_SUITE_P(Dense, MatrixUnit,
                         ::testing::Combine(::testing::Range(0, int(dense_cases().size())),
                                            ::testing::Values(DType::f32, DType::f16, DType::bf16),
                                            ::testing::Bool()),
                         [](const auto& info) {
                           const DType d = std::get<1>(info.param);
                           return dense_cases()[std::get<0>(info.param)].name + "_" +
                                  (d == DType::f32   ? "f32"
                                   : d == DType::f16 ? "f16"
                                                     : "bf16") +
                                  (std::get<2>(info.param) ? "_in_place" : "");
                         });

// The tile path and the FMA path agree within the sum of their bounds; the tile model's packing
// is exact where the matrix is (a signed permutation given as a dense matrix never gets here).
TEST(MatrixUnit, AgreesWithFmaPath) {
  const Rotation rotation = Rotation::dense(random_matrix(128, 11), random_matrix(128, 12), 128);
  TestTensor x = TestTensor::make(DType::bf16, {1, 4, 33, 128});
  std::mt19937_64 rng(5);
  x.fill_random(rng, -1, 1);
  TestTables tables;
  tables.cos = TestTensor::make(DType::f32, {33, 128});
  tables.sin = TestTensor::make(DType::f32, {33, 128});
  tables.cos.fill_random(rng, -1, 1);
  tables.sin.fill_random(rng, -1, 1);
  TestTensor fma_out = TestTensor::make(DType::bf16, x.shape), tile_out = fma_out;
  rope_forward(rotation, tables.view(), Operand{x.cview(), fma_out.view()});
  {
    EmulatedMatrixUnit emulated;
    if (!emulated.active()) GTEST_SKIP() << "the tile model's epilogue needs AVX-512, absent here";
    rope_forward(rotation, tables.view(), Operand{x.cview(), tile_out.view()});
  }
  const Reference ref = reference(rotation, tables, x, true);
  std::vector<double> fma_values(x.numel()), bound(ref.bound);
  for (std::int64_t e = 0; e < x.numel(); ++e) {
    fma_values[e] = fma_out.get(x.unravel(e));
    bound[e] *= 2;
  }
  const Comparison c = compare(tile_out, fma_values, bound);
  EXPECT_TRUE(c.ok) << c.first_failure;
}

// Every signed permutation forced through the dense path (Rotation::as_dense, what the benchmark's
// "forced dense" row runs): same matrices, kind dense; on the FMA paths every output sums one
// ±x term and zeros, so the result equals the permute path bit for bit on every ISA; the tile
// model is held to its derived bound (fp32 x loses bits in the bf16 hi/lo split).
TEST(MatrixUnit, SignedPermutationsForcedThroughDensePath) {
  const std::pair<const char*, Rotation> cases[] = {
      {"half_128", Rotation::half(128)},
      {"interleave_64", Rotation::interleave(64)},
      {"quarter_64", Rotation::quarter(64)},
      {"interleave_half_64", Rotation::interleave_half(64)},
      {"blocks_44_44_40", Rotation::block_diag({Rotation::interleave(44), Rotation::interleave(44),
                                                Rotation::interleave(40)})},
      {"partial_32_of_64", Rotation::half(32).partial(64)},
  };
  for (const auto& [name, permute] : cases) {
    const Rotation dense = permute.as_dense();
    ASSERT_EQ(dense.kind(), Rotation::Kind::dense) << name;
    ASSERT_EQ(permute.kind(), Rotation::Kind::signed_permutation) << name;
    EXPECT_EQ(dense.head_dim(), permute.head_dim()) << name;
    EXPECT_EQ(dense.to_dense_a(), permute.to_dense_a()) << name;
    EXPECT_EQ(dense.to_dense_b(), permute.to_dense_b()) << name;
    for (DType dtype : {DType::f32, DType::f16, DType::bf16}) {
      std::mt19937_64 rng(77);
      TestTensor x = TestTensor::make(dtype, {2, 3, 19, permute.head_dim()});
      x.fill_random(rng, -2, 2);
      TestTables tables;
      tables.cos = TestTensor::make(DType::f32, {19, permute.rotary_dim()});
      tables.sin = TestTensor::make(DType::f32, {19, permute.rotary_dim()});
      tables.cos.fill_random(rng, -1, 1);
      tables.sin.fill_random(rng, -1, 1);
      for (Isa isa : isas_under_test()) {
        ScopedIsa scoped(isa);
        TestTensor want = TestTensor::make(dtype, x.shape), got = want;
        rope_forward(permute, tables.view(), Operand{x.cview(), want.view()});
        rope_forward(dense, tables.view(), Operand{x.cview(), got.view()});
        EXPECT_EQ(want.storage, got.storage)
            << name << " " << dtype_name(dtype) << " on " << isa_name(isa);
      }
      EmulatedMatrixUnit emulated;
      if (!emulated.active()) continue;
      TestTensor got = TestTensor::make(dtype, x.shape);
      rope_forward(dense, tables.view(), Operand{x.cview(), got.view()});
      const Reference ref = reference(dense, tables, x, /*matrix_unit=*/true);
      const Comparison c = compare(got, ref.y, ref.bound);
      EXPECT_TRUE(c.ok) << name << " " << dtype_name(dtype)
                        << " on the tile model: " << c.first_failure;
    }
  }
}

}  // namespace
}  // namespace rome::testing
