// QK-norm + RoPE and RoPE + paged KV-cache write: against a float64 reference built from the
// separate steps (RMSNorm, rotate, scatter), bit-identical to the scalar kernel on every ISA,
// head dims 64, 80, 96, 128, 256, partial rotary, GQA, slices of a packed qkv buffer, Gemma's
// (1 + w), padding slots; bad input writes nothing. Also the non-temporal copy the cache write
// and the benchmarks' floor use.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <random>
#include <vector>

#include "core/dispatch.hpp"
#include "isa_testing.hpp"
#include "kernels/kernel_api.hpp"
#include "reference.hpp"
#include "rome/rome.hpp"

namespace rome::testing {
namespace {

struct Packed {
  // qkv [T, (Hq + 2·Hk)·D] with q, k, v as [T, H, D] views.
  TestTensor buffer;
  std::int64_t T, hq, hk, d;
  TensorView view(std::int64_t first_head, std::int64_t heads) {
    TensorView v = buffer.view();
    const std::int64_t es = dtype_size(buffer.dtype);
    v.data = static_cast<char*>(v.data) + first_head * d * es;
    v.rank = 3;
    v.shape[0] = T;
    v.shape[1] = heads;
    v.shape[2] = d;
    v.strides[0] = (hq + 2 * hk) * d;
    v.strides[1] = d;
    v.strides[2] = 1;
    return v;
  }
  TensorView q() { return view(0, hq); }
  TensorView k() { return view(hq, hk); }
  TensorView v() { return view(hq + hk, hk); }
};

Packed make_packed(DType dtype, std::int64_t T, std::int64_t hq, std::int64_t hk, std::int64_t d,
                   std::mt19937_64& rng) {
  Packed p{TestTensor::make(dtype, {T, (hq + 2 * hk) * d}), T, hq, hk, d};
  p.buffer.fill_random(rng, -3, 3);
  return p;
}

double get(const TensorView& v, std::int64_t t, std::int64_t h, std::int64_t j) {
  const char* p = static_cast<const char*>(v.data) +
                  (t * v.strides[0] + h * v.strides[1] + j * v.strides[2]) * dtype_size(v.dtype);
  return to_double(v.dtype, p);
}

// A vLLM-style cache [P, rd] (cos | sin halves) read with TableWidth halves / pairs.
struct Cache {
  TestTensor cos, sin, positions;
  Tables view(bool neox) const {
    Tables t;
    t.cos = cos.cview();
    t.sin = sin.cview();
    t.positions = positions.cview();
    t.width = neox ? TableWidth::halves : TableWidth::pairs;
    return t;
  }
};

Cache make_cache(std::int64_t rows, std::int64_t rd, std::int64_t T, std::mt19937_64& rng,
                 DType table_dtype = DType::f32) {
  Cache c{TestTensor::make(table_dtype, {rows, rd / 2}),
          TestTensor::make(table_dtype, {rows, rd / 2}), TestTensor::make(DType::i64, {T, 1})};
  c.cos.fill([&](const auto& i) {
    return std::cos(double(i[0]) * std::pow(10000.0, -2.0 * double(i[1]) / double(rd)));
  });
  c.sin.fill([&](const auto& i) {
    return std::sin(double(i[0]) * std::pow(10000.0, -2.0 * double(i[1]) / double(rd)));
  });
  std::uniform_int_distribution<std::int64_t> u(0, rows - 1);
  c.positions.fill([&](const auto&) { return double(u(rng)); });
  return c;
}

// float64: RMSNorm of a head, then the rotation (neox halves or GPT-J pairs) of its first rd
// lanes. Also each lane's magnitude |n_a·c| + |n_b·s| (|n_j| past rd): where the two terms
// cancel, fp32 arithmetic is only accurate relative to it.
struct ReferenceHead {
  std::vector<double> y, magnitude;
};

ReferenceHead reference_head(const std::vector<double>& x, const std::vector<double>& w, double eps,
                             const Cache& cache, std::int64_t t, std::int64_t rd, bool neox,
                             bool normalise) {
  const std::int64_t d = std::int64_t(x.size());
  std::vector<double> n(x);
  if (normalise) {
    double ss = 0;
    for (double v : x) ss += v * v;
    const double r = 1.0 / std::sqrt(ss / double(d) + eps);
    for (std::int64_t j = 0; j < d; ++j) n[j] = x[j] * r * w[j];
  }
  ReferenceHead out{n, n};
  for (double& m : out.magnitude) m = std::abs(m);
  const auto p = std::int64_t(cache.positions.get({t, 0}));
  for (std::int64_t i = 0; i < rd / 2; ++i) {
    const double c = cache.cos.get({p, i}), s = cache.sin.get({p, i});
    const std::int64_t a = neox ? i : 2 * i, b = neox ? i + rd / 2 : 2 * i + 1;
    out.y[a] = n[a] * c - n[b] * s;
    out.y[b] = n[b] * c + n[a] * s;
    out.magnitude[a] = out.magnitude[b] = std::abs(n[a] * c) + std::abs(n[b] * s);
  }
  return out;
}

// One rounding of the output type (1 ulp), or fp32's own error relative to the lane's magnitude
// (the folded table C·w, the norm's scale and the sum are fp32: a few 2^-24 of it).
void expect_close(DType dtype, double got, double want, double magnitude, const std::string& what) {
  const double fp32_error = 4 * std::ldexp(magnitude, -24);
  if (dtype == DType::f32) {
    ASSERT_LE(std::abs(got - want), 2e-6 * std::max(1.0, std::abs(want)) + fp32_error) << what;
  } else if (std::abs(got - want) > fp32_error) {
    ASSERT_LE(ulp_distance(dtype, got, want), 1) << what << " got " << got << " want " << want;
  }
}

// The AVX-512 table the core installs on a CPU without AVX512-BF16 (bf16 narrowed in integer
// arithmetic), run on CPUs that have the instructions (the core would pick the other table there).
std::vector<const kernels::KernelTable*> tables_not_picked_here() {
  std::vector<const kernels::KernelTable*> out;
#ifdef ROME_TEST_HAVE_AVX512
  const std::vector<Isa> isas = isas_under_test();
  if (std::find(isas.begin(), isas.end(), Isa::avx512) != isas.end() &&
      detail::cpu_features().avx512_bf16)
    out.push_back(&kernels::avx512_kernels(false));
#endif
  return out;
}

struct FusedCase {
  std::int64_t d, rd, hq, hk;
  bool neox;
};

const FusedCase kCases[] = {{64, 64, 4, 2, true},
                            {80, 80, 3, 1, true},
                            {96, 96, 2, 2, false},
                            {128, 64, 4, 1, true},
                            {128, 128, 8, 2, false},
                            {256, 256, 2, 1, true},
                            {40, 20, 2, 2, true},
                            {128, 64, 4, 1, false},
                            // head_dim not a multiple of 8 or 16 past a whole-vector rotation
                            // (masked tails), more than 8 heads (several row groups per tile)
                            {100, 64, 9, 3, true},
                            {72, 64, 16, 8, false},
                            // pass-1 groups of 8 rows with a partial remainder (q 8 + 4), and
                            // partial groups padded to 8 rows (k 5; q 6 at head_dim 128)
                            {64, 64, 12, 5, false},
                            {128, 128, 6, 1, true}};

// 16-bit rows sum their products in one fma (kernel_api.hpp: single_fma_epilogue), fp32 rows
// compensated.
TEST(QkNormRope, MatchesReferenceAndScalarOnEveryIsa) {
  std::mt19937_64 rng(21);
  for (const FusedCase& fc : kCases)
    for (DType dtype : {DType::f32, DType::bf16, DType::f16})
      for (DType table_dtype : {DType::f32, DType::bf16})
        for (bool gemma : {false, true}) {
          // Under the sanitizers 19 tokens: still more than one group of rows on every ISA.
          const std::int64_t T = kSanitized ? 19 : 37;
          const Rotation rotation =
              (fc.neox ? Rotation::half(fc.rd) : Rotation::interleave(fc.rd)).partial(fc.d);
          const Cache cache = make_cache(64, fc.rd, T, rng, table_dtype);
          TestTensor qw = TestTensor::make(DType::bf16, {fc.d}),
                     kw = TestTensor::make(DType::f32, {fc.d});
          qw.fill_random(rng, 0.5, 1.5);
          kw.fill_random(rng, -0.5, 0.5);
          QkNorm norm{qw.cview(), kw.cview(), 1e-6f, gemma};
          const Packed original = make_packed(dtype, T, fc.hq, fc.hk, fc.d, rng);
          Packed expected = original;
          {
            ScopedIsa scoped(Isa::scalar);
            qk_norm_rope(rotation, cache.view(fc.neox), norm, expected.q(), expected.k());
          }
          // The reference from the separate steps.
          Packed in = original;
          for (int which = 0; which < 2; ++which) {
            const TensorView before = which ? in.k() : in.q();
            const TensorView after = which ? expected.k() : expected.q();
            const TestTensor& wt = which ? kw : qw;
            std::vector<double> w(fc.d);
            for (std::int64_t j = 0; j < fc.d; ++j) w[j] = wt.get({j}) + (gemma ? 1.0 : 0.0);
            for (std::int64_t t = 0; t < T; ++t)
              for (std::int64_t h = 0; h < before.shape[1]; ++h) {
                std::vector<double> x(fc.d);
                for (std::int64_t j = 0; j < fc.d; ++j) x[j] = get(before, t, h, j);
                const ReferenceHead ref =
                    reference_head(x, w, 1e-6, cache, t, fc.rd, fc.neox, true);
                for (std::int64_t j = 0; j < fc.d; ++j)
                  expect_close(dtype, get(after, t, h, j), ref.y[j], ref.magnitude[j],
                               std::string(dtype_name(dtype)) + " d " + std::to_string(fc.d) +
                                   (which ? " k" : " q") + " t " + std::to_string(t) + " lane " +
                                   std::to_string(j));
              }
          }
          // v untouched; every ISA gives the scalar kernel's bits, on 1 and 2 threads.
          for (std::int64_t t = 0; t < T; ++t)
            for (std::int64_t h = 0; h < fc.hk; ++h)
              for (std::int64_t j = 0; j < fc.d; ++j)
                ASSERT_EQ(get(expected.v(), t, h, j), get(in.v(), t, h, j));
          for (Isa isa : isas_under_test())
            for (int threads : {1, 2}) {
              ScopedIsa scoped(isa);
              Packed got = original;
              // Small tensors: the second thread still runs.
              const ExecOptions options = split_across(threads);
              qk_norm_rope(rotation, cache.view(fc.neox), norm, got.q(), got.k(), options);
              EXPECT_EQ(got.buffer.storage, expected.buffer.storage)
                  << isa_name(isa) << " " << dtype_name(dtype) << " tables "
                  << dtype_name(table_dtype) << " d " << fc.d;
            }
          for (const kernels::KernelTable* table : tables_not_picked_here()) {
            ScopedKernels scoped(table);
            Packed got = original;
            qk_norm_rope(rotation, cache.view(fc.neox), norm, got.q(), got.k());
            EXPECT_EQ(got.buffer.storage, expected.buffer.storage)
                << table->name << " (no bf16 instructions) " << dtype_name(dtype) << " d " << fc.d;
          }
        }
}

// NaN, infinities, values whose products overflow, zero rows, NaN and huge weights, huge table
// entries: every ISA still gives the scalar kernel's bits (the SIMD paths skip the epilogue's
// guard and redo a chunk with a non-finite result lane by lane; this reaches the redo). 16-bit
// rows take the single-fma sum, where an unnormalised product that overflows (x·3e38) must fall
// back to the normalised form. With eps = 0 a zero row has an
// infinite scale and a row of 1e-22 values a subnormal sum of squares; without the NaN weight,
// q's rows may take the path without the per-chunk test.
TEST(QkNormRope, SpecialValuesMatchScalarOnEveryIsa) {
  std::mt19937_64 rng(8);
  const double specials[] = {std::nan(""), INFINITY, -INFINITY, 3.0e38, -3.0e38, 1e-40, 0.0};
  for (const FusedCase& fc : kCases)
    for (DType dtype : {DType::f32, DType::bf16, DType::f16})
      for (DType table_dtype : {DType::f32, DType::bf16})
        for (const float eps : {1e-6f, 0.0f})
          for (const bool nan_weight : {true, false}) {
            const std::int64_t T = 12;
            const Rotation rotation =
                (fc.neox ? Rotation::half(fc.rd) : Rotation::interleave(fc.rd)).partial(fc.d);
            Cache cache = make_cache(16, fc.rd, T, rng, table_dtype);
            for (std::int64_t t = 0; t < T; ++t) cache.positions.set({t, 0}, double(t % 8));
            cache.cos.set({3, 1}, 1e30);  // products past fp32's range where it is read
            cache.sin.set({5, 0}, -1e30);
            cache.cos.set({7, fc.rd / 4}, 3.0e38);  // x·C overflows even where x's row does not
            TestTensor qw = TestTensor::make(table_dtype, {fc.d}),
                       kw = TestTensor::make(table_dtype, {fc.d});
            qw.fill_random(rng, 0.5, 1.5);
            kw.fill_random(rng, 0.5, 1.5);
            // A NaN with every payload bit set (in bf16 weights, every bit bf16 keeps): rounding it
            // to bf16 must quieten it, not carry it into the sign (0x7fffffff + 0x7fff would be
            // -0).
            const std::uint32_t payload_bits =
                table_dtype == DType::bf16 ? 0x7fff0000u : 0x7fffffffu;
            float payload_nan;
            std::memcpy(&payload_nan, &payload_bits, sizeof payload_nan);
            if (nan_weight) qw.set({1}, double(payload_nan));
            kw.set({fc.d - 1}, 1e30);
            QkNorm norm{qw.cview(), kw.cview(), eps, false};
            Packed original = make_packed(dtype, T, fc.hq, fc.hk, fc.d, rng);
            const std::int64_t width = (fc.hq + 2 * fc.hk) * fc.d;
            std::uniform_int_distribution<std::int64_t> any_column(0, width - 1);
            for (std::int64_t t = 0; t < T; ++t) {
              if (t == 4) {  // a row of zeros: scale 1/sqrt(eps)
                for (std::int64_t j = 0; j < width; ++j) original.buffer.set({t, j}, 0.0);
                continue;
              }
              if (t == 9) {  // tiny values: the sum of squares underflows
                for (std::int64_t j = 0; j < width; ++j)
                  original.buffer.set({t, j}, (j % 3 ? 1e-22 : -2e-22));
                continue;
              }
              for (int n = 0; n < 3; ++n)
                original.buffer.set({t, any_column(rng)}, specials[std::size_t(rng() % 7)]);
            }
            Packed expected = original;
            {
              ScopedIsa scoped(Isa::scalar);
              qk_norm_rope(rotation, cache.view(fc.neox), norm, expected.q(), expected.k());
            }
            // Every ISA, then (nullptr isa) each table the core does not pick on this CPU.
            std::vector<std::pair<Isa, const kernels::KernelTable*>> runs;
            for (Isa isa : isas_under_test()) runs.push_back({isa, nullptr});
            for (const kernels::KernelTable* table : tables_not_picked_here())
              runs.push_back({Isa::scalar, table});
            for (const auto& [isa, table] : runs) {
              ScopedIsa scoped(isa);
              ScopedKernels kernels(table);
              Packed got = original;
              qk_norm_rope(rotation, cache.view(fc.neox), norm, got.q(), got.k());
              // Bit for bit, but where both are NaN: which of two NaN operands' payloads an
              // arithmetic operation passes on depends on the operand order the compiler chose.
              const TestTensor& g = got.buffer;
              const TestTensor& e = expected.buffer;
              for (std::int64_t i = 0; i < g.numel(); ++i) {
                const auto idx = g.unravel(i);
                const double a = g.get(idx), b = e.get(idx);
                if (std::isnan(a) && std::isnan(b)) continue;
                ASSERT_EQ(std::memcmp(&a, &b, sizeof a), 0)
                    << (table ? table->name : isa_name(isa)) << (table ? " (override)" : "") << " "
                    << dtype_name(dtype) << " tables " << dtype_name(table_dtype) << " d " << fc.d
                    << " rd " << fc.rd << " element " << i << ": " << a << " vs " << b;
              }
            }
          }
}

TEST(QkNormRope, OtherPermutationsTakeTheLaneLoop) {
  std::mt19937_64 rng(5);
  const Rotation rotation = Rotation::quarter(64);
  TestTables tables;
  tables.cos = TestTensor::make(DType::f32, {9, 1, 64});
  tables.sin = TestTensor::make(DType::f32, {9, 1, 64});
  tables.cos.fill_random(rng, -1, 1);
  tables.sin.fill_random(rng, -1, 1);
  TestTensor w = TestTensor::make(DType::f32, {64});
  w.fill_random(rng, 0.5, 1.5);
  QkNorm norm{w.cview(), w.cview(), 1e-5f, false};
  const Packed original = make_packed(DType::bf16, 9, 2, 1, 64, rng);
  Packed expected = original;
  {
    ScopedIsa scoped(Isa::scalar);
    qk_norm_rope(rotation, tables.view(), norm, expected.q(), expected.k());
  }
  for (Isa isa : isas_under_test()) {
    ScopedIsa scoped(isa);
    Packed got = original;
    qk_norm_rope(rotation, tables.view(), norm, got.q(), got.k());
    EXPECT_EQ(got.buffer.storage, expected.buffer.storage) << isa_name(isa);
  }
}

// Also with a tiny reported L3, so that the cache rows take the non-temporal stores
// (KernelTable::stream_copy: a plain head up to an aligned address, streamed vectors, a plain
// tail; d = 6 has rows of 12 and 24 bytes, and a misaligned key cache has misaligned rows).
TEST(RopeAndCacheKv, WritesRotatedKeysAndValuesToTheirSlots) {
  std::mt19937_64 rng(8);
  for (bool streamed : {false, true})
    for (std::int64_t d : {64, 6})
      for (bool with_norm : {false, true})
        for (DType dtype : {DType::bf16, DType::f32})
          for (Isa isa : isas_under_test()) {
            ScopedIsa scoped(isa);
            const detail::CacheSizes tiny{32 << 10, 256 << 10, 1024, 1024};
            std::optional<ScopedCacheSizes> small_l3;
            if (streamed) small_l3.emplace(tiny);
            const std::int64_t T = 11, hq = 4, hk = 2, blocks = 5, bs = 4;
            const Rotation rotation = Rotation::half(d);
            const Cache cache = make_cache(32, d, T, rng);
            Packed packed = make_packed(dtype, T, hq, hk, d, rng);
            const Packed original = packed;
            // Streamed, the key cache starts one element past an aligned address: its rows begin
            // with a plain head before their streamed part; the value cache's rows are aligned.
            TestTensor kc =
                TestTensor::make(dtype, {blocks, bs, hk, d}, Layout{{}, 0, -1, streamed ? 1 : 0});
            TestTensor vc = TestTensor::make(dtype, {blocks, bs, hk, d}, Layout{{0, 2, 1, 3}});
            kc.fill_random(rng, -1, 1);
            vc.fill_random(rng, -1, 1);
            const TestTensor kc0 = kc, vc0 = vc;
            TestTensor slots = TestTensor::make(DType::i64, {T});
            const std::int64_t slot_of[T] = {7, -1, 0, 19, 3, 12, -1, 5, 18, 1, 9};
            slots.fill([&](const auto& i) { return double(slot_of[i[0]]); });
            TestTensor w = TestTensor::make(DType::f32, {d});
            w.fill_random(rng, 0.5, 1.5);
            QkNorm norm{w.cview(), w.cview(), 1e-6f, false};
            PagedKvWrite write{as_const(packed.v()), kc.view(), vc.view(), slots.cview()};
            rope_and_cache_kv(rotation, cache.view(true), packed.q(), packed.k(), write,
                              with_norm ? &norm : nullptr);
            // q and k rotated in place as qk_norm_rope / rope_forward leave them.
            Packed expected = original;
            if (with_norm) {
              qk_norm_rope(rotation, cache.view(true), norm, expected.q(), expected.k());
            } else {
              const TensorView q = expected.q(), k = expected.k();
              const Operand oq{as_const(q), q}, ok{as_const(k), k};
              rope_forward(rotation, cache.view(true), oq, &ok);
            }
            const std::string what = std::string(isa_name(isa)) + " " + dtype_name(dtype) + " d " +
                                     std::to_string(d) + (streamed ? " streamed" : "");
            ASSERT_EQ(packed.buffer.storage, expected.buffer.storage) << what;
            for (std::int64_t b = 0; b < blocks; ++b)
              for (std::int64_t o = 0; o < bs; ++o) {
                const std::int64_t slot = b * bs + o;
                std::int64_t token = -1;
                for (std::int64_t t = 0; t < T; ++t)
                  if (slot_of[t] == slot) token = t;
                for (std::int64_t h = 0; h < hk; ++h)
                  for (std::int64_t j = 0; j < d; ++j) {
                    if (token < 0) {
                      ASSERT_EQ(kc.get({b, o, h, j}), kc0.get({b, o, h, j})) << what;
                      ASSERT_EQ(vc.get({b, o, h, j}), vc0.get({b, o, h, j})) << what;
                    } else {
                      ASSERT_EQ(kc.get({b, o, h, j}), get(packed.k(), token, h, j)) << what;
                      ASSERT_EQ(vc.get({b, o, h, j}), get(packed.v(), token, h, j)) << what;
                    }
                  }
              }
          }
}

TEST(RopeAndCacheKv, BadInputWritesNothing) {
  std::mt19937_64 rng(9);
  const std::int64_t T = 4, d = 32;
  const Rotation rotation = Rotation::half(d);
  const Cache cache = make_cache(8, d, T, rng);
  Packed packed = make_packed(DType::f32, T, 2, 1, d, rng);
  TestTensor kc = TestTensor::make(DType::f32, {2, 2, 1, d}),
             vc = TestTensor::make(DType::f32, {2, 2, 1, d});
  kc.fill_random(rng, -1, 1);
  vc.fill_random(rng, -1, 1);
  struct Bad {
    std::vector<double> slots;
    const char* argument;
  };
  const Bad bad[] = {{{0, 1, 4, 2}, "slot_mapping[2]"},
                     {{0, 1, -2, 2}, "slot_mapping[2]"},
                     {{0, 1, 1, 2}, "slot_mapping"}};
  for (const Bad& b : bad) {
    TestTensor slots = TestTensor::make(DType::i32, {T});
    slots.fill([&](const auto& i) { return b.slots[i[0]]; });
    const auto before = packed.buffer.storage, kb = kc.storage, vb = vc.storage;
    try {
      rope_and_cache_kv(rotation, cache.view(true), packed.q(), packed.k(),
                        PagedKvWrite{as_const(packed.v()), kc.view(), vc.view(), slots.cview()});
      ADD_FAILURE() << "no error for " << b.argument;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(std::string("rome: ") + b.argument + ":"),
                std::string::npos)
          << e.what();
    }
    EXPECT_EQ(packed.buffer.storage, before);
    EXPECT_EQ(kc.storage, kb);
    EXPECT_EQ(vc.storage, vb);
  }
  // A cache of another dtype, a value overlapping k, a dense rotation, a bad eps.
  TestTensor slots = TestTensor::make(DType::i64, {T});
  slots.fill([](const auto& i) { return double(i[0]); });
  TestTensor kc16 = TestTensor::make(DType::bf16, {2, 2, 1, d});
  EXPECT_THROW(
      rope_and_cache_kv(rotation, cache.view(true), packed.q(), packed.k(),
                        PagedKvWrite{as_const(packed.v()), kc16.view(), vc.view(), slots.cview()}),
      Error);
  EXPECT_THROW(
      rope_and_cache_kv(rotation, cache.view(true), packed.q(), packed.k(),
                        PagedKvWrite{as_const(packed.k()), kc.view(), vc.view(), slots.cview()}),
      Error);
  std::vector<float> m(d * d, 0.5f);
  TestTensor w = TestTensor::make(DType::f32, {d});
  w.fill([](const auto&) { return 1.0; });
  EXPECT_THROW(qk_norm_rope(Rotation::dense(m, d), cache.view(true),
                            QkNorm{w.cview(), w.cview(), 1e-6f, false}, packed.q(), packed.k()),
               Error);
  EXPECT_THROW(qk_norm_rope(rotation, cache.view(true), QkNorm{w.cview(), w.cview(), -1.0f, false},
                            packed.q(), packed.k()),
               Error);
}

// Every ISA's stream_copy (through detail::stream_copy, which fences): every byte at every
// destination phase of a 64-byte line and lengths around the plain head, the vector body and the
// tail; nothing outside [dst, dst + n) touched.
TEST(StreamCopy, EveryIsaCopiesEveryByteAtAnyAlignmentAndLength) {
  std::vector<unsigned char> src(300), dst(400);
  for (std::size_t i = 0; i < src.size(); ++i) src[i] = static_cast<unsigned char>(i * 7 + 1);
  int isas = 0;
  for (rome::Isa isa : isas_under_test()) {
    ScopedIsa scoped(isa);
    ++isas;
    for (std::size_t offset = 0; offset < 72; ++offset)
      for (std::size_t n :
           {0, 1, 15, 16, 17, 31, 32, 47, 63, 64, 65, 127, 128, 129, 200, 255, 297}) {
        std::fill(dst.begin(), dst.end(), 0xee);
        detail::stream_copy(dst.data() + offset, src.data() + 3, n);
        for (std::size_t i = 0; i < dst.size(); ++i) {
          const bool inside = i >= offset && i < offset + n;
          ASSERT_EQ(dst[i], inside ? src[i - offset + 3] : 0xee)
              << isa_name(isa) << " offset " << offset << " n " << n << " byte " << i;
        }
      }
  }
  EXPECT_GT(isas, 0);
}

}  // namespace
}  // namespace rome::testing
