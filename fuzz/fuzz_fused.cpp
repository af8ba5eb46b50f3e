// libFuzzer target over the fused passes: qk_norm_rope and rope_and_cache_kv.
//
// The input is decoded byte by byte (a zero byte, or the end of the input, picks the plainest
// option) into one call: tokens, heads, head and rotary dims (odd and oversized ones rarely),
// half or interleave (or a dense rotation, rarely), x / weight / cache dtypes (wrong ones
// rarely), q/k/v as slices of a packed buffer with a random row padding, positions (some past the
// cache), eps (negative or NaN rarely), slot mappings (padding -1, out of range, duplicates),
// value and cache shapes (wrong ones rarely). Every tensor lives in a buffer of exactly its
// bytes, so ASan sees any access outside it.
//
// Oracle: the call on the active ISA with 2 threads and the same call through the scalar kernel
// on 1 thread must agree: both raise rome::Error with the same status and argument and leave
// every buffer untouched, or both succeed with the same bytes in every buffer; on success every
// cache slot that no token names is unchanged; and the check functions on the same views
// without data raise the same error, or none where the error needs memory. Anything else aborts.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "fuzz_support.hpp"
#include "rome/rome.hpp"

namespace {

using namespace rome;
using i64 = std::int64_t;

using fuzzing::Reader;

[[noreturn]] void bug(const std::string& what) {
  fuzzing::report_bug("fuzz_fused", what);
}

struct Buffer {
  DType dtype = DType::f32;
  std::vector<std::uint8_t> bytes;
  void fill(DType d, i64 elements, std::uint64_t& seed, double scale) {
    dtype = d;
    bytes.assign(std::size_t(elements * dtype_size(d)), 0);
    for (i64 e = 0; e < elements; ++e) {
      seed = seed * 6364136223846793005ull + 1442695040888963407ull;
      const double u = double(seed >> 11) / double(1ull << 53) * 2 - 1;
      void* p = bytes.data() + e * dtype_size(d);
      const float v = float(u * scale);
      switch (d) {
        case DType::f32: std::memcpy(p, &v, 4); break;
        case DType::bf16: {
          std::uint32_t b;
          std::memcpy(&b, &v, 4);
          const std::uint16_t h = std::uint16_t(b >> 16);
          std::memcpy(p, &h, 2);
          break;
        }
        case DType::f16: {
          const std::uint16_t h = std::uint16_t(0x3c00 ^ (std::uint16_t(seed >> 40) & 0x83ff));
          std::memcpy(p, &h, 2);
          break;
        }
        case DType::i32: {
          const std::int32_t x = std::int32_t(u * scale);
          std::memcpy(p, &x, 4);
          break;
        }
        case DType::i64: {
          const std::int64_t x = std::int64_t(u * scale);
          std::memcpy(p, &x, 8);
          break;
        }
      }
    }
  }
  void* ptr(i64 element = 0) {
    return bytes.empty() ? nullptr : bytes.data() + element * dtype_size(dtype);
  }
};

struct Case {
  i64 T = 1, hq = 1, hk = 1, d = 8, rd = 8, rows = 8, pad = 0, blocks = 2, block = 2;
  bool neox = true, dense = false, use_norm = false, use_cache = false, gemma = false;
  float eps = 1e-6f;
  DType x = DType::f32, weight = DType::f32, cache_dtype = DType::f32, table = DType::f32;
  i64 weight_len = 8, value_heads = 1, cache_heads = 1;
  std::vector<i64> positions, slots;
  std::uint64_t seed = 1;
};

Case decode(Reader& R) {
  Case c;
  c.T = R.below(10);
  c.hq = 1 + R.below(4);
  c.hk = 1 + R.below(3);
  c.d = 2 * (1 + R.below(40));
  if (R.rare(16)) c.d += 1;
  c.rd = 2 * (1 + R.below(c.d / 2));
  if (R.rare(16)) c.rd = c.d + 2;
  c.neox = R.below(2) == 0;
  c.dense = R.rare(32);
  const DType floats[] = {DType::f32, DType::bf16, DType::f16};
  c.x = floats[R.below(3)];
  if (R.rare(32)) c.x = DType::i32;
  c.weight = floats[R.below(3)];
  if (R.rare(32)) c.weight = DType::i64;
  c.table = floats[R.below(3)];
  c.cache_dtype = R.rare(16) ? floats[R.below(3)] : c.x;
  c.use_cache = R.below(2) == 1;
  c.use_norm = !c.use_cache || R.below(2) == 1;
  c.gemma = R.below(4) == 0;
  c.eps = R.rare(16) ? (R.below(2) ? -1.0f : std::nanf("")) : 1e-6f * float(1 + R.below(100));
  c.weight_len = R.rare(16) ? c.d + 1 : c.d;
  c.pad = R.below(3) * 8;
  c.rows = 1 + R.below(16);
  c.positions.resize(std::size_t(c.T));
  for (auto& p : c.positions) p = R.rare(24) ? c.rows + R.below(3) : R.below(c.rows);
  c.block = 1 + R.below(4);
  c.blocks = 1 + R.below(6);
  c.value_heads = R.rare(24) ? c.hk + 1 : c.hk;
  c.cache_heads = R.rare(24) ? c.hk + 1 : c.hk;
  const i64 slots = c.blocks * c.block;
  c.slots.resize(std::size_t(c.T));
  for (i64 t = 0; t < c.T; ++t) {
    const unsigned kind = R.byte() % 16;
    c.slots[std::size_t(t)] = kind == 15            ? slots + R.below(3)  // out of range
                              : kind == 14          ? -1                  // padding
                              : kind == 13 && t > 0 ? c.slots[0]          // a duplicate
                                                    : (t * 7 + 3) % std::max<i64>(slots, 1);
  }
  c.seed = 1 + R.byte() * 131 + R.byte();
  return c;
}

struct World {
  Buffer qkv, table_cos, table_sin, positions, q_weight, k_weight, value, key_cache, value_cache,
      slots;
  std::vector<Buffer*> all() {
    return {&qkv,      &table_cos, &table_sin, &positions,   &q_weight,
            &k_weight, &value,     &key_cache, &value_cache, &slots};
  }
};

World build(const Case& c) {
  World w;
  std::uint64_t seed = c.seed;
  const i64 width = (c.hq + c.hk) * c.d + c.pad;
  w.qkv.fill(c.x, c.T * width, seed, 3.0);
  w.table_cos.fill(c.table, c.rows * (c.rd / 2), seed, 1.0);
  w.table_sin.fill(c.table, c.rows * (c.rd / 2), seed, 1.0);
  w.positions.fill(DType::i64, c.T, seed, 0);
  for (i64 t = 0; t < c.T; ++t) static_cast<i64*>(w.positions.ptr())[t] = c.positions[t];
  w.q_weight.fill(c.weight, c.weight_len, seed, 2.0);
  w.k_weight.fill(c.weight, c.weight_len, seed, 2.0);
  w.value.fill(c.x, c.T * c.value_heads * c.d, seed, 3.0);
  const i64 cache_elems = c.blocks * c.block * c.cache_heads * c.d;
  w.key_cache.fill(c.cache_dtype, cache_elems, seed, 1.0);
  w.value_cache.fill(c.cache_dtype, cache_elems, seed, 1.0);
  w.slots.fill(DType::i64, c.T, seed, 0);
  for (i64 t = 0; t < c.T; ++t) static_cast<i64*>(w.slots.ptr())[t] = c.slots[t];
  return w;
}

struct Outcome {
  bool ok = true;
  Status status = Status::ok;
  std::string argument, message;
};

// check_only: the same views without data through qk_norm_rope_check / rope_and_cache_kv_check.
Outcome call(const Case& c, World& w, int threads, bool check_only = false) {
  Outcome o;
  auto data = [&](Buffer& b, i64 offset = 0) -> void* {
    return check_only ? nullptr : b.ptr(offset);
  };
  try {
    std::optional<Rotation> rotation;
    if (c.dense) {
      std::vector<float> m(std::size_t(c.rd * c.rd), 0.25f);
      rotation = Rotation::dense(m, c.rd);
    } else {
      rotation = c.neox ? Rotation::half(c.rd) : Rotation::interleave(c.rd);
    }
    if (c.d > c.rd) rotation = rotation->partial(c.d);
    Tables tables;
    tables.cos = make_view<const void*>(data(w.table_cos), c.table, {c.rows, c.rd / 2});
    tables.sin = make_view<const void*>(data(w.table_sin), c.table, {c.rows, c.rd / 2});
    tables.positions = make_view<const void*>(data(w.positions), DType::i64, {c.T, 1});
    tables.width = c.neox ? TableWidth::halves : TableWidth::pairs;
    const i64 width = (c.hq + c.hk) * c.d + c.pad;
    const TensorView q = make_view<void*>(data(w.qkv), c.x, {c.T, c.hq, c.d}, {width, c.d, 1});
    const TensorView k =
        make_view<void*>(data(w.qkv, c.hq * c.d), c.x, {c.T, c.hk, c.d}, {width, c.d, 1});
    QkNorm norm;
    norm.q_weight = make_view<const void*>(data(w.q_weight), c.weight, {c.weight_len});
    norm.k_weight = make_view<const void*>(data(w.k_weight), c.weight, {c.weight_len});
    norm.eps = c.eps;
    norm.unit_offset = c.gemma;
    ExecOptions options;
    options.num_threads = threads;
    options.min_parallel_bytes = 0;  // small cases: the threaded path still runs
    if (!c.use_cache) {
      if (check_only)
        qk_norm_rope_check(*rotation, tables, norm, q, k);
      else
        qk_norm_rope(*rotation, tables, norm, q, k, options);
    } else {
      PagedKvWrite write;
      write.value = make_view<const void*>(data(w.value), c.x, {c.T, c.value_heads, c.d});
      write.key_cache = make_view<void*>(data(w.key_cache), c.cache_dtype,
                                         {c.blocks, c.block, c.cache_heads, c.d});
      write.value_cache = make_view<void*>(data(w.value_cache), c.cache_dtype,
                                           {c.blocks, c.block, c.cache_heads, c.d});
      write.slot_mapping = make_view<const void*>(data(w.slots), DType::i64, {c.T});
      if (check_only)
        rope_and_cache_kv_check(*rotation, tables, q, k, write, c.use_norm ? &norm : nullptr);
      else
        rope_and_cache_kv(*rotation, tables, q, k, write, c.use_norm ? &norm : nullptr, options);
    }
  } catch (const Error& e) {
    o.ok = false;
    o.status = e.status();
    o.argument = e.argument();
    o.message = e.what();
    if (o.message.rfind("rome: ", 0) != 0) bug("message without 'rome: '");
  } catch (const std::exception& e) {
    bug(std::string("exception other than rome::Error: ") + e.what());
  }
  return o;
}

// Errors whose cause needs memory (pointers, aliasing, slot and position values) or the execution
// options: the check functions, which read nothing and take no options, do not see them.
bool needs_memory(const std::string& message) {
  for (const char* cause : {"data pointer", "disjoint", "overlap", "options.", "slot_mapping[",
                            "twice", "positions: expected values"})
    if (message.find(cause) != std::string::npos) return true;
  return false;
}

// Shows the fuzzer reaches successful calls of both passes as well as every error.
fuzzing::OutcomeCounts g_stats;

bool same_bits(World& a, World& b) {
  const auto x = a.all(), y = b.all();
  for (std::size_t i = 0; i < x.size(); ++i)
    if (x[i]->bytes != y[i]->bytes) return false;
  return true;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  Reader R{data, size};
  const Case c = decode(R);
  const World original = build(c);
  World expected = original, got = original;
  set_max_isa(Isa::scalar);
  const Outcome want = call(c, expected, 1);
  set_max_isa(Isa::amx);
  const Outcome have = call(c, got, 2);
  if (want.ok != have.ok || want.status != have.status || want.argument != have.argument)
    bug("the scalar kernel and the active ISA disagree on the outcome: '" + want.argument +
        "' vs '" + have.argument + "'");
  World unused = original;
  const Outcome checked = call(c, unused, 1, /*check_only=*/true);
  if (checked.ok && !want.ok && !needs_memory(want.message))
    bug("the check accepted what the call refused: " + want.message);
  if (!checked.ok && want.ok) bug("the check refused what the call ran: " + checked.message);
  if (!checked.ok && !want.ok && checked.message != want.message && !needs_memory(want.message))
    bug("the check and the call disagree: " + checked.message + " / " + want.message);
  g_stats.add(want.ok ? (c.use_cache ? (c.use_norm ? "ok cache+norm" : "ok cache") : "ok norm")
                      : "error " + want.argument);
  World untouched = original;
  if (!want.ok && !same_bits(expected, untouched)) bug("an error left a buffer changed");
  if (!same_bits(expected, got)) bug("the active ISA's bytes differ from the scalar kernel's");
  if (want.ok && c.use_cache) {
    // Slots no token names keep their bytes.
    const i64 row = c.cache_heads * c.d * dtype_size(c.cache_dtype);
    for (i64 s = 0; s < c.blocks * c.block; ++s) {
      bool named = false;
      for (i64 t : c.slots) named = named || t == s;
      if (named) continue;
      for (Buffer World::*cache : {&World::key_cache, &World::value_cache})
        if (std::memcmp((expected.*cache).bytes.data() + s * row,
                        (untouched.*cache).bytes.data() + s * row, std::size_t(row)) != 0)
          bug("a slot no token names was written");
    }
  }
  return 0;
}
