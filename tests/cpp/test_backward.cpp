// Gradients against central finite differences of L = Σ g ⊙ y evaluated in double.
#include <gtest/gtest.h>

#include <functional>
#include <random>

#include "isa_testing.hpp"
#include "reference.hpp"
#include "rome/rome.hpp"

namespace rome::testing {
namespace {

struct GradCase {
  std::string name;
  std::function<Rotation()> make;
  std::vector<std::int64_t> table_shape;  // last entry: placeholder for the table width
  TableWidth width = TableWidth::full;
  bool learn_matrices = false;
};

std::vector<float> random_values(std::int64_t n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-1, 1);
  std::vector<float> v(n);
  for (auto& f : v) f = u(rng);
  return v;
}

class Backward : public ::testing::TestWithParam<std::tuple<Isa, int>> {};

const std::vector<GradCase>& grad_cases() {
  static const std::vector<GradCase> cases = {
      {"half_tables_1_1_S_D", [] { return Rotation::half(8); }, {1, 1, 4, 0}},
      {"half_tables_B_1_S_D", [] { return Rotation::half(8); }, {2, 1, 4, 0}},
      {"half_table_halves_width", [] { return Rotation::half(8); }, {4, 0}, TableWidth::halves},
      {"interleave_pairs_width", [] { return Rotation::interleave(6); }, {4, 0}, TableWidth::pairs},
      {"interleave_half", [] { return Rotation::interleave_half(8); }, {1, 3, 4, 0}},
      {"blocks_half_interleave",
       [] {
         return Rotation::block_diag({Rotation::half(4), Rotation::interleave(6)});
       },
       {4, 0}},
      {"partial_half", [] { return Rotation::half(4).partial(10); }, {1, 1, 4, 0}},
      {"dense_learned",
       [] { return Rotation::dense(random_values(36, 1), random_values(36, 2), 6); },
       {1, 1, 4, 0},
       TableWidth::full,
       true},
      {"dense_b_learned",
       [] { return Rotation::dense(random_values(16, 3), 4).partial(6); },
       {2, 1, 4, 0},
       TableWidth::full,
       true},
  };
  return cases;
}

TEST_P(Backward, MatchesFiniteDifferences) {
  const auto [isa, index] = GetParam();
  const GradCase& gc = grad_cases()[index];
  ScopedIsa scoped(isa);
  SCOPED_TRACE(gc.name);
  const Rotation rotation = gc.make();
  const std::int64_t d = rotation.head_dim(), rd = rotation.rotary_dim();
  const std::int64_t width = gc.width == TableWidth::full ? rd : rd / 2;
  std::mt19937_64 rng(17 + index);
  TestTensor x = TestTensor::make(DType::f32, {2, 3, 4, d}),
             g = TestTensor::make(DType::f32, {2, 3, 4, d});
  x.fill_random(rng, -1, 1);
  g.fill_random(rng, -1, 1);
  auto table_shape = gc.table_shape;
  table_shape.back() = width;
  TestTables tables;
  tables.width = gc.width;
  tables.cos = TestTensor::make(DType::f32, table_shape);
  tables.sin = TestTensor::make(DType::f32, table_shape);
  tables.cos.fill_random(rng, -1, 1);
  tables.sin.fill_random(rng, -1, 1);

  // L in double, as a function of every input through copies that we perturb.
  auto loss = [&](const TestTensor& xv, const TestTables& tv, const Rotation& r) {
    const std::vector<double> y = reference_forward(r, tv, xv);
    double l = 0;
    for (std::int64_t e = 0; e < g.numel(); ++e) l += y[e] * g.get(g.unravel(e));
    return l;
  };
  // Perturbations are exact in double: the test tensors are fp32 and L is linear in each input,
  // so a step of 1 gives the derivative exactly: dL/dv = L(v + 1) - L(v), computed in double.
  TestTensor dx = TestTensor::make(DType::f32, x.shape);
  TestTensor dcos = TestTensor::make(DType::f32, table_shape),
             dsin = TestTensor::make(DType::f32, table_shape);
  std::vector<float> da(rd * rd, NAN), db(rd * rd, NAN);
  Gradients out;
  out.dx = dx.view();
  out.dcos = dcos.view();
  out.dsin = dsin.view();
  if (gc.learn_matrices) {
    out.da = da.data();
    out.db = db.data();
  }
  rope_backward(rotation, tables.view(), g.cview(), x.cview(), out);

  const double base = loss(x, tables, rotation);
  auto close = [](double got, double want) {
    return std::abs(got - want) <= 1e-5 * (1 + std::abs(want));
  };
  for (std::int64_t e = 0; e < x.numel(); ++e) {
    const auto idx = x.unravel(e);
    TestTensor xp = x;
    xp.set(idx, x.get(idx) + 1.0);
    const double want = loss(xp, tables, rotation) - base;
    ASSERT_TRUE(close(dx.get(idx), want))
        << "dx at element " << e << ": " << dx.get(idx) << " vs " << want;
  }
  for (bool is_sin : {false, true}) {
    TestTensor& grad = is_sin ? dsin : dcos;
    for (std::int64_t e = 0; e < grad.numel(); ++e) {
      const auto idx = grad.unravel(e);
      TestTables tp = tables;
      TestTensor& t = is_sin ? tp.sin : tp.cos;
      t.set(idx, t.get(idx) + 1.0);
      const double want = loss(x, tp, rotation) - base;
      ASSERT_TRUE(close(grad.get(idx), want))
          << (is_sin ? "dsin" : "dcos") << " at " << e << ": " << grad.get(idx) << " vs " << want;
    }
  }
  if (gc.learn_matrices) {
    const std::vector<float> a = rotation.to_dense_a(), b = rotation.to_dense_b();
    for (std::int64_t e = 0; e < rd * rd; ++e) {
      for (bool is_b : {false, true}) {
        std::vector<float> ap = a, bp = b;
        (is_b ? bp : ap)[e] += 1.0f;
        const Rotation perturbed = Rotation::dense(ap, bp, rd).partial(d);
        const double want = loss(x, tables, perturbed) - base;
        const double got = (is_b ? db : da)[e];
        ASSERT_TRUE(close(got, want))
            << (is_b ? "db" : "da") << " at " << e << ": " << got << " vs " << want;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllCases, Backward,
                         ::testing::Combine(::testing::ValuesIn(isas_under_test()),
                                            ::testing::Range(0, int(grad_cases().size()))),
                         [](const auto& info) {
                           return std::string(isa_name(std::get<0>(info.param))) + "_" +
                                  grad_cases()[std::get<1>(info.param)].name;
                         });

// dA/dB do not depend on the thread count (fixed chunks summed in order).
TEST(Backward, MatrixGradientsIndependentOfThreads) {
  const Rotation rotation = Rotation::dense(random_values(64, 9), random_values(64, 10), 8);
  TestTensor x = TestTensor::make(DType::f32, {4, 8, 512, 8}),
             g = TestTensor::make(DType::f32, {4, 8, 512, 8});
  std::mt19937_64 rng(4);
  x.fill_random(rng, -1, 1);
  g.fill_random(rng, -1, 1);
  TestTables tables;
  tables.cos = TestTensor::make(DType::f32, {512, 8});
  tables.sin = TestTensor::make(DType::f32, {512, 8});
  tables.cos.fill_random(rng, -1, 1);
  tables.sin.fill_random(rng, -1, 1);
  std::vector<float> da1(64), db1(64), da2(64), db2(64);
  Gradients one, two;
  one.da = da1.data(), one.db = db1.data(), two.da = da2.data(), two.db = db2.data();
  rope_backward(rotation, tables.view(), g.cview(), x.cview(), one, ExecOptions{1});
  rope_backward(rotation, tables.view(), g.cview(), x.cview(), two, ExecOptions{2});
  EXPECT_EQ(da1, da2);
  EXPECT_EQ(db1, db2);
}

}  // namespace
}  // namespace rome::testing
