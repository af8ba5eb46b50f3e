// AVX-512 QK-norm + rotation (NormForwardFn): common/norm_rope-inl.hpp over 16-lane traits, table
// rows in natural order. Pass 1 sums two bf16 or f16 rows per vector (lanes 0-7 one row's 8 partial
// sums, 8-15 the other's): a 16-lane accumulator of one row would sum in another order. f32 rows
// take AVX2's one row per 8-lane accumulator (Avx512NormOneRow): that order took 0.8x the time of
// the pairs on f32 rows at T = 4096 but 1.2x on bf16 rows at T = 512, so f32 only (measured with
// 4 rows per group; AVX2 now sums 8, not yet timed on AVX-512). bf16 rows are
// narrowed by integer rounding, or in the table of a CPU with AVX512-BF16 by vcvtne2ps2bf16, two
// vectors at a time where a row's steps allow, else vcvtneps2bf16 (avx512_lanes.hpp's
// NarrowBf16Insn; NaturalOrder::store_finite_pairs).
#include <cstdint>
#include <type_traits>

#include "../common/norm_rope-inl.hpp"
#include "../common/norm_rows_8lane-inl.hpp"
#include "../kernel_api.hpp"
#include "avx512_lanes.hpp"

namespace rome::kernels {
namespace {

using detail::RotationData;
using namespace avx512;
using namespace norm_rope;

// Pass 1 of f32 rows (see the top of the file): two rows per 16-lane vector cost each f32 load a
// vinsertf32x8.
struct Avx512NormOneRow : OneRowPer8Lanes {
  template <DType D>
  static ROME_INLINE F load_rows(const float* const* x, std::int64_t j, std::int64_t n) {
    static_assert(D == DType::f32);
    return _mm256_maskz_loadu_ps(n >= 8 ? __mmask8(0xff) : __mmask8((1u << n) - 1), x[0] + j);
  }
};
static_assert(kGroupRows<Avx512NormOneRow> == 8, "inverse_rms takes 8 rows");

struct Avx512Norm {
  using F = __m512;
  using Count = __mmask16;
  static constexpr int kLanes = kW;
  static constexpr int kRowsPerVector = 2;
  static constexpr int kAccumulators = 4;
  template <DType D>
  using SumSquares = std::conditional_t<D == DType::f32, Avx512NormOneRow, Avx512Norm>;

  static ROME_INLINE Count lanes(std::int64_t n) { return first_lanes(n); }
  static ROME_INLINE F loadu(const float* p) { return _mm512_loadu_ps(p); }
  static ROME_INLINE F load_floats(const float* p, Count m) { return _mm512_maskz_loadu_ps(m, p); }
  static ROME_INLINE void storeu(float* p, F v) { _mm512_storeu_ps(p, v); }
  static ROME_INLINE F set1(float v) { return _mm512_set1_ps(v); }
  static ROME_INLINE F add(F a, F b) { return _mm512_add_ps(a, b); }
  static ROME_INLINE F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static ROME_INLINE F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static ROME_INLINE F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static ROME_INLINE F max(F a, F b) { return _mm512_max_ps(a, b); }
  static ROME_INLINE F abs(F v) { return _mm512_abs_ps(v); }
  static ROME_INLINE bool any_not_finite(F v) {
    return _mm512_fpclass_ps_mask(v, 0x99) != 0;  // QNaN, SNaN, +inf, -inf
  }
  static ROME_INLINE float reduce_max(F v) { return _mm512_reduce_max_ps(v); }
  static ROME_INLINE F swap_pairs(F v) { return _mm512_permute_ps(v, 0xb1); }
  static ROME_INLINE F combine_unguarded(F xa, F c, F xb, F s) {
    return avx512::combine_unguarded(xa, c, xb, s);
  }
  static ROME_INLINE F combine_one_fma(F xa, F c, F xb, F s) {
    return avx512::combine_one_fma(xa, c, xb, s);
  }

  // Lanes [j, j + n) of two 16-bit rows (n <= 8; zeros past n), the first row's in lanes 0-7
  // (f32 rows sum in Avx512NormOneRow).
  template <DType D>
  static ROME_INLINE F load_rows(const Storage<D>* const* x, std::int64_t j, std::int64_t n) {
    static_assert(D != DType::f32);
    const __mmask8 m = n >= 8 ? __mmask8(0xff) : __mmask8((1u << n) - 1);
    const __m128i lo = _mm_maskz_loadu_epi16(m, x[0] + j);
    const __m128i hi = _mm_maskz_loadu_epi16(m, x[1] + j);
    const __m256i both = _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1);
    if constexpr (D == DType::f16) return _mm512_cvtph_ps(both);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(both), 16));
  }
  // One 16-lane chunk of two rows: even lanes by a shift, odd lanes by a mask, no shuffle.
  struct EvenOdd {
    F even, odd;
  };
  static ROME_INLINE EvenOdd split_rows_bf16(const std::uint16_t* const* x, std::int64_t j) {
    const __m512i w = _mm512_inserti64x4(
        _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[0] + j))),
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[1] + j)), 1);
    return {_mm512_castsi512_ps(_mm512_slli_epi32(w, 16)),
            _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(int(0xffff0000u))))};
  }
  template <int A>
  static ROME_INLINE void reduce_rows(const F* acc, float* ss) {
    for (int a = 0; a < A; ++a) {
      const __m512 u =
          _mm512_add_ps(acc[a], _mm512_shuffle_f32x4(acc[a], acc[a], _MM_SHUFFLE(2, 3, 0, 1)));
      const __m512 v = _mm512_add_ps(u, _mm512_permute_ps(u, _MM_SHUFFLE(1, 0, 3, 2)));
      const __m512 t = _mm512_add_ps(v, _mm512_permute_ps(v, _MM_SHUFFLE(2, 3, 0, 1)));
      ss[2 * a] = _mm512_cvtss_f32(t);
      ss[2 * a + 1] = _mm256_cvtss_f32(_mm512_extractf32x8_ps(t, 1));
    }
  }
  // 1 / sqrt(ss / hd + eps) of the group's 8 rows (the first `rows` of them used), the scalar
  // kernel's operations lane by lane.
  static ROME_INLINE void inverse_rms(const float* ss, int /*rows*/, std::int64_t hd, float eps,
                                      float* scale) {
    _mm256_storeu_ps(
        scale, _mm256_div_ps(_mm256_set1_ps(1.0f),
                             _mm256_sqrt_ps(_mm256_add_ps(
                                 _mm256_div_ps(_mm256_loadu_ps(ss), _mm256_set1_ps(float(hd))),
                                 _mm256_set1_ps(eps)))));
  }
  static ROME_INLINE void prefetch(const char* p) { _mm_prefetch(p, _MM_HINT_T0); }
  static ROME_INLINE void prefetch_to_l2(const char* p) { _mm_prefetch(p, _MM_HINT_T1); }
};
static_assert(kGroupRows<Avx512Norm> == 8, "inverse_rms takes 8 rows");

}  // namespace

void avx512_forward_norm_permute(const RotationData& r, const ForwardTile& tile,
                                 const NormParams& norm) {
  switch (tile.dtype) {
    case DType::f32:
      return forward_norm<Avx512Norm, DType::f32, Lanes<DType::f32, NarrowExact>>(r, tile, norm);
    case DType::f16:
      return forward_norm<Avx512Norm, DType::f16, Lanes<DType::f16, NarrowExact>>(r, tile, norm);
    case DType::bf16:
      return forward_norm<Avx512Norm, DType::bf16, Lanes<DType::bf16, NarrowExact>>(r, tile, norm);
    default: return scalar_kernels().forward_norm_permute(r, tile, norm);
  }
}

void avx512_bf16_forward_norm_permute(const RotationData& r, const ForwardTile& tile,
                                      const NormParams& norm) {
  if (tile.dtype != DType::bf16) return avx512_forward_norm_permute(r, tile, norm);
  forward_norm<Avx512Norm, DType::bf16, Lanes<DType::bf16, NarrowBf16Insn>>(r, tile, norm);
}

}  // namespace rome::kernels
