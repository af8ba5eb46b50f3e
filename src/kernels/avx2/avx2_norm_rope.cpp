// AVX2 + FMA QK-norm + rotation (NormForwardFn): pass 1 takes each row's sum of squares (8-lane
// fma accumulators in the contract's order; rows go four at a time so their fma chains and
// square roots overlap), pass 2 forms r·(x_a·C' + x_b·S') from the raw lanes with the weight
// folded into the table row (once per row of tables, shared by every head of a token). bf16 rows
// whose halves (or pairs) are whole 16-lane chunks go 16 lanes at a time on even/odd splits
// with even/odd table rows, as the RoPE kernel's bf16 path does: no buffer (x is split again from
// L1), one fma per lane when the products are exact, and no per-chunk test on rows that cannot
// produce inf or NaN (FoldedRow::finite_sum_squares_max; other rows redo a chunk with a non-finite
// lane lane by lane). Half rotations whose half is whole vectors and interleave rotations of
// whole vectors run on 8-lane vectors from an fp32 buffer; other sizes and signed permutations
// take the scalar kernel's lane loop on the same buffer. Bit-identical to the scalar kernel: same
// operations, same order, same epilogue.
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "../../core/convert.hpp"
#include "../common/combine-inl.hpp"
#include "../common/norm_fold-inl.hpp"
#include "../kernel_api.hpp"
#include "avx2_lanes.hpp"

namespace rome::kernels {
namespace {

using detail::RotationData;
using namespace avx2;

// ((s0+s4)+(s2+s6)) + ((s1+s5)+(s3+s7)) of the 8 partial sums.
ROME_INLINE float reduce(__m256 acc) {
  const __m128 t = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  const __m128 u = _mm_add_ps(t, _mm_movehl_ps(t, t));
  return _mm_cvtss_f32(_mm_add_ss(u, _mm_shuffle_ps(u, u, 1)));
}

// Whether the tiles of this rotation and dtype take the bf16 even/odd path: bf16, rotary_dim and
// head_dim multiples of 16, half (h a multiple of 16) or interleave. Its table rows then come in
// even_odd_16 order (avx2_norm_table_layout asks the same question).
bool bf16_even_odd(const RotationData& r, NormKind kind, DType dtype) {
  const std::int64_t rd = r.rotary_dim, hd = r.head_dim;
  return dtype == DType::bf16 && hd % 16 == 0 && rd % 16 == 0 &&
         ((kind == NormKind::half && (rd / 2) % 16 == 0) || kind == NormKind::interleave);
}

// The table row of the tile's row n with the weight folded in (fold_norm_weight): refolded only
// when the row changes (the fused executor hands one row to every head of a token). Half (h a
// multiple of 8) and interleave rotations (rotary_dim a multiple of 8) fold 8 lanes at a time,
// elementwise, from the weights laid out as the table rows are (weight_lanes: natural, or even/odd
// per 16-lane chunk): the same products as fold_norm_weight, so the same bits.
struct FoldedRow {
  const float* cos = nullptr;
  const float* sin = nullptr;
  float* cw;
  float* sw;
  const float* weight_lanes;
  NormKind kind;
  bool vector_fold, even_odd;
  std::int64_t head_dim;
  // Rows whose sum of squares is at most this (and whose scale is finite) skip the per-chunk
  // inf/NaN test (finite_sum_squares_bound).
  float finite_sum_squares_max = -1;

  // A local of each call (its table rows may sit where the last call's did), not a
  // thread_local: members read through TLS cost a vzeroupper and a reload per row.
  FoldedRow(float* cw_sw, const float* weights, const RotationData& r, NormKind k, bool eo)
      : cw(cw_sw),
        sw(cw_sw + r.rotary_dim),
        weight_lanes(weights),
        kind(k),
        vector_fold(whole_vector_rows(r, k, kW)),
        even_odd(eo),
        head_dim(r.head_dim) {}

  ROME_INLINE void update(const RotationData& r, const float* c, const float* s,
                          const float* weight) {
    if (c != cos || s != sin) refold(r, c, s, weight);
  }

  [[gnu::noinline]] void refold(const RotationData& r, const float* c, const float* s,
                                const float* weight) {
    const std::int64_t rd = r.rotary_dim, h = rd / 2;
    double m;
    if (vector_fold) {
      const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
      __m256 most = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
      // Lanes [j, j + 8) with the weights of their A lanes (wa) and B lanes (wb).
      auto fold = [&](std::int64_t j, __m256 wa, __m256 wb) {
        const __m256 fc = _mm256_mul_ps(_mm256_loadu_ps(c + j), wa);
        const __m256 fs = _mm256_mul_ps(_mm256_loadu_ps(s + j), wb);
        _mm256_storeu_ps(cw + j, fc);
        _mm256_storeu_ps(sw + j, fs);
        most = _mm256_max_ps(most, _mm256_and_ps(fc, abs_mask));
        most = _mm256_max_ps(most, _mm256_and_ps(fs, abs_mask));
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(fc, fs, _CMP_UNORD_Q));
      };
      const float* w = weight_lanes;
      if (kind == NormKind::half) {  // B lane of j is j ± h, in either layout (h % 16 == 0)
        for (std::int64_t j = 0; j < h; j += kW)
          fold(j, _mm256_loadu_ps(w + j), _mm256_loadu_ps(w + j + h));
        for (std::int64_t j = h; j < rd; j += kW)
          fold(j, _mm256_loadu_ps(w + j), _mm256_loadu_ps(w + j - h));
      } else if (even_odd) {  // B lanes of a chunk's even half are its odd half, and back
        for (std::int64_t j = 0; j < rd; j += 16) {
          const __m256 even = _mm256_loadu_ps(w + j), odd = _mm256_loadu_ps(w + j + kW);
          fold(j, even, odd);
          fold(j + kW, odd, even);
        }
      } else {
        for (std::int64_t j = 0; j < rd; j += kW) {
          const __m256 wa = _mm256_loadu_ps(w + j);
          fold(j, wa, _mm256_permute_ps(wa, 0xb1));
        }
      }
      // most is max(|cw|, |sw|), and max |cw| + max |sw| <= 2·most. max_ps drops NaNs: they
      // make m infinite.
      m = _mm256_testz_ps(nan, nan) ? 2.0 * double(horizontal_max(most)) : INFINITY;
    } else {
      fold_norm_weight(r, c, s, weight, cw, sw);
      m = double(max_abs(cw, rd)) + double(max_abs(sw, rd));
    }
    finite_sum_squares_max = finite_sum_squares_bound(m, head_dim);
    cos = c;
    sin = s;
  }

  static float horizontal_max(__m256 v) {
    float lanes[kW];
    _mm256_storeu_ps(lanes, v);
    float m = 0;
    for (float l : lanes) m = std::max(m, l);
    return m;
  }
  static float max_abs(const float* v, std::int64_t n) {
    float m = 0;
    for (std::int64_t j = 0; j < n; ++j) {
      if (std::isnan(v[j])) return INFINITY;
      m = std::max(m, std::fabs(v[j]));
    }
    return m;
  }
};

// n a multiple of 16: per chunk, the 8 even lanes, then the 8 odd ones.
void to_even_odd(const float* in, std::int64_t n, float* out) {
  for (std::int64_t c = 0; c < n; c += 16) {
    const EvenOdd e = split_even_odd(_mm256_loadu_ps(in + c), _mm256_loadu_ps(in + c + kW));
    _mm256_storeu_ps(out + c, e.even);
    _mm256_storeu_ps(out + c + kW, e.odd);
  }
}

// Pass 1 of G rows at once: scale[i] = 1 / rms of row i (and with kCopy, row i widened into
// N + i·row_floats in lane order). The rows' fma chains (one per row, in the contract's order)
// are independent, so interleaving them hides the fma latency one row alone waits on, and the
// group's square roots overlap too. bf16 sums each whole 16-lane chunk as its even lanes, then
// its odd ones (the contract).
constexpr int kRowGroup = 4;

template <DType D, int G, bool kCopy>
ROME_INLINE void widen_and_scale(const typename Lanes<D>::T* const* x, std::int64_t hd, float eps,
                                 float* N, std::int64_t row_floats, float* scale,
                                 float* sum_squares) {
  using L = Lanes<D>;
  __m256 acc[G];
  for (int i = 0; i < G; ++i) acc[i] = _mm256_setzero_ps();
  std::int64_t j = 0;
  if constexpr (D == DType::bf16) {
    for (; j + 16 <= hd; j += 16)
      for (int i = 0; i < G; ++i) {
        const EvenOdd eo = split_bf16(x[i] + j);
        acc[i] = _mm256_fmadd_ps(eo.even, eo.even, acc[i]);
        acc[i] = _mm256_fmadd_ps(eo.odd, eo.odd, acc[i]);
        if constexpr (kCopy) {
          float* row = N + i * row_floats + j;
          _mm256_storeu_ps(row, L::load(x[i] + j));
          _mm256_storeu_ps(row + kW, L::load(x[i] + j + kW));
        }
      }
  }
  for (; j < hd; j += kW) {
    const int lanes = hd - j < kW ? int(hd - j) : kW;
    for (int i = 0; i < G; ++i) {
      // zeros past hd: fma(0, 0, s) == s
      const __m256 xv = lanes == kW ? L::load(x[i] + j) : L::load(x[i] + j, lanes);
      acc[i] = _mm256_fmadd_ps(xv, xv, acc[i]);
      if constexpr (kCopy) _mm256_storeu_ps(N + i * row_floats + j, xv);
    }
  }
  for (int i = 0; i < G; ++i) {
    sum_squares[i] = reduce(acc[i]);
    scale[i] = 1.0f / std::sqrt(sum_squares[i] / float(hd) + eps);
  }
}

// Pass 1 for rows [n, n + count) of the tile, count <= kRowGroup.
template <DType D, bool kCopy>
void widen_rows(const ForwardTile& tile, std::int64_t n, int count, std::int64_t hd, float eps,
                float* N, std::int64_t row_floats, float* scale, float* sum_squares) {
  using T = typename Lanes<D>::T;
  const T* x[kRowGroup];
  for (int i = 0; i < count; ++i) x[i] = static_cast<const T*>(tile.x_row(n + i));
  const std::int64_t bytes = hd * std::int64_t(sizeof(T));
  if (bytes <= 1024)
    for (int i = 0; i < count; ++i) {
      const char* next = reinterpret_cast<const char*>(x[i]) + (tile.x_step < 0 ? -4096 : 4096);
      for (std::int64_t b = 0; b < bytes; b += 64) _mm_prefetch(next + b, _MM_HINT_T0);
    }
  if (count == kRowGroup)
    widen_and_scale<D, kRowGroup, kCopy>(x, hd, eps, N, row_floats, scale, sum_squares);
  else
    for (int i = 0; i < count; ++i)
      widen_and_scale<D, 1, kCopy>(x + i, hd, eps, N + i * row_floats, row_floats, scale + i,
                                   sum_squares + i);
}

// r·(xa·c + xb·s) of the contract where it is finite: with kExact one fma (the products are
// exact), else the compensated sum without its guard (where the guard matters it gives NaN, so
// the caller's non-finite test sends the vector to rotated_lanes).
template <bool kExact>
ROME_INLINE __m256 scaled_sum(__m256 xa, __m256 c, __m256 xb, __m256 s, __m256 r) {
  return _mm256_mul_ps(
      kExact ? combine_exact_product(xa, c, xb, s) : combine_unguarded(xa, c, xb, s), r);
}

// The contract for every lane: r·(xa·c + xb·s), and where that is not finite the normalised form
// combine(xa·r, c, xb·r, s).
template <bool kExact>
ROME_INLINE __m256 rotated_lanes(__m256 xa, __m256 c, __m256 xb, __m256 s, __m256 r) {
  const __m256 v =
      _mm256_mul_ps(kExact ? combine_exact_product(xa, c, xb, s) : avx2::combine(xa, c, xb, s), r);
  const __m256 d = _mm256_sub_ps(v, v);  // NaN exactly where v is inf or NaN
  const __m256 not_finite = _mm256_cmp_ps(d, d, _CMP_UNORD_Q);
  return _mm256_blendv_ps(v, avx2::combine(_mm256_mul_ps(xa, r), c, _mm256_mul_ps(xb, r), s),
                          not_finite);
}

// Whether any lane of the sum of the vectors is inf or NaN: it is wherever a lane of one of them
// is (and also where finite lanes overflow or infinities cancel: a redo that is not needed,
// never a wrong result).
ROME_INLINE bool any_not_finite(__m256 sum) {
  const __m256 d = _mm256_sub_ps(sum, sum);
  return !_mm256_testz_ps(_mm256_cmp_ps(d, d, _CMP_UNORD_Q), _mm256_cmp_ps(d, d, _CMP_UNORD_Q));
}

// 16 bf16 values from their even and odd lanes: no NaN lane (fast), or any lane (rounded).
ROME_INLINE void store_bf16_even_odd_not_nan(std::uint16_t* y, __m256 even, __m256 odd) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(y),
                      _mm256_blend_epi16(_mm256_srli_epi32(round_bf16_high_not_nan(even), 16),
                                         round_bf16_high_not_nan(odd), 0xaa));
}
ROME_INLINE void store_bf16_even_odd(std::uint16_t* y, __m256 even, __m256 odd) {
  _mm256_storeu_si256(
      reinterpret_cast<__m256i*>(y),
      _mm256_blend_epi16(_mm256_srli_epi32(round_bf16_high(even), 16), round_bf16_high(odd), 0xaa));
}

// The outputs of half chunks j0 and j1 = j0 + h (their even and odd lanes): f(xa, c, xb, s) of
// each vector's A lanes, folded table entries and B lanes (each chunk is the other's B lanes).
// The fast loop passes scaled_sum, its slow path rotated_lanes: which lanes pair is said once.
struct FourVectors {
  __m256 v0, v1, v2, v3;
};

template <typename F>
ROME_INLINE FourVectors half_chunks(const EvenOdd& lo, const EvenOdd& hi, const float* cw,
                                    const float* sw, std::int64_t j0, std::int64_t j1, F f) {
  return {f(lo.even, _mm256_loadu_ps(cw + j0), hi.even, _mm256_loadu_ps(sw + j0)),
          f(lo.odd, _mm256_loadu_ps(cw + j0 + kW), hi.odd, _mm256_loadu_ps(sw + j0 + kW)),
          f(hi.even, _mm256_loadu_ps(cw + j1), lo.even, _mm256_loadu_ps(sw + j1)),
          f(hi.odd, _mm256_loadu_ps(cw + j1 + kW), lo.odd, _mm256_loadu_ps(sw + j1 + kW))};
}

// The same for one interleave chunk: its even and odd lanes are each other's B lanes.
template <typename F>
ROME_INLINE EvenOdd pair_chunk(const EvenOdd& e, const float* cw, const float* sw, std::int64_t j0,
                               F f) {
  return {f(e.even, _mm256_loadu_ps(cw + j0), e.odd, _mm256_loadu_ps(sw + j0)),
          f(e.odd, _mm256_loadu_ps(cw + j0 + kW), e.even, _mm256_loadu_ps(sw + j0 + kW))};
}

// The slow paths of norm_rows_bf16_even_odd, out of line: everything is read again, so the
// fast loop keeps no vector alive for them (no spills).
template <bool kExact>
[[gnu::noinline]] void half_chunks_lane_by_lane(const std::uint16_t* x, std::uint16_t* y,
                                                const float* cw, const float* sw, std::int64_t j0,
                                                std::int64_t j1, __m256 scale) {
  const FourVectors v = half_chunks(split_bf16(x + j0), split_bf16(x + j1), cw, sw, j0, j1,
                                    [scale](__m256 xa, __m256 c, __m256 xb, __m256 s) {
                                      return rotated_lanes<kExact>(xa, c, xb, s, scale);
                                    });
  store_bf16_even_odd(y + j0, v.v0, v.v1);  // after both chunks are read: in place, y is x
  store_bf16_even_odd(y + j1, v.v2, v.v3);
}

template <bool kExact>
[[gnu::noinline]] void pair_chunk_lane_by_lane(const std::uint16_t* x, std::uint16_t* y,
                                               const float* cw, const float* sw, std::int64_t j0,
                                               __m256 scale) {
  const EvenOdd v =
      pair_chunk(split_bf16(x + j0), cw, sw, j0, [scale](__m256 xa, __m256 c, __m256 xb, __m256 s) {
        return rotated_lanes<kExact>(xa, c, xb, s, scale);
      });
  store_bf16_even_odd(y + j0, v.even, v.odd);
}

// The rotated lanes of one bf16 row, half rotation: chunk j0 and its partner j0 + h together
// (x is split once for both, and in place both are read before either is written). kChecked:
// test each pair of chunks for a non-finite lane.
template <bool kExact, bool kChecked>
ROME_INLINE void half_row_bf16(const std::uint16_t* x, std::uint16_t* y, const float* cw,
                               const float* sw, std::int64_t h, __m256 scale) {
  auto sum = [scale](__m256 xa, __m256 c, __m256 xb, __m256 s) {
    return scaled_sum<kExact>(xa, c, xb, s, scale);
  };
  for (std::int64_t j0 = 0; j0 < h; j0 += 16) {
    const std::int64_t j1 = j0 + h;
    const FourVectors v = half_chunks(split_bf16(x + j0), split_bf16(x + j1), cw, sw, j0, j1, sum);
    if (kChecked &&
        any_not_finite(_mm256_add_ps(_mm256_add_ps(v.v0, v.v1), _mm256_add_ps(v.v2, v.v3)))) {
      half_chunks_lane_by_lane<kExact>(x, y, cw, sw, j0, j1, scale);
    } else {
      store_bf16_even_odd_not_nan(y + j0, v.v0, v.v1);
      store_bf16_even_odd_not_nan(y + j1, v.v2, v.v3);
    }
  }
}

// The same for an interleave rotation.
template <bool kExact, bool kChecked>
ROME_INLINE void pair_row_bf16(const std::uint16_t* x, std::uint16_t* y, const float* cw,
                               const float* sw, std::int64_t rd, __m256 scale) {
  auto sum = [scale](__m256 xa, __m256 c, __m256 xb, __m256 s) {
    return scaled_sum<kExact>(xa, c, xb, s, scale);
  };
  for (std::int64_t j0 = 0; j0 < rd; j0 += 16) {
    const EvenOdd v = pair_chunk(split_bf16(x + j0), cw, sw, j0, sum);
    if (kChecked && any_not_finite(_mm256_add_ps(v.even, v.odd)))
      pair_chunk_lane_by_lane<kExact>(x, y, cw, sw, j0, scale);
    else
      store_bf16_even_odd_not_nan(y + j0, v.even, v.odd);
  }
}

// bf16, half (h a multiple of 16) or interleave, rotary_dim and head_dim multiples of 16. Pass 1
// only sums (no buffer: pass 2 splits x again from L1); the folded tables and w_eo (the weight
// of lanes past rotary_dim) are in even/odd order per chunk. Rows under
// FoldedRow::finite_sum_squares_max skip the non-finite tests (the common case: only rows with inf,
// NaN or huge values pay for them).
template <NormKind K, bool kExact>
[[gnu::noinline]] void norm_rows_bf16_even_odd(const RotationData& r, const ForwardTile& tile,
                                               const NormParams& norm, FoldedRow& folded,
                                               const float* w_eo) {
  using T = std::uint16_t;
  const std::int64_t rd = r.rotary_dim, hd = r.head_dim, h = rd / 2;
  float scales[kRowGroup], sum_squares[kRowGroup];
  for (std::int64_t n0 = 0; n0 < tile.count; n0 += kRowGroup) {
    const int group = int(std::min<std::int64_t>(kRowGroup, tile.count - n0));
    widen_rows<DType::bf16, false>(tile, n0, group, hd, norm.eps, nullptr, 0, scales, sum_squares);
    for (int i = 0; i < group; ++i) {
      const std::int64_t n = n0 + i;
      const T* x = static_cast<const T*>(tile.x_row(n));
      T* y = static_cast<T*>(tile.y_row(n));
      folded.update(r, tile.cos_row(n), tile.sin_row(n), norm.weight);
      const float* cw = folded.cw;
      const float* sw = folded.sw;
      const __m256 scale = _mm256_set1_ps(scales[i]);
      const bool finite = sum_squares[i] <= folded.finite_sum_squares_max && scales[i] <= FLT_MAX;
      if constexpr (K == NormKind::half) {
        if (finite)
          half_row_bf16<kExact, false>(x, y, cw, sw, h, scale);
        else
          half_row_bf16<kExact, true>(x, y, cw, sw, h, scale);
      } else {
        if (finite)
          pair_row_bf16<kExact, false>(x, y, cw, sw, rd, scale);
        else
          pair_row_bf16<kExact, true>(x, y, cw, sw, rd, scale);
      }
      for (std::int64_t j = rd; j < hd; j += 16) {
        const EvenOdd e = split_bf16(x + j);
        store_bf16_even_odd(
            y + j, _mm256_mul_ps(_mm256_mul_ps(e.even, scale), _mm256_loadu_ps(w_eo + j)),
            _mm256_mul_ps(_mm256_mul_ps(e.odd, scale), _mm256_loadu_ps(w_eo + j + kW)));
      }
    }
  }
}

// Half (h = rotary_dim/2 a multiple of 8) or interleave (rotary_dim a multiple of 8) with whole
// vectors: no lane masks.
template <DType D, NormKind K, bool kExact>
void norm_rows_whole(const RotationData& r, const ForwardTile& tile, const NormParams& norm,
                     float* buffer, std::int64_t row_floats, FoldedRow& folded) {
  using L = Lanes<D>;
  using T = typename L::T;
  const std::int64_t rd = r.rotary_dim, hd = r.head_dim, h = rd / 2;
  float scales[kRowGroup], sum_squares[kRowGroup];
  for (std::int64_t n0 = 0; n0 < tile.count; n0 += kRowGroup) {
    const int group = int(std::min<std::int64_t>(kRowGroup, tile.count - n0));
    widen_rows<D, true>(tile, n0, group, hd, norm.eps, buffer, row_floats, scales, sum_squares);
    for (int i = 0; i < group; ++i) {
      const std::int64_t n = n0 + i;
      T* y = static_cast<T*>(tile.y_row(n));
      const float* N = buffer + i * row_floats;
      folded.update(r, tile.cos_row(n), tile.sin_row(n), norm.weight);
      const float* cw = folded.cw;
      const float* sw = folded.sw;
      const __m256 scale = _mm256_set1_ps(scales[i]);
      // As in norm_rows_bf16_even_odd: rows under the bound need no non-finite test.
      const bool checked =
          !(sum_squares[i] <= folded.finite_sum_squares_max && scales[i] <= FLT_MAX);
      for (std::int64_t j0 = 0; j0 < rd; j0 += kW) {
        const __m256 a = _mm256_loadu_ps(N + j0);
        const __m256 b = K == NormKind::interleave
                             ? _mm256_permute_ps(a, 0xb1)
                             : _mm256_loadu_ps(N + (j0 < h ? j0 + h : j0 - h));
        const __m256 c = _mm256_loadu_ps(cw + j0), s = _mm256_loadu_ps(sw + j0);
        __m256 v = scaled_sum<kExact>(a, c, b, s, scale);
        if (checked && __builtin_expect(any_not_finite(v), 0))
          v = rotated_lanes<kExact>(a, c, b, s, scale);
        L::store(y + j0, v);
      }
      for (std::int64_t j = rd; j < hd; j += kW) {
        const int lanes = hd - j < kW ? int(hd - j) : kW;
        const __m256 w = Lanes<DType::f32>::load(norm.weight + j, lanes);
        L::store(y + j, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(N + j), scale), w), lanes);
      }
    }
  }
}

// Any other size or signed permutation: pass 1 vectorised, the rotation lane by lane as the
// scalar kernel does it.
template <DType D>
void norm_rows_lanes(const RotationData& r, const ForwardTile& tile, const NormParams& norm,
                     float* N, FoldedRow& folded) {
  using T = typename Lanes<D>::T;
  for (std::int64_t n = 0; n < tile.count; ++n) {
    const T* x = static_cast<const T*>(tile.x_row(n));
    folded.update(r, tile.cos_row(n), tile.sin_row(n), norm.weight);
    float scale, sum_squares;
    widen_and_scale<D, 1, true>(&x, r.head_dim, norm.eps, N, 0, &scale, &sum_squares);
    store_norm_row_lanes<D>(r, N, scale, folded.cw, folded.sw, norm,
                            static_cast<T*>(tile.y_row(n)));
  }
}

template <DType D>
void norm_rows(const RotationData& r, const ForwardTile& tile, const NormParams& norm) {
  const std::int64_t rd = r.rotary_dim, hd = r.head_dim;
  const std::int64_t row_floats = (hd + kW - 1) / kW * kW;
  // The rows of pass 1, the weights in even/odd order (hd), the folded row (cw, sw).
  thread_local std::vector<float> buffer;
  const std::size_t need = std::size_t(kRowGroup * row_floats + hd + 2 * rd);
  if (buffer.size() < need) buffer.assign(need, 0.0f);
  float* w_eo = buffer.data() + kRowGroup * row_floats;
  const NormKind kind = classify_norm(r);
  const bool even_odd = bf16_even_odd(r, kind, D);
  if (even_odd) to_even_odd(norm.weight, hd, w_eo);
  FoldedRow folded(w_eo + hd, even_odd ? w_eo : norm.weight, r, kind, even_odd);
  // Only bf16 x has exact products (NormParams::exact_products).
  const bool exact = D == DType::bf16 && norm.exact_products;
  using Half = std::integral_constant<NormKind, NormKind::half>;
  using Pairs = std::integral_constant<NormKind, NormKind::interleave>;
  if (even_odd) {
    auto run = [&](auto kind_tag, auto exact_tag) {
      norm_rows_bf16_even_odd<decltype(kind_tag)::value, decltype(exact_tag)::value>(r, tile, norm,
                                                                                     folded, w_eo);
    };
    if (kind == NormKind::half)
      exact ? run(Half{}, std::true_type{}) : run(Half{}, std::false_type{});
    else
      exact ? run(Pairs{}, std::true_type{}) : run(Pairs{}, std::false_type{});
  } else if (folded.vector_fold) {
    auto run = [&](auto kind_tag, auto exact_tag) {
      norm_rows_whole<D, decltype(kind_tag)::value, decltype(exact_tag)::value>(
          r, tile, norm, buffer.data(), row_floats, folded);
    };
    if (kind == NormKind::half)
      exact ? run(Half{}, std::true_type{}) : run(Half{}, std::false_type{});
    else
      exact ? run(Pairs{}, std::true_type{}) : run(Pairs{}, std::false_type{});
  } else {
    norm_rows_lanes<D>(r, tile, norm, buffer.data(), folded);
  }
}

}  // namespace

TableLayout avx2_norm_table_layout(const RotationData& r, DType dtype) {
  return bf16_even_odd(r, classify_norm(r), dtype) ? TableLayout::even_odd_16
                                                   : TableLayout::natural;
}

void avx2_forward_norm_permute(const RotationData& r, const ForwardTile& tile,
                               const NormParams& norm) {
  switch (tile.dtype) {
    case DType::f32: return norm_rows<DType::f32>(r, tile, norm);
    case DType::f16: return norm_rows<DType::f16>(r, tile, norm);
    case DType::bf16: return norm_rows<DType::bf16>(r, tile, norm);
    default: return scalar_kernels().forward_norm_permute(r, tile, norm);
  }
}

}  // namespace rome::kernels
