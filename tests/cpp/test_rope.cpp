// One table-driven test of every variant, dtype, layout and broadcast, run on every ISA present.
#include <gtest/gtest.h>

#include <functional>
#include <map>
#include <random>

#include "isa_testing.hpp"
#include "reference.hpp"
#include "rome/rome.hpp"

namespace rome::testing {
namespace {

struct Variant {
  std::string name;
  std::function<Rotation()> make;
  TableWidth cache_width = TableWidth::full;  // width used when the case gathers from a cache
};

std::vector<float> random_matrix(std::int64_t n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> m(n * n);
  for (auto& v : m) v = u(rng);
  return m;
}

std::vector<float> random_signed_permutation(std::int64_t n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int> p(n);
  for (int i = 0; i < n; ++i) p[i] = i;
  std::shuffle(p.begin(), p.end(), rng);
  std::vector<float> m(n * n, 0.0f);
  for (int j = 0; j < n; ++j) m[p[j] * n + j] = (rng() & 1) ? 1.0f : -1.0f;
  return m;
}

// Every variant of SPEC.md, with compositions and odd tails.
const std::vector<Variant>& variants() {
  static const std::vector<Variant> v = {
      {"half_128", [] { return Rotation::half(128); }, TableWidth::halves},
      {"interleave_128", [] { return Rotation::interleave(128); }, TableWidth::pairs},
      {"quarter_128", [] { return Rotation::quarter(128); }},
      {"interleave_half_64", [] { return Rotation::interleave_half(64); }, TableWidth::halves},
      {"half_2d_64_64",
       [] {
         return Rotation::block_diag({Rotation::half(64), Rotation::half(64)});
       }},
      {"half_3d_44_44_40",
       [] {
         return Rotation::block_diag({Rotation::half(44), Rotation::half(44), Rotation::half(40)});
       }},
      {"half_3d_44_42_42",
       [] {
         return Rotation::block_diag({Rotation::half(44), Rotation::half(42), Rotation::half(42)});
       }},
      {"interleave_3d_44_42_42",
       [] {
         return Rotation::block_diag(
             {Rotation::interleave(44), Rotation::interleave(42), Rotation::interleave(42)});
       },
       TableWidth::pairs},
      {"half_3d_16_56_56",
       [] {
         return Rotation::block_diag({Rotation::half(16), Rotation::half(56), Rotation::half(56)});
       }},
      {"mixed_half_interleave_quarter",
       [] {
         return Rotation::block_diag(
             {Rotation::half(20), Rotation::interleave(18), Rotation::quarter(24)});
       }},
      {"partial_half_64_of_128", [] { return Rotation::half(64).partial(128); },
       TableWidth::halves},
      {"partial_interleave_32_of_80", [] { return Rotation::interleave(32).partial(80); },
       TableWidth::pairs},
      {"partial_3d_blocks_of_96",
       [] {
         return Rotation::block_diag({Rotation::half(24), Rotation::half(40)}).partial(96);
       }},
      {"permutation_given_dense_48",
       [] { return Rotation::dense(random_signed_permutation(48, 7), 48); }},
      {"dense_64", [] { return Rotation::dense(random_matrix(64, 1), 64); }},
      {"dense_two_matrix_32",
       [] { return Rotation::dense(random_matrix(32, 2), random_matrix(32, 3), 32); }},
      {"dense_blocks_44_44_40",
       [] {
         return Rotation::block_diag({Rotation::dense(random_matrix(44, 4), 44),
                                      Rotation::dense(random_matrix(44, 5), 44),
                                      Rotation::dense(random_matrix(40, 6), 40)});
       }},
      {"half_2", [] { return Rotation::half(2); }, TableWidth::halves},
      {"interleave_6", [] { return Rotation::interleave(6); }, TableWidth::pairs},
      {"half_80", [] { return Rotation::half(80); }, TableWidth::halves},
      {"quarter_192", [] { return Rotation::quarter(192); }},
      {"interleave_half_4094", [] { return Rotation::interleave_half(4094); }},
      {"half_4094", [] { return Rotation::half(4094); }},
  };
  return v;
}

// How x, its output and the tables are laid out. x is logically [B, N, S, D] except where the
// layout says otherwise.
struct LayoutCase {
  std::string name;
  std::vector<std::int64_t> x_shape;  // with D = 0 as a placeholder for head_dim
  Layout x_layout;
  std::vector<std::int64_t> table_shape;      // direct tables; D placeholder 0. Empty: cache
  std::vector<std::int64_t> positions_shape;  // cache: positions
  bool in_place = false;
  bool multi_axis = false;
  DType positions_dtype = DType::i64;
  Layout table_layout;
};

const std::vector<LayoutCase>& layout_cases() {
  static const std::vector<LayoutCase> s = {
      {"bnsd_tables_1_1_S_D", {2, 3, 5, 0}, {}, {1, 1, 5, 0}},
      {"bnsd_in_place", {2, 3, 5, 0}, {}, {1, 1, 5, 0}, {}, true},
      {"bsnd_tables_1_S_1_D", {2, 5, 3, 0}, {{0, 1, 2, 3}}, {1, 5, 1, 0}},
      {"bnsd_stored_bsnd", {2, 3, 5, 0}, {{0, 2, 1, 3}}, {1, 1, 5, 0}},
      {"bnsd_stored_sbnd", {2, 3, 5, 0}, {{2, 0, 1, 3}}, {5, 0}},
      {"tables_B_1_S_D", {2, 3, 4, 0}, {}, {2, 1, 4, 0}},
      {"tables_B_N_S_D", {2, 3, 4, 0}, {}, {2, 3, 4, 0}},
      {"tables_S_D_rank2_x", {7, 0}, {}, {7, 0}},
      {"packed_T_N_D_tables_T_1_D", {6, 4, 0}, {}, {6, 1, 0}},
      {"qkv_slice_of_fused_buffer", {6, 4, 0}, {{}, 0, -1, 3, 4}, {6, 1, 0}},
      {"padded_head_rows", {2, 3, 5, 0}, {{}, 5, -1, 0}, {1, 1, 5, 0}},
      {"negative_stride_seq", {2, 2, 5, 0}, {{}, 0, 2, 0}, {1, 1, 5, 0}},
      {"misaligned_in_place", {1, 3, 4, 0}, {{}, 0, -1, 1}, {1, 1, 4, 0}, {}, true},
      {"rank5_tables_broadcast", {2, 2, 2, 3, 0}, {}, {2, 1, 2, 1, 0}},
      {"strided_tables",
       {2, 3, 5, 0},
       {},
       {1, 1, 5, 0},
       {},
       false,
       false,
       DType::i64,
       {{}, 3, -1, 0}},
      {"tables_lane_strided",
       {2, 3, 5, 0},
       {},
       {1, 1, 5, 0},
       {},
       false,
       false,
       DType::i64,
       {{0, 1, 3, 2}}},
      {"cache_positions_i64", {2, 3, 5, 0}, {}, {}, {2, 1, 5}},
      {"cache_positions_i32_in_place", {2, 3, 5, 0}, {}, {}, {2, 1, 5}, true, false, DType::i32},
      {"cache_multi_axis", {1, 2, 6, 0}, {}, {}, {1, 1, 6, 3}, false, true},
      // One token (a decode step): no axis moves the table row.
      {"cache_one_token", {1, 3, 1, 0}, {}, {}, {1, 1, 1}},
      {"cache_one_packed_token_in_place", {1, 4, 0}, {}, {}, {1, 1}, true},
  };
  return s;
}

struct Case {
  int variant, setup;
  DType x_dtype, table_dtype;
};

std::string dtype_tag(DType d) {
  return d == DType::f32 ? "f32" : d == DType::f16 ? "f16" : "bf16";
}

std::vector<Case> all_cases() {
  std::vector<Case> out;
  const DType dtypes[] = {DType::f32, DType::f16, DType::bf16};
  for (int v = 0; v < int(variants().size()); ++v) {
    const bool huge = variants()[v].name.find("4094") != std::string::npos;
    for (int s = 0; s < int(layout_cases().size()); ++s) {
      if (huge && s > 1) continue;  // D = 4094: the tail path, not every layout again
      for (DType xd : dtypes) {
        // Table dtypes: fp32 everywhere, plus x's own dtype on the first setups.
        out.push_back({v, s, xd, DType::f32});
        if (xd != DType::f32 && s < 2) out.push_back({v, s, xd, xd});
      }
    }
  }
  return out;
}

class RopeForward : public ::testing::TestWithParam<std::tuple<Isa, int>> {};

TestTensor make_tables_tensor(DType dtype, std::vector<std::int64_t> shape, const Layout& layout,
                              std::mt19937_64& rng, bool is_sin) {
  TestTensor t = TestTensor::make(dtype, shape, layout);
  // Not unit norm on purpose: YaRN and LongRoPE scale tables.
  std::uniform_real_distribution<double> angle(-3.2, 3.2), amp(0.5, 1.5);
  t.fill([&](const auto&) {
    return (is_sin ? std::sin(angle(rng)) : std::cos(angle(rng))) * amp(rng);
  });
  return t;
}

TEST_P(RopeForward, MatchesDoubleReference) {
  const auto [isa, index] = GetParam();
  static const std::vector<Case> cases = all_cases();
  const Case& c = cases[index];
  const Variant& variant = variants()[c.variant];
  const LayoutCase& setup = layout_cases()[c.setup];
  ScopedIsa scoped(isa);
  SCOPED_TRACE(variant.name + " / " + setup.name + " / x " + dtype_tag(c.x_dtype) + " / tables " +
               dtype_tag(c.table_dtype) + " / " + isa_name(isa));

  const Rotation rotation = variant.make();
  const std::int64_t d = rotation.head_dim(), rd = rotation.rotary_dim();
  std::mt19937_64 rng(1234 + index);
  auto with_dim = [&](std::vector<std::int64_t> shape, std::int64_t last) {
    shape.back() = last;
    return shape;
  };
  const auto x_shape = with_dim(setup.x_shape, d);
  TestTensor x = TestTensor::make(c.x_dtype, x_shape, setup.x_layout);
  x.fill_random(rng, -4.0, 4.0);

  TestTables tables;
  if (!setup.table_shape.empty()) {
    tables.cos = make_tables_tensor(c.table_dtype, with_dim(setup.table_shape, rd),
                                    setup.table_layout, rng, false);
    tables.sin = make_tables_tensor(c.table_dtype, with_dim(setup.table_shape, rd),
                                    setup.table_layout, rng, true);
  } else {
    tables.width = variant.cache_width;
    const std::int64_t width = tables.width == TableWidth::full ? rd : rd / 2;
    const std::int64_t cache_rows = 11;
    tables.cos = make_tables_tensor(c.table_dtype, {cache_rows, width}, {}, rng, false);
    tables.sin = make_tables_tensor(c.table_dtype, {cache_rows, width}, {}, rng, true);
    tables.positions = TestTensor::make(setup.positions_dtype, setup.positions_shape);
    std::uniform_int_distribution<int> pos(0, int(cache_rows) - 1);
    tables.positions.fill([&](const auto&) { return double(pos(rng)); });
    if (setup.multi_axis)
      for (std::int64_t col = 0; col < width; ++col)
        tables.column_axis.push_back(int((col * 7 / 3) % 3));
  }

  // Each variant's columns once: a D = 4094 rotation's dense form has 16.7M entries.
  static std::map<int, DenseRotation> columns;
  const DenseRotation& rotation_columns = columns.try_emplace(c.variant, rotation).first->second;
  const Reference reference_result = reference(rotation_columns, tables, x, isa == Isa::amx);
  const std::vector<double>& ref = reference_result.y;
  const std::vector<double>& bound = reference_result.bound;

  if (setup.in_place) {
    const auto before = x.storage;
    rope_forward(rotation, tables.view(), Operand{x.cview(), x.view()});
    const Comparison cmp = compare(x, ref, bound);
    EXPECT_TRUE(cmp.ok) << cmp.first_failure;
    // Bytes outside the view (padding, guard) are untouched.
    TestTensor probe = x;
    probe.storage = before;
    for (std::int64_t e = 0; e < x.numel(); ++e) {
      const auto idx = x.unravel(e);
      std::memcpy(probe.at(idx), x.at(idx), dtype_size(x.dtype));
    }
    EXPECT_EQ(probe.storage, x.storage) << "bytes outside the view changed";
  } else {
    TestTensor out = TestTensor::make(c.x_dtype, x_shape, setup.x_layout);  // NaN-filled
    const auto x_before = x.storage;
    rope_forward(rotation, tables.view(), Operand{x.cview(), out.view()});
    const Comparison cmp = compare(out, ref, bound);
    EXPECT_TRUE(cmp.ok) << cmp.first_failure;
    EXPECT_EQ(x_before, x.storage) << "input modified";
  }
}

std::string case_name(const ::testing::TestParamInfo<std::tuple<Isa, int>>& info) {
  static const std::vector<Case> cases = all_cases();
  const auto [isa, index] = info.param;
  const Case& c = cases[index];
  return std::string(isa_name(isa)) + "_" + variants()[c.variant].name + "_" +
         layout_cases()[c.setup].name + "_x" + dtype_tag(c.x_dtype) + "_t" +
         dtype_tag(c.table_dtype);
}

INSTANTIATE_TEST_SUITE_P(AllVariants, RopeForward,
                         ::testing::Combine(::testing::ValuesIn(isas_under_test()),
                                            ::testing::Range(0, int(all_cases().size()))),
                         case_name);

}  // namespace
}  // namespace rome::testing

namespace rome::testing {
namespace {

// q and k in one call: k has fewer heads (GQA) or one head (MQA), laid out BSND as engines keep
// them, tables [1, S, 1, D]; in place and out of place.
class RopeQK : public ::testing::TestWithParam<std::tuple<Isa, int, bool, DType>> {};

TEST_P(RopeQK, MatchesReferenceForBothTensors) {
  const auto [isa, k_heads, in_place, dtype] = GetParam();
  ScopedIsa scoped(isa);
  const Rotation rotation = Rotation::half(64);
  std::mt19937_64 rng(99 + k_heads);
  const std::int64_t b = 2, s = 9, d = 64;
  TestTensor q = TestTensor::make(dtype, {b, s, 8, d}),
             k = TestTensor::make(dtype, {b, s, k_heads, d});
  q.fill_random(rng, -2, 2);
  k.fill_random(rng, -2, 2);
  TestTables tables;
  tables.cos = make_tables_tensor(DType::f32, {1, s, 1, d}, {}, rng, false);
  tables.sin = make_tables_tensor(DType::f32, {1, s, 1, d}, {}, rng, true);
  const auto q_ref = reference_forward(rotation, tables, q),
             k_ref = reference_forward(rotation, tables, k);
  TestTensor q_out = in_place ? q : TestTensor::make(dtype, q.shape);
  TestTensor k_out = in_place ? k : TestTensor::make(dtype, k.shape);
  const Operand qo{in_place ? q_out.cview() : q.cview(), q_out.view()};
  const Operand ko{in_place ? k_out.cview() : k.cview(), k_out.view()};
  rope_forward(rotation, tables.view(), qo, &ko);
  EXPECT_TRUE(compare(q_out, q_ref).ok) << compare(q_out, q_ref).first_failure;
  EXPECT_TRUE(compare(k_out, k_ref).ok) << compare(k_out, k_ref).first_failure;
}

INSTANTIATE_TEST_SUITE_P(GqaMqa, RopeQK,
                         ::testing::Combine(::testing::ValuesIn(isas_under_test()),
                                            ::testing::Values(1, 2, 8), ::testing::Bool(),
                                            ::testing::Values(DType::f32, DType::bf16)));

// The q and k slices of one fused qkv buffer [T, (Hq + 2·Hk)·D], rotated in place in one call.
TEST(RopeQK, FusedQkvSlicesInPlace) {
  for (Isa isa : isas_under_test()) {
    ScopedIsa scoped(isa);
    const std::int64_t t = 5, hq = 4, hk = 2, d = 32, width = (hq + 2 * hk) * d;
    TestTensor qkv = TestTensor::make(DType::bf16, {t, width});
    std::mt19937_64 rng(5);
    qkv.fill_random(rng, -1, 1);
    TestTensor q = qkv, k = qkv;
    q.shape = {t, hq, d};
    q.strides = {width, d, 1};
    k.shape = {t, hk, d};
    k.strides = {width, d, 1};
    k.base = hq * d;
    TestTables tables;
    tables.cos = make_tables_tensor(DType::f32, {t, 1, d}, {}, rng, false);
    tables.sin = make_tables_tensor(DType::f32, {t, 1, d}, {}, rng, true);
    const Rotation rotation = Rotation::interleave(d);
    const auto q_ref = reference_forward(rotation, tables, q),
               k_ref = reference_forward(rotation, tables, k);
    // Both views share qkv's storage.
    TestTensor shared = qkv;
    q.storage.clear();
    k.storage.clear();
    auto view_of = [&](const TestTensor& v) {
      TestTensor w = v;
      w.storage = {};
      TensorView tv = shared.view();
      tv.rank = int(v.shape.size());
      tv.data = shared.storage.data() + v.base * 2;
      for (int i = 0; i < tv.rank; ++i) tv.shape[i] = v.shape[i], tv.strides[i] = v.strides[i];
      return tv;
    };
    const TensorView qv = view_of(q), kv = view_of(k);
    const Operand qo{as_const(qv), qv}, ko{as_const(kv), kv};
    rope_forward(rotation, tables.view(), qo, &ko);
    TestTensor q_after = shared, k_after = shared;
    q_after.shape = q.shape, q_after.strides = q.strides, q_after.base = 0;
    k_after.shape = k.shape, k_after.strides = k.strides, k_after.base = hq * d;
    EXPECT_TRUE(compare(q_after, q_ref).ok)
        << isa_name(isa) << compare(q_after, q_ref).first_failure;
    EXPECT_TRUE(compare(k_after, k_ref).ok)
        << isa_name(isa) << compare(k_after, k_ref).first_failure;
    // The v third of the buffer is untouched.
    for (std::int64_t r = 0; r < t; ++r)
      for (std::int64_t j = (hq + hk) * d; j < width; ++j)
        ASSERT_EQ(shared.get({r, j}), qkv.get({r, j}));
  }
}

}  // namespace
}  // namespace rome::testing
