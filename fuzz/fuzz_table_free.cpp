// libFuzzer target over table-free RoPE: rope_forward with Tables::frequencies.
//
// The input is decoded byte by byte (a zero byte, or the end of the input, picks the plainest
// option) into one call: a rotation (half, interleave, quarter, interleave_half, two half blocks,
// a partial one at a lane offset, or rarely a dense one or a random signed permutation, which
// may or may not turn lane pairs), x as BNSD, BSND or packed tokens in any float dtype, q alone
// or q + k (GQA), in place or out of place, positions (int32/int64) broadcast on any axis (rarely
// a leading axis dropped: an error in C++), or with a trailing axis and column_axis (MRoPE);
// positions up to 2^40 and negative; frequencies of every kind (rarely a wrong count, NaN, inf,
// zero, negative, tiny or huge), an amplitude (rarely NaN or inf), 1 to 4 threads and small tiles.
//
// Oracle, from the harness's own model of the contract:
//  * invalid (the rotation does not turn lane pairs, a positions axis missing, a wrong frequency
//    count, a non-finite frequency or amplitude, or |position| × the largest |frequency| ≥ 2^50
//    for some position; the harness draws products far from that limit): rope_forward raises
//    rome::Error and every buffer is byte-identical to before;
//  * valid: rope_forward succeeds, and its bytes equal the same call through direct fp32 tables
//    built here, lane by lane, from rome::exact_cos_sin_rows (the fp32 cos/sin the table-free
//    executor must compute), run through the scalar kernel on one thread: bit for bit; and
//    those cos/sin within 3e-7 · amplitude of cos/sin of the exact angle in fp64.
// Any other exception, crash or sanitizer report is a bug.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "fuzz_support.hpp"
#include "rome/rome.hpp"

namespace {

using namespace rome;
using i64 = std::int64_t;

using fuzzing::Reader;

[[noreturn]] void bug(const std::string& what) {
  fuzzing::report_bug("fuzz_table_free", what);
}

// cos and sin of position × frequency in double from the exact product (hi + lo, lo from an
// fma: p and f are doubles, |p·f| < 2^50 so |lo| <= 2^-4) by the angle-sum formulas: glibc's
// cos/sin reduce any double exactly, and sin(lo) ~ lo is where the fp32 angle of other RoPE
// code loses its digits. Errors ~1e-16, far below the 3e-7 bound checked.
void cos_sin_fp64(std::int64_t position, double frequency, double& c, double& s) {
  const double p = double(position);  // |position| < 2^41 here: exact
  const double hi = p * frequency, lo = std::fma(p, frequency, -hi);
  const double ch = std::cos(hi), sh = std::sin(hi), cl = std::cos(lo), sl = std::sin(lo);
  c = ch * cl - sh * sl;
  s = sh * cl + ch * sl;
}

// exact_cos_sin_rows (half layout: columns i and i + n) against the fp64 angle: the library's
// table-free cos/sin, which the rest of the oracle takes as given, within 3e-7 · amplitude
// (issue 16's bound on fp32 outputs; an fp32 angle is off by 1e-4 past position 10^5).
void check_against_fp64(std::int64_t position, const std::vector<double>& frequencies,
                        double amplitude, const std::vector<float>& c_row,
                        const std::vector<float>& s_row) {
  const std::size_t n = frequencies.size();
  const double bound = 3e-7 * std::max(1.0, std::fabs(amplitude));
  for (std::size_t i = 0; i < n; ++i) {
    double c = 0, s = 0;
    cos_sin_fp64(position, frequencies[i], c, s);
    const double dc = std::fabs(double(c_row[i]) - amplitude * c);
    const double ds = std::fabs(double(s_row[i]) - amplitude * s);
    const bool halves_equal = c_row[i] == c_row[i + n] && s_row[i] == s_row[i + n];
    if (!(dc <= bound && ds <= bound && halves_equal)) {
      char what[200];
      std::snprintf(what, sizeof what,
                    "exact_cos_sin_rows is off the fp64 angle at position %lld, frequency %.17g: "
                    "cos error %.3g, sin error %.3g, halves equal %d",
                    static_cast<long long>(position), frequencies[i], dc, ds, int(halves_equal));
      bug(what);
    }
  }
}

// Does the fuzzer reach valid calls as well as rejected ones?
fuzzing::OutcomeCounts stats;

std::uint64_t next(std::uint64_t& seed) {
  seed = seed * 6364136223846793005ull + 1442695040888963407ull;
  return seed >> 11;
}

double uniform(std::uint64_t& seed) {
  return double(next(seed)) / double(1ull << 53) * 2 - 1;
}

// x's values in [-2, 2] in its dtype.
std::vector<std::uint8_t> random_x(DType dtype, i64 elements, std::uint64_t& seed) {
  std::vector<std::uint8_t> out(std::size_t(elements * dtype_size(dtype)));
  for (i64 e = 0; e < elements; ++e) {
    const float v = float(2 * uniform(seed));
    std::uint32_t b;
    std::memcpy(&b, &v, 4);
    void* p = out.data() + e * dtype_size(dtype);
    if (dtype == DType::f32) {
      std::memcpy(p, &v, 4);
    } else if (dtype == DType::bf16) {
      const std::uint16_t h = std::uint16_t(b >> 16);
      std::memcpy(p, &h, 2);
    } else {  // fp16 in [-2, 2): sign, exponent 0..15 biased, any mantissa
      const std::uint16_t h = std::uint16_t((b >> 16 & 0x8000) | (next(seed) % 0x4000));
      std::memcpy(p, &h, 2);
    }
  }
  return out;
}

// A random signed permutation of n lanes as a dense row-major matrix (column j holds one ±1).
std::vector<float> signed_permutation(i64 n, std::uint64_t& seed) {
  std::vector<i64> perm(static_cast<std::size_t>(n));
  for (i64 i = 0; i < n; ++i) perm[i] = i;
  for (i64 i = n - 1; i > 0; --i) std::swap(perm[i], perm[next(seed) % std::uint64_t(i + 1)]);
  std::vector<float> m(static_cast<std::size_t>(n * n), 0.0f);
  for (i64 j = 0; j < n; ++j) m[perm[j] * n + j] = next(seed) & 1 ? 1.0f : -1.0f;
  return m;
}

// The pair index of each rotated lane (pairs numbered by their lower lane), from the dense A
// and B: output lane j reads (x·B)_j = ±x[b(j)], which A delivers to lane m with a(m) = b(j);
// j and m rotate together when m's partner is j and their signs are opposite. Empty when the
// lanes do not pair up.
std::vector<i64> lane_pairs(const Rotation& r) {
  const i64 n = r.rotary_dim();
  const std::vector<float> a = r.to_dense_a(), b = r.to_dense_b();
  std::vector<i64> row_a(n, -1), row_b(n, -1), lane_of_row(n, -1);
  std::vector<float> sign_a(n, 0), sign_b(n, 0);
  for (i64 j = 0; j < n; ++j)
    for (i64 i = 0; i < n; ++i) {
      if (a[i * n + j] != 0) {
        if (row_a[j] >= 0 || std::fabs(a[i * n + j]) != 1) return {};
        row_a[j] = i;
        sign_a[j] = a[i * n + j];
        lane_of_row[i] = j;
      }
      if (b[i * n + j] != 0) {
        if (row_b[j] >= 0 || std::fabs(b[i * n + j]) != 1) return {};
        row_b[j] = i;
        sign_b[j] = b[i * n + j];
      }
    }
  std::vector<i64> partner(n, -1);
  for (i64 j = 0; j < n; ++j) {
    if (row_a[j] < 0 || row_b[j] < 0 || lane_of_row[row_b[j]] < 0) return {};
    partner[j] = lane_of_row[row_b[j]];
    if (partner[j] == j) return {};
  }
  std::vector<i64> index(n, -1);
  i64 count = 0;
  for (i64 j = 0; j < n; ++j) {
    const i64 m = partner[j];
    if (partner[m] != j || sign_b[j] * sign_a[m] != -(sign_b[m] * sign_a[j])) return {};
    if (index[j] < 0) index[j] = index[m] = count++;
  }
  return index;
}

Rotation decode_rotation(Reader& R, i64 hd, std::uint64_t& seed, i64& offset) {
  offset = 0;
  const i64 kind = R.below(9);
  if (kind == 6 && hd >= 4) {  // partial, at an even lane offset
    const i64 rd = 2 * (1 + R.below(hd / 2 - 1));
    offset = 2 * R.below((hd - rd) / 2 + 1);
    return Rotation::half(rd).partial(hd, offset);
  }
  if (kind == 7 && R.rare(2)) return Rotation::dense(signed_permutation(hd, seed), hd);
  if (kind == 8 && R.rare(2)) {
    std::vector<float> m(static_cast<std::size_t>(hd * hd));
    for (float& v : m) v = float(uniform(seed));
    return Rotation::dense(m, hd);
  }
  if (kind == 2 && hd % 4 == 0) return Rotation::quarter(hd);
  if (kind == 3) return Rotation::interleave_half(hd);
  if (kind == 4 && hd >= 4) {
    const i64 first = 2 * (1 + R.below(hd / 2 - 1));
    return Rotation::block_diag({Rotation::half(first), Rotation::half(hd - first)});
  }
  if (kind == 5) return Rotation::interleave(hd);
  return Rotation::half(hd);
}

i64 numel(const std::vector<i64>& shape) {
  i64 n = 1;
  for (i64 d : shape) n *= d;
  return n;
}

// A row-major view of `shape` (make_view takes an initializer list; these shapes are built).
template <typename Pointer>
BasicView<Pointer> row_major_view(Pointer data, DType dtype, const std::vector<i64>& shape) {
  BasicView<Pointer> v;
  v.data = data;
  v.dtype = dtype;
  v.rank = int(shape.size());
  i64 stride = 1;
  for (int i = v.rank - 1; i >= 0; --i) {
    v.shape[i] = shape[i];
    v.strides[i] = stride;
    stride *= shape[i];
  }
  return v;
}

struct Tensor {
  std::vector<i64> shape;
  DType dtype = DType::f32;
  std::vector<std::uint8_t> in, out;  // out empty: in place
};

Operand operand(Tensor& t) {
  Operand o;
  o.in = row_major_view<const void*>(t.in.data(), t.dtype, t.shape);
  o.out = row_major_view<void*>(t.out.empty() ? t.in.data() : t.out.data(), t.dtype, t.shape);
  return o;
}

const std::vector<std::uint8_t>& result(const Tensor& t) {
  return t.out.empty() ? t.in : t.out;
}

// Position of x row `row` (row-major over x's shape without its last axis) for column axis
// `axis` (-1: no trailing axis), broadcasting `pos_shape` (right-aligned) as the library does.
i64 position_of(const std::vector<i64>& positions, const std::vector<i64>& pos_shape,
                const std::vector<i64>& x_rows, i64 row, i64 axis) {
  const int trailing = axis >= 0 ? 1 : 0;
  const int prank = int(pos_shape.size()) - trailing;
  std::vector<i64> idx(x_rows.size());
  for (int i = int(x_rows.size()) - 1; i >= 0; --i) {
    idx[i] = row % x_rows[i];
    row /= x_rows[i];
  }
  i64 offset = 0;
  for (int i = 0; i < prank; ++i) {
    const i64 x_axis = i64(x_rows.size()) - prank + i;
    offset = offset * pos_shape[i] + (pos_shape[i] == 1 ? 0 : idx[x_axis]);
  }
  if (trailing) offset = offset * pos_shape.back() + axis;
  return positions[offset];
}

int run(const std::uint8_t* data, std::size_t size) {
  Reader R{data, size};
  std::uint64_t seed = 0x9e3779b97f4a7c15ull ^ (R.byte() | R.byte() << 8);
  const i64 hd = 2 * (1 + R.below(40));
  i64 offset = 0;
  const Rotation rotation = decode_rotation(R, hd, seed, offset);
  const i64 rd = rotation.rotary_dim();
  const std::vector<i64> pair_of_lane = lane_pairs(rotation);
  const bool pairing = !pair_of_lane.empty();

  // x: BNSD [B, N, S, D], BSND [B, S, N, D] or packed [T, N, D]; k with fewer heads (GQA).
  const DType floats[] = {DType::f32, DType::bf16, DType::f16};
  const DType dtype = floats[R.below(3)];
  const i64 layout = R.below(3), B = 1 + R.below(2), S = 1 + R.below(9), N = 1 + R.below(4);
  const bool with_k = R.below(2) == 1;
  const i64 NK = 1 + R.below(N);
  auto shape_of = [&](i64 heads) -> std::vector<i64> {
    if (layout == 0) return {B, heads, S, hd};
    if (layout == 1) return {B, S, heads, hd};
    return {B * S, heads, hd};
  };
  Tensor q{shape_of(N), dtype}, k{shape_of(NK), dtype};
  q.in = random_x(dtype, numel(q.shape), seed);
  if (R.below(2)) q.out.assign(q.in.size(), 0xff);  // NaN-like bytes where nothing was written
  k.in = random_x(dtype, numel(k.shape), seed);
  if (R.below(2)) k.out.assign(k.in.size(), 0xff);

  // Positions: x's shape without the last axis, each axis kept or 1 (the head axis always 1,
  // q and k share them), leading 1s dropped; rarely a trailing axis for column_axis.
  std::vector<i64> pos_shape = q.shape;
  pos_shape.pop_back();
  const int head_axis = layout == 0 ? 1 : layout == 1 ? 2 : 1;
  for (int i = 0; i < int(pos_shape.size()); ++i)
    if (i == head_axis || R.below(4) == 0) pos_shape[i] = 1;
  // The C++ contract wants every axis (the torch ops add dropped leading ones): rarely drop one.
  const bool dropped_axis = pos_shape.size() > 1 && pos_shape[0] == 1 && R.rare(8);
  if (dropped_axis) pos_shape.erase(pos_shape.begin());
  const bool multi_axis = R.rare(4);
  const i64 axes = multi_axis ? 1 + R.below(3) : 0;
  if (multi_axis) pos_shape.push_back(axes);
  const i64 position_count = numel(pos_shape);
  const DType pos_dtype = R.below(2) ? DType::i64 : DType::i32;
  const i64 range = R.rare(4) ? (i64(1) << 31) - 1 : 1 + R.below(5000);
  const bool far = pos_dtype == DType::i64 && R.rare(8);  // positions near 2^40
  std::vector<i64> positions(position_count);
  for (i64& p : positions) {
    p = i64(uniform(seed) * double(range));
    if (R.rare(8)) p = -p - 1;
    if (far) p += i64(1) << 40;
  }
  std::vector<std::uint8_t> pos_bytes(std::size_t(position_count * dtype_size(pos_dtype)));
  for (i64 i = 0; i < position_count; ++i) {
    if (pos_dtype == DType::i64) {
      std::memcpy(pos_bytes.data() + 8 * i, &positions[i], 8);
    } else {
      const std::int32_t v = std::int32_t(positions[i]);
      positions[i] = v;
      std::memcpy(pos_bytes.data() + 4 * i, &v, 4);
    }
  }

  // Frequencies: one per pair (rarely one more or one fewer), θ^(-2i/rd) style or random;
  // rarely a bad or extreme value. Angles past the 2^50 limit come from the frequency 2^40 with
  // |position| ≥ 1024, or from positions near 2^40 with the frequency 2^15; the others stay
  // below 2^47.
  i64 count = pairing ? rd / 2 : std::max<i64>(1, rd / 2);
  if (R.rare(16)) count += R.below(2) ? 1 : -1;
  std::vector<double> frequencies(static_cast<std::size_t>(std::max<i64>(count, 0)));
  const double theta = R.below(2) ? 10000.0 : 500000.0;
  for (i64 i = 0; i < i64(frequencies.size()); ++i) {
    double f = std::pow(theta, -2.0 * double(i) / double(std::max<i64>(rd, 2)));
    if (R.rare(4)) f = uniform(seed);
    if (R.rare(32)) {
      const double extremes[] = {NAN, INFINITY, -INFINITY, 0.0, -1.0, 4.9e-324, 0x1p40, 0x1p15};
      f = extremes[R.below(8)];
    }
    frequencies[i] = f;
  }
  double amplitude = 1.0;
  if (R.rare(4)) amplitude = 1 + uniform(seed);
  if (R.rare(32)) amplitude = R.below(2) ? NAN : INFINITY;
  std::vector<int> column_axis;
  for (i64 i = 0; multi_axis && i < i64(frequencies.size()); ++i)
    column_axis.push_back(int(R.below(axes)));
  const int threads = int(1 + R.below(4));
  const i64 tile_tokens = R.below(2) ? 0 : 1 + R.below(4);

  // The model.
  bool valid = pairing && count == rd / 2 && std::isfinite(amplitude) && !dropped_axis;
  for (double f : frequencies) valid = valid && std::isfinite(f);
  // The limit holds every position against the largest |frequency| (with column_axis too: a
  // simple rule, and positions near 2^50 / frequency are far past any context anyway).
  double largest = 0;
  for (double f : frequencies) largest = std::max(largest, std::fabs(f));
  for (i64 i = 0; valid && i < position_count; ++i) {
    const double angle = std::fabs(double(positions[i])) * largest;
    if (angle >= 0x1p49 && angle < 0x1p51) {  // too near the limit to model
      stats.add("near the limit (input dropped)");
      return -1;
    }
    if (angle >= 0x1p50) valid = false;
  }

  Tables tables;
  tables.positions = row_major_view<const void*>(pos_bytes.data(), pos_dtype, pos_shape);
  tables.frequencies = frequencies;
  tables.amplitude = amplitude;
  tables.column_axis = column_axis;
  ExecOptions options;
  options.num_threads = threads;
  options.min_parallel_bytes = 0;  // small cases: the threaded path still runs
  options.tile_tokens = tile_tokens;
  const Tensor q0 = q, k0 = k;
  const std::vector<std::uint8_t> pos0 = pos_bytes;
  std::string error;
  try {
    Operand oq = operand(q), ok = operand(k);
    rope_forward(rotation, tables, oq, with_k ? &ok : nullptr, options);
  } catch (const rome::Error& e) {
    error = e.what();
  } catch (const std::exception& e) {
    bug(std::string("exception other than rome::Error: ") + e.what());
  }
  if (pos_bytes != pos0) bug("positions were written");
  if (!error.empty()) {
    if (valid) bug("a valid call was rejected: " + error);
    if (q.in != q0.in || q.out != q0.out || k.in != k0.in || k.out != k0.out)
      bug("a rejected call wrote an output: " + error);
    stats.add("rejected");
    return 0;
  }
  if (!valid) bug("an invalid call succeeded (pairing " + std::to_string(pairing) + ")");

  // The reference: direct fp32 tables [rows, rd] from exact_cos_sin_rows, lane by lane.
  std::vector<i64> x_rows = q.shape;
  x_rows.pop_back();
  const i64 rows = numel(x_rows);
  const i64 n = i64(frequencies.size());
  std::vector<float> C(static_cast<std::size_t>(rows * rd)), S_(std::size_t(rows * rd));
  std::vector<float> c_row(static_cast<std::size_t>(2 * n)), s_row(std::size_t(2 * n));
  for (i64 r = 0; r < rows; ++r) {
    for (i64 a = 0; a < (multi_axis ? axes : 1); ++a) {
      const std::int64_t p = position_of(positions, pos_shape, x_rows, r, multi_axis ? a : -1);
      exact_cos_sin_rows({&p, 1}, frequencies, amplitude, false, c_row.data(), s_row.data());
      check_against_fp64(p, frequencies, amplitude, c_row, s_row);
      for (i64 j = 0; j < rd; ++j) {
        const i64 pair = pair_of_lane[j];
        if (multi_axis && column_axis[pair] != a) continue;
        C[r * rd + j] = c_row[pair];
        S_[r * rd + j] = s_row[pair];
      }
    }
  }
  std::vector<i64> table_shape = x_rows;
  table_shape.push_back(rd);
  Tables direct;
  direct.cos = row_major_view<const void*>(C.data(), DType::f32, table_shape);
  direct.sin = row_major_view<const void*>(S_.data(), DType::f32, table_shape);
  // k's rows: its own shape (fewer heads), tables with one head broadcast.
  std::vector<i64> k_table_shape = table_shape;
  k_table_shape[head_axis] = 1;
  const Isa active = active_isa();
  set_max_isa(Isa::scalar);
  Tensor rq = q0, rk = k0;
  ExecOptions one;
  one.num_threads = 1;
  Operand oq = operand(rq);
  rope_forward(rotation, direct, oq, nullptr, one);
  if (with_k) {
    // The positions do not depend on the head: k's table is q's for head 0.
    std::vector<float> kc, ks;
    for (i64 r = 0; r < rows; ++r) {
      std::vector<i64> idx(x_rows.size());
      i64 rest = r;
      for (int i = int(x_rows.size()) - 1; i >= 0; --i) {
        idx[i] = rest % x_rows[i];
        rest /= x_rows[i];
      }
      if (idx[head_axis] != 0) continue;
      kc.insert(kc.end(), C.begin() + r * rd, C.begin() + (r + 1) * rd);
      ks.insert(ks.end(), S_.begin() + r * rd, S_.begin() + (r + 1) * rd);
    }
    Tables kt;
    kt.cos = row_major_view<const void*>(kc.data(), DType::f32, k_table_shape);
    kt.sin = row_major_view<const void*>(ks.data(), DType::f32, k_table_shape);
    Operand ok = operand(rk);
    rope_forward(rotation, kt, ok, nullptr, one);
  }
  set_max_isa(active);
  if (result(q) != result(rq)) bug("q differs from the reference");
  if (with_k && result(k) != result(rk)) bug("k differs from the reference");
  if (!q.out.empty() && q.in != q0.in) bug("out of place wrote q's input");
  if (!k.out.empty() && k.in != k0.in) bug("out of place wrote k's input");
  if (!with_k && (k.in != k0.in || k.out != k0.out)) bug("k was written without being passed");
  stats.add("valid, equal to the reference");
  return 0;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  return run(data, size);
}
