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
      // Blocks wider than a vector with ragged tails (18 = 16 + 2, 22 = 16 + 6 lanes), A dense.
      {"dense_blocks_learned",
       [] {
         return Rotation::block_diag(
                    {Rotation::dense(random_values(324, 4), random_values(324, 5), 18),
                     Rotation::dense(random_values(484, 6), random_values(484, 7), 22)})
             .partial(42);
       },
       {1, 3, 4, 0},
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
    // Each entry costs a new rotation and a reference pass: under the sanitizers every 5th.
    const std::int64_t entry_step = kSanitized ? 5 : 1;
    for (std::int64_t e = 0; e < rd * rd; e += entry_step) {
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

// dA/dB do not depend on the thread count (fixed chunks summed in order), and the fp32 partial
// sums flushed to double every 512 rows (2048 rows per chunk here) add up to the double sum.
TEST(Backward, MatrixGradientsIndependentOfThreads) {
  const Rotation rotation = Rotation::dense(random_values(64, 9), random_values(64, 10), 8);
  // At least 4 chunks of 2048 rows per thread count (8 heads per token).
  constexpr std::int64_t kTokens = kSanitized ? 4096 : 16384;
  TestTensor x = TestTensor::make(DType::f32, {1, 8, kTokens, 8}),
             g = TestTensor::make(DType::f32, {1, 8, kTokens, 8});
  std::mt19937_64 rng(4);
  x.fill_random(rng, -1, 1);
  g.fill_random(rng, -1, 1);
  TestTables tables;
  tables.cos = TestTensor::make(DType::f32, {kTokens, 8});
  tables.sin = TestTensor::make(DType::f32, {kTokens, 8});
  tables.cos.fill_random(rng, -1, 1);
  tables.sin.fill_random(rng, -1, 1);
  std::vector<float> da1(64), db1(64), da2(64), db2(64);
  Gradients one, two;
  one.da = da1.data(), one.db = db1.data(), two.da = da2.data(), two.db = db2.data();
  rope_backward(rotation, tables.view(), g.cview(), x.cview(), one, split_across(1));
  rope_backward(rotation, tables.view(), g.cview(), x.cview(), two, split_across(2));
  EXPECT_EQ(da1, da2);
  EXPECT_EQ(db1, db2);
  std::vector<double> db(64), scale(64);
  for (std::int64_t h = 0; h < 8; ++h)
    for (std::int64_t s = 0; s < kTokens; ++s)
      for (std::int64_t i = 0; i < 8; ++i)
        for (std::int64_t j = 0; j < 8; ++j) {
          const double term = x.get({0, h, s, i}) * g.get({0, h, s, j}) * tables.sin.get({s, j});
          db[i * 8 + j] += term;
          scale[i * 8 + j] += std::abs(term);
        }
  for (int e = 0; e < 64; ++e) EXPECT_NEAR(db1[e], db[e], 1e-5 * scale[e]) << "db at " << e;
}

// The dense backward on the ISA product kernels: rows in batches of 64 (tables shared by 700 rows,
// or per token), against the formulas evaluated in double, bit-identical on every ISA and for 1
// and 2 threads (every ISA does the same fma sequence; the batch split is fixed).
TEST(Backward, DenseMatchesDoubleFormulasOnEveryIsa) {
  std::vector<Rotation> parts;
  for (std::int64_t size : {44, 44, 40})
    parts.push_back(Rotation::dense(random_values(size * size, size),
                                    random_values(size * size, size + 1), size));
  const Rotation rotation = Rotation::block_diag(parts);
  const std::int64_t rd = 128;
  const std::vector<float> a = rotation.to_dense_a(), b = rotation.to_dense_b();
  for (const std::vector<std::int64_t>& table_shape :
       {std::vector<std::int64_t>{70, rd}, std::vector<std::int64_t>{1, 1, 1, rd}}) {
    for (DType dtype : {DType::f32, DType::bf16}) {
      SCOPED_TRACE(std::string(dtype_name(dtype)) +
                   (table_shape.size() == 2 ? " per-token tables" : " one table row"));
      std::mt19937_64 rng(8);
      // Under the sanitizers 210 rows: still batches of 64 plus a ragged one, per thread.
      TestTensor x = TestTensor::make(dtype, {kSanitized ? 1 : 2, kSanitized ? 3 : 5, 70, rd}),
                 g = x;
      x.fill_random(rng, -1, 1);
      g.fill_random(rng, -1, 1);
      TestTables tables;
      tables.cos = TestTensor::make(DType::f32, table_shape);
      tables.sin = TestTensor::make(DType::f32, table_shape);
      tables.cos.fill_random(rng, -1, 1);
      tables.sin.fill_random(rng, -1, 1);
      const bool per_token = table_shape.size() == 2;
      auto table = [&](const TestTensor& t, std::int64_t s, std::int64_t j) {
        return per_token ? t.get({s, j}) : t.get({0, 0, 0, j});
      };
      // Double formulas, and the scale Σ|terms| each result is held to.
      const std::int64_t rows = x.numel() / rd;
      std::vector<double> dx(x.numel()), dx_scale(x.numel()), dc(tables.cos.numel()), ds(dc.size()),
          dc_scale(dc.size()), ds_scale(dc.size()), da(rd * rd), db(rd * rd), da_scale(rd * rd),
          db_scale(rd * rd);
      for (std::int64_t row = 0; row < rows; ++row) {
        const std::int64_t s = row % 70, t_row = per_token ? s : 0;
        std::vector<double> xv(rd), u(rd), v(rd), gv(rd);
        for (std::int64_t j = 0; j < rd; ++j) {
          xv[j] = x.get(x.unravel(row * rd + j));
          gv[j] = g.get(g.unravel(row * rd + j));
          u[j] = gv[j] * table(tables.cos, s, j);
          v[j] = gv[j] * table(tables.sin, s, j);
        }
        for (std::int64_t i = 0; i < rd; ++i)
          for (std::int64_t j = 0; j < rd; ++j) {
            // Entries off the diagonal blocks add nothing to dx, dcos, dsin (it saves 2/3 of the
            // time under the sanitizers); dA and dB are dense all the same.
            if (a[i * rd + j] != 0 || b[i * rd + j] != 0) {
              dx[row * rd + i] += u[j] * a[i * rd + j] + v[j] * b[i * rd + j];
              dx_scale[row * rd + i] +=
                  std::abs(u[j] * a[i * rd + j]) + std::abs(v[j] * b[i * rd + j]);
              dc[t_row * rd + j] += gv[j] * xv[i] * a[i * rd + j];
              ds[t_row * rd + j] += gv[j] * xv[i] * b[i * rd + j];
              dc_scale[t_row * rd + j] += std::abs(gv[j] * xv[i] * a[i * rd + j]);
              ds_scale[t_row * rd + j] += std::abs(gv[j] * xv[i] * b[i * rd + j]);
            }
            da[i * rd + j] += xv[i] * u[j];
            db[i * rd + j] += xv[i] * v[j];
            da_scale[i * rd + j] += std::abs(xv[i] * u[j]);
            db_scale[i * rd + j] += std::abs(xv[i] * v[j]);
          }
      }
      auto check = [](const char* what, const std::vector<double>& got,
                      const std::vector<double>& want, const std::vector<double>& scale,
                      double rounding) {
        for (std::size_t e = 0; e < want.size(); ++e)
          ASSERT_LE(std::abs(got[e] - want[e]),
                    1e-5 * scale[e] + rounding * std::abs(want[e]) + 1e-30)
              << what << " at " << e << ": " << got[e] << " vs " << want[e];
      };
      std::vector<TestTensor> first;
      std::vector<float> first_da, first_db;
      for (Isa isa : isas_under_test()) {
        ScopedIsa scoped(isa);
        for (int threads : {1, 2}) {
          TestTensor gx = TestTensor::make(dtype, x.shape), gc = tables.cos, gs = tables.sin;
          std::vector<float> gda(rd * rd), gdb(rd * rd);
          Gradients out;
          out.dx = gx.view();
          out.dcos = gc.view();
          out.dsin = gs.view();
          out.da = gda.data();
          out.db = gdb.data();
          rope_backward(rotation, tables.view(), g.cview(), x.cview(), out, split_across(threads));
          if (first.empty()) {
            std::vector<double> v(x.numel()), c(dc.size()), sn(dc.size());
            for (std::int64_t e = 0; e < x.numel(); ++e) v[e] = gx.get(gx.unravel(e));
            for (std::size_t e = 0; e < dc.size(); ++e) {
              c[e] = gc.get(gc.unravel(e));
              sn[e] = gs.get(gs.unravel(e));
            }
            const double out_rounding = dtype == DType::bf16 ? 0x1p-8 : 0x1p-24;
            check("dx", v, dx, dx_scale, out_rounding);
            check("dcos", c, dc, dc_scale, 0x1p-24);
            check("dsin", sn, ds, ds_scale, 0x1p-24);
            check("da", std::vector<double>(gda.begin(), gda.end()), da, da_scale, 0x1p-24);
            check("db", std::vector<double>(gdb.begin(), gdb.end()), db, db_scale, 0x1p-24);
            first = {gx, gc, gs};
            first_da = gda;
            first_db = gdb;
          } else {
            EXPECT_EQ(first[0].storage, gx.storage) << isa_name(isa) << " threads " << threads;
            EXPECT_EQ(first[1].storage, gc.storage) << isa_name(isa) << " threads " << threads;
            EXPECT_EQ(first[2].storage, gs.storage) << isa_name(isa) << " threads " << threads;
            EXPECT_EQ(first_da, gda) << isa_name(isa) << " threads " << threads;
            EXPECT_EQ(first_db, gdb) << isa_name(isa) << " threads " << threads;
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace rome::testing
