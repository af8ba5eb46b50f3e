// prepare_table_tile's one-pass paths for cache rows gathered by position and for direct rows:
// spread_row (read, spread over the lanes, sine negated, signs folded in one loop; 16-bit, half
// width, or a lane stride of 2 as in a complex table's real and imaginary views) and, into the
// even/odd layout, spread_even_odd_16 (fp32 or bf16 rows, unit lanes, split as well), against the
// general path (load_table_row per column, then fold_signs), which the same cache takes with one
// position per column (column_axis): the same values must give the same table tile bit for bit,
// for every table dtype (cos and sin apart too), width, rotation, inverse and lane layout, with NaN
// payloads, infinities, signed zeros and subnormals among the values; and every NaN of an
// even/odd tile is quiet with 16 zero low bits.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "core/convert.hpp"
#include "core/dispatch.hpp"
#include "core/plan.hpp"
#include "isa_testing.hpp"
#include "rome/rope.hpp"

namespace {

using rome::DType;
using rome::TableWidth;

struct Cache {
  std::vector<std::uint8_t> bytes;  // [rows, 2 * columns] elements: lane stride 2 view reads even
  std::int64_t rows = 0, columns = 0;
};

std::uint32_t special_bits(std::mt19937& rng, int i) {
  switch (i % 11) {
    case 0: return 0x7fc12345u;  // quiet NaN with a payload
    case 1: return 0xff812345u;  // signalling NaN, negative
    case 2: return 0x80000000u;  // -0
    case 3: return 0x7f800000u;  // inf
    case 4: return 0x00000123u;  // fp32 subnormal
    default: {
      std::uniform_real_distribution<float> d(-1.5f, 1.5f);
      return rome::detail::float_bits(d(rng));
    }
  }
}

// Values of the contiguous cache at element (r, c) also at (r, 2c) of a twice as wide one.
void fill(Cache& contiguous, Cache& strided, DType dtype, std::int64_t rows, std::int64_t columns,
          unsigned seed) {
  std::mt19937 rng(seed);
  const int es = rome::dtype_size(dtype);
  contiguous.rows = strided.rows = rows;
  contiguous.columns = strided.columns = columns;
  contiguous.bytes.assign(std::size_t(rows * columns * es), 0);
  strided.bytes.assign(std::size_t(rows * columns * 2 * es), 0xab);
  for (std::int64_t e = 0; e < rows * columns; ++e) {
    const std::uint32_t bits = special_bits(rng, int(e));
    std::uint8_t raw[4];
    if (dtype == DType::f32) {
      std::memcpy(raw, &bits, 4);
    } else {
      // 16-bit patterns: the high half (bf16) or a few fp16 specials (0x7e01 NaN, 0x8000, 0x0001
      // subnormal) among random halves.
      std::uint16_t h = std::uint16_t(bits >> 16);
      if (dtype == DType::f16 && e % 11 == 4) h = 0x0001;
      if (dtype == DType::f16 && e % 11 == 0) h = 0x7e01;
      std::memcpy(raw, &h, 2);
    }
    std::memcpy(&contiguous.bytes[std::size_t(e * es)], raw, std::size_t(es));
    std::memcpy(&strided.bytes[std::size_t(2 * e * es)], raw, std::size_t(es));
  }
}

struct Tile {
  std::vector<float> cos, sin;
};

Tile tile_of(const rome::Rotation& rotation, const rome::Tables& tables,
             std::vector<std::uint16_t>& x, std::int64_t tokens, std::int64_t heads,
             rome::kernels::TableLayout layout) {
  const std::int64_t hd = rotation.head_dim();
  const auto view = rome::make_view<void*>(x.data(), DType::bf16, {tokens, heads, hd});
  const rome::Operand op{rome::as_const(view), view};
  const rome::detail::ForwardPlan plan = rome::detail::plan_forward(rotation, tables, op, nullptr);
  const std::int64_t rd = rotation.rotary_dim(), stride = (rd + 15) / 16 * 16;
  Tile t;
  t.cos.assign(std::size_t(tokens * stride), -7.0f);
  t.sin.assign(std::size_t(tokens * stride), -7.0f);
  std::vector<float> row_cos(static_cast<std::size_t>(stride)),
      row_sin(static_cast<std::size_t>(stride));
  std::int64_t outer[rome::kMaxRank] = {};
  rome::detail::prepare_table_tile(plan, outer, tokens, stride, layout, t.cos.data(), t.sin.data(),
                                   row_cos.data(), row_sin.data());
  return t;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

void spread_rows_match_per_column_path();

}  // namespace

// On every ISA: the plan takes the active kernels' spread_even_odd_16.
TEST(TableSpread, GatheredAndDirectRowsMatchThePerColumnPathBitForBit) {
  for (rome::Isa isa : rome::testing::isas_under_test()) {
    SCOPED_TRACE(rome::isa_name(isa));
    rome::testing::ScopedIsa scoped(isa);
    spread_rows_match_per_column_path();
  }
}

namespace {

void spread_rows_match_per_column_path() {
  struct Named {
    std::string name;
    rome::Rotation rotation;
  };
  std::vector<float> dense_b(48 * 48, 0.0f);
  for (int i = 0; i < 48; ++i) dense_b[std::size_t(i * 48 + (47 - i))] = i % 3 ? 0.5f : -2.0f;
  const std::vector<Named> rotations = {
      {"half64", rome::Rotation::half(64)},
      {"interleave64", rome::Rotation::interleave(64)},
      {"quarter64", rome::Rotation::quarter(64)},
      {"interleave_half64", rome::Rotation::interleave_half(64)},
      {"half48", rome::Rotation::half(48)},
      {"dense48", rome::Rotation::dense(dense_b, 48)},
  };
  const std::int64_t tokens = 11, heads = 3, rows = 23;
  int cases = 0, even_odd_nans = 0;
  for (const Named& r : rotations) {
    const std::int64_t rd = r.rotation.rotary_dim();
    std::vector<std::uint16_t> x(std::size_t(tokens * heads * r.rotation.head_dim()), 0x3f80);
    for (auto [dtype, sin_dtype] :
         {std::pair{DType::f32, DType::f32}, std::pair{DType::bf16, DType::bf16},
          std::pair{DType::f16, DType::f16}, std::pair{DType::f32, DType::bf16}})
      for (TableWidth width : {TableWidth::full, TableWidth::halves, TableWidth::pairs})
        for (bool inverse : {false, true})
          for (auto layout :
               {rome::kernels::TableLayout::natural, rome::kernels::TableLayout::even_odd_16}) {
            if (layout == rome::kernels::TableLayout::even_odd_16 && rd % 16 != 0) continue;
            const std::int64_t columns = width == TableWidth::full ? rd : rd / 2;
            Cache cc, cs, sc, ss;
            fill(cc, cs, dtype, rows, columns, 17u + unsigned(cases));
            fill(sc, ss, sin_dtype, rows, columns, 9001u + unsigned(cases));
            std::vector<std::int64_t> positions(static_cast<std::size_t>(tokens));
            for (std::int64_t i = 0; i < tokens; ++i)
              positions[std::size_t(i)] = (i * 7 + 3) % rows;
            // Direct tables: the rows the positions pick, copied in token order.
            Cache dc, ds, sdc, sds;
            auto direct_of = [&](const Cache& from, Cache& to, std::int64_t lane, DType d) {
              const std::int64_t row_bytes = columns * lane * rome::dtype_size(d);
              to.bytes.resize(std::size_t(tokens * row_bytes));
              for (std::int64_t i = 0; i < tokens; ++i)
                std::memcpy(&to.bytes[std::size_t(i * row_bytes)],
                            &from.bytes[std::size_t(positions[std::size_t(i)] * row_bytes)],
                            std::size_t(row_bytes));
            };
            direct_of(cc, dc, 1, dtype);
            direct_of(sc, ds, 1, sin_dtype);
            direct_of(cs, sdc, 2, dtype);
            direct_of(ss, sds, 2, sin_dtype);
            enum class Form { gathered, direct, per_column };
            auto tables_of = [&](const Cache& c, const Cache& s, bool strided, Form form) {
              rome::Tables t;
              const std::int64_t lane = strided ? 2 : 1;
              // Direct tables [tokens, 1, columns] (x is [tokens, heads, hd]); caches [rows,
              // columns].
              auto view_of = [&](const Cache& table, DType d) {
                const void* data = table.bytes.data();
                return form == Form::direct
                           ? rome::make_view<const void*>(data, d, {tokens, 1, columns},
                                                          {columns * lane, 0, lane})
                           : rome::make_view<const void*>(data, d, {rows, columns},
                                                          {columns * lane, lane});
              };
              t.cos = view_of(c, dtype);
              t.sin = view_of(s, sin_dtype);
              if (form == Form::gathered)
                t.positions =
                    rome::make_view<const void*>(positions.data(), DType::i64, {tokens, 1}, {1, 0});
              if (form == Form::per_column) {
                t.positions = rome::make_view<const void*>(positions.data(), DType::i64,
                                                           {tokens, 1, 1}, {1, 0, 1});
                t.column_axis.assign(std::size_t(columns), 0);
              }
              t.width = width;
              t.inverse = inverse;
              return t;
            };
            const std::string what =
                r.name + " " + rome::dtype_name(dtype) + "/" + rome::dtype_name(sin_dtype) +
                " width " + std::to_string(int(width)) + " inverse " + std::to_string(inverse) +
                " layout " + std::to_string(int(layout));
            const Tile general = tile_of(r.rotation, tables_of(cc, sc, false, Form::per_column), x,
                                         tokens, heads, layout);
            // Even/odd tiles go to bf16 kernels that narrow without a NaN case: every NaN in them
            // is quiet with 16 zero low bits (kernel_api.hpp: nan_results_low_bits_zero).
            if (layout == rome::kernels::TableLayout::even_odd_16)
              for (const std::vector<float>* values : {&general.cos, &general.sin})
                for (float v : *values) {
                  const std::uint32_t u = rome::detail::float_bits(v);
                  if ((u & 0x7fffffffu) <= 0x7f800000u) continue;
                  ++even_odd_nans;
                  EXPECT_EQ(u & 0x0040ffffu, 0x00400000u) << what << ": NaN bits " << std::hex << u;
                }
            for (bool strided : {false, true})
              for (Form form : {Form::gathered, Form::direct}) {
                const Cache& c = form == Form::direct ? (strided ? sdc : dc) : (strided ? cs : cc);
                const Cache& s = form == Form::direct ? (strided ? sds : ds) : (strided ? ss : sc);
                const Tile fast =
                    tile_of(r.rotation, tables_of(c, s, strided, form), x, tokens, heads, layout);
                const std::string how = std::string(strided ? " lane stride 2" : " unit lanes") +
                                        (form == Form::direct ? " direct" : " gathered");
                EXPECT_TRUE(same_bits(fast.cos, general.cos)) << what << how;
                EXPECT_TRUE(same_bits(fast.sin, general.sin)) << what << how;
              }
            ++cases;
          }
  }
  EXPECT_GT(cases, 150);
  EXPECT_GT(even_odd_nans, 100);
}

}  // namespace

// Each ISA's KernelTable::spread_even_odd_16 against its definition (kernel_api.hpp), written out
// lane by lane here: fp32 and bf16 rows, full and half width, with and without signs and flip, in
// place, on rows without a NaN, with one NaN in their last chunk only (fp32: a signalling NaN
// whose payload is only in the low bits, which the quiet bit keeps from becoming an infinity), and
// full of NaN payloads, infinities, signed zeros and subnormals. Lanes past rotary_dim stay
// untouched. (The tile test above runs its per-column reference through the same function: this
// test is what checks the function itself.)
TEST(TableSpread, EveryIsaSpreadsEvenOddRowsAsDefined) {
  constexpr std::uint32_t kUntouched = 0x7fbadbadu;
  int cases = 0, nans = 0;
  for (rome::Isa isa : rome::testing::isas_under_test()) {
    rome::testing::ScopedIsa scoped(isa);
    const rome::kernels::SpreadEvenOdd16Fn spread =
        rome::detail::active_kernels().spread_even_odd_16;
    std::mt19937 rng(7);
    for (std::int64_t rd : {16, 48, 128, 256})
      for (DType dtype : {DType::f32, DType::bf16})
        for (std::int64_t period : {rd, rd / 2})
          for (bool signed_lanes : {false, true})
            for (std::uint32_t flip : {0u, 0x80000000u})
              for (bool in_place : {false, true})
                for (int values = 0; values < 3; ++values) {
                  if (period % 16 != 0 || (in_place && (dtype != DType::f32 || period != rd)))
                    continue;
                  std::vector<std::uint32_t> bits(static_cast<std::size_t>(period));
                  for (std::size_t i = 0; i < bits.size(); ++i) {
                    const std::uint32_t u =
                        values == 2 ? special_bits(rng, int(i))
                                    : rome::detail::float_bits(float(int(rng() % 2001) - 1000) / 7);
                    bits[i] = dtype == DType::bf16 ? u & 0xffff0000u : u;
                  }
                  if (values == 1) bits.back() = dtype == DType::bf16 ? 0xff810000u : 0x7f800001u;
                  std::vector<std::uint32_t> signs(static_cast<std::size_t>(rd));
                  for (auto& w : signs) w = rng() % 3 == 0 ? 0x80000000u : 0u;
                  std::vector<std::uint32_t> expected(std::size_t(rd + 16), kUntouched);
                  for (std::int64_t k = 0; k < rd; k += 16) {
                    const std::int64_t column = k < period ? k : k - period;
                    for (std::int64_t i = 0; i < 16; ++i) {
                      std::uint32_t u = bits[std::size_t(column + 2 * (i % 8) + i / 8)] ^ flip;
                      if (signed_lanes) u ^= signs[std::size_t(k + i)];
                      if ((u & 0x7fffffffu) > 0x7f800000u) u = (u | 0x00400000u) & 0xffff0000u;
                      expected[std::size_t(k + i)] = u;
                    }
                  }
                  std::vector<std::uint16_t> halves(bits.size());
                  for (std::size_t i = 0; i < bits.size(); ++i)
                    halves[i] = std::uint16_t(bits[i] >> 16);
                  std::vector<std::uint32_t> out(std::size_t(rd + 16), kUntouched);
                  const void* row = dtype == DType::bf16 ? static_cast<const void*>(halves.data())
                                                         : static_cast<const void*>(bits.data());
                  if (in_place) {
                    std::copy(bits.begin(), bits.end(), out.begin());
                    row = out.data();
                  }
                  spread(row, dtype, period, signed_lanes ? signs.data() : nullptr, flip, rd,
                         reinterpret_cast<float*>(out.data()));
                  ASSERT_EQ(out, expected)
                      << rome::isa_name(isa) << " rd " << rd << " " << rome::dtype_name(dtype)
                      << " period " << period << " signs " << signed_lanes << " flip " << flip
                      << " in place " << in_place << " values " << values;
                  for (std::int64_t j = 0; j < rd; ++j)
                    nans += (expected[std::size_t(j)] & 0x7fffffffu) > 0x7f800000u;
                  ++cases;
                }
  }
  EXPECT_GT(cases, 200);
  EXPECT_GT(nans, 1000);
}
