// The matrix-unit (AMX) kernel for dense rotations of 16-bit x. Its tile products sum in the
// hardware's own order (not the FMA kernels' ascending one) and flush bf16 subnormals, so it is
// held to its derived error bound against the fp64 reference, not to the scalar kernel's bits. Each
// test runs twice where it can: on the tile unit itself (CPUs with AMX), and on a software model of
// the tile instructions (any AVX-512 CPU: the same tiling, packing and epilogue).
#include <gtest/gtest.h>

#include <functional>
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

// Runs `body(name)` on every matrix unit this machine has: the tile model (AVX-512) and the
// hardware (AMX). Returns how many ran.
int on_each_matrix_unit(const std::function<void(const char*)>& body) {
  int ran = 0;
  {
    EmulatedMatrixUnit emulated;
    if (emulated.active()) {
      body("the tile model");
      ++ran;
    }
  }
  const std::vector<Isa> isas = isas_under_test();
  if (std::find(isas.begin(), isas.end(), Isa::amx) != isas.end()) {
    ScopedIsa scoped(Isa::amx);
    body("the AMX tile unit");
    ++ran;
  }
  return ran;
}

constexpr const char* kNoMatrixUnit =
    "neither AMX nor the tile model (which needs AVX-512) is available here";

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

TEST_P(MatrixUnit, TilesMatchReferenceWithinDerivedBound) {
  const auto [index, dtype, in_place] = GetParam();
  const Rotation rotation = dense_cases()[index].make();
  std::mt19937_64 rng(40 + index);
  TestTensor x =
      TestTensor::make(dtype, {2, 3, 21, rotation.head_dim()});  // 126 rows: 3 groups of 32 + 30
  x.fill_random(rng, -2, 2);
  TestTables tables;
  tables.cos = TestTensor::make(DType::f32, {21, rotation.rotary_dim()});
  tables.sin = TestTensor::make(DType::f32, {21, rotation.rotary_dim()});
  tables.cos.fill_random(rng, -1, 1);
  tables.sin.fill_random(rng, -1, 1);
  const Reference ref = reference(rotation, tables, x, /*matrix_unit=*/true);
  const int ran = on_each_matrix_unit([&](const char* unit) {
    TestTensor out = in_place ? x : TestTensor::make(dtype, x.shape);
    rope_forward(rotation, tables.view(), Operand{in_place ? out.cview() : x.cview(), out.view()});
    const Comparison c = compare(out, ref.y, ref.bound);
    EXPECT_TRUE(c.ok) << dense_cases()[index].name << " on " << unit << ": " << c.first_failure;
  });
  if (ran == 0) GTEST_SKIP() << kNoMatrixUnit;
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
  TestTensor fma_out = TestTensor::make(DType::bf16, x.shape);
  {
    ScopedIsa scoped(std::min(detected_isa(), Isa::avx512));
    rope_forward(rotation, tables.view(), Operand{x.cview(), fma_out.view()});
  }
  const Reference ref = reference(rotation, tables, x, true);
  std::vector<double> fma_values(x.numel()), bound(ref.bound);
  for (std::int64_t e = 0; e < x.numel(); ++e) {
    fma_values[e] = fma_out.get(x.unravel(e));
    bound[e] *= 2;
  }
  const int ran = on_each_matrix_unit([&](const char* unit) {
    TestTensor tile_out = TestTensor::make(DType::bf16, x.shape);
    rope_forward(rotation, tables.view(), Operand{x.cview(), tile_out.view()});
    const Comparison c = compare(tile_out, fma_values, bound);
    EXPECT_TRUE(c.ok) << unit << ": " << c.first_failure;
  });
  if (ran == 0) GTEST_SKIP() << kNoMatrixUnit;
}

// A matrix exact in bf16 but for one entry still gets its lo part for that entry. Lane 7 of
// the output is that entry alone times x[5]: without the lo part it would be off by 0.3%, three
// fp16 ulps.
TEST(MatrixUnit, OneInexactEntryKeepsItsLowPart) {
  const std::int64_t d = 64;
  std::vector<float> m = random_matrix(d, 21, 0.25f);
  for (auto& v : m) v = detail::bf16_to_float(detail::float_to_bf16(v));
  for (std::int64_t i = 0; i < d; ++i) m[i * d + 7] = 0.0f;
  m[5 * d + 7] = 1.0f + 3 * 0x1p-10f;  // bf16 keeps 1.0: the rest is the lo part
  const Rotation rotation = Rotation::dense(m, d);
  std::mt19937_64 rng(22);
  TestTensor x = TestTensor::make(DType::f16, {1, 2, 40, d});
  x.fill_random(rng, 0.5, 2);
  TestTables tables;
  tables.cos = TestTensor::make(DType::f32, {40, d});
  tables.sin = TestTensor::make(DType::f32, {40, d});
  tables.cos.fill([](const auto&) { return 0.0; });
  tables.sin.fill([](const auto&) { return 1.0; });
  const Reference ref = reference(rotation, tables, x, true);
  const int ran = on_each_matrix_unit([&](const char* unit) {
    TestTensor out = TestTensor::make(DType::f16, x.shape);
    rope_forward(rotation, tables.view(), Operand{x.cview(), out.view()});
    const Comparison c = compare(out, ref.y, ref.bound);
    EXPECT_TRUE(c.ok) << unit << ": " << c.first_failure;
  });
  if (ran == 0) GTEST_SKIP() << kNoMatrixUnit;
}

// Random ragged blocks, one or two matrices, bf16-exact or not, 16-bit x in BNSD, token-major,
// padded and reversed layouts, in place and out of place, q with a GQA k, table dtypes: within the
// bound everywhere, and nothing outside the rows written (the NaN prefill stays).
TEST(MatrixUnit, RandomLayoutsWithinBound) {
  std::mt19937_64 rng(2024);
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  int cases = 0;
  // Under the sanitizers the first 15 of the 40 random cases.
  const int count = kSanitized ? 15 : 40;
  for (int n = 0; n < count; ++n) {
    // Blocks: even sizes 2..96, total at most 192; sometimes one matrix exact in bf16.
    std::vector<Rotation> blocks;
    std::int64_t rd = 0;
    const bool two = pick(0, 2) == 0, exact = pick(0, 2) == 0;
    auto matrix = [&](std::int64_t size) {
      std::vector<float> m = random_matrix(size, rng(), 1.0f / float(size));
      if (exact)
        for (auto& v : m) v = detail::bf16_to_float(detail::float_to_bf16(v));
      return m;
    };
    do {
      const std::int64_t size = 2 * pick(1, 48);
      blocks.push_back(two ? Rotation::dense(matrix(size), matrix(size), size)
                           : Rotation::dense(matrix(size), size));
      rd += size;
    } while (rd < 64 && pick(0, 1));
    Rotation rotation = Rotation::block_diag(blocks);
    if (pick(0, 3) == 0) rotation = rotation.partial(rd + 2 * pick(1, 8));
    const std::int64_t hd = rotation.head_dim();
    const DType dtype = pick(0, 1) ? DType::bf16 : DType::f16;
    const std::int64_t batch = pick(1, 2), heads = pick(1, 5), seq = pick(1, 70);
    const int shape_kind = pick(0, 2);
    const Layout layout = shape_kind == 0   ? Layout{}
                          : shape_kind == 1 ? Layout{{0, 2, 1, 3}}  // BSND memory
                                            : Layout{{}, 4, 1, 3};  // padded rows, heads reversed
    TestTensor x = TestTensor::make(dtype, {batch, heads, seq, hd}, layout);
    x.fill_random(rng, -2, 2);
    const std::int64_t k_heads = std::max<std::int64_t>(1, heads / 2);
    TestTensor k = TestTensor::make(dtype, {batch, k_heads, seq, hd}, layout);
    k.fill_random(rng, -2, 2);
    TestTables tables;
    const DType table_dtype = pick(0, 1) ? DType::f32 : DType::bf16;
    tables.cos = TestTensor::make(table_dtype, {seq, rotation.rotary_dim()});
    tables.sin = TestTensor::make(table_dtype, {seq, rotation.rotary_dim()});
    tables.cos.fill_random(rng, -1, 1);
    tables.sin.fill_random(rng, -1, 1);
    const Reference ref_q = reference(rotation, tables, x, true);
    const Reference ref_k = reference(rotation, tables, k, true);
    const bool in_place = pick(0, 1);
    cases += on_each_matrix_unit([&](const char* unit) {
      TestTensor q_out = in_place ? x : TestTensor::make(dtype, x.shape, layout);
      TestTensor k_out = in_place ? k : TestTensor::make(dtype, k.shape, layout);
      const Operand kq{in_place ? k_out.cview() : k.cview(), k_out.view()};
      rope_forward(rotation, tables.view(),
                   Operand{in_place ? q_out.cview() : x.cview(), q_out.view()}, &kq);
      const Comparison cq = compare(q_out, ref_q.y, ref_q.bound);
      const Comparison ck = compare(k_out, ref_k.y, ref_k.bound);
      EXPECT_TRUE(cq.ok && ck.ok) << "case " << n << " on " << unit << " (rd "
                                  << rotation.rotary_dim() << ", " << blocks.size() << " blocks, "
                                  << dtype_name(dtype) << (in_place ? ", in place" : "")
                                  << "): " << (cq.ok ? ck.first_failure : cq.first_failure);
      EXPECT_TRUE(q_out.outside_view_untouched() && k_out.outside_view_untouched()) << "case " << n;
    });
  }
  if (cases == 0) GTEST_SKIP() << kNoMatrixUnit;
}

// Every signed permutation forced through the dense path (Rotation::as_dense, what the benchmark's
// "forced dense" row runs): same matrices, kind dense; on the FMA paths every output sums one
// ±x term and zeros, and both take the same epilogue (kernel_api.hpp: single_fma_epilogue), so
// the result equals the permute path bit for bit on every ISA, with fp32 and with bf16 tables;
// the tile model is held to its derived bound (fp32 x loses bits in the bf16 hi/lo split).
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
    for (DType dtype : {DType::f32, DType::f16, DType::bf16})
      for (DType table_dtype : {DType::f32, DType::bf16}) {
        std::mt19937_64 rng(77);
        TestTensor x = TestTensor::make(dtype, {2, 3, 19, permute.head_dim()});
        x.fill_random(rng, -2, 2);
        TestTables tables;
        tables.cos = TestTensor::make(table_dtype, {19, permute.rotary_dim()});
        tables.sin = TestTensor::make(table_dtype, {19, permute.rotary_dim()});
        tables.cos.fill_random(rng, -1, 1);
        tables.sin.fill_random(rng, -1, 1);
        for (Isa isa : isas_under_test()) {
          ScopedIsa scoped(isa);
          TestTensor want = TestTensor::make(dtype, x.shape), got = want;
          rope_forward(permute, tables.view(), Operand{x.cview(), want.view()});
          rope_forward(dense, tables.view(), Operand{x.cview(), got.view()});
          EXPECT_EQ(want.storage, got.storage)
              << name << " " << dtype_name(dtype) << " x, " << dtype_name(table_dtype)
              << " tables on " << isa_name(isa);
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
