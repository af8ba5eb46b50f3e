// AVX2 + FMA QK-norm + rotation (NormForwardFn): common/norm_rope-inl.hpp over 8-lane traits,
// one row per pass-1 accumulator. bf16 rows whose halves (or pairs) are whole 16-lane chunks go
// 16 lanes at a time split into their even and odd lanes, with table rows in even_odd_16 order,
// as the RoPE kernel's bf16 path does: no vpmovzx to widen, no pack and lane-crossing shuffle to
// narrow (natural order measured 1.2-1.5x slower on such rows, T = 512 and 4096, 1 thread).
#include <algorithm>
#include <cstdint>

#include "../common/norm_rope-inl.hpp"
#include "../common/norm_rows_8lane-inl.hpp"
#include "../kernel_api.hpp"
#include "avx2_lanes.hpp"

namespace rome::kernels {
namespace {

using detail::RotationData;
using namespace avx2;
using namespace norm_rope;

struct Bf16EvenOdd;

struct Avx2Norm : OneRowPer8Lanes {
  using Count = int;
  using Bf16Order = Bf16EvenOdd;
  static constexpr int kLanes = kW;

  static ROME_INLINE Count lanes(std::int64_t n) { return n < kW ? int(n) : kW; }
  static ROME_INLINE F loadu(const float* p) { return _mm256_loadu_ps(p); }
  static ROME_INLINE F load_floats(const float* p, Count n) {
    return Lanes<DType::f32>::load(p, n);
  }
  static ROME_INLINE void storeu(float* p, F v) { _mm256_storeu_ps(p, v); }
  static ROME_INLINE F add(F a, F b) { return _mm256_add_ps(a, b); }
  static ROME_INLINE F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static ROME_INLINE F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static ROME_INLINE F max(F a, F b) { return _mm256_max_ps(a, b); }
  static ROME_INLINE F abs(F v) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), v); }
  static ROME_INLINE bool any_not_finite(F v) {
    const __m256 d = _mm256_sub_ps(v, v);  // NaN exactly where v is inf or NaN
    const __m256 nan = _mm256_cmp_ps(d, d, _CMP_UNORD_Q);
    return !_mm256_testz_ps(nan, nan);
  }
  static float reduce_max(F v) {
    float lanes[kW];
    _mm256_storeu_ps(lanes, v);
    float m = 0;
    for (float l : lanes) m = std::max(m, l);
    return m;
  }
  static ROME_INLINE F swap_pairs(F v) { return _mm256_permute_ps(v, 0xb1); }
  static ROME_INLINE F combine_unguarded(F xa, F c, F xb, F s) {
    return avx2::combine_unguarded(xa, c, xb, s);
  }
  static ROME_INLINE F combine_one_fma(F xa, F c, F xb, F s) {
    return avx2::combine_one_fma(xa, c, xb, s);
  }

  template <DType D>
  static ROME_INLINE F load_rows(const typename Lanes<D>::T* const* x, std::int64_t j,
                                 std::int64_t n) {
    return Lanes<D>::load(x[0] + j, lanes(n));
  }
  static ROME_INLINE EvenOdd split_rows_bf16(const std::uint16_t* const* x, std::int64_t j) {
    return split_bf16(x[0] + j);
  }
};
// bf16 rows, 16 lanes a chunk: its 8 even lanes, then its 8 odd ones.
struct Bf16EvenOdd {
  using T = std::uint16_t;
  using Chunk = Vectors<Avx2Norm, 2>;
  static constexpr int kVectors = 2;
  static constexpr int kLanes = 16;
  static constexpr bool kNaturalTables = false;
  static constexpr TableLayout kLayout = TableLayout::even_odd_16;

  // head_dim too, so that the lanes past rotary_dim are whole chunks.
  static bool takes(const RotationData& r, NormKind kind) {
    return r.head_dim % 16 == 0 && whole_chunk_rows(r, kind, 16);
  }
  static ROME_INLINE Chunk load(const T* x) {
    const EvenOdd e = split_bf16(x);
    return {{e.even, e.odd}};
  }
  static ROME_INLINE Chunk load(const T* x, std::int64_t) { return load(x); }
  static ROME_INLINE Chunk load_weights(const float* w, std::int64_t) {
    return {{_mm256_loadu_ps(w), _mm256_loadu_ps(w + kW)}};
  }
  static ROME_INLINE void store_finite(T* y, const Chunk& c) {
    _mm256_storeu_si256(
        reinterpret_cast<__m256i*>(y),
        merge_bf16_even_odd(round_bf16_high_not_nan(c.v[0]), round_bf16_high_not_nan(c.v[1])));
  }
  static ROME_INLINE void store(T* y, const Chunk& c, std::int64_t) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y),
                        merge_bf16_even_odd(round_bf16_high(c.v[0]), round_bf16_high(c.v[1])));
  }
  // A lane's pair partner is in the other half of its chunk.
  static ROME_INLINE Chunk swap_pairs(const Chunk& c) { return {{c.v[1], c.v[0]}}; }

  static const float* weights_in_table_order(const float* w, std::int64_t hd, float* out) {
    for (std::int64_t j = 0; j < hd; j += 16) {
      const EvenOdd e = split_even_odd(_mm256_loadu_ps(w + j), _mm256_loadu_ps(w + j + kW));
      _mm256_storeu_ps(out + j, e.even);
      _mm256_storeu_ps(out + j + kW, e.odd);
    }
    return out;
  }
  // For the lane loop (rare rows: no need to be fast).
  static void to_natural(const float* in, std::int64_t n, float* out) {
    for (std::int64_t j = 0; j < n; j += 16)
      for (int k = 0; k < kW; ++k) {
        out[j + 2 * k] = in[j + k];
        out[j + 2 * k + 1] = in[j + kW + k];
      }
  }
};

static_assert(kGroupRows<Avx2Norm> == 8, "inverse_rms takes 8 rows");

}  // namespace

TableLayout avx2_norm_table_layout(const RotationData& r, DType dtype) {
  return norm_table_layout<Avx2Norm>(r, dtype);
}

void avx2_forward_norm_permute(const RotationData& r, const ForwardTile& tile,
                               const NormParams& norm) {
  switch (tile.dtype) {
    case DType::f32: return forward_norm<Avx2Norm, DType::f32, Lanes<DType::f32>>(r, tile, norm);
    case DType::f16: return forward_norm<Avx2Norm, DType::f16, Lanes<DType::f16>>(r, tile, norm);
    case DType::bf16: return forward_norm<Avx2Norm, DType::bf16, Lanes<DType::bf16>>(r, tile, norm);
    default: return scalar_kernels().forward_norm_permute(r, tile, norm);
  }
}

}  // namespace rome::kernels
