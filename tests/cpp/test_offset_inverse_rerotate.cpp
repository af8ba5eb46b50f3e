// Lane offsets ([nope | rope] heads, vLLM's rope_dim_offset), the inverse rotation (−θ, vLLM's
// `inverse`) and re-rotation of a paged key cache, on every ISA and dtype. References: the double
// reference of the same rotation without offset on the rotated lanes (leading lanes must be the
// input bit for bit), sine negated for the inverse, and a per-slot loop for the paged cache.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <set>
#include <utility>
#include <vector>

#include "isa_testing.hpp"
#include "reference.hpp"
#include "rome/rome.hpp"

namespace rome::testing {
namespace {

constexpr DType kDtypes[] = {DType::f32, DType::bf16, DType::f16};

struct NamedRotation {
  const char* name;
  Rotation rotation;  // full (no offset): partial(head_dim, offset) is applied by the test
};

std::vector<NamedRotation> rotations() {
  return {{"half64", Rotation::half(64)},
          {"interleave64", Rotation::interleave(64)},
          {"quarter32", Rotation::quarter(32)},
          {"blocks_12_8_12",
           Rotation::block_diag({Rotation::half(12), Rotation::half(8), Rotation::half(12)})},
          {"interleave_half32", Rotation::interleave_half(32)}};
}

// A [positions, rd] cache of unit rows at angles p·f_j (per_lane), or p·0.37 on every lane (a
// rotation for any pairing of lanes).
TestTables unit_cache(std::int64_t rows, std::int64_t rd,
                      const std::vector<std::int64_t>& pos_shape, std::mt19937_64& rng,
                      bool per_lane = true) {
  TestTables t;
  t.cos = TestTensor::make(DType::f32, {rows, rd});
  t.sin = TestTensor::make(DType::f32, {rows, rd});
  for (std::int64_t p = 0; p < rows; ++p)
    for (std::int64_t j = 0; j < rd; ++j) {
      const double f = per_lane ? std::pow(10000.0, -double(j / 2 * 2) / double(rd)) : 0.37;
      t.cos.set({p, j}, std::cos(double(p) * f));
      t.sin.set({p, j}, std::sin(double(p) * f));
    }
  t.positions = TestTensor::make(DType::i64, pos_shape);
  std::uniform_int_distribution<std::int64_t> u(0, rows - 1);
  t.positions.fill([&](const auto&) { return double(u(rng)); });
  return t;
}

TestTensor narrowed_copy(const TestTensor& x, std::int64_t offset) {
  std::vector<std::int64_t> shape = x.shape;
  shape.back() -= offset;
  TestTensor n = TestTensor::make(x.dtype, shape);
  n.fill([&](const auto& idx) {
    auto i = idx;
    i.back() += offset;
    return x.get(i);
  });
  return n;
}

// y must be x on lanes [0, offset) bit for bit and the reference of the unshifted rotation on
// the rest.
void expect_offset_result(const Rotation& rotation, const TestTables& ref_tables,
                          const TestTensor& x, const TestTensor& y, const std::string& what) {
  const std::int64_t offset = rotation.lane_offset();
  const std::vector<double> ref =
      reference_forward(rotation.unshifted(), ref_tables, narrowed_copy(x, offset));
  TestTensor rotated = narrowed_copy(y, offset);
  const Comparison c = compare(rotated, ref);
  EXPECT_TRUE(c.ok) << what << ": " << c.first_failure;
  std::vector<std::int64_t> idx(x.shape.size(), 0);
  for (std::int64_t e = 0; e < x.numel(); ++e, x.next_index(idx)) {
    if (idx.back() >= offset) continue;
    const double a = x.get(idx), b = y.get(idx);
    ASSERT_TRUE(a == b || (std::isnan(a) && std::isnan(b))) << what << ": leading lane changed";
  }
}

TEST(LaneOffset, ForwardEveryRotationDtypeAndIsa) {
  std::mt19937_64 rng(7);
  for (Isa isa : isas_under_test()) {
    ScopedIsa scoped(isa);
    for (const auto& [name, full] : rotations())
      // One pair with a tail, whole vectors, 128 lanes with a tail (each offset with and without
      // a tail doubled the test's time under ASan for no path the three do not reach).
      for (const auto& [offset, tail] :
           {std::pair<std::int64_t, std::int64_t>{2, 6}, {64, 0}, {128, 6}})
        for (DType dtype : kDtypes)
          for (bool inverse : {false, true})
            for (bool in_place : {false, true}) {
              const std::int64_t rd = full.rotary_dim(), hd = offset + rd + tail;
              const Rotation rotation = full.partial(hd, offset);
              ASSERT_EQ(rotation.lane_offset(), offset);
              ASSERT_EQ(rotation.unshifted().head_dim(), hd - offset);
              TestTables tables = unit_cache(40, rd, {3, 9, 1}, rng);
              TestTables ref_tables = tables;
              if (inverse) ref_tables.sin.fill([&](const auto& i) { return -tables.sin.get(i); });
              TestTensor q = TestTensor::make(dtype, {3, 9, 4, hd});
              q.fill_random(rng, -2, 2);
              TestTensor k = TestTensor::make(dtype, {3, 9, 2, hd}, Layout{{}, 5});
              k.fill_random(rng, -2, 2);
              TestTensor q_out = in_place ? q : TestTensor::make(dtype, q.shape);
              TestTensor k_out = in_place ? k : TestTensor::make(dtype, k.shape, Layout{{}, 3});
              Tables view = tables.view();
              view.inverse = inverse;
              const Operand oq{q.cview(), q_out.view()}, ok{k.cview(), k_out.view()};
              rope_forward(rotation, view, oq, &ok);
              const std::string what = std::string(isa_name(isa)) + " " + name + " offset " +
                                       std::to_string(offset) + " " + dtype_name(dtype) +
                                       (inverse ? " inverse" : "") + (in_place ? " in place" : "");
              expect_offset_result(rotation, ref_tables, q, q_out, what + " q");
              expect_offset_result(rotation, ref_tables, k, k_out, what + " k");
            }
  }
}

TEST(LaneOffset, MatchesScalarBitForBit) {
  std::mt19937_64 rng(11);
  const Rotation rotation = Rotation::half(64).partial(192, 128);
  TestTables tables = unit_cache(50, 64, {33, 1}, rng);
  for (DType dtype : kDtypes) {
    TestTensor q = TestTensor::make(dtype, {33, 8, 192});
    q.fill_random(rng, -3, 3);
    TestTensor expected = TestTensor::make(dtype, q.shape);
    {
      ScopedIsa scoped(Isa::scalar);
      rope_forward(rotation, tables.view(), Operand{q.cview(), expected.view()});
    }
    for (Isa isa : isas_under_test()) {
      ScopedIsa scoped(isa);
      TestTensor got = TestTensor::make(dtype, q.shape);
      rope_forward(rotation, tables.view(), Operand{q.cview(), got.view()});
      EXPECT_EQ(got.storage, expected.storage) << isa_name(isa) << " " << dtype_name(dtype);
    }
  }
}

TEST(Inverse, UndoesTheRotation) {
  std::mt19937_64 rng(3);
  for (Isa isa : isas_under_test()) {
    ScopedIsa scoped(isa);
    for (const auto& [name, rotation] : rotations()) {
      // interleave_half reorders lanes (A != I): negating the sine does not undo A.
      if (!rotation.a_is_identity()) continue;
      TestTables tables = unit_cache(64, rotation.rotary_dim(), {20, 1}, rng, false);
      TestTensor x = TestTensor::make(DType::f32, {20, 3, rotation.rotary_dim()});
      x.fill_random(rng, -1, 1);
      TestTensor y = x;
      Tables forward = tables.view(), back = tables.view();
      back.inverse = true;
      rope_forward(rotation, forward, Operand{y.cview(), y.view()});
      rope_forward(rotation, back, Operand{y.cview(), y.view()});
      for (std::int64_t e = 0; e < x.numel(); ++e)
        ASSERT_NEAR(y.get(x.unravel(e)), x.get(x.unravel(e)), 4e-7) << isa_name(isa) << " " << name;
    }
  }
}

TEST(LaneOffset, BackwardIsTheUnshiftedBackwardPlusPassThrough) {
  std::mt19937_64 rng(5);
  const std::int64_t offset = 32, rd = 64, hd = offset + rd + 8;
  const Rotation rotation = Rotation::interleave(rd).partial(hd, offset);
  for (bool inverse : {false, true}) {
    TestTables tables;
    tables.cos = TestTensor::make(DType::f32, {7, rd});
    tables.sin = TestTensor::make(DType::f32, {7, rd});
    tables.cos.fill_random(rng, -1, 1);
    tables.sin.fill_random(rng, -1, 1);
    Tables view = tables.view();
    view.inverse = inverse;
    TestTensor x = TestTensor::make(DType::f32, {2, 7, hd});
    TestTensor g = TestTensor::make(DType::f32, {2, 7, hd});
    x.fill_random(rng, -1, 1);
    g.fill_random(rng, -1, 1);
    TestTensor dx = TestTensor::make(DType::f32, x.shape);
    TestTensor dsin = TestTensor::make(DType::f32, {7, rd});
    Gradients grads;
    grads.dx = dx.view();
    grads.dsin = dsin.view();
    rope_backward(rotation, view, g.cview(), x.cview(), grads);
    // The same on narrowed copies with the unshifted rotation.
    const TestTensor xn = narrowed_copy(x, offset), gn = narrowed_copy(g, offset);
    TestTensor dxn = TestTensor::make(DType::f32, xn.shape);
    TestTensor dsin_n = TestTensor::make(DType::f32, {7, rd});
    Gradients gn_out;
    gn_out.dx = dxn.view();
    gn_out.dsin = dsin_n.view();
    rope_backward(rotation.unshifted(), view, gn.cview(), xn.cview(), gn_out);
    for (std::int64_t e = 0; e < x.numel(); ++e) {
      auto idx = x.unravel(e);
      if (idx.back() < offset) {
        ASSERT_EQ(dx.get(idx), g.get(idx));
      } else {
        auto n = idx;
        n.back() -= offset;
        ASSERT_EQ(dx.get(idx), dxn.get(n));
      }
    }
    EXPECT_EQ(dsin.storage, dsin_n.storage);
    // dS of the inverse is minus dS of the forward rotation.
    if (inverse) {
      Tables plain = tables.view();
      TestTensor dsin_plain = TestTensor::make(DType::f32, {7, rd});
      Gradients p;
      p.dsin = dsin_plain.view();
      rope_backward(rotation, plain, g.cview(), x.cview(), p);
      for (std::int64_t e = 0; e < dsin.numel(); ++e)
        ASSERT_EQ(dsin.get(dsin.unravel(e)), -dsin_plain.get(dsin.unravel(e)));
    }
  }
}

TEST(LaneOffset, Validation) {
  EXPECT_THROW(Rotation::half(64).partial(128, -2), Error);
  EXPECT_THROW(Rotation::half(64).partial(128, 66), Error);  // 66 + 64 > 128
  EXPECT_THROW(Rotation::half(64).partial(128, 32).partial(160, 0), Error);
  // A wrong last axis names the full head and writes nothing.
  const Rotation rotation = Rotation::half(64).partial(128, 64);
  TestTables tables;
  tables.cos = TestTensor::make(DType::f32, {4, 64});
  tables.sin = TestTensor::make(DType::f32, {4, 64});
  tables.cos.fill([](const auto&) { return 1.0; });
  tables.sin.fill([](const auto&) { return 0.0; });
  TestTensor x = TestTensor::make(DType::f32, {4, 2, 96});
  x.fill([](const auto&) { return 1.0; });
  TestTensor y = TestTensor::make(DType::f32, {4, 2, 96});
  const auto before = y.storage;
  try {
    rope_forward(rotation, tables.view(), Operand{x.cview(), y.view()});
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("128"), std::string::npos) << e.what();
  }
  EXPECT_EQ(y.storage, before);
}

// ---------------------------------------------------------------------------------------------
// Paged re-rotation

struct PagedCase {
  std::int64_t num_blocks, block_size, heads, rotary_dim, offset;
  bool head_major;  // cache memory [num_blocks, heads, block_size, D] passed as a permuted view
  bool interleave;
};

TEST(RerotatePaged, EveryIsaDtypeAndLayout) {
  std::mt19937_64 rng(13);
  const PagedCase cases[] = {{12, 4, 2, 64, 0, false, false},
                             {12, 16, 3, 64, 0, false, true},
                             {9, 5, 2, 32, 64, true, false},
                             {9, 1, 1, 16, 8, false, true}};
  for (Isa isa : isas_under_test()) {
    ScopedIsa scoped(isa);
    for (const PagedCase& pc : cases)
      for (DType dtype : kDtypes) {
        const std::int64_t rd = pc.rotary_dim, hd = pc.offset + rd + 4, bs = pc.block_size;
        const Rotation full = pc.interleave ? Rotation::interleave(rd) : Rotation::half(rd);
        const Rotation rotation = full.partial(hd, pc.offset);
        TestTensor cache = TestTensor::make(dtype, {pc.num_blocks, bs, pc.heads, hd},
                                            pc.head_major ? Layout{{0, 2, 1, 3}} : Layout{});
        cache.fill_random(rng, -2, 2);
        const TestTensor before = cache;
        // Three sequences: 2.5 blocks, empty, exactly one block; blocks scattered.
        const std::int64_t max_blocks = 3;
        TestTensor block_table = TestTensor::make(DType::i32, {3, max_blocks});
        const std::int64_t ids[3][3] = {{5, 0, 7}, {1, 1, 1}, {8 % pc.num_blocks, 2, 3}};
        block_table.fill([&](const auto& i) { return double(ids[i[0]][i[1]]); });
        TestTensor seq_lens = TestTensor::make(DType::i64, {3});
        const std::int64_t lens[3] = {2 * bs + (bs + 1) / 2, 0, bs};
        seq_lens.fill([&](const auto& i) { return double(lens[i[0]]); });
        // Row b: the angles of shift delta_b, half width.
        const double deltas[3] = {17, 5, -3};
        TestTables tables;
        tables.width = pc.interleave ? TableWidth::pairs : TableWidth::halves;
        tables.cos = TestTensor::make(DType::f32, {3, rd / 2});
        tables.sin = TestTensor::make(DType::f32, {3, rd / 2});
        tables.cos.fill([&](const auto& i) {
          return std::cos(deltas[i[0]] * std::pow(500.0, -2.0 * double(i[1]) / double(rd)));
        });
        tables.sin.fill([&](const auto& i) {
          return std::sin(deltas[i[0]] * std::pow(500.0, -2.0 * double(i[1]) / double(rd)));
        });
        PagedKeys keys{cache.view(), block_table.cview(), seq_lens.cview()};
        rerotate_paged(rotation, tables.view(), keys);

        std::set<std::pair<std::int64_t, std::int64_t>> touched;
        for (std::int64_t b = 0; b < 3; ++b)
          for (std::int64_t t = 0; t < lens[b]; ++t) {
            const std::int64_t block = ids[b][t / bs], slot = t % bs;
            touched.insert({block, slot});
            // One token's heads through the double reference.
            TestTensor x = TestTensor::make(dtype, {pc.heads, hd - pc.offset});
            x.fill([&](const auto& i) {
              return before.get({block, slot, i[0], i[1] + pc.offset});
            });
            TestTables row;
            row.width = tables.width;
            row.cos = TestTensor::make(DType::f32, {1, rd / 2});
            row.sin = TestTensor::make(DType::f32, {1, rd / 2});
            row.cos.fill([&](const auto& i) { return tables.cos.get({b, i[1]}); });
            row.sin.fill([&](const auto& i) { return tables.sin.get({b, i[1]}); });
            const std::vector<double> ref = reference_forward(rotation.unshifted(), row, x);
            TestTensor got = TestTensor::make(dtype, x.shape);
            got.fill([&](const auto& i) {
              return cache.get({block, slot, i[0], i[1] + pc.offset});
            });
            const Comparison c = compare(got, ref);
            ASSERT_TRUE(c.ok) << isa_name(isa) << " " << dtype_name(dtype) << " block " << block
                              << " slot " << slot << ": " << c.first_failure;
            for (std::int64_t h = 0; h < pc.heads; ++h)
              for (std::int64_t j = 0; j < pc.offset; ++j)
                ASSERT_EQ(cache.get({block, slot, h, j}), before.get({block, slot, h, j}));
          }
        // Every other slot (other sequences' blocks, slots past a length) is untouched.
        for (std::int64_t blk = 0; blk < pc.num_blocks; ++blk)
          for (std::int64_t s = 0; s < bs; ++s) {
            if (touched.count({blk, s})) continue;
            for (std::int64_t h = 0; h < pc.heads; ++h)
              for (std::int64_t j = 0; j < hd; ++j)
                ASSERT_EQ(cache.get({blk, s, h, j}), before.get({blk, s, h, j}))
                    << "block " << blk << " slot " << s;
          }
      }
  }
}

TEST(RerotatePaged, BadInputWritesNothing) {
  const Rotation rotation = Rotation::half(16);
  TestTensor cache = TestTensor::make(DType::f32, {4, 2, 1, 16});
  cache.fill([](const auto&) { return 1.5; });
  TestTables tables;
  tables.width = TableWidth::halves;
  tables.cos = TestTensor::make(DType::f32, {2, 8});
  tables.sin = TestTensor::make(DType::f32, {2, 8});
  tables.cos.fill([](const auto&) { return 0.5; });
  tables.sin.fill([](const auto&) { return 0.5; });
  struct Bad {
    std::vector<double> table, lens;
    const char* argument;
  };
  const Bad bad[] = {
      {{0, 4, 1, 2}, {3, 2}, "block_table[0, 1]"},  // block 4 of 4: out of range
      {{0, 1, 1, 2}, {3, 2}, "block_table[1, 0]"},  // block 1 twice
      {{0, 1, 2, 3}, {5, 2}, "seq_lens[0]"},        // 5 slots > 2 blocks × 2
      {{0, 1, 2, 3}, {-1, 2}, "seq_lens[0]"},       // negative
  };
  for (const Bad& b : bad) {
    TestTensor block_table = TestTensor::make(DType::i64, {2, 2});
    block_table.fill([&](const auto& i) { return b.table[i[0] * 2 + i[1]]; });
    TestTensor seq_lens = TestTensor::make(DType::i32, {2});
    seq_lens.fill([&](const auto& i) { return b.lens[i[0]]; });
    const auto before = cache.storage;
    try {
      rerotate_paged(rotation, tables.view(),
                     PagedKeys{cache.view(), block_table.cview(), seq_lens.cview()});
      ADD_FAILURE() << "no error for " << b.argument;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(b.argument), std::string::npos) << e.what();
    }
    EXPECT_EQ(cache.storage, before) << b.argument;
  }
  // Tables with the wrong number of sequences.
  TestTensor block_table = TestTensor::make(DType::i64, {3, 1});
  block_table.fill([](const auto& i) { return double(i[0]); });
  TestTensor seq_lens = TestTensor::make(DType::i64, {3});
  seq_lens.fill([](const auto&) { return 1.0; });
  EXPECT_THROW(rerotate_paged(rotation, tables.view(),
                              PagedKeys{cache.view(), block_table.cview(), seq_lens.cview()}),
               Error);
}

}  // namespace
}  // namespace rome::testing
