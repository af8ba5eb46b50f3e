// rome_timer: times one RoME call from C++ (no PyTorch) and a plain copy of the same bytes, in
// the same process, on the same threads. Used by `python -m rome.bench` for its "RoME (C++)"
// column; handy on its own too.
//
//   rome_timer --rotation half --blocks 44,44,40 --q 1,24,28800,128 --dtype bf16 \
//              --threads 2 --repeats 20
//   rome_timer --rotation half --q 1,32,4096,128 --k 1,8,4096,128 --cache 8192 --dtype bf16
//
// Options (all but --q optional):
//   --rotation half|interleave|quarter|interleave_half|dense   (default half); dense: a random
//                       orthogonal matrix (with --blocks: random orthogonal blocks)
//   --blocks a,b,c      block-diagonal rotation of that kind (sizes sum to the head size)
//   --matrix-dtype f32|bf16  dense matrices as given (default f32) or rounded to bf16 first, as
//                       a user who hands over M in bf16 (the matrix unit then needs no lo part)
//   --force-dense       run the rotation through the dense (matrix) path even when it is a
//                       signed permutation (Rotation::as_dense), to compare the two paths
//   --q B,N,S,D         q, BNSD (any rank 2..5; S is the second-to-last axis, D the last)
//   --k B,N,S,D         optional second operand (GQA: fewer heads), rotated in the same call
//   --cache P           tables are a [P, D] cache gathered by int64 positions P-S .. P-1
//                       (default: direct tables [S, D], broadcast over the leading axes)
//   --shuffle-positions with --cache: S distinct positions in random order instead (every
//                       cache row a random read, as in the layout study's positions rows)
//   --half-width-cache  with --cache: rows of rotary_dim / 2 columns, each used for both halves
//                       of the row (TableWidth::halves: vLLM's cos_sin_cache as NeoX reads it)
//   --table-free        with --cache: the same positions, but cos and sin computed in the call
//                       from rotary_dim / 2 frequencies 10000^(-2i/rotary_dim) (Tables'
//                       table-free form); the copy floor then reads no table bytes
//   --dtype bf16|f16|f32          x's dtype (default bf16)
//   --table-dtype f32|bf16|f16    table dtype (default f32)
//   --threads N         threads for RoME and for the copy (default: RoME's default)
//   --tile-tokens T     tokens per executor tile (default: sized from the L2 cache)
//   --min-parallel-bytes B  split calls from B bytes moved (default -1: RoME's threshold; 0: any)
//   --repeats R         timed samples (default 20); --warmup W (default 3)
//   --inner K           calls per sample (default: auto, so a sample lasts >= 1 ms)
//   --in-place          rotate q/k in place instead of writing separate outputs
//   --bsnd              q/k (and outputs) laid out token-major, [B, S, N, D] in memory, as
//                       transformers hands them over before its transpose (--q stays B,N,S,D)
//   --qk-norm           rome::qk_norm_rope (per-head RMSNorm + RoPE, in place) on token-major
//                       q [T, Hq, D] and k [T, Hk, D] (give --q T,Hq,D --k T,Hk,D)
//   --kv-cache          rome::rope_and_cache_kv on token-major q [T, Hq, D] and k [T, Hk, D] (give
//                       --q and --k as for --qk-norm; with --qk-norm too, the norm as well): q and
//                       k rotated in place, k and a value [T, Hk, D] written to a paged cache of
//                       16-slot blocks (twice the blocks T needs) at shuffled slots; the copy
//                       floor also copies k's and the value's bytes once more
//   --packed-qkv        q and k are the q and k heads of one packed qkv buffer
//                       [T, (Hq + 2·Hk)·D] (Hk value heads, untouched), as an engine's qkv
//                       projection leaves them (give --q T,Hq,D --k T,Hk,D; without --qk-norm or
//                       --kv-cache: rome::rope_forward on them, in place or into contiguous
//                       outputs); the copy floor still copies q's and k's bytes
//   --isa NAME          cap the ISA (scalar|avx2|avx512|amx), or avx512-no-bf16: the AVX-512
//                       kernels of CPUs without AVX512-BF16 (bf16 narrowed in integer
//                       arithmetic), on a CPU that has the instructions
//
// Output: one JSON object on stdout; times are seconds per call. The copy ("floor") reads x (and
// k) and writes the output buffers with memcpy, and reads every table byte the call reads, split
// into `threads` contiguous pieces on RoME's own thread pool; "stream_copy" does the same with
// non-temporal stores (copy_floor.hpp: on some machines memcpy is well above the memory's
// speed). Samples of RoME and of both copies alternate, so background load affects them alike.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/copy_floor.hpp"
#include "common/random_matrices.hpp"
#include "core/convert.hpp"
#include "core/dispatch.hpp"
#include "core/rotation_data.hpp"
#include "core/thread_pool.hpp"
#include "kernels/kernel_api.hpp"
#include "rome/fused.hpp"
#include "rome/rome.hpp"

namespace {

using Clock = std::chrono::steady_clock;
using rome::DType;

struct Buffer {
  void* data = nullptr;
  std::size_t bytes = 0;
  explicit Buffer(std::size_t n) : bytes(n) {
    const std::size_t rounded = std::max<std::size_t>(4096, (n + 4095) / 4096 * 4096);
    data = std::aligned_alloc(4096, rounded);
    if (!data) throw std::runtime_error("out of memory");
    std::memset(data, 0, rounded);  // touch every page before timing
  }
  ~Buffer() { std::free(data); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  char* bytes_ptr() const { return static_cast<char*>(data); }
};

std::vector<std::int64_t> parse_ints(const std::string& s) {
  std::vector<std::int64_t> out;
  std::size_t at = 0;
  while (at < s.size()) {
    std::size_t end = s.find_first_of(",x", at);
    if (end == std::string::npos) end = s.size();
    out.push_back(std::stoll(s.substr(at, end - at)));
    at = end + 1;
  }
  return out;
}

DType parse_dtype(const std::string& s) {
  if (s == "bf16" || s == "bfloat16") return DType::bf16;
  if (s == "f16" || s == "fp16" || s == "float16") return DType::f16;
  if (s == "f32" || s == "fp32" || s == "float32") return DType::f32;
  throw std::invalid_argument("unknown dtype '" + s + "' (bf16, f16, f32)");
}

rome::Isa parse_isa(const std::string& s) {
  if (s == "scalar") return rome::Isa::scalar;
  if (s == "avx2") return rome::Isa::avx2;
  if (s == "avx512") return rome::Isa::avx512;
  if (s == "amx") return rome::Isa::amx;
  throw std::invalid_argument("unknown isa '" + s + "'");
}

rome::Rotation make_rotation(const std::string& kind, std::int64_t dim) {
  if (kind == "half") return rome::Rotation::half(dim);
  if (kind == "interleave") return rome::Rotation::interleave(dim);
  if (kind == "quarter") return rome::Rotation::quarter(dim);
  if (kind == "interleave_half") return rome::Rotation::interleave_half(dim);
  if (kind == "dense") return rome::Rotation::dense(rome::bench::random_orthogonal(dim, 7), dim);
  throw std::invalid_argument("unknown rotation '" + kind + "'");
}

// The frequency of each lane: pairs of lanes that rotate together share one (half and
// interleave_half: j and j + b/2 within a block of b lanes; quarter: the same within each half;
// interleave: 2i and 2i + 1). Dense matrices mix lanes anyway: any layout will do.
std::vector<std::int64_t> lane_frequency_index(const std::string& kind,
                                               const std::vector<std::int64_t>& blocks) {
  std::vector<std::int64_t> index;
  std::int64_t first = 0;  // frequencies used by the blocks before
  for (std::int64_t b : blocks) {
    for (std::int64_t j = 0; j < b; ++j) {
      std::int64_t i = j % (b / 2);
      if (kind == "interleave") i = j / 2;
      if (kind == "quarter") i = (j % (b / 2)) % (b / 4);
      index.push_back(first + i);
    }
    first += b / 2;
  }
  return index;
}

// token_major: a rank-4 [B, N, S, D] view over memory laid out [B, S, N, D] (BSND).
template <typename Pointer>
rome::BasicView<Pointer> view_of(Pointer data, DType dtype, const std::vector<std::int64_t>& shape,
                                 bool token_major = false) {
  rome::BasicView<Pointer> v;
  v.data = data;
  v.dtype = dtype;
  v.rank = static_cast<int>(shape.size());
  std::int64_t stride = 1;
  for (int d = v.rank - 1; d >= 0; --d) {
    v.shape[d] = shape[d];
    v.strides[d] = stride;
    stride *= shape[d];
  }
  if (token_major && v.rank == 4) {
    v.strides[1] = shape[3];
    v.strides[2] = shape[1] * shape[3];
  }
  return v;
}

std::int64_t product(const std::vector<std::int64_t>& v) {
  std::int64_t n = 1;
  for (auto s : v) n *= s;
  return n;
}

void fill_values(void* p, DType dtype, std::int64_t n, std::uint32_t seed) {
  std::uint32_t s = seed;
  for (std::int64_t i = 0; i < n; ++i) {
    s = s * 1664525u + 1013904223u;
    const float v = float(std::int32_t(s >> 8) - (1 << 23)) * (1.0f / float(1 << 22));
    rome::detail::store_any(p, dtype, i, v == 0.0f ? 0.5f : v);
  }
}

double seconds(const std::function<void()>& f, int inner) {
  const auto t0 = Clock::now();
  for (int i = 0; i < inner; ++i) f();
  return std::chrono::duration<double>(Clock::now() - t0).count() / inner;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

std::string shape_json(const std::vector<std::int64_t>& s) {
  std::string out = "[";
  for (std::size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

int usage(const char* why) {
  std::fprintf(
      stderr,
      "rome_timer: %s\nusage: rome_timer --q B,N,S,D [--k B,N,S,D] [--rotation half] "
      "[--blocks a,b,..] [--cache P [--shuffle-positions] [--half-width-cache]] [--dtype bf16] "
      "[--table-dtype f32] "
      "[--threads N] "
      "[--tile-tokens T] [--min-parallel-bytes B] "
      "[--repeats R] [--warmup W] [--inner K] [--in-place] [--bsnd] [--table-free] [--qk-norm] "
      "[--kv-cache] [--packed-qkv] "
      "[--force-dense] "
      "[--matrix-dtype f32|bf16] [--isa NAME]\n",
      why);
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  std::string rotation_kind = "half", isa_name;
  std::vector<std::int64_t> q_shape, k_shape, blocks;
  std::int64_t cache = 0;
  DType dtype = DType::bf16, table_dtype = DType::f32, matrix_dtype = DType::f32;
  int threads = 0, repeats = 20, warmup = 3, inner = 0;
  std::int64_t tile_tokens = 0, min_parallel_bytes = -1;
  bool in_place = false, force_dense = false, qk_norm = false, bsnd = false, shuffle = false,
       half_width = false;
  bool packed_qkv = false, table_free = false, kv_cache = false;
  try {
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      auto value = [&]() -> std::string {
        if (i + 1 >= argc) throw std::invalid_argument("missing value after " + a);
        return argv[++i];
      };
      if (a == "--rotation" || a == "--variant")
        rotation_kind = value();
      else if (a == "--blocks")
        blocks = parse_ints(value());
      else if (a == "--q" || a == "--shape")
        q_shape = parse_ints(value());
      else if (a == "--k")
        k_shape = parse_ints(value());
      else if (a == "--cache")
        cache = std::stoll(value());
      else if (a == "--dtype")
        dtype = parse_dtype(value());
      else if (a == "--table-dtype")
        table_dtype = parse_dtype(value());
      else if (a == "--matrix-dtype")
        matrix_dtype = parse_dtype(value());
      else if (a == "--threads")
        threads = std::stoi(value());
      else if (a == "--tile-tokens")
        tile_tokens = std::stoll(value());
      else if (a == "--min-parallel-bytes")
        min_parallel_bytes = std::stoll(value());
      else if (a == "--repeats")
        repeats = std::stoi(value());
      else if (a == "--warmup")
        warmup = std::stoi(value());
      else if (a == "--inner")
        inner = std::stoi(value());
      else if (a == "--in-place")
        in_place = true;
      else if (a == "--bsnd")
        bsnd = true;
      else if (a == "--shuffle-positions")
        shuffle = true;
      else if (a == "--half-width-cache")
        half_width = true;
      else if (a == "--qk-norm")
        qk_norm = in_place = true;
      else if (a == "--kv-cache")
        kv_cache = in_place = true;
      else if (a == "--table-free")
        table_free = true;
      else if (a == "--packed-qkv")
        packed_qkv = true;
      else if (a == "--force-dense")
        force_dense = true;
      else if (a == "--isa")
        isa_name = value();
      else if (a == "-h" || a == "--help")
        return usage("help"), 0;
      else
        throw std::invalid_argument("unknown option " + a);
    }
  } catch (const std::exception& e) {
    return usage(e.what());
  }
  if (q_shape.size() < 2 || q_shape.size() > 5) return usage("--q needs 2 to 5 sizes");
  if (!k_shape.empty() && k_shape.size() != q_shape.size())
    return usage("--k needs as many sizes as --q");
  // --qk-norm, --kv-cache and --packed-qkv: token-major operands (the fused passes').
  const bool token_major = qk_norm || kv_cache || packed_qkv;
  if (token_major && (q_shape.size() != 3 || k_shape.size() != 3 || k_shape[0] != q_shape[0]))
    return usage("--qk-norm, --kv-cache and --packed-qkv need --q T,Hq,D and --k T,Hk,D");
  if (packed_qkv && bsnd) return usage("--packed-qkv is token-major already (no --bsnd)");
  if (table_free && cache <= 0) return usage("--table-free needs --cache P (the positions)");
  if (half_width && (cache <= 0 || table_free))
    return usage("--half-width-cache needs --cache P and tables (not --table-free)");
  repeats = std::max(1, repeats);
  if (threads <= 0) threads = rome::default_num_threads();

  try {
    if (isa_name == "avx512-no-bf16") {
      if (rome::detected_isa() < rome::Isa::avx512)
        throw std::invalid_argument("--isa avx512-no-bf16 needs an AVX-512 CPU");
      rome::set_max_isa(rome::Isa::avx512);
      rome::detail::override_kernels_for_testing(&rome::kernels::avx512_kernels(false));
    } else if (!isa_name.empty()) {
      rome::set_max_isa(parse_isa(isa_name));
    }
    const std::int64_t dim = q_shape.back();
    const std::int64_t seq = token_major ? q_shape[0] : q_shape[q_shape.size() - 2];
    rome::Rotation rotation = make_rotation(rotation_kind, dim);
    if (!blocks.empty() && rotation_kind == "dense") {
      rotation = rome::bench::random_orthogonal_blocks(blocks);
    } else if (!blocks.empty()) {
      std::vector<rome::Rotation> parts;
      for (auto b : blocks) parts.push_back(make_rotation(rotation_kind, b));
      rotation = rome::Rotation::block_diag(parts);
    }
    if (force_dense) rotation = rotation.as_dense();
    if (matrix_dtype != DType::f32 && rotation.kind() == rome::Rotation::Kind::dense) {
      auto rounded = [&](std::vector<float> m) {
        for (float& v : m) {
          std::uint16_t h = 0;
          rome::detail::store_any(&h, matrix_dtype, 0, v);
          v = float(rome::detail::load_any(&h, matrix_dtype, 0));
        }
        return m;
      };
      const std::int64_t d = rotation.rotary_dim();
      rotation = rotation.a_is_identity()
                     ? rome::Rotation::dense(rounded(rotation.to_dense_b()), d)
                     : rome::Rotation::dense(rounded(rotation.to_dense_a()),
                                             rounded(rotation.to_dense_b()), d);
    }
    const std::int64_t rd = rotation.rotary_dim();

    // Operands.
    const int es = rome::dtype_size(dtype);
    const std::int64_t q_elems = product(q_shape), k_elems = k_shape.empty() ? 0 : product(k_shape);
    Buffer q(std::size_t(q_elems) * es), q_out(in_place ? 0 : std::size_t(q_elems) * es);
    Buffer k(std::size_t(k_elems) * es), k_out(in_place ? 0 : std::size_t(k_elems) * es);
    fill_values(q.data, dtype, q_elems, 1);
    if (k_elems) fill_values(k.data, dtype, k_elems, 2);

    // Tables: direct [S, rd] or a cache [P, rd] with positions P-S .. P-1.
    const std::int64_t rows = cache > 0 ? cache : seq;
    if (cache > 0 && cache < seq) throw std::invalid_argument("--cache must be >= S");
    const int ts = rome::dtype_size(table_dtype);
    const std::int64_t columns = half_width ? rd / 2 : rd;
    Buffer cos_t(std::size_t(rows * columns) * ts), sin_t(std::size_t(rows * columns) * ts);
    // Both lanes of a rotated pair share one frequency, as in a real model, so an in-place run
    // that rotates the same data again and again keeps its norms (with another layout, e.g. the
    // frequency of lane j % (rd/2) under a block split, values grow or shrink call after call
    // until they are subnormal or infinite, and the timing measures that).
    const std::vector<std::int64_t> frequency_index = lane_frequency_index(
        rotation_kind, blocks.empty() ? std::vector<std::int64_t>{rd} : blocks);
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t j = 0; j < columns; ++j) {
        const double inv =
            std::pow(10000.0, -2.0 * double(frequency_index[std::size_t(j)]) / double(rd));
        rome::detail::store_any(cos_t.data, table_dtype, r * columns + j,
                                float(std::cos(double(r) * inv)));
        rome::detail::store_any(sin_t.data, table_dtype, r * columns + j,
                                float(std::sin(double(r) * inv)));
      }
    std::vector<std::int64_t> positions(std::size_t(cache > 0 ? seq : 0));
    for (std::int64_t s = 0; s < std::int64_t(positions.size()); ++s)
      positions[s] = cache - seq + s;
    if (shuffle) {
      std::vector<std::int64_t> all(static_cast<std::size_t>(cache));
      for (std::int64_t p = 0; p < cache; ++p) all[std::size_t(p)] = p;
      std::shuffle(all.begin(), all.end(), std::mt19937_64(1));
      std::copy_n(all.begin(), positions.size(), positions.begin());
    }

    rome::Tables tables;
    // qk_norm_rope's tables vary along T only: direct [T, 1, rd], or positions [T, 1].
    const std::vector<std::int64_t> table_shape = token_major && cache == 0
                                                      ? std::vector<std::int64_t>{rows, 1, rd}
                                                      : std::vector<std::int64_t>{rows, columns};
    tables.cos = view_of<const void*>(cos_t.data, table_dtype, table_shape);
    tables.sin = view_of<const void*>(sin_t.data, table_dtype, table_shape);
    if (half_width) tables.width = rome::TableWidth::halves;
    if (cache > 0) {
      std::vector<std::int64_t> pshape(q_shape.size() - 1, 1);
      pshape[token_major ? 0 : pshape.size() - 1] = seq;
      tables.positions = view_of<const void*>(positions.data(), DType::i64, pshape);
    }
    if (table_free) {
      tables.cos = tables.sin = {};
      for (std::int64_t i = 0; i < rd / 2; ++i)
        tables.frequencies.push_back(std::pow(10000.0, -2.0 * double(i) / double(rd)));
    }
    std::vector<float> q_weight(std::size_t(dim), 1.25f), k_weight(std::size_t(dim), 0.75f);
    rome::QkNorm norm;
    norm.q_weight = view_of<const void*>(q_weight.data(), DType::f32, {dim});
    norm.k_weight = view_of<const void*>(k_weight.data(), DType::f32, {dim});

    auto qv = view_of<void*>(q.data, dtype, q_shape, bsnd);
    auto qo = in_place ? qv : view_of<void*>(q_out.data, dtype, q_shape, bsnd);
    rome::Operand q_op{rome::as_const(qv), qo};
    rome::Operand k_op;
    if (k_elems) {
      auto kv = view_of<void*>(k.data, dtype, k_shape, bsnd);
      auto ko = in_place ? kv : view_of<void*>(k_out.data, dtype, k_shape, bsnd);
      k_op = {rome::as_const(kv), ko};
    }
    rome::ExecOptions options;
    options.num_threads = threads;
    options.tile_tokens = tile_tokens;
    options.min_parallel_bytes = min_parallel_bytes;
    // --packed-qkv: q and k as views of one [T, (Hq + 2·Hk)·D] buffer.
    const std::int64_t qkv_row = packed_qkv ? (q_shape[1] + 2 * k_shape[1]) * dim : 0;
    Buffer qkv(std::size_t(q_shape[0] * qkv_row) * es);
    auto norm_q = qv;
    auto norm_k = view_of<void*>(k.data, dtype, k_shape);
    if (packed_qkv) {
      fill_values(qkv.data, dtype, q_shape[0] * qkv_row, 3);
      norm_q.data = qkv.data;
      norm_k.data = qkv.bytes_ptr() + q_shape[1] * dim * es;
      norm_q.strides[0] = norm_k.strides[0] = qkv_row;
    }
    // --kv-cache: the value, the caches and a slot per token.
    const std::int64_t kv_heads = kv_cache ? k_shape[1] : 0, block_size = 16;
    const std::int64_t cache_blocks = kv_cache ? 2 * ((seq + block_size - 1) / block_size) : 0;
    const std::int64_t kv_elems = seq * kv_heads * dim;
    Buffer value(std::size_t(kv_elems) * es),
        key_cache(std::size_t(cache_blocks * block_size * kv_heads * dim) * es),
        value_cache(std::size_t(cache_blocks * block_size * kv_heads * dim) * es);
    std::vector<std::int64_t> slots(std::size_t(cache_blocks * block_size));
    for (std::size_t i = 0; i < slots.size(); ++i) slots[i] = std::int64_t(i);
    std::shuffle(slots.begin(), slots.end(), std::mt19937_64(2));
    rome::PagedKvWrite kv;
    if (kv_cache) {
      fill_values(value.data, dtype, kv_elems, 4);
      kv.value = view_of<const void*>(value.data, dtype, {seq, kv_heads, dim});
      kv.key_cache =
          view_of<void*>(key_cache.data, dtype, {cache_blocks, block_size, kv_heads, dim});
      kv.value_cache =
          view_of<void*>(value_cache.data, dtype, {cache_blocks, block_size, kv_heads, dim});
      kv.slot_mapping = view_of<const void*>(slots.data(), DType::i64, {seq});
    }
    if (packed_qkv && !qk_norm && !kv_cache) {  // rope_forward on the packed q and k heads
      q_op = {rome::as_const(norm_q),
              in_place ? norm_q : view_of<void*>(q_out.data, dtype, q_shape)};
      k_op = {rome::as_const(norm_k),
              in_place ? norm_k : view_of<void*>(k_out.data, dtype, k_shape)};
    }
    auto rope = [&] {
      if (kv_cache)
        rome::rope_and_cache_kv(rotation, tables, norm_q, norm_k, kv, qk_norm ? &norm : nullptr,
                                options);
      else if (qk_norm)
        rome::qk_norm_rope(rotation, tables, norm, norm_q, norm_k, options);
      else
        rome::rope_forward(rotation, tables, q_op, k_elems ? &k_op : nullptr, options);
    };

    // The same bytes: x (and k) copied to the outputs (or onto themselves in place: a copy to
    // the output buffer is the same traffic), the table bytes the call reads, the positions.
    const std::size_t table_bytes = std::size_t(seq * columns) * ts;  // rows actually read
    const std::size_t table_offset = std::size_t(rows - seq) * columns * ts;
    Buffer copy_q(in_place ? std::size_t(q_elems) * es : 0),
        copy_k(in_place ? std::size_t(k_elems) * es : 0);
    rome::bench::CopyJob job;
    std::vector<rome::bench::CopyJob::Span>& spans = job.spans;
    spans = {{q.bytes_ptr(), in_place ? copy_q.bytes_ptr() : q_out.bytes_ptr(),
              std::size_t(q_elems) * es}};
    if (k_elems)
      spans.push_back({k.bytes_ptr(), in_place ? copy_k.bytes_ptr() : k_out.bytes_ptr(),
                       std::size_t(k_elems) * es});
    Buffer copy_value(std::size_t(kv_elems) * es), copy_key(std::size_t(kv_elems) * es);
    if (kv_cache) {
      spans.push_back({value.bytes_ptr(), copy_value.bytes_ptr(), std::size_t(kv_elems) * es});
      spans.push_back({k.bytes_ptr(), copy_key.bytes_ptr(), std::size_t(kv_elems) * es});
    }
    if (!table_free) {
      spans.push_back({cos_t.bytes_ptr() + table_offset, nullptr, table_bytes});
      spans.push_back({sin_t.bytes_ptr() + table_offset, nullptr, table_bytes});
    }
    if (!positions.empty())
      spans.push_back(
          {reinterpret_cast<const char*>(positions.data()), nullptr, positions.size() * 8});
    const std::size_t total = job.bytes();
    // Like RoME, the copy only splits work worth splitting (>= 256 KiB per thread): waking a
    // second thread for a decode-sized copy costs more than the copy.
    const int copy_threads =
        int(std::clamp<std::size_t>(total / (std::size_t(256) << 10), 1, std::size_t(threads)));
    auto copy = [&] { rome::bench::run_copy(job, copy_threads); };
    auto stream_floor = [&] { rome::bench::run_copy(job, copy_threads, true); };

    for (int i = 0; i < std::max(1, warmup); ++i) rope(), copy(), stream_floor();
    if (inner <= 0) {
      const double once = std::min({seconds(rope, 1), seconds(copy, 1), seconds(stream_floor, 1)});
      inner = std::clamp(int(std::ceil(1e-3 / std::max(once, 1e-9))), 1, 100000);
    }
    std::vector<double> t_rope, t_copy, t_stream;
    for (int r = 0; r < repeats; ++r) {
      t_rope.push_back(seconds(rope, inner));
      t_copy.push_back(seconds(copy, inner));
      t_stream.push_back(seconds(stream_floor, inner));
    }
    const double bytes = double(total + std::size_t(q_elems + k_elems) * es);  // reads + writes
    // The matrix part of a dense rotation: 2 flops per multiply-add, per row, per diagonal block
    // (x·B, and x·A when A is not the identity). Zero on the permute path.
    double matrix_flops = 0;
    const auto& data = rotation.data();
    if (rotation.kind() == rome::Rotation::Kind::dense) {
      double per_row = 0;
      for (const auto& b : data.dense_blocks) per_row += 2.0 * double(b.size) * double(b.size);
      if (!data.a_identity) per_row *= 2;
      matrix_flops = per_row * double(q_elems + k_elems) / double(dim);
    }
    std::printf(
        "{\"rotation\": \"%s\", \"blocks\": %s, \"q\": %s, \"k\": %s, \"cache\": %lld, "
        "\"dtype\": \"%s\", \"table_dtype\": \"%s\", \"in_place\": %s, \"threads\": %d, "
        "\"copy_threads\": %d, \"isa\": \"%s\", \"repeats\": %d, \"inner\": %d, \"bytes\": %.0f, "
        "\"rome_median_s\": %.9g, \"rome_min_s\": %.9g, \"copy_median_s\": %.9g, "
        "\"copy_min_s\": %.9g, \"ratio_to_copy\": %.4f, \"stream_copy_median_s\": %.9g, "
        "\"stream_copy_min_s\": %.9g, \"ratio_to_stream_copy\": %.4f, \"path\": \"%s\", "
        "\"matrix_flops\": %.0f}\n",
        rotation_kind.c_str(), shape_json(blocks).c_str(), shape_json(q_shape).c_str(),
        shape_json(k_shape).c_str(), static_cast<long long>(cache), rome::dtype_name(dtype),
        rome::dtype_name(table_dtype), in_place ? "true" : "false", threads, copy_threads,
        isa_name == "avx512-no-bf16" ? isa_name.c_str() : rome::isa_name(rome::active_isa()),
        repeats, inner, bytes, median(t_rope), *std::min_element(t_rope.begin(), t_rope.end()),
        median(t_copy), *std::min_element(t_copy.begin(), t_copy.end()),
        median(t_rope) / median(t_copy), median(t_stream),
        *std::min_element(t_stream.begin(), t_stream.end()), median(t_rope) / median(t_stream),
        rotation.kind() == rome::Rotation::Kind::dense ? "dense" : "permute", matrix_flops);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rome_timer: %s\n", e.what());
    return 1;
  }
  return 0;
}
