// AVX-512 QK-norm + rotation (NormForwardFn). Bit-identical to the scalar kernel: the same
// operations in the same order, so every row's sum of squares follows the contract's 8 partial
// sums, not 16.
//
// Pass 1 takes the sums of squares of two rows per vector (lanes 0-7 one row's 8 partial sums,
// 8-15 the other's), four pairs at a time so their fma chains overlap: a 16-lane accumulator of
// one row would sum in another order. bf16 splits each 16-lane chunk into its even lanes (shift)
// and odd lanes (mask), the contract's order, without a shuffle. It also asks for the rows 4 KiB
// ahead: one core waits on memory with the hardware prefetchers alone (BENCHMARKS.md).
// Pass 2 widens each row again from L1 in natural lane order (the table rows stay natural: no
// even/odd layout) and forms r·(x_a·C' + x_b·S') with the weight folded into the table row, once
// per table row. Rows that could produce inf or NaN (FoldedRow::finite_sum_squares_max) and
// rotations other than half / interleave of whole vectors take the contract's lane loop
// (store_norm_row_lanes), which is the scalar kernel's code.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <vector>

#include "../../core/convert.hpp"
#include "../common/combine-inl.hpp"
#include "../common/norm_fold-inl.hpp"
#include "../kernel_api.hpp"
#include "avx512_lanes.hpp"

namespace rome::kernels {
namespace {

using detail::RotationData;
using namespace avx512;

ROME_INLINE float horizontal_max(__m512 v) {
  return _mm512_reduce_max_ps(v);
}

// The table row of a tile row with the weight folded in (fold_norm_weight), refolded only when
// the row changes (the fused executor hands one row to every head of a token).
struct FoldedRow {
  const float* cos = nullptr;
  const float* sin = nullptr;
  float* cw;
  float* sw;
  NormKind kind;
  bool vector_fold;
  std::int64_t head_dim;
  // Rows whose sum of squares is at most this (and whose scale is finite) take the vector loop,
  // which has no inf/NaN test (finite_sum_squares_bound).
  float finite_sum_squares_max = -1;

  FoldedRow(float* cw_sw, const RotationData& r, NormKind k)
      : cw(cw_sw),
        sw(cw_sw + r.rotary_dim),
        kind(k),
        vector_fold(whole_vector_rows(r, k, kW)),
        head_dim(r.head_dim) {}

  ROME_INLINE void update(const RotationData& r, const float* c, const float* s,
                          const float* weight) {
    if (c != cos || s != sin) refold(r, c, s, weight);
  }

  [[gnu::noinline]] void refold(const RotationData& r, const float* c, const float* s,
                                const float* w) {
    const std::int64_t rd = r.rotary_dim, h = rd / 2;
    double m;
    if (vector_fold) {
      __m512 most_c = _mm512_setzero_ps(), most_s = _mm512_setzero_ps();
      __mmask16 nan = 0;
      // The same single products as fold_norm_weight, 16 lanes at a time.
      auto fold = [&](std::int64_t j, __m512 wa, __m512 wb) {
        const __m512 fc = _mm512_mul_ps(_mm512_loadu_ps(c + j), wa);
        const __m512 fs = _mm512_mul_ps(_mm512_loadu_ps(s + j), wb);
        _mm512_storeu_ps(cw + j, fc);
        _mm512_storeu_ps(sw + j, fs);
        most_c = _mm512_max_ps(most_c, _mm512_abs_ps(fc));
        most_s = _mm512_max_ps(most_s, _mm512_abs_ps(fs));
        nan |= _mm512_cmp_ps_mask(fc, fs, _CMP_UNORD_Q);
      };
      if (kind == NormKind::half) {
        for (std::int64_t j = 0; j < h; j += kW)
          fold(j, _mm512_loadu_ps(w + j), _mm512_loadu_ps(w + j + h));
        for (std::int64_t j = h; j < rd; j += kW)
          fold(j, _mm512_loadu_ps(w + j), _mm512_loadu_ps(w + j - h));
      } else {
        for (std::int64_t j = 0; j < rd; j += kW) {
          const __m512 wa = _mm512_loadu_ps(w + j);
          fold(j, wa, _mm512_permute_ps(wa, 0xb1));
        }
      }
      // The unordered mask catches NaNs (max_ps may drop them): they make m infinite.
      m = nan ? INFINITY : double(horizontal_max(most_c)) + double(horizontal_max(most_s));
    } else {  // the lane loop's rotations: every row takes it, no bound needed
      fold_norm_weight(r, c, s, w, cw, sw);
      m = INFINITY;
    }
    finite_sum_squares_max = finite_sum_squares_bound(m, head_dim);
    cos = c;
    sin = s;
  }
};

// ((s0+s4)+(s2+s6)) + ((s1+s5)+(s3+s7)) of each row's 8 partial sums: lanes 0-7 and 8-15.
ROME_INLINE void reduce_pair(__m512 acc, float* first, float* second) {
  const __m512 u = _mm512_add_ps(acc, _mm512_shuffle_f32x4(acc, acc, _MM_SHUFFLE(2, 3, 0, 1)));
  const __m512 v = _mm512_add_ps(u, _mm512_permute_ps(u, _MM_SHUFFLE(1, 0, 3, 2)));
  const __m512 t = _mm512_add_ps(v, _mm512_permute_ps(v, _MM_SHUFFLE(2, 3, 0, 1)));
  *first = _mm512_cvtss_f32(t);
  *second = _mm256_cvtss_f32(_mm512_extractf32x8_ps(t, 1));
}

// Lanes [j, j + n) of two rows (n <= 8; zeros past n: fma(0, 0, s) == s), a's in lanes 0-7.
template <DType D>
ROME_INLINE __m512 load_pair(const void* a, const void* b, std::int64_t j, std::int64_t n) {
  const __mmask8 m = n >= 8 ? __mmask8(0xff) : __mmask8((1u << n) - 1);
  if constexpr (D == DType::f32) {
    const __m256 lo = _mm256_maskz_loadu_ps(m, static_cast<const float*>(a) + j);
    const __m256 hi = _mm256_maskz_loadu_ps(m, static_cast<const float*>(b) + j);
    return _mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1);
  } else {
    const __m128i lo = _mm_maskz_loadu_epi16(m, static_cast<const std::uint16_t*>(a) + j);
    const __m128i hi = _mm_maskz_loadu_epi16(m, static_cast<const std::uint16_t*>(b) + j);
    const __m256i both = _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1);
    if constexpr (D == DType::f16) return _mm512_cvtph_ps(both);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(both), 16));
  }
}

constexpr int kPairsPerGroup = 4;

// Sums of squares of P row pairs (rows x[2p], x[2p + 1]) in the contract's order.
template <DType D, int P>
ROME_INLINE void sum_squares_pairs(const void* const* x, std::int64_t hd, float* ss) {
  __m512 acc[P];
  for (int p = 0; p < P; ++p) acc[p] = _mm512_setzero_ps();
  std::int64_t j = 0;
  if constexpr (D == DType::bf16) {
    // Per 16-lane chunk: even lanes 2k into partial k, then odd lanes.
    const __m512i odd_bits = _mm512_set1_epi32(int(0xffff0000u));
    for (; j + 16 <= hd; j += 16)
#pragma GCC unroll 4
      for (int p = 0; p < P; ++p) {
        const auto* a = static_cast<const std::uint16_t*>(x[2 * p]) + j;
        const auto* b = static_cast<const std::uint16_t*>(x[2 * p + 1]) + j;
        const __m512i w = _mm512_inserti64x4(
            _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a))),
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)), 1);
        const __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
        const __m512 odd = _mm512_castsi512_ps(_mm512_and_si512(w, odd_bits));
        acc[p] = _mm512_fmadd_ps(even, even, acc[p]);
        acc[p] = _mm512_fmadd_ps(odd, odd, acc[p]);
      }
  }
  for (; j < hd; j += 8)
#pragma GCC unroll 4
    for (int p = 0; p < P; ++p) {
      const __m512 v = load_pair<D>(x[2 * p], x[2 * p + 1], j, hd - j);
      acc[p] = _mm512_fmadd_ps(v, v, acc[p]);
    }
  for (int p = 0; p < P; ++p) reduce_pair(acc[p], ss + 2 * p, ss + 2 * p + 1);
}

// Pass 1 for rows [n, n + count) of the tile (count <= 2 · kPairsPerGroup); an odd last row is
// paired with itself.
template <DType D>
void sum_squares_rows(const ForwardTile& tile, std::int64_t n, int count, std::int64_t hd,
                      float* ss) {
  const void* x[2 * kPairsPerGroup];
  for (int i = 0; i < count; ++i) x[i] = tile.x_row(n + i);
  const std::int64_t bytes = hd * dtype_size(D);
  if (bytes <= 1024)
    for (int i = 0; i < count; ++i) {
      const char* next = static_cast<const char*>(x[i]) + (tile.x_step < 0 ? -4096 : 4096);
      for (std::int64_t b = 0; b < bytes; b += 64) _mm_prefetch(next + b, _MM_HINT_T0);
    }
  if (count == 2 * kPairsPerGroup) return sum_squares_pairs<D, kPairsPerGroup>(x, hd, ss);
  float pair[2];
  for (int i = 0; i < count; i += 2) {
    const void* two[2] = {x[i], x[i + 1 < count ? i + 1 : i]};
    sum_squares_pairs<D, 1>(two, hd, pair);
    ss[i] = pair[0];
    if (i + 1 < count) ss[i + 1] = pair[1];
  }
}

// r·(xa·c + xb·s) where it is finite: combine_lane(_exact_product) without combine_lane's guard
// for a non-finite xa·c (rows that get here have none), then scaled once.
template <bool kExact>
ROME_INLINE __m512 scaled_sum(__m512 xa, __m512 c, __m512 xb, __m512 s, __m512 r) {
  const __m512 p = _mm512_mul_ps(xa, c);
  const __m512 sum = kExact ? _mm512_fmadd_ps(xb, s, p)
                            : _mm512_add_ps(_mm512_fmadd_ps(xb, s, p), _mm512_fmsub_ps(xa, c, p));
  return _mm512_mul_ps(sum, r);
}

// One row of a half or interleave rotation of whole vectors, rows under the finite bound.
template <typename L, NormKind K, bool kExact>
ROME_INLINE void rotate_row(const typename L::T* x, typename L::T* y, const float* cw,
                            const float* sw, const float* weight, std::int64_t rd, std::int64_t hd,
                            __m512 r) {
  if constexpr (K == NormKind::half) {
    const std::int64_t h = rd / 2;
    for (std::int64_t j0 = 0; j0 < h; j0 += kW) {
      const std::int64_t j1 = j0 + h;
      const __m512 a = L::load(x + j0), b = L::load(x + j1);  // both read before either is written
      const __m512 v0 =
          scaled_sum<kExact>(a, _mm512_load_ps(cw + j0), b, _mm512_load_ps(sw + j0), r);
      const __m512 v1 =
          scaled_sum<kExact>(b, _mm512_load_ps(cw + j1), a, _mm512_load_ps(sw + j1), r);
      L::store(y + j0, v0);
      L::store(y + j1, v1);
    }
  } else {
    for (std::int64_t j = 0; j < rd; j += kW) {
      const __m512 a = L::load(x + j);
      L::store(y + j, scaled_sum<kExact>(a, _mm512_load_ps(cw + j), _mm512_permute_ps(a, 0xb1),
                                         _mm512_load_ps(sw + j), r));
    }
  }
  for (std::int64_t j = rd; j < hd; j += kW) {  // (x·r)·w
    const __mmask16 m = first_lanes(hd - j);
    const __m512 w = _mm512_maskz_loadu_ps(m, weight + j);
    L::store(y + j, _mm512_mul_ps(_mm512_mul_ps(L::load(x + j, m), r), w), m);
  }
}

// Row n in fp32, natural order, for the lane loop.
template <typename L>
ROME_INLINE void widen_row(const typename L::T* x, std::int64_t hd, float* out) {
  for (std::int64_t j = 0; j < hd; j += kW) {
    const __mmask16 m = first_lanes(hd - j);
    _mm512_mask_storeu_ps(out + j, m, L::load(x + j, m));
  }
}

template <DType D, typename N, NormKind K, bool kExact>
void norm_rows(const RotationData& r, const ForwardTile& tile, const NormParams& norm,
               FoldedRow& folded, float* row) {
  using L = Lanes<D, N>;
  using T = typename L::T;
  const std::int64_t rd = r.rotary_dim, hd = r.head_dim;
  constexpr int kGroup = 2 * kPairsPerGroup;
  static_assert(kGroup == 8, "one 8-lane vector of scales per group");
  float ss[kGroup] = {}, scales[kGroup];
  for (std::int64_t n0 = 0; n0 < tile.count; n0 += kGroup) {
    const int group = int(std::min<std::int64_t>(kGroup, tile.count - n0));
    sum_squares_rows<D>(tile, n0, group, hd, ss);
    // 1 / sqrt(ss / hd + eps) of the group at once (lane by lane the scalar kernel's operations):
    // one row's divide-root-divide chain would hold up its rotation.
    _mm256_storeu_ps(
        scales, _mm256_div_ps(_mm256_set1_ps(1.0f),
                              _mm256_sqrt_ps(_mm256_add_ps(
                                  _mm256_div_ps(_mm256_loadu_ps(ss), _mm256_set1_ps(float(hd))),
                                  _mm256_set1_ps(norm.eps)))));
    for (int i = 0; i < group; ++i) {
      const std::int64_t n = n0 + i;
      const T* x = static_cast<const T*>(tile.x_row(n));
      T* y = static_cast<T*>(tile.y_row(n));
      folded.update(r, tile.cos_row(n), tile.sin_row(n), norm.weight);
      const float scale = scales[i];
      if (K != NormKind::other && ss[i] <= folded.finite_sum_squares_max && scale <= FLT_MAX) {
        rotate_row<L, K, kExact>(x, y, folded.cw, folded.sw, norm.weight, rd, hd,
                                 _mm512_set1_ps(scale));
      } else {
        widen_row<L>(x, hd, row);
        store_norm_row_lanes<D>(r, row, scale, folded.cw, folded.sw, norm, y);
      }
    }
  }
}

template <DType D, typename N>
void norm_rows_any(const RotationData& r, const ForwardTile& tile, const NormParams& norm) {
  const std::int64_t rd = r.rotary_dim, hd = r.head_dim;
  // The widened row of the lane loop, then the folded table row (cw, sw: 64-byte aligned where
  // the vector loop reads them, rotary_dim being a multiple of 16 there), plus alignment slack.
  thread_local std::vector<float> buffer;
  const std::int64_t row_floats = (hd + kW - 1) / kW * kW;
  const std::size_t need = std::size_t(row_floats + 2 * rd + kW);
  if (buffer.size() < need) buffer.assign(need, 0.0f);
  float* row = reinterpret_cast<float*>((reinterpret_cast<std::uintptr_t>(buffer.data()) + 63) &
                                        ~std::uintptr_t(63));
  float* cw_sw = row + row_floats;
  const NormKind kind = classify_norm(r);
  FoldedRow folded(cw_sw, r, kind);
  // Only bf16 x has exact products (NormParams::exact_products).
  const bool exact = D == DType::bf16 && norm.exact_products;
  if (!whole_vector_rows(r, kind, kW))
    return norm_rows<D, N, NormKind::other, false>(r, tile, norm, folded, row);
  if (kind == NormKind::half)
    return exact ? norm_rows<D, N, NormKind::half, true>(r, tile, norm, folded, row)
                 : norm_rows<D, N, NormKind::half, false>(r, tile, norm, folded, row);
  return exact ? norm_rows<D, N, NormKind::interleave, true>(r, tile, norm, folded, row)
               : norm_rows<D, N, NormKind::interleave, false>(r, tile, norm, folded, row);
}

}  // namespace

void avx512_forward_norm_permute(const RotationData& r, const ForwardTile& tile,
                                 const NormParams& norm) {
  switch (tile.dtype) {
    case DType::f32: return norm_rows_any<DType::f32, NarrowExact>(r, tile, norm);
    case DType::f16: return norm_rows_any<DType::f16, NarrowExact>(r, tile, norm);
    case DType::bf16: return norm_rows_any<DType::bf16, NarrowExact>(r, tile, norm);
    default: return scalar_kernels().forward_norm_permute(r, tile, norm);
  }
}

// bf16 rows narrowed by vcvtneps2bf16 (avx512_lanes.hpp's NarrowBf16Insn).
void avx512_bf16_forward_norm_permute(const RotationData& r, const ForwardTile& tile,
                                      const NormParams& norm) {
  if (tile.dtype != DType::bf16) return avx512_forward_norm_permute(r, tile, norm);
  norm_rows_any<DType::bf16, NarrowBf16Insn>(r, tile, norm);
}

}  // namespace rome::kernels
