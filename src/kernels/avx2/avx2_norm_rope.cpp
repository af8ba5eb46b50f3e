// AVX2 + FMA QK-norm + rotation (NormForwardFn): every row is widened into an fp32 buffer while
// its sum of squares accumulates (one 8-lane fma accumulator: the partial sums j % 8 of the
// contract), scaled by its RMS and the weight, then rotated from the buffer. Half and interleave
// rotations run vectorised (the partner of lane j is j ± rotary_dim/2, or j ^ 1); other signed
// permutations take the scalar kernel's lane loop on the same buffer. Bit-identical to the
// scalar kernel: same operations, same order, same epilogue (avx2::combine).
#include <cmath>
#include <cstdint>
#include <vector>

#include "../../core/convert.hpp"
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

template <DType D>
void norm_rows(const RotationData& r, const ForwardTile& tile, const NormParams& norm) {
  using L = Lanes<D>;
  using T = typename L::T;
  const std::int64_t rd = r.rotary_dim, hd = r.head_dim, h = rd / 2;
  const std::int64_t hv = (hd + kW - 1) / kW;  // vectors per row
  const NormKind kind = classify(r);
  // N with rd + 8 floats of room before and after: the half kind loads whole vectors at
  // N + j0 ± h and blends the lanes it needs (the others, and lanes past rd, are never stored).
  thread_local std::vector<float> buffer;
  const std::size_t need = std::size_t(hv * kW + 2 * (rd + kW));
  if (buffer.size() < need) buffer.assign(need, 0.0f);
  float* N = buffer.data() + rd + kW;
  const __m256 lane = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
  for (std::int64_t n = 0; n < tile.count; ++n) {
    const T* x = static_cast<const T*>(tile.x_row(n));
    T* y = static_cast<T*>(tile.y_row(n));
    const float* cos = tile.cos_row(n);
    const float* sin = tile.sin_row(n);
    __m256 acc = _mm256_setzero_ps();
    for (std::int64_t v = 0; v < hv; ++v) {
      const int lanes = v == hv - 1 && hd % kW ? int(hd % kW) : kW;
      const __m256 xv = L::load(x + kW * v, lanes);  // zeros past hd: fma(0, 0, s) == s
      acc = _mm256_fmadd_ps(xv, xv, acc);
      _mm256_storeu_ps(N + kW * v, xv);
    }
    const __m256 scale = _mm256_set1_ps(1.0f / std::sqrt(reduce(acc) / float(hd) + norm.eps));
    for (std::int64_t v = 0; v < hv; ++v) {
      const int lanes = v == hv - 1 && hd % kW ? int(hd % kW) : kW;
      const __m256 w = Lanes<DType::f32>::load(norm.weight + kW * v, lanes);
      _mm256_storeu_ps(N + kW * v,
                       _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(N + kW * v), scale), w));
    }
    std::int64_t j0 = 0;
    if (kind != NormKind::other) {
      for (; j0 < rd; j0 += kW) {
        const int lanes = rd - j0 < kW ? int(rd - j0) : kW;
        const __m256 a = _mm256_loadu_ps(N + j0);
        __m256 b;
        if (kind == NormKind::interleave) {
          b = _mm256_permute_ps(a, 0xb1);
        } else if (j0 + kW <= h) {
          b = _mm256_loadu_ps(N + j0 + h);
        } else if (j0 >= h) {
          b = _mm256_loadu_ps(N + j0 - h);
        } else {  // the vector that straddles h (h not a multiple of 8)
          const __m256 upper = _mm256_cmp_ps(_mm256_add_ps(lane, _mm256_set1_ps(float(j0))),
                                             _mm256_set1_ps(float(h)), _CMP_GE_OQ);
          b = _mm256_blendv_ps(_mm256_loadu_ps(N + j0 + h), _mm256_loadu_ps(N + j0 - h), upper);
        }
        const __m256 out =
            avx2::combine(a, _mm256_loadu_ps(cos + j0), b, _mm256_loadu_ps(sin + j0));
        L::store(y + j0, out, lanes);
      }
      j0 = rd;
    } else {
      for (; j0 < rd; ++j0) {
        const float xa = r.a_identity ? N[j0] : r.a.sign[j0] == 0 ? 0.0f : N[r.a.src[j0]];
        const float xb = r.b.sign[j0] == 0 ? 0.0f : N[r.b.src[j0]];
        const float p = xa * cos[j0];
        const float e = std::fabs(p) <= 3.40282347e+38f ? std::fma(xa, cos[j0], -p) : 0.0f;
        detail::store_float<D>(y + j0, std::fma(xb, sin[j0], p) + e);
      }
    }
    for (std::int64_t j = j0; j < hd; j += kW) {
      const int lanes = hd - j < kW ? int(hd - j) : kW;
      L::store(y + j, _mm256_loadu_ps(N + j), lanes);
    }
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
