// AVX2 + FMA QK-norm + rotation (NormForwardFn): each row is widened into an fp32 buffer while
// its sum of squares accumulates (8-lane fma accumulators in the contract's order; rows go four
// at a time so their fma chains and square roots overlap), then rotated from the buffer times
// 1/rms with the weight folded into the table row (once per row of tables, shared by every head
// of a token). bf16 rows whose halves (or pairs) are whole 16-lane chunks go 16 lanes at a time
// on even/odd splits, as the RoPE kernel's bf16 path does (unguarded epilogue, exact redo of a
// chunk with a NaN); half rotations whose half is whole vectors and interleave rotations of whole
// vectors run on 8-lane vectors; other sizes and signed permutations take the scalar kernel's
// lane loop on the same buffer. Bit-identical to the scalar kernel: same operations, same order,
// same epilogue (avx2::combine).
#include <algorithm>
#include <cmath>
#include <cstdint>
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

enum class NormKind { half, interleave, other };

// Classified once per rotation per thread (kernels keep no other state).
NormKind classify(const RotationData& r) {
  thread_local const RotationData* last = nullptr;
  thread_local std::uint64_t last_uid = 0;
  thread_local NormKind kind = NormKind::other;
  if (last == &r && last_uid == r.uid) return kind;
  const std::int64_t rd = r.rotary_dim, h = rd / 2;
  bool half = r.a_identity && rd % 2 == 0, pairs = r.a_identity && rd % 2 == 0;
  for (std::int64_t j = 0; j < rd && (half || pairs); ++j) {
    const bool has = r.b.sign[j] != 0;
    half = half && has && r.b.src[j] == (j < h ? j + h : j - h);
    pairs = pairs && has && r.b.src[j] == (j ^ 1);
  }
  kind = half ? NormKind::half : pairs ? NormKind::interleave : NormKind::other;
  last = &r;
  last_uid = r.uid;
  return kind;
}

// ((s0+s4)+(s2+s6)) + ((s1+s5)+(s3+s7)) of the 8 partial sums.
ROME_INLINE float reduce(__m256 acc) {
  const __m128 t = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  const __m128 u = _mm_add_ps(t, _mm_movehl_ps(t, t));
  return _mm_cvtss_f32(_mm_add_ss(u, _mm_shuffle_ps(u, u, 1)));
}

// The table row of the tile's row n with the weight folded in (fold_norm_weight): refolded only
// when the row changes (the fused executor hands one row to every head of a token). Half (h a
// multiple of 8) and interleave rotations fold 8 lanes at a time: the same products as
// fold_norm_weight, so the same bits. With even_odd, each 16-lane chunk of cw and sw holds its
// even lanes, then its odd ones.
struct FoldedRow {
  std::vector<float> buffer;
  const float* cos = nullptr;
  const float* sin = nullptr;
  float* cw = nullptr;
  float* sw = nullptr;
  float* natural = nullptr;  // 2·rd floats of scratch for the even/odd reorder
  NormKind kind = NormKind::other;
  bool even_odd = false;

  void reset(std::int64_t rd, NormKind k, bool split) {
    if (buffer.size() < std::size_t(4 * rd)) buffer.assign(std::size_t(4 * rd), 0.0f);
    cw = buffer.data();
    sw = cw + rd;
    natural = sw + rd;
    cos = sin = nullptr;
    kind = k;
    even_odd = split;
  }
  void update(const RotationData& r, const float* c, const float* s, const float* weight) {
    if (c == cos && s == sin) return;
    const std::int64_t rd = r.rotary_dim;
    float* to_cw = even_odd ? natural : cw;
    float* to_sw = even_odd ? natural + rd : sw;
    if (kind == NormKind::interleave && rd % kW == 0) {
      for (std::int64_t j = 0; j < rd; j += kW) {
        const __m256 w = _mm256_loadu_ps(weight + j);
        _mm256_storeu_ps(to_cw + j, _mm256_mul_ps(_mm256_loadu_ps(c + j), w));
        _mm256_storeu_ps(to_sw + j,
                         _mm256_mul_ps(_mm256_loadu_ps(s + j), _mm256_permute_ps(w, 0xb1)));
      }
    } else if (kind == NormKind::half && (rd / 2) % kW == 0) {
      const std::int64_t h = rd / 2;
      for (std::int64_t j = 0; j < rd; j += kW) {
        const __m256 w = _mm256_loadu_ps(weight + j);
        const __m256 w_partner = _mm256_loadu_ps(weight + (j < h ? j + h : j - h));
        _mm256_storeu_ps(to_cw + j, _mm256_mul_ps(_mm256_loadu_ps(c + j), w));
        _mm256_storeu_ps(to_sw + j, _mm256_mul_ps(_mm256_loadu_ps(s + j), w_partner));
      }
    } else {
      fold_norm_weight(r, c, s, weight, to_cw, to_sw);
    }
    if (even_odd) {
      to_even_odd(natural, rd, cw);
      to_even_odd(natural + rd, rd, sw);
    }
    cos = c;
    sin = s;
  }
  // n a multiple of 16: per chunk, the 8 even lanes, then the 8 odd ones.
  static void to_even_odd(const float* in, std::int64_t n, float* out) {
    for (std::int64_t c = 0; c < n; c += 16) {
      const __m256 a = _mm256_loadu_ps(in + c), b = _mm256_loadu_ps(in + c + kW);
      const __m256 even = _mm256_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0));  // a0 a2 b0 b2 a4..
      const __m256 odd = _mm256_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1));
      constexpr int kOrder = _MM_SHUFFLE(3, 1, 2, 0);  // 64-bit pairs: a0a2 a4a6 b0b2 b4b6
      _mm256_storeu_ps(out + c,
                       _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(even), kOrder)));
      _mm256_storeu_ps(out + c + kW,
                       _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(odd), kOrder)));
    }
  }
};

// Pass 1 of G rows at once: row i widened into N + i·row_floats while its sum of squares
// accumulates in its own register; scale[i] = 1 / rms of row i. The rows' fma chains (one per
// row, in the contract's order) are independent, so interleaving them hides the fma latency one
// row alone waits on, and the group's square roots overlap too. bf16 sums each whole 16-lane
// chunk as its even lanes, then its odd ones (the contract); kEvenOdd also stores N that way,
// else in lane order.
constexpr int kRowGroup = 4;

template <DType D, int G, bool kEvenOdd>
ROME_INLINE void widen_and_scale(const typename Lanes<D>::T* const* x, std::int64_t hd, float eps,
                                 float* N, std::int64_t row_floats, float* scale) {
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
        float* row = N + i * row_floats + j;
        if constexpr (kEvenOdd) {
          _mm256_storeu_ps(row, eo.even);
          _mm256_storeu_ps(row + kW, eo.odd);
        } else {
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
      _mm256_storeu_ps(N + i * row_floats + j, xv);
    }
  }
  for (int i = 0; i < G; ++i) scale[i] = 1.0f / std::sqrt(reduce(acc[i]) / float(hd) + eps);
}

// Pass 1 for rows [n, n + count) of the tile, count <= kRowGroup.
template <DType D, bool kEvenOdd>
void widen_rows(const ForwardTile& tile, std::int64_t n, int count, std::int64_t hd, float eps,
                float* N, std::int64_t row_floats, float* scale) {
  using T = typename Lanes<D>::T;
  const T* x[kRowGroup];
  for (int i = 0; i < count; ++i) x[i] = static_cast<const T*>(tile.x_row(n + i));
  if (count == kRowGroup)
    widen_and_scale<D, kRowGroup, kEvenOdd>(x, hd, eps, N, row_floats, scale);
  else
    for (int i = 0; i < count; ++i)
      widen_and_scale<D, 1, kEvenOdd>(x + i, hd, eps, N + i * row_floats, row_floats, scale + i);
}

// bf16, half (h a multiple of 16) or interleave, rotary_dim and head_dim multiples of 16: N, the
// folded tables and w_eo (the weight of lanes past rotary_dim) in even/odd order per chunk.
template <NormKind K>
void norm_rows_bf16_even_odd(const RotationData& r, const ForwardTile& tile, const NormParams& norm,
                             float* buffer, std::int64_t row_floats, FoldedRow& folded,
                             const float* w_eo) {
  using T = std::uint16_t;
  const std::int64_t rd = r.rotary_dim, hd = r.head_dim, h = rd / 2;
  const __m256i high = _mm256_set1_epi32(int(0xffff0000u));
  float scales[kRowGroup];
  for (std::int64_t n0 = 0; n0 < tile.count; n0 += kRowGroup) {
    const int group = int(std::min<std::int64_t>(kRowGroup, tile.count - n0));
    widen_rows<DType::bf16, true>(tile, n0, group, hd, norm.eps, buffer, row_floats, scales);
    for (int i = 0; i < group; ++i) {
      const std::int64_t n = n0 + i;
      T* y = static_cast<T*>(tile.y_row(n));
      const float* N = buffer + i * row_floats;
      folded.update(r, tile.cos_row(n), tile.sin_row(n), norm.weight);
      // Locals, not the thread_local's members: read through TLS in the loop, they cost a
      // vzeroupper and reloads of every vector per iteration.
      const float* cw = folded.cw;
      const float* sw = folded.sw;
      const __m256 scale = _mm256_set1_ps(scales[i]);
      for (std::int64_t j0 = 0; j0 < rd; j0 += 16) {
        const __m256 a_even = _mm256_mul_ps(_mm256_loadu_ps(N + j0), scale);
        const __m256 a_odd = _mm256_mul_ps(_mm256_loadu_ps(N + j0 + kW), scale);
        __m256 b_even, b_odd;
        if constexpr (K == NormKind::interleave) {
          b_even = a_odd;
          b_odd = a_even;
        } else {
          const std::int64_t p = j0 < h ? j0 + h : j0 - h;
          b_even = _mm256_mul_ps(_mm256_loadu_ps(N + p), scale);
          b_odd = _mm256_mul_ps(_mm256_loadu_ps(N + p + kW), scale);
        }
        const __m256 c_even = _mm256_loadu_ps(cw + j0), c_odd = _mm256_loadu_ps(cw + j0 + kW);
        const __m256 s_even = _mm256_loadu_ps(sw + j0), s_odd = _mm256_loadu_ps(sw + j0 + kW);
        __m256 even = combine_unguarded(a_even, c_even, b_even, s_even);
        __m256 odd = combine_unguarded(a_odd, c_odd, b_odd, s_odd);
        __m256i out;
        if (__builtin_expect(!any_nan(even, odd), 1)) {
          out = _mm256_or_si256(_mm256_srli_epi32(round_bf16_high_not_nan(even), 16),
                                _mm256_and_si256(round_bf16_high_not_nan(odd), high));
        } else {  // where a guard can matter: the exact way
          even = avx2::combine(a_even, c_even, b_even, s_even);
          odd = avx2::combine(a_odd, c_odd, b_odd, s_odd);
          out = _mm256_or_si256(_mm256_srli_epi32(round_bf16_high(even), 16),
                                _mm256_and_si256(round_bf16_high(odd), high));
        }
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + j0), out);
      }
      for (std::int64_t j = rd; j < hd; j += 16) {
        const __m256 even =
            _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(N + j), scale), _mm256_loadu_ps(w_eo + j));
        const __m256 odd = _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(N + j + kW), scale),
                                         _mm256_loadu_ps(w_eo + j + kW));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + j),
                            _mm256_or_si256(_mm256_srli_epi32(round_bf16_high(even), 16),
                                            _mm256_and_si256(round_bf16_high(odd), high)));
      }
    }
  }
}

// Half (h = rotary_dim/2 a multiple of 8) or interleave (rotary_dim a multiple of 8) with whole
// vectors: no lane masks, no per-vector tests.
template <DType D, NormKind K>
void norm_rows_whole(const RotationData& r, const ForwardTile& tile, const NormParams& norm,
                     float* buffer, std::int64_t row_floats, FoldedRow& folded) {
  using L = Lanes<D>;
  using T = typename L::T;
  const std::int64_t rd = r.rotary_dim, hd = r.head_dim, h = rd / 2;
  float scales[kRowGroup];
  for (std::int64_t n0 = 0; n0 < tile.count; n0 += kRowGroup) {
    const int group = int(std::min<std::int64_t>(kRowGroup, tile.count - n0));
    widen_rows<D, false>(tile, n0, group, hd, norm.eps, buffer, row_floats, scales);
    for (int i = 0; i < group; ++i) {
      const std::int64_t n = n0 + i;
      T* y = static_cast<T*>(tile.y_row(n));
      const float* N = buffer + i * row_floats;
      folded.update(r, tile.cos_row(n), tile.sin_row(n), norm.weight);
      const float* cw = folded.cw;  // locals: see norm_rows_bf16_even_odd
      const float* sw = folded.sw;
      const __m256 scale = _mm256_set1_ps(scales[i]);
      for (std::int64_t j0 = 0; j0 < rd; j0 += kW) {
        const __m256 a = _mm256_mul_ps(_mm256_loadu_ps(N + j0), scale);
        __m256 b;
        if constexpr (K == NormKind::interleave)
          b = _mm256_permute_ps(a, 0xb1);
        else
          b = _mm256_mul_ps(_mm256_loadu_ps(N + (j0 < h ? j0 + h : j0 - h)), scale);
        L::store(y + j0, avx2::combine(a, _mm256_loadu_ps(cw + j0), b, _mm256_loadu_ps(sw + j0)));
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
  const std::int64_t rd = r.rotary_dim, hd = r.head_dim;
  for (std::int64_t n = 0; n < tile.count; ++n) {
    const T* x = static_cast<const T*>(tile.x_row(n));
    T* y = static_cast<T*>(tile.y_row(n));
    folded.update(r, tile.cos_row(n), tile.sin_row(n), norm.weight);
    const float* cw = folded.cw;
    const float* sw = folded.sw;
    float scale;
    widen_and_scale<D, 1, false>(&x, hd, norm.eps, N, 0, &scale);
    for (std::int64_t j = 0; j < hd; ++j) N[j] *= scale;
    for (std::int64_t j = 0; j < rd; ++j) {
      const float xa = r.a_identity ? N[j] : r.a.sign[j] == 0 ? 0.0f : N[r.a.src[j]];
      const float xb = r.b.sign[j] == 0 ? 0.0f : N[r.b.src[j]];
      detail::store_float<D>(y + j, combine_lane(xa, cw[j], xb, sw[j]));
    }
    for (std::int64_t j = rd; j < hd; ++j) detail::store_float<D>(y + j, N[j] * norm.weight[j]);
  }
}

template <DType D>
void norm_rows(const RotationData& r, const ForwardTile& tile, const NormParams& norm) {
  const std::int64_t rd = r.rotary_dim, hd = r.head_dim, h = rd / 2;
  const std::int64_t row_floats = (hd + kW - 1) / kW * kW;
  thread_local std::vector<float> buffer;
  const std::size_t need = std::size_t(kRowGroup * row_floats + hd);
  if (buffer.size() < need) buffer.assign(need, 0.0f);
  thread_local FoldedRow folded;
  const NormKind kind = classify(r);
  const bool even_odd = D == DType::bf16 && hd % 16 == 0 && rd % 16 == 0 &&
                        ((kind == NormKind::half && h % 16 == 0) || kind == NormKind::interleave);
  folded.reset(rd, kind, even_odd);  // a new call: its table rows may sit where the last did
  if (even_odd) {
    float* w_eo = buffer.data() + kRowGroup * row_floats;
    FoldedRow::to_even_odd(norm.weight + rd, hd - rd, w_eo + rd);
    if (kind == NormKind::half)
      norm_rows_bf16_even_odd<NormKind::half>(r, tile, norm, buffer.data(), row_floats, folded,
                                              w_eo);
    else
      norm_rows_bf16_even_odd<NormKind::interleave>(r, tile, norm, buffer.data(), row_floats,
                                                    folded, w_eo);
  } else if (kind == NormKind::half && h % kW == 0) {
    norm_rows_whole<D, NormKind::half>(r, tile, norm, buffer.data(), row_floats, folded);
  } else if (kind == NormKind::interleave && rd % kW == 0) {
    norm_rows_whole<D, NormKind::interleave>(r, tile, norm, buffer.data(), row_floats, folded);
  } else {
    norm_rows_lanes<D>(r, tile, norm, buffer.data(), folded);
  }
}

}  // namespace

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
