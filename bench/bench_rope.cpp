// The issue-3 benchmark suite: RoME forward against a plain copy of the same bytes.
//
// rope/<isa>/<dtype>/<variant>/threads:<n>
//     x = [1, 24, 28800, 128] BNSD with [S, rd] fp32 tables (or, positions_cache_*, a [S, 128]
//     fp32 cache gathered by positions); llm_prefill_*: Q [1, 4096, 32, 128] + GQA K
//     [1, 4096, 8, 128] in BSND layout, positions + [4096, 128] fp32 cache; bsnd_*: the same
//     x bytes as [1, 28800, 24, 128]; packed_qk_*: q (16 heads) and k (4 heads) slices of a
//     fused [28800, 24·128] buffer.
// decode/<isa>/<dtype>/<mode>: Q [1, 1, 32, 128] + K [1, 1, 8, 128], one token, one thread.
// copy/<dtype>/<shape>/threads:<n>: memcpy x -> y plus a read pass over the tables, cut into
//     <n> pieces run on RoME's own thread pool (the threading of rope_forward).
// scalar/..., small_ops/...: the scalar kernel and the unfused baseline, 1D rows.
//
// Counters: GB/s = (read x + read tables + write y) / time. Every rope / scalar / small_ops
// iteration is followed by a copy of the same bytes with the same threads: ratio = Σ time /
// Σ copy time, ratio_med = median of the per-iteration ratios (robust when other processes share
// the machine); rope iterations also by a copy with non-temporal stores (ratio_stream_med). decode:
// us_per_call (mean) and us_per_call_min (fastest block of 256 calls). Every variant is out of
// place.
//
// A full run takes a few minutes; pick rows with --benchmark_filter, e.g.
//   rome_bench --benchmark_filter='rope/avx512/bf16/'
//   rome_bench --benchmark_filter='rope/avx512/.*/(1d_half|llm_prefill_half)/'
//   rome_bench --benchmark_filter='decode/avx512'
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "baselines/small_ops.hpp"
#include "common/copy_floor.hpp"
#include "common/random_matrices.hpp"
#include "core/convert.hpp"
#include "core/thread_pool.hpp"
#include "rome/rome.hpp"

namespace {

using rome::DType;
using rome::Isa;
using rome::Rotation;
using Clock = std::chrono::steady_clock;

constexpr std::int64_t kHeads = 24, kSeq = 28800, kDim = 128;
constexpr std::int64_t kLlmSeq = 4096, kLlmQHeads = 32, kLlmKHeads = 8;
constexpr double kMinTime = 0.2;

const char* dtype_tag(DType d) {
  return d == DType::f32 ? "f32" : d == DType::f16 ? "f16" : "bf16";
}

// ---------------------------------------------------------------------------------------------
// Buffers, allocated once, touched before use.

struct Buffer {
  void* data = nullptr;
  std::size_t bytes = 0;
  explicit Buffer(std::size_t n) : bytes(n) {
    data = std::aligned_alloc(4096, (n + 4095) / 4096 * 4096);
    if (!data) std::abort();
    std::memset(data, 0, n);
  }
  ~Buffer() { std::free(data); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  template <typename T = void>
  T* as() const {
    return static_cast<T*>(data);
  }
};

// Normal values in x (no subnormals, no NaN), as `dtype`.
void fill_values(void* p, DType dtype, std::int64_t n, std::uint32_t seed) {
  std::uint32_t s = seed;
  for (std::int64_t i = 0; i < n; ++i) {
    s = s * 1664525u + 1013904223u;
    const float v = float(std::int32_t(s >> 8) - (1 << 23)) * (1.0f / float(1 << 22));
    rome::detail::store_any(p, dtype, i, v == 0.0f ? 0.5f : v);
  }
}

// x and y sized for the largest case (fp32 BNSD); refilled when the dtype changes.
struct Data {
  std::int64_t x_elems = kHeads * kSeq * kDim;
  Buffer x{std::size_t(kHeads * kSeq * kDim * 4)};
  Buffer y{std::size_t(kHeads * kSeq * kDim * 4)};
  Buffer cos{std::size_t(kSeq * kDim * 4)}, sin{std::size_t(kSeq * kDim * 4)};
  Buffer positions{std::size_t(kSeq * 8)};
  DType x_dtype = DType::i32;  // nothing yet

  // LLM shapes.
  std::int64_t q_elems = kLlmSeq * kLlmQHeads * kDim, k_elems = kLlmSeq * kLlmKHeads * kDim;
  Buffer q{std::size_t(q_elems * 4)}, k{std::size_t(k_elems * 4)};
  Buffer q_out{std::size_t(q_elems * 4)}, k_out{std::size_t(k_elems * 4)};
  DType llm_dtype = DType::i32;

  Data() {
    for (std::int64_t s = 0; s < kSeq; ++s) {
      for (std::int64_t j = 0; j < kDim; ++j) {
        const double inv = std::pow(10000.0, -2.0 * double(j % (kDim / 2)) / double(kDim));
        cos.as<float>()[s * kDim + j] = float(std::cos(double(s) * inv));
        sin.as<float>()[s * kDim + j] = float(std::sin(double(s) * inv));
      }
      positions.as<std::int64_t>()[s] = s;
    }
  }
  void ensure_x(DType d) {
    if (x_dtype == d) return;
    fill_values(x.data, d, x_elems, 1);
    x_dtype = d;
  }
  void ensure_llm(DType d) {
    if (llm_dtype == d) return;
    fill_values(q.data, d, q_elems, 2);
    fill_values(k.data, d, k_elems, 3);
    llm_dtype = d;
  }
};

Data& data() {
  static Data d;
  return d;
}

double time_once(const std::function<void()>& f) {
  const auto t0 = Clock::now();
  f();
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// ---------------------------------------------------------------------------------------------
// Cases

// bnsd: x [1, 24, 28800, 128]; bsnd: the same bytes as [1, 28800, 24, 128] with tables
// [1, S, 1, rd]; packed: q (16 heads) and k (4 heads) slices of a fused [28800, 24·128] buffer
// (the other 4 heads, v, untouched) with [S, 1, rd] tables; llm: the prefill shapes below.
enum class Shape { bnsd, bsnd, packed, llm };

struct Case {
  std::string name;  // variant name
  Shape shape = Shape::bnsd;
  std::function<Rotation()> rotation;
  bool positions = false;  // BNSD: gather from a [P, 128] cache instead of [S, rd] tables
};

std::vector<Case> bnsd_cases() {
  auto half_blocks = [](std::vector<std::int64_t> sizes, bool interleave) {
    return [sizes, interleave] {
      std::vector<Rotation> b;
      for (auto s : sizes) b.push_back(interleave ? Rotation::interleave(s) : Rotation::half(s));
      return Rotation::block_diag(b);
    };
  };
  std::vector<Case> cases;
  for (bool il : {false, true}) {
    const std::string m = il ? "interleave" : "half";
    cases.push_back({"1d_" + m, Shape::bnsd, half_blocks({128}, il)});
    cases.push_back({"2d_64_64_" + m, Shape::bnsd, half_blocks({64, 64}, il)});
    cases.push_back({"3d_44_44_40_" + m, Shape::bnsd, half_blocks({44, 44, 40}, il)});
    cases.push_back({"partial_64_of_128_" + m, Shape::bnsd, [il] {
                       return (il ? Rotation::interleave(64) : Rotation::half(64)).partial(128);
                     }});
    cases.push_back({"positions_cache_" + m, Shape::bnsd, half_blocks({128}, il), true});
  }
  cases.push_back({"wan_3d_44_42_42_interleave", Shape::bnsd, half_blocks({44, 42, 42}, true)});
  for (bool il : {false, true}) {
    const std::string m = il ? "interleave" : "half";
    cases.push_back({"bsnd_1d_" + m, Shape::bsnd, half_blocks({128}, il)});
    cases.push_back({"packed_qk_1d_" + m, Shape::packed, half_blocks({128}, il)});
  }
  cases.push_back({"bsnd_3d_44_44_40_half", Shape::bsnd, half_blocks({44, 44, 40}, false)});
  cases.push_back({"packed_qk_3d_44_44_40_half", Shape::packed, half_blocks({44, 44, 40}, false)});
  cases.push_back({"llm_prefill_half", Shape::llm, [] { return Rotation::half(128); }});
  cases.push_back({"llm_prefill_interleave", Shape::llm, [] { return Rotation::interleave(128); }});
  // Dense rotations (issue 6): the FMA paths here, the matrix unit where the CPU has AMX.
  const auto dense_128 = [] {
    return Rotation::dense(rome::bench::random_orthogonal(128, 7), 128);
  };
  cases.push_back({"dense_orthogonal_128", Shape::bnsd, dense_128});
  cases.push_back({"dense_blocks_44_44_40", Shape::bnsd, [] {
                     return rome::bench::random_orthogonal_blocks({44, 44, 40});
                   }});
  cases.push_back({"llm_prefill_dense_orthogonal", Shape::llm, dense_128});
  return cases;
}

// Everything one call needs; views point into data().
struct Call {
  Rotation rotation = Rotation::half(2);
  rome::Tables tables;
  rome::Operand q, k;
  bool has_k = false;
  double bytes = 0;  // read x + read tables + write y
  rome::bench::CopyJob copy;
};

Call make_call(const Case& c, DType dtype) {
  Data& d = data();
  Call call;
  call.rotation = c.rotation();
  const std::int64_t rd = call.rotation.rotary_dim();
  const int es = rome::dtype_size(dtype);
  if (c.shape == Shape::bnsd) {
    d.ensure_x(dtype);
    auto xv = rome::make_view<void*>(d.x.data, dtype, {1, kHeads, kSeq, kDim});
    auto yv = rome::make_view<void*>(d.y.data, dtype, {1, kHeads, kSeq, kDim});
    call.q = {rome::as_const(xv), yv};
    double table_bytes;
    if (c.positions) {
      call.tables.cos = rome::make_view<const void*>(d.cos.data, DType::f32, {kSeq, rd});
      call.tables.sin = rome::make_view<const void*>(d.sin.data, DType::f32, {kSeq, rd});
      call.tables.positions =
          rome::make_view<const void*>(d.positions.data, DType::i64, {1, 1, kSeq});
      table_bytes = 2.0 * kSeq * rd * 4 + kSeq * 8.0;
    } else {
      call.tables.cos = rome::make_view<const void*>(d.cos.data, DType::f32, {kSeq, rd});
      call.tables.sin = rome::make_view<const void*>(d.sin.data, DType::f32, {kSeq, rd});
      table_bytes = 2.0 * kSeq * rd * 4;
    }
    const double xb = double(kHeads * kSeq * kDim * es);
    call.bytes = 2 * xb + table_bytes;
    call.copy.spans = {{d.x.as<const char>(), d.y.as<char>(), std::size_t(xb)},
                       {d.cos.as<const char>(), nullptr, std::size_t(table_bytes / 2)},
                       {d.sin.as<const char>(), nullptr, std::size_t(table_bytes / 2)}};
  } else if (c.shape == Shape::bsnd || c.shape == Shape::packed) {
    d.ensure_x(dtype);
    const double table_bytes = 2.0 * kSeq * rd * 4;
    if (c.shape == Shape::bsnd) {
      auto xv = rome::make_view<void*>(d.x.data, dtype, {1, kSeq, kHeads, kDim});
      auto yv = rome::make_view<void*>(d.y.data, dtype, {1, kSeq, kHeads, kDim});
      call.q = {rome::as_const(xv), yv};
      call.tables.cos = rome::make_view<const void*>(d.cos.data, DType::f32, {1, kSeq, 1, rd});
      call.tables.sin = rome::make_view<const void*>(d.sin.data, DType::f32, {1, kSeq, 1, rd});
      const double xb = double(kHeads * kSeq * kDim * es);
      call.bytes = 2 * xb + table_bytes;
      call.copy.spans = {{d.x.as<const char>(), d.y.as<char>(), std::size_t(xb)},
                         {d.cos.as<const char>(), nullptr, std::size_t(table_bytes / 2)},
                         {d.sin.as<const char>(), nullptr, std::size_t(table_bytes / 2)}};
    } else {
      constexpr std::int64_t kQHeads = 16, kKHeads = 4;
      auto slice = [&](void* base, std::int64_t first_head, std::int64_t heads) {
        rome::TensorView v = rome::make_view<void*>(base, dtype, {kSeq, heads, kDim});
        v.data = static_cast<char*>(base) + first_head * kDim * es;
        v.strides[0] = kHeads * kDim;  // the fused row
        return v;
      };
      const rome::TensorView qi = slice(d.x.data, 0, kQHeads),
                             ki = slice(d.x.data, kQHeads, kKHeads);
      const rome::TensorView qo = slice(d.y.data, 0, kQHeads),
                             ko = slice(d.y.data, kQHeads, kKHeads);
      call.q = {rome::as_const(qi), qo};
      call.k = {rome::as_const(ki), ko};
      call.has_k = true;
      call.tables.cos = rome::make_view<const void*>(d.cos.data, DType::f32, {kSeq, 1, rd});
      call.tables.sin = rome::make_view<const void*>(d.sin.data, DType::f32, {kSeq, 1, rd});
      // The floor copies as many bytes (contiguous): q and k are 20 of the 24 heads.
      const double xb = double((kQHeads + kKHeads) * kSeq * kDim * es);
      call.bytes = 2 * xb + table_bytes;
      call.copy.spans = {{d.x.as<const char>(), d.y.as<char>(), std::size_t(xb)},
                         {d.cos.as<const char>(), nullptr, std::size_t(table_bytes / 2)},
                         {d.sin.as<const char>(), nullptr, std::size_t(table_bytes / 2)}};
    }
  } else {
    d.ensure_llm(dtype);
    auto qv = rome::make_view<void*>(d.q.data, dtype, {1, kLlmSeq, kLlmQHeads, kDim});
    auto kv = rome::make_view<void*>(d.k.data, dtype, {1, kLlmSeq, kLlmKHeads, kDim});
    auto qo = rome::make_view<void*>(d.q_out.data, dtype, {1, kLlmSeq, kLlmQHeads, kDim});
    auto ko = rome::make_view<void*>(d.k_out.data, dtype, {1, kLlmSeq, kLlmKHeads, kDim});
    call.q = {rome::as_const(qv), qo};
    call.k = {rome::as_const(kv), ko};
    call.has_k = true;
    call.tables.cos = rome::make_view<const void*>(d.cos.data, DType::f32, {kLlmSeq, kDim});
    call.tables.sin = rome::make_view<const void*>(d.sin.data, DType::f32, {kLlmSeq, kDim});
    call.tables.positions =
        rome::make_view<const void*>(d.positions.data, DType::i64, {1, kLlmSeq, 1});
    const double table_bytes = 2.0 * kLlmSeq * kDim * 4 + kLlmSeq * 8.0;
    const double qb = double(d.q_elems * es), kb = double(d.k_elems * es);
    call.bytes = 2 * (qb + kb) + table_bytes;
    call.copy.spans = {{d.q.as<const char>(), d.q_out.as<char>(), std::size_t(qb)},
                       {d.k.as<const char>(), d.k_out.as<char>(), std::size_t(kb)},
                       {d.cos.as<const char>(), nullptr, std::size_t(table_bytes / 2)},
                       {d.sin.as<const char>(), nullptr, std::size_t(table_bytes / 2)}};
  }
  return call;
}

void rope_call(const Call& c, int threads) {
  rome::rope_forward(c.rotation, c.tables, c.q, c.has_k ? &c.k : nullptr,
                     rome::ExecOptions{threads});
}

// Restores the ISA after a benchmark that lowered it.
struct IsaScope {
  explicit IsaScope(Isa isa) { rome::set_max_isa(isa); }
  ~IsaScope() { rome::set_max_isa(Isa::amx); }
};

void bench_copy(benchmark::State& state, Case c, DType dtype, int threads) {
  const Call call = make_call(c, dtype);
  rome::bench::run_copy(call.copy, threads);
  double total = 0;
  std::int64_t n = 0;
  for (auto _ : state) {
    const double t = time_once([&] { rome::bench::run_copy(call.copy, threads); });
    state.SetIterationTime(t);
    total += t, ++n;
  }
  if (n) state.counters["GB/s"] = call.bytes / (total / double(n)) / 1e9;
}

// Each iteration times the rope call, then (untimed for the benchmark) the copy of the same
// bytes: both see the same machine state. ratio = Σ rope / Σ copy; ratio_med = the median of the
// per-iteration ratios (robust when other processes share the machine). With `stream`, also the
// copy with non-temporal stores (copy_floor.hpp: memcpy can be well above the hardware's floor):
// stream_copy_GB/s and ratio_stream_med.
void paired_loop(benchmark::State& state, const std::function<void()>& op,
                 const std::function<void()>& copy, double bytes,
                 const std::function<void()>& stream = nullptr) {
  op();
  copy();
  if (stream) stream();
  double op_total = 0, copy_total = 0, stream_total = 0;
  std::vector<double> ratios, stream_ratios;
  for (auto _ : state) {
    const double t = time_once(op);
    state.SetIterationTime(t);
    const double c = time_once(copy);
    op_total += t, copy_total += c;
    ratios.push_back(t / c);
    if (stream) {
      const double s = time_once(stream);
      stream_total += s;
      stream_ratios.push_back(t / s);
    }
  }
  if (ratios.empty()) return;
  auto median = [](std::vector<double>& v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  const double n = double(ratios.size());
  state.counters["GB/s"] = bytes / (op_total / n) / 1e9;
  state.counters["copy_GB/s"] = bytes / (copy_total / n) / 1e9;
  state.counters["ratio"] = op_total / copy_total;
  state.counters["ratio_med"] = median(ratios);
  if (stream) {
    state.counters["stream_copy_GB/s"] = bytes / (stream_total / n) / 1e9;
    state.counters["ratio_stream_med"] = median(stream_ratios);
  }
}

void bench_rope(benchmark::State& state, Case c, DType dtype, Isa isa, int threads) {
  IsaScope scope(isa);
  if (rome::active_isa() != isa) {
    state.SkipWithError("ISA not available");
    return;
  }
  const Call call = make_call(c, dtype);
  paired_loop(
      state, [&] { rope_call(call, threads); }, [&] { rome::bench::run_copy(call.copy, threads); },
      call.bytes, [&] { rome::bench::run_copy(call.copy, threads, true); });
}

// The unfused baseline on the 1D rows: tables in x's dtype, single thread.
void bench_small_ops(benchmark::State& state, bool interleave, DType dtype) {
  Data& d = data();
  d.ensure_x(dtype);
  static std::map<DType, std::pair<std::unique_ptr<Buffer>, std::unique_ptr<Buffer>>> tables;
  auto& t = tables[dtype];
  if (!t.first) {
    const int es = rome::dtype_size(dtype);
    t.first = std::make_unique<Buffer>(std::size_t(kSeq * kDim * es));
    t.second = std::make_unique<Buffer>(std::size_t(kSeq * kDim * es));
    for (std::int64_t i = 0; i < kSeq * kDim; ++i) {
      rome::detail::store_any(t.first->data, dtype, i, d.cos.as<float>()[i]);
      rome::detail::store_any(t.second->data, dtype, i, d.sin.as<float>()[i]);
    }
  }
  const Case c{"1d", Shape::bnsd, [] { return Rotation::half(kDim); }};
  const Call call = make_call(c, dtype);
  const auto mode = interleave ? rome::baselines::Mode::interleave : rome::baselines::Mode::half;
  paired_loop(
      state,
      [&] {
        rome::baselines::small_ops_rope(mode, dtype, d.x.data, d.y.data, kHeads * kSeq, kDim,
                                        t.first->data, t.second->data, kSeq);
      },
      [&] { rome::bench::run_copy(call.copy, 1); }, call.bytes);
}

// Decode: one token, Q [1, 1, 32, 128] + K [1, 1, 8, 128], position gathered from the cache.
void bench_decode(benchmark::State& state, bool interleave, DType dtype, Isa isa) {
  IsaScope scope(isa);
  if (rome::active_isa() != isa) {
    state.SkipWithError("ISA not available");
    return;
  }
  Data& d = data();
  d.ensure_llm(dtype);
  const Rotation rotation = interleave ? Rotation::interleave(kDim) : Rotation::half(kDim);
  static const std::int64_t position[1] = {1234};
  rome::Tables tables;
  tables.cos = rome::make_view<const void*>(d.cos.data, DType::f32, {kLlmSeq, kDim});
  tables.sin = rome::make_view<const void*>(d.sin.data, DType::f32, {kLlmSeq, kDim});
  tables.positions = rome::make_view<const void*>(position, DType::i64, {1, 1, 1});
  // Out of place, so the inputs stay the same values call after call.
  auto qv = rome::make_view<void*>(d.q.data, dtype, {1, 1, kLlmQHeads, kDim});
  auto kv = rome::make_view<void*>(d.k.data, dtype, {1, 1, kLlmKHeads, kDim});
  auto qo = rome::make_view<void*>(d.q_out.data, dtype, {1, 1, kLlmQHeads, kDim});
  auto ko = rome::make_view<void*>(d.k_out.data, dtype, {1, 1, kLlmKHeads, kDim});
  const rome::Operand q{rome::as_const(qv), qo}, k{rome::as_const(kv), ko};
  const rome::ExecOptions one{1};
  rome::rope_forward(rotation, tables, q, &k, one);
  const auto t0 = Clock::now();
  auto block_start = t0;
  double best_block = 1e30;
  std::int64_t n = 0;
  constexpr std::int64_t kBlock = 256;
  for (auto _ : state) {
    rome::rope_forward(rotation, tables, q, &k, one);
    if (++n % kBlock == 0) {
      const auto now = Clock::now();
      best_block = std::min(best_block, std::chrono::duration<double>(now - block_start).count());
      block_start = now;
    }
  }
  const double s = std::chrono::duration<double>(Clock::now() - t0).count();
  state.counters["us_per_call"] = s / double(n) * 1e6;
  if (n >= kBlock) state.counters["us_per_call_min"] = best_block / kBlock * 1e6;
}

std::vector<Isa> simd_isas() {
  std::vector<Isa> out;
  for (Isa isa : {Isa::avx512, Isa::avx2})
    if (rome::isa_compiled(isa) && isa <= rome::detected_isa()) out.push_back(isa);
  return out;
}

void register_all() {
  const std::vector<Case> cases = bnsd_cases();
  const Case bnsd_1d = cases[0];
  const auto named = [&](const std::string& name) {
    return *std::find_if(cases.begin(), cases.end(), [&](const Case& c) { return c.name == name; });
  };
  const Case llm = named("llm_prefill_half");
  const Case partial = cases[3];
  for (DType dtype : {DType::bf16, DType::f16, DType::f32}) {
    const std::string dt = dtype_tag(dtype);
    for (int threads : {1, 2}) {
      const std::string th = "/threads:" + std::to_string(threads);
      benchmark::RegisterBenchmark(("copy/" + dt + "/x_1x24x28800x128" + th).c_str(), bench_copy,
                                   bnsd_1d, dtype, threads)
          ->UseManualTime()
          ->MinTime(kMinTime)
          ->Unit(benchmark::kMillisecond);
      benchmark::RegisterBenchmark(("copy/" + dt + "/x_1x24x28800x128_tables_64" + th).c_str(),
                                   bench_copy, partial, dtype, threads)
          ->UseManualTime()
          ->MinTime(kMinTime)
          ->Unit(benchmark::kMillisecond);
      benchmark::RegisterBenchmark(
          ("copy/" + dt + "/llm_q_1x4096x32x128_k_1x4096x8x128" + th).c_str(), bench_copy, llm,
          dtype, threads)
          ->UseManualTime()
          ->MinTime(kMinTime)
          ->Unit(benchmark::kMillisecond);
    }
    for (const Case& c : cases)
      for (Isa isa : simd_isas())
        for (int threads : {1, 2})
          benchmark::RegisterBenchmark(("rope/" + std::string(rome::isa_name(isa)) + "/" + dt +
                                        "/" + c.name + "/threads:" + std::to_string(threads))
                                           .c_str(),
                                       bench_rope, c, dtype, isa, threads)
              ->UseManualTime()
              ->MinTime(kMinTime)
              ->Unit(benchmark::kMillisecond);
    for (int ci : {0, 5})  // 1d_half, 1d_interleave
      for (int threads : {1, 2})
        benchmark::RegisterBenchmark(
            ("scalar/" + dt + "/" + cases[ci].name + "/threads:" + std::to_string(threads)).c_str(),
            bench_rope, cases[ci], dtype, Isa::scalar, threads)
            ->UseManualTime()
            ->Iterations(2)
            ->Unit(benchmark::kMillisecond);
    for (bool il : {false, true})
      benchmark::RegisterBenchmark(
          ("small_ops/" + dt + "/1d_" + std::string(il ? "interleave" : "half") + "/threads:1")
              .c_str(),
          bench_small_ops, il, dtype)
          ->UseManualTime()
          ->Iterations(1)
          ->Unit(benchmark::kMillisecond);
    for (Isa isa : simd_isas())
      for (bool il : {false, true})
        benchmark::RegisterBenchmark(("decode/" + std::string(rome::isa_name(isa)) + "/" + dt +
                                      "/q_1x1x32x128_k_1x1x8x128_" + (il ? "interleave" : "half"))
                                         .c_str(),
                                     bench_decode, il, dtype, isa)
            ->MinTime(kMinTime)
            ->Unit(benchmark::kMicrosecond);
  }
}

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  register_all();
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
