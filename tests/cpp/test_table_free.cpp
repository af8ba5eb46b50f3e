// Table-free RoPE (Tables::frequencies): cos/sin computed from positions × frequencies.
// References: cosl/sinl of the angle formed in long double (64-bit significand: the product of a
// position below 2^31 and a double frequency is off by < 2^-64 relative, far below fp32) for the
// kernel itself, and the double reference of the rotation on tables built that way for the
// executor. Every ISA must give the scalar kernel's bits; bad input must leave outputs untouched.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "isa_testing.hpp"
#include "kernels/kernel_api.hpp"
#include "reference.hpp"
#include "rome/rome.hpp"

namespace rome::testing {
namespace {

constexpr DType kDtypes[] = {DType::f32, DType::bf16, DType::f16};

long double exact_angle(std::int64_t p, double f) {
  return static_cast<long double>(p) * static_cast<long double>(f);
}

std::vector<const kernels::KernelTable*> kernel_tables() {
  std::vector<const kernels::KernelTable*> out{&kernels::scalar_kernels()};
  if (isa_compiled(Isa::avx2) && detected_isa() >= Isa::avx2)
    out.push_back(&kernels::avx2_kernels());
  if (isa_compiled(Isa::avx512) && detected_isa() >= Isa::avx512)
    out.push_back(&kernels::avx512_kernels(false));
  return out;
}

float ulp_of(float v) {
  const float a = std::fabs(v);
  return std::nextafter(a, INFINITY) - a;
}

// The kernel: within 3e-7 (the contract) and 2 fp32 ulp of the true value at positions up to
// 10^7 and beyond (fp32 table builders are off by up to 0.1 there; the angle is reduced exactly,
// then evaluated in fp32: 1.55 ulp measured), 3 ulp with an amplitude (one more fp32 rounding);
// same bits on every ISA.
TEST(TableFreeKernel, ExactToFp32AtLongPositionsOnEveryIsa) {
  std::mt19937_64 rng(11);
  std::vector<double> position, frequency;
  for (std::int64_t p :
       {std::int64_t(0), std::int64_t(1), std::int64_t(4095), std::int64_t(131071),
        std::int64_t(1000003), std::int64_t(10000019), std::int64_t(-77777), std::int64_t(1) << 30})
    for (int i = 0; i < 64; ++i) {
      position.push_back(double(p));
      frequency.push_back(std::pow(500000.0, -double(i) / 64.0));
    }
  std::uniform_int_distribution<std::int64_t> any_position(-20000000, 20000000);
  std::uniform_real_distribution<double> any_frequency(0.0, 1.0);
  for (int i = 0; i < 4001; ++i) {  // odd count: every ISA's tail path
    position.push_back(double(any_position(rng)));
    frequency.push_back(any_frequency(rng));
  }
  const std::int64_t n = std::int64_t(position.size());
  for (double amplitude : {1.0, 1.2345678901234567}) {
    std::vector<float> cos0(n), sin0(n);
    kernels::scalar_cos_sin(n, position.data(), frequency.data(), amplitude, cos0.data(),
                            sin0.data());
    const double ulps = amplitude == 1.0 ? 2.0 : 3.0, bound = 3e-7 * amplitude;
    for (std::int64_t i = 0; i < n; ++i) {
      const long double angle = exact_angle(std::int64_t(position[i]), frequency[i]);
      const long double c = amplitude * cosl(angle), s = amplitude * sinl(angle);
      const double cos_error = std::fabs(double(cos0[i] - c));
      const double sin_error = std::fabs(double(sin0[i] - s));
      ASSERT_LE(cos_error, std::min(bound, ulps * ulp_of(float(c))))
          << "cos at position " << position[i] << " frequency " << frequency[i];
      ASSERT_LE(sin_error, std::min(bound, ulps * ulp_of(float(s))))
          << "sin at position " << position[i] << " frequency " << frequency[i];
    }
    for (const kernels::KernelTable* table : kernel_tables()) {
      std::vector<float> c(n, NAN), s(n, NAN);
      table->cos_sin(n, position.data(), frequency.data(), amplitude, c.data(), s.data());
      ASSERT_EQ(0, std::memcmp(c.data(), cos0.data(), n * sizeof(float))) << table->name;
      ASSERT_EQ(0, std::memcmp(s.data(), sin0.data(), n * sizeof(float))) << table->name;
    }
  }
}

// The rows kernel: for every ISA, row width (vector multiples and tails), amplitude, both
// layouts and sign words (none, sin only, both), the bits of the element-wise kernel at each
// (position, frequency) xor-ed with the lane's sign word; the lanes between rows (stride past
// the row) stay as they were.
TEST(TableFreeKernel, RowsKernelMatchesTheElementwiseBits) {
  std::mt19937_64 rng(12);
  std::uniform_int_distribution<std::int64_t> any_position(-20000000, 20000000);
  std::uniform_real_distribution<double> any_frequency(-1.0, 1.0);
  for (std::int64_t n : {1, 3, 7, 8, 16, 22, 32, 64, 65})
    for (bool repeat : {false, true})
      for (double amplitude : {1.0, 0.75})
        for (int signed_sides : {0, 1, 2}) {
          const std::int64_t rows = 5, width = repeat ? 2 * n : n, stride = width + 3;
          std::vector<double> position(rows), frequency(n);
          for (double& p : position) p = double(any_position(rng));
          for (double& f : frequency) f = any_frequency(rng);
          position[0] = 0.0;  // θ = 0 on row 0 and in the last lane: sin is +0 there
          frequency.back() = 0.0;
          // Sign words as the core folds them (the sign bit), plus a low bit that a kernel
          // applying only the sign would lose.
          std::vector<std::uint32_t> cos_signs(width), sin_signs(width);
          for (std::uint32_t& w : cos_signs) w = (rng() & 1 ? 0x80000000u : 0u) | (rng() & 1);
          for (std::uint32_t& w : sin_signs) w = (rng() & 1 ? 0x80000000u : 0u) | (rng() & 1);
          const std::uint32_t* cs = signed_sides == 2 ? cos_signs.data() : nullptr;
          const std::uint32_t* ss = signed_sides >= 1 ? sin_signs.data() : nullptr;
          std::vector<float> want_cos(rows * stride, NAN), want_sin(rows * stride, NAN);
          auto xor_bits = [](float& v, const std::uint32_t* signs, std::int64_t lane) {
            if (signs) v = std::bit_cast<float>(std::bit_cast<std::uint32_t>(v) ^ signs[lane]);
          };
          for (std::int64_t r = 0; r < rows; ++r) {
            float* const wc = &want_cos[r * stride];
            float* const ws = &want_sin[r * stride];
            const std::vector<double> p(n, position[r]);
            kernels::scalar_cos_sin(n, p.data(), frequency.data(), amplitude, wc, ws);
            if (repeat) {
              std::copy_n(wc, n, wc + n);
              std::copy_n(ws, n, ws + n);
            }
            for (std::int64_t lane = 0; lane < width; ++lane) {
              xor_bits(wc[lane], cs, lane);
              xor_bits(ws[lane], ss, lane);
            }
          }
          for (const kernels::KernelTable* table : kernel_tables()) {
            std::vector<float> c(rows * stride, NAN), s(rows * stride, NAN);
            table->cos_sin_rows(rows, position.data(), n, frequency.data(), amplitude, repeat, cs,
                                ss, stride, c.data(), s.data());
            const std::string what = std::string(table->name) + " n " + std::to_string(n) +
                                     (repeat ? " halves" : "") + " signed sides " +
                                     std::to_string(signed_sides);
            ASSERT_EQ(0, std::memcmp(c.data(), want_cos.data(), c.size() * sizeof(float))) << what;
            ASSERT_EQ(0, std::memcmp(s.data(), want_sin.data(), s.size() * sizeof(float))) << what;
          }
        }
}

// The builder narrows its fp32 rows with the vectorised to_bf16_bits (the active ISA's kernel):
// element for element the bits of bf16_bits on every ISA, for every class of float (NaN
// payloads, infinities, subnormals, ties) and every length (the vector loops' tails).
TEST(TableFreeKernel, RowNarrowingMatchesTheScalarBf16Rounding) {
  std::mt19937 rng(5);
  std::vector<float> values;
  for (int i = 0; i < 100000; ++i) values.push_back(std::bit_cast<float>(std::uint32_t(rng())));
  for (std::uint32_t bits :
       {0x7f800000u, 0xff800000u, 0x7f800001u, 0xffc00000u, 0x7fffffffu, 0x00008000u, 0x00018000u,
        0x3f808000u, 0x3f818000u, 0x7f7fffffu, 0xff7fffffu, 0x80000000u, 0x00000000u})
    values.push_back(std::bit_cast<float>(bits));
  for (Isa isa : isas_under_test())
    for (std::size_t length : {std::size_t(0), std::size_t(1), std::size_t(7), std::size_t(8),
                               std::size_t(13), std::size_t(17), std::size_t(31), values.size()}) {
      ScopedIsa scoped(isa);
      std::vector<std::uint16_t> out(length + 1, 0x1234);
      const std::size_t start = values.size() - length;  // the special values sit at the end
      tables::to_bf16_bits(std::span<const float>(values.data() + start, length), out.data());
      for (std::size_t i = 0; i < length; ++i)
        ASSERT_EQ(out[i], tables::bf16_bits(values[start + i]))
            << isa_name(isa) << " " << std::hex << std::bit_cast<std::uint32_t>(values[start + i]);
      EXPECT_EQ(out[length], 0x1234);  // nothing past the end
    }
}

struct NamedRotation {
  const char* name;
  Rotation rotation;
  std::vector<int> lane_frequency;  // expected pairing, written out independently of the library
};

std::vector<int> blocks_of_halves(std::initializer_list<int> sizes) {
  std::vector<int> f;
  int base = 0;
  for (int d : sizes) {
    for (int j = 0; j < d; ++j) f.push_back(base + j % (d / 2));
    base += d / 2;
  }
  return f;
}

std::vector<NamedRotation> rotations() {
  std::vector<NamedRotation> out;
  std::vector<int> half, inter, quarter, mla;
  for (int j = 0; j < 64; ++j) {
    half.push_back(j % 32);
    inter.push_back(j / 2);
    quarter.push_back(j / 32 * 16 + j % 16);
  }
  for (int j = 0; j < 32; ++j) mla.push_back(j % 16);
  out.push_back({"half64", Rotation::half(64), half});
  // Halves of 24 lanes, not whole 16-lane chunks: natural rows on every ISA (the rows kernel's
  // tail on AVX-512).
  std::vector<int> half48;
  for (int j = 0; j < 48; ++j) half48.push_back(j % 24);
  out.push_back({"half48", Rotation::half(48), half48});
  out.push_back({"interleave64", Rotation::interleave(64), inter});
  out.push_back({"quarter64", Rotation::quarter(64), quarter});
  out.push_back({"blocks_22_22_20",
                 Rotation::block_diag({Rotation::half(22), Rotation::half(22), Rotation::half(20)}),
                 blocks_of_halves({22, 22, 20})});
  out.push_back({"interleave_half32", Rotation::interleave_half(32), mla});
  out.push_back({"half64_partial_of_80", Rotation::half(64).partial(80), half});
  out.push_back({"half32_offset_8_of_48", Rotation::half(32).partial(48, 8),
                 std::vector<int>(half.begin(), half.begin() + 32)});
  for (int j = 0; j < 32; ++j) out.back().lane_frequency[j] = j % 16;
  return out;
}

// Direct tables with x's shape but the head axis -> rd: lane j at row r from the position of
// the row (axis `axis` of `positions` when column_axis is set) in long double.
TestTables reference_tables(const std::vector<std::int64_t>& x_shape, std::int64_t rd,
                            const TestTensor& positions, const std::vector<int>& column_axis,
                            const std::vector<int>& lane_frequency,
                            const std::vector<double>& frequencies, double amplitude,
                            bool inverse) {
  std::vector<std::int64_t> shape(x_shape.begin(), x_shape.end() - 1);
  shape.push_back(rd);
  TestTables t;
  t.cos = TestTensor::make(DType::f32, shape);
  t.sin = TestTensor::make(DType::f32, shape);
  std::vector<double> cos_v(t.cos.numel()), sin_v(t.cos.numel());
  for (std::int64_t e = 0; e < t.cos.numel(); ++e) {
    const auto idx = t.cos.unravel(e);
    const std::int64_t j = idx.back();
    const int f = lane_frequency[j];
    std::vector<std::int64_t> pidx(positions.shape.size(), 0);
    for (std::size_t i = 0; i + 1 < idx.size(); ++i) pidx[i] = positions.shape[i] == 1 ? 0 : idx[i];
    if (!column_axis.empty()) pidx.back() = column_axis[f];
    const long double angle = exact_angle(std::int64_t(positions.get(pidx)), frequencies[f]);
    cos_v[e] = double(amplitude * cosl(angle));
    sin_v[e] = double(amplitude * sinl(angle)) * (inverse ? -1 : 1);
  }
  // Stored in fp32 for TestTables; the reference reads them back (fp32-rounded tables: the
  // comparison's tolerance covers the difference).
  t.cos.fill([&](const auto& idx) { return cos_v[t.cos.offset_of(idx) - t.cos.base]; });
  t.sin.fill([&](const auto& idx) { return sin_v[t.sin.offset_of(idx) - t.sin.base]; });
  return t;
}

// The contract is cos/sin within one fp32 ulp of the true values, not equal to the reference's
// fp32 rounding of them: where xa·c and xb·s cancel, a one-ulp table difference moves the result
// by up to 2^-23·amplitude·(|xa| + |xb|), beyond the output's own ulp. Accepted on top of
// compare().
Comparison compare_table_free(const TestTensor& out, const Rotation& rotation,
                              const TestTables& ref_tables, const TestTensor& x, double amplitude) {
  const Reference ref = reference(rotation, ref_tables, x);
  double largest = 0;
  for (std::int64_t e = 0; e < x.numel(); ++e)
    largest = std::max(largest, std::fabs(x.get(x.unravel(e))));
  const double out_ulp = x.dtype == DType::f32 ? 0x1p-23 : x.dtype == DType::f16 ? 0x1p-10 : 0x1p-7;
  std::vector<double> bound(ref.y.size());
  for (std::size_t e = 0; e < bound.size(); ++e)
    bound[e] = 0x1p-22 * amplitude * largest + out_ulp * std::fabs(ref.y[e]);
  return compare(out, ref.y, bound);
}

std::vector<double> llama_frequencies(std::int64_t count) {
  std::vector<double> f;
  for (std::int64_t i = 0; i < count; ++i) f.push_back(std::pow(500000.0, -double(i) / count));
  return f;
}

struct Case {
  const char* layout;
  std::vector<std::int64_t> q_shape, k_shape, positions_shape;
};

// BNSD [B, H, S, D] with positions [1, 1, S] or [B, 1, S]; BSND [B, S, H, D] with [B, S, 1];
// packed [T, H, D] with [T, 1]; GQA k with fewer heads.
std::vector<Case> cases(std::int64_t hd) {
  return {{"bnsd", {2, 4, 9, hd}, {2, 1, 9, hd}, {1, 1, 9}},
          {"bnsd_per_batch", {2, 4, 9, hd}, {2, 2, 9, hd}, {2, 1, 9}},
          {"bsnd", {2, 9, 8, hd}, {2, 9, 1, hd}, {2, 9, 1}},
          {"packed", {17, 8, hd}, {17, 2, hd}, {17, 1}}};
}

TEST(TableFree, EveryRotationLayoutDtypeAndIsaMatchesTheReferenceAndTheScalarBits) {
  std::mt19937_64 rng(5);
  std::uniform_int_distribution<std::int64_t> any_position(0, 10000000);
  for (const auto& [name, rotation, lane_frequency] : rotations()) {
    const std::int64_t rd = rotation.rotary_dim(), hd = rotation.head_dim();
    const std::vector<double> frequencies = llama_frequencies(rd / 2);
    for (const Case& c : cases(hd))
      for (DType dtype : kDtypes)
        for (bool in_place : {false, true})
          for (bool inverse : {false, true}) {
            const double amplitude = inverse ? 1.0 : 1.125;
            TestTensor positions = TestTensor::make(DType::i64, c.positions_shape);
            positions.fill([&](const auto&) { return double(any_position(rng)); });
            TestTensor q = TestTensor::make(dtype, c.q_shape);
            q.fill_random(rng, -2, 2);
            TestTensor k = TestTensor::make(dtype, c.k_shape, Layout{{}, 3});
            k.fill_random(rng, -2, 2);
            Tables tables;
            tables.positions = positions.cview();
            tables.frequencies = frequencies;
            tables.amplitude = amplitude;
            tables.inverse = inverse;
            const TestTables ref_tables = reference_tables(
                c.q_shape, rd, positions, {}, lane_frequency, frequencies, amplitude, inverse);
            const TestTables ref_tables_k = reference_tables(
                c.k_shape, rd, positions, {}, lane_frequency, frequencies, amplitude, inverse);
            std::vector<TestTensor> first_q, first_k;
            for (Isa isa : isas_under_test()) {
              ScopedIsa scoped(isa);
              TestTensor qi = q, ki = k;
              TestTensor q_out = in_place ? qi : TestTensor::make(dtype, q.shape);
              TestTensor k_out = in_place ? ki : TestTensor::make(dtype, k.shape);
              const Operand oq{qi.cview(), q_out.view()}, ok{ki.cview(), k_out.view()};
              rope_forward(rotation, tables, oq, &ok);
              const std::string what = std::string(isa_name(isa)) + " " + name + " " + c.layout +
                                       " " + dtype_name(dtype) + (in_place ? " in place" : "") +
                                       (inverse ? " inverse" : "");
              if (rotation.lane_offset() == 0) {  // offsets: LaneOffsetKeepsLeadingLanes
                const Comparison cq = compare_table_free(q_out, rotation, ref_tables, q, amplitude);
                EXPECT_TRUE(cq.ok) << what << " q: " << cq.first_failure;
                const Comparison ck =
                    compare_table_free(k_out, rotation, ref_tables_k, k, amplitude);
                EXPECT_TRUE(ck.ok) << what << " k: " << ck.first_failure;
              }
              if (first_q.empty()) {
                first_q.push_back(q_out);
                first_k.push_back(k_out);
              } else {
                for (std::int64_t e = 0; e < q.numel(); ++e) {
                  const auto idx = q.unravel(e);
                  ASSERT_EQ(ulp_distance(dtype, q_out.get(idx), first_q[0].get(idx)), 0) << what;
                }
                for (std::int64_t e = 0; e < k.numel(); ++e) {
                  const auto idx = k.unravel(e);
                  ASSERT_EQ(ulp_distance(dtype, k_out.get(idx), first_k[0].get(idx)), 0) << what;
                }
              }
            }
          }
  }
}

// The same rotation through precomputed tables holding the kernel's own cos/sin
// (exact_cos_sin_rows) gives the same bits: the rows the table-free executor prepares (sign
// words and frequency order folded into the rows kernel, inverse as a flipped sin) are those of
// the table path. Position 0 and a zero frequency make θ = 0, where an inverse done by negating
// the angle would give sin +0 instead of the flip's -0 (visible against x = -0).
TEST(TableFree, MatchesTheTablePathBitForBit) {
  std::mt19937_64 rng(33);
  struct Named {
    const char* name;
    Rotation rotation;
    bool pairs;
  };
  const Named rotations[] = {{"half64", Rotation::half(64), false},
                             {"half48", Rotation::half(48), false},
                             {"interleave64", Rotation::interleave(64), true}};
  for (const auto& [name, rotation, pairs] : rotations) {
    const std::int64_t rd = rotation.rotary_dim(), T = 9, H = 3;
    std::vector<double> frequencies = llama_frequencies(rd / 2);
    frequencies.back() = 0.0;
    std::vector<std::int64_t> pos = {0, 1, 7, 4095, 131071, 1000003, 0, 9999991, 2};
    TestTensor positions = TestTensor::make(DType::i64, {T, 1});
    positions.fill([&](const auto& i) { return double(pos[std::size_t(i[0])]); });
    for (DType dtype : kDtypes)
      for (bool inverse : {false, true})
        for (double amplitude : {1.0, 1.125}) {
          std::vector<float> c(std::size_t(T * rd)), s(std::size_t(T * rd));
          exact_cos_sin_rows(pos, frequencies, amplitude, pairs, c.data(), s.data());
          TestTensor cos_t = TestTensor::make(DType::f32, {T, 1, rd});
          TestTensor sin_t = TestTensor::make(DType::f32, {T, 1, rd});
          cos_t.fill([&](const auto& i) { return double(c[std::size_t(i[0] * rd + i[2])]); });
          sin_t.fill([&](const auto& i) { return double(s[std::size_t(i[0] * rd + i[2])]); });
          TestTensor x = TestTensor::make(dtype, {T, H, rd});
          x.fill_random(rng, -2, 2);
          for (std::int64_t t = 0; t < T; ++t)  // signed zeros on some lanes of every row
            for (std::int64_t h = 0; h < H; ++h)
              for (std::int64_t j = h; j < rd; j += 5) x.set({t, h, j}, (j & 1) ? -0.0 : 0.0);
          Tables table_free;
          table_free.positions = positions.cview();
          table_free.frequencies = frequencies;
          table_free.amplitude = amplitude;
          table_free.inverse = inverse;
          Tables tables;
          tables.cos = cos_t.cview();
          tables.sin = sin_t.cview();
          tables.inverse = inverse;
          for (Isa isa : isas_under_test()) {
            ScopedIsa scoped(isa);
            TestTensor free_out = TestTensor::make(dtype, x.shape);
            TestTensor table_out = TestTensor::make(dtype, x.shape);
            rope_forward(rotation, table_free, Operand{x.cview(), free_out.view()});
            rope_forward(rotation, tables, Operand{x.cview(), table_out.view()});
            EXPECT_EQ(free_out.storage, table_out.storage)
                << isa_name(isa) << " " << name << " " << dtype_name(dtype)
                << (inverse ? " inverse" : "") << " amplitude " << amplitude;
          }
        }
  }
}

// A lane offset: lanes [8, 40) of 48 rotate, the leading and trailing lanes stay.
TEST(TableFree, LaneOffsetKeepsLeadingLanes) {
  std::mt19937_64 rng(9);
  const Rotation rotation = Rotation::half(32).partial(48, 8);
  TestTensor positions = TestTensor::make(DType::i32, {5, 1});
  positions.fill([&](const auto& i) { return double(1000003 * (i[0] + 1)); });
  TestTensor x = TestTensor::make(DType::bf16, {5, 3, 48});
  x.fill_random(rng, -2, 2);
  Tables tables;
  tables.positions = positions.cview();
  tables.frequencies = llama_frequencies(16);
  for (Isa isa : isas_under_test()) {
    ScopedIsa scoped(isa);
    TestTensor y = TestTensor::make(DType::bf16, x.shape);
    rope_forward(rotation, tables, Operand{x.cview(), y.view()});
    const std::vector<int> lanes = [] {
      std::vector<int> f;
      for (int j = 0; j < 32; ++j) f.push_back(j % 16);
      return f;
    }();
    for (std::int64_t e = 0; e < x.numel(); ++e) {
      const auto idx = x.unravel(e);
      if (idx.back() < 8 || idx.back() >= 40) {
        ASSERT_EQ(x.get(idx), y.get(idx)) << "lane outside [8, 40) changed";
        continue;
      }
      const std::int64_t j = idx.back() - 8, m = j < 16 ? j + 16 : j - 16;
      auto partner = idx;
      partner.back() = m + 8;
      const long double angle =
          exact_angle(std::int64_t(positions.get({idx[0], 0})), tables.frequencies[lanes[j]]);
      const double xb = (j < 16 ? -1 : 1) * x.get(partner);
      const double want = x.get(idx) * double(cosl(angle)) + xb * double(sinl(angle));
      ASSERT_LE(ulp_distance(DType::bf16, y.get(idx), want), 1)
          << isa_name(isa) << " at " << idx[0] << "," << idx[1] << "," << idx[2] << " got "
          << y.get(idx) << " want " << want;
    }
  }
}

// MRoPE: frequency i driven by position axis column_axis[i] (Qwen2-VL sections 8/12/12 of 32).
TEST(TableFree, MropeColumnAxis) {
  std::mt19937_64 rng(3);
  const Rotation rotation = Rotation::half(64);
  std::vector<int> column_axis;
  for (int i = 0; i < 32; ++i) column_axis.push_back(i < 8 ? 0 : i < 20 ? 1 : 2);
  std::vector<int> lanes;
  for (int j = 0; j < 64; ++j) lanes.push_back(j % 32);
  TestTensor positions = TestTensor::make(DType::i64, {7, 1, 3});
  std::uniform_int_distribution<std::int64_t> any(0, 5000000);
  positions.fill([&](const auto&) { return double(any(rng)); });
  const std::vector<double> frequencies = llama_frequencies(32);
  TestTensor x = TestTensor::make(DType::f32, {7, 4, 64});
  x.fill_random(rng, -2, 2);
  const TestTables ref =
      reference_tables(x.shape, 64, positions, column_axis, lanes, frequencies, 1.0, false);
  Tables tables;
  tables.positions = positions.cview();
  tables.frequencies = frequencies;
  tables.column_axis = column_axis;
  for (Isa isa : isas_under_test()) {
    ScopedIsa scoped(isa);
    TestTensor y = TestTensor::make(DType::f32, x.shape);
    rope_forward(rotation, tables, Operand{x.cview(), y.view()});
    const Comparison c = compare_table_free(y, rotation, ref, x, 1.0);
    EXPECT_TRUE(c.ok) << isa_name(isa) << ": " << c.first_failure;
  }
}

// The gradient of a table-free rotation is the rotation by −θ: dx equals the forward run with
// `inverse` on the gradient.
TEST(TableFree, BackwardIsTheInverseRotation) {
  std::mt19937_64 rng(21);
  const Rotation rotation = Rotation::interleave(64);
  TestTensor positions = TestTensor::make(DType::i64, {1, 1, 6});
  positions.fill([&](const auto& i) { return double(999983 * i[2]); });
  TestTensor x = TestTensor::make(DType::f32, {2, 3, 6, 64});
  TestTensor g = TestTensor::make(DType::f32, x.shape);
  x.fill_random(rng, -2, 2);
  g.fill_random(rng, -2, 2);
  Tables tables;
  tables.positions = positions.cview();
  tables.frequencies = llama_frequencies(32);
  tables.amplitude = 0.75;
  for (Isa isa : isas_under_test()) {
    ScopedIsa scoped(isa);
    TestTensor dx = TestTensor::make(DType::f32, x.shape);
    Gradients grads;
    grads.dx = dx.view();
    rope_backward(rotation, tables, g.cview(), x.cview(), grads);
    Tables inverse = tables;
    inverse.inverse = true;
    TestTensor want = TestTensor::make(DType::f32, x.shape);
    rope_forward(rotation, inverse, Operand{g.cview(), want.view()});
    // Different operation orders: compare within fp32 rounding of the terms (|g|, |C|, |S| ≤ 2).
    for (std::int64_t e = 0; e < x.numel(); ++e) {
      const auto idx = x.unravel(e);
      ASSERT_NEAR(dx.get(idx), want.get(idx), 1e-6) << isa_name(isa);
    }
  }
}

// Bad input: a clear error naming the argument, outputs untouched (still NaN).
TEST(TableFree, BadInputIsRejectedAndWritesNothing) {
  TestTensor positions = TestTensor::make(DType::i64, {1, 1, 4});
  positions.fill([&](const auto& i) { return double(i[2]); });
  TestTensor x = TestTensor::make(DType::f32, {1, 2, 4, 64});
  x.fill([&](const auto&) { return 1.0; });
  auto expect_error = [&](const Rotation& rotation, const Tables& tables, const char* argument) {
    TestTensor y = TestTensor::make(DType::f32, x.shape);
    try {
      rope_forward(rotation, tables, Operand{x.cview(), y.view()});
      ADD_FAILURE() << "no error for " << argument;
    } catch (const Error& e) {
      EXPECT_EQ(e.argument(), argument) << e.what();
    }
    for (std::int64_t i = 0; i < y.numel(); ++i) ASSERT_TRUE(std::isnan(y.get(y.unravel(i))));
  };
  Tables good;
  good.positions = positions.cview();
  good.frequencies = llama_frequencies(32);
  const Rotation half = Rotation::half(64);
  Tables t = good;
  t.frequencies.pop_back();
  expect_error(half, t, "tables.frequencies");
  t = good;
  t.frequencies[3] = NAN;
  expect_error(half, t, "tables.frequencies");
  t = good;
  t.frequencies[5] = INFINITY;
  expect_error(half, t, "tables.frequencies");
  t = good;
  t.amplitude = INFINITY;
  expect_error(half, t, "tables.amplitude");
  t = good;
  t.positions = {};
  expect_error(half, t, "positions");
  TestTensor float_positions = TestTensor::make(DType::f32, {1, 1, 4});
  float_positions.fill([](const auto&) { return 1.0; });
  t = good;
  t.positions = float_positions.cview();
  expect_error(half, t, "positions.dtype");
  TestTensor wrong_shape = TestTensor::make(DType::i64, {1, 1, 5});
  wrong_shape.fill([](const auto&) { return 1.0; });
  t = good;
  t.positions = wrong_shape.cview();
  expect_error(half, t, "positions");
  TestTensor huge = TestTensor::make(DType::i64, {1, 1, 4});
  huge.fill([](const auto& i) { return i[2] == 2 ? 0x1p51 : 0.0; });
  t = good;
  t.positions = huge.cview();
  expect_error(half, t, "positions");
  t = good;
  t.column_axis = {0, 1};
  expect_error(half, t, "positions");  // positions lack the per-axis axis
  std::vector<float> dense(64 * 64, 0.0f);
  for (int i = 0; i < 64; ++i) dense[i * 64 + (i + 1) % 64] = 0.5f;
  expect_error(Rotation::dense(dense, 64), good, "rotation");
  TestTensor cos = TestTensor::make(DType::f32, {4, 64});
  cos.fill([](const auto&) { return 1.0; });
  t = good;
  t.cos = cos.cview();
  t.sin = cos.cview();
  expect_error(half, t, "cos");
}

}  // namespace
}  // namespace rome::testing
