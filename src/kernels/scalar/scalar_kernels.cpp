// Portable kernels: the fallback on every CPU and the reference the SIMD kernels must match bit
// for bit (the same operations in the same order: common/combine-inl.hpp).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "../../core/convert.hpp"
#include "../common/combine-inl.hpp"
#include "../common/norm_fold-inl.hpp"
#include "../dense_kernels.hpp"
#include "../kernel_api.hpp"

namespace rome::kernels {
namespace {

using detail::RotationData;

// The tile's tables carry the signs of A and B, so a lane only reads its source (or nothing).
template <DType D>
void forward_permute_run(const RotationData& r, const ForwardTile& tile) {
  using T = typename detail::Storage<D>::type;
  const std::int64_t rd = r.rotary_dim, hd = r.head_dim;
  thread_local std::vector<float> row;
  if (std::int64_t(row.size()) < rd) row.resize(rd);
  float* xf = row.data();
  constexpr bool kOneFma = single_fma_epilogue(D);
  for (std::int64_t n = 0; n < tile.count; ++n) {
    const T* x = static_cast<const T*>(tile.x_row(n));
    T* y = static_cast<T*>(tile.y_row(n));
    const float* cos = tile.cos_row(n);
    const float* sin = tile.sin_row(n);
    for (std::int64_t j = 0; j < rd; ++j) xf[j] = detail::load_float<D>(x + j);
    for (std::int64_t j = 0; j < rd; ++j) {
      const float xa = r.a_identity ? xf[j] : r.a.sign[j] == 0 ? 0.0f : xf[r.a.src[j]];
      const float xb = r.b.sign[j] == 0 ? 0.0f : xf[r.b.src[j]];
      detail::store_float<D>(y + j, epilogue_lane(kOneFma, xa, cos[j], xb, sin[j]));
    }
    if (tile.copy_passthrough && hd > rd) std::memcpy(y + rd, x + rd, (hd - rd) * sizeof(T));
  }
}

template <DType D>
void forward_permute(const RotationData& r, const ForwardTile& tile) {
  for (std::int64_t t = 0; t < tile.tokens; ++t) forward_permute_run<D>(r, tile.token(t));
}

template <DType D>
void forward_dense(const RotationData& r, const ForwardTile& tile) {
  using T = typename detail::Storage<D>::type;
  const std::int64_t rd = r.rotary_dim, hd = r.head_dim;
  thread_local std::vector<float> row;
  if (std::int64_t(row.size()) < rd) row.resize(rd);
  float* xf = row.data();
  const float* a = r.dense_a.data();
  const float* b = r.dense_b.data();
  constexpr bool kOneFma = single_fma_epilogue(D);
  for (std::int64_t n = 0; n < tile.count; ++n) {
    const T* x = static_cast<const T*>(tile.x_row(n));
    T* y = static_cast<T*>(tile.y_row(n));
    const float* cos = tile.cos_row(n);
    const float* sin = tile.sin_row(n);
    for (std::int64_t j = 0; j < rd; ++j) xf[j] = detail::load_float<D>(x + j);
    for (const auto& block : r.dense_blocks) {
      const std::int64_t end = block.offset + block.size;
      for (std::int64_t j = block.offset; j < end; ++j) {
        // Summed in ascending i from +0: the SIMD dense kernels follow the same order.
        float xa = 0.0f, xb = 0.0f;
        for (std::int64_t i = block.offset; i < end; ++i) {
          if (!r.a_identity) xa = std::fma(xf[i], a[i * rd + j], xa);
          xb = std::fma(xf[i], b[i * rd + j], xb);
        }
        if (r.a_identity) xa = xf[j];
        detail::store_float<D>(y + j, epilogue_lane(kOneFma, xa, cos[j], xb, sin[j]));
      }
    }
    if (tile.copy_passthrough && hd > rd) std::memcpy(y + rd, x + rd, (hd - rd) * sizeof(T));
  }
}

// The fixed summation order of NormForwardFn: partial sum j % 8 for lane j; for bf16 rows, the
// lanes of each whole 16-lane chunk c go even lanes first (16c + 2k into partial sum k), then
// odd ones (16c + 2k + 1 into k), the order of the SIMD kernels' even/odd split.
template <DType D>
float sum_of_squares(const float* x, std::int64_t n) {
  float s[8] = {};
  std::int64_t j = 0;
  if constexpr (D == DType::bf16) {
    for (; j + 16 <= n; j += 16) {
      for (int k = 0; k < 8; ++k) s[k] = std::fma(x[j + 2 * k], x[j + 2 * k], s[k]);
      for (int k = 0; k < 8; ++k) s[k] = std::fma(x[j + 2 * k + 1], x[j + 2 * k + 1], s[k]);
    }
  }
  for (; j < n; ++j) s[j % 8] = std::fma(x[j], x[j], s[j % 8]);
  return ((s[0] + s[4]) + (s[2] + s[6])) + ((s[1] + s[5]) + (s[3] + s[7]));
}

template <DType D>
void forward_norm_permute_run(const RotationData& r, const ForwardTile& tile,
                              const NormParams& norm) {
  using T = typename detail::Storage<D>::type;
  const std::int64_t rd = r.rotary_dim, hd = r.head_dim;
  thread_local std::vector<float> row;
  if (std::int64_t(row.size()) < hd + 2 * rd) row.resize(hd + 2 * rd);
  float* nf = row.data();
  float* cw = nf + hd;  // the table row with the weight folded in (fold_norm_weight)
  float* sw = cw + rd;
  const float* folded_cos = nullptr;
  const float* folded_sin = nullptr;
  for (std::int64_t n = 0; n < tile.count; ++n) {
    const T* x = static_cast<const T*>(tile.x_row(n));
    T* y = static_cast<T*>(tile.y_row(n));
    const float* cos = tile.cos_row(n);
    const float* sin = tile.sin_row(n);
    if (cos != folded_cos || sin != folded_sin) {
      fold_norm_weight(r, cos, sin, norm.weight, cw, sw);
      folded_cos = cos;
      folded_sin = sin;
    }
    for (std::int64_t j = 0; j < hd; ++j) nf[j] = detail::load_float<D>(x + j);
    const float scale = 1.0f / std::sqrt(sum_of_squares<D>(nf, hd) / float(hd) + norm.eps);
    store_norm_row_lanes<D>(r, nf, scale, cw, sw, norm, y);
  }
}

template <DType D>
void forward_norm_permute(const RotationData& r, const ForwardTile& tile, const NormParams& norm) {
  for (std::int64_t t = 0; t < tile.tokens; ++t)
    forward_norm_permute_run<D>(r, tile.token(t), norm);
}

void forward_norm_permute_any(const RotationData& r, const ForwardTile& b, const NormParams& n) {
  switch (b.dtype) {
    case DType::f32: return forward_norm_permute<DType::f32>(r, b, n);
    case DType::f16: return forward_norm_permute<DType::f16>(r, b, n);
    case DType::bf16: return forward_norm_permute<DType::bf16>(r, b, n);
    default: return;
  }
}

void forward_permute_any(const RotationData& r, const ForwardTile& b) {
  switch (b.dtype) {
    case DType::f32: return forward_permute<DType::f32>(r, b);
    case DType::f16: return forward_permute<DType::f16>(r, b);
    case DType::bf16: return forward_permute<DType::bf16>(r, b);
    default: return;
  }
}

void forward_dense_any(const RotationData& r, const ForwardTile& b) {
  switch (b.dtype) {
    case DType::f32: return forward_dense<DType::f32>(r, b);
    case DType::f16: return forward_dense<DType::f16>(r, b);
    case DType::bf16: return forward_dense<DType::bf16>(r, b);
    default: return;
  }
}

}  // namespace

void scalar_accumulate_product(std::int64_t rows, std::int64_t k, std::int64_t n, const float* a,
                               std::int64_t lda, const float* b, std::int64_t ldb, float* c,
                               std::int64_t ldc) {
  for (std::int64_t r = 0; r < rows; ++r) {
    float* cr = c + r * ldc;
    for (std::int64_t i = 0; i < k; ++i) {
      const float ai = a[r * lda + i];
      const float* bi = b + i * ldb;
      for (std::int64_t j = 0; j < n; ++j) cr[j] = std::fma(ai, bi[j], cr[j]);
    }
  }
}

namespace {

#if defined(__SSE2__)
// float_to_bf16 on 4 lanes. The rounded bits, shifted arithmetically, are the int16 of the
// result (no finite or infinite input carries past bit 31), so a signed pack keeps them exactly.
inline __m128i bf16_of_4(__m128i u) {
  const __m128i lsb = _mm_and_si128(_mm_srli_epi32(u, 16), _mm_set1_epi32(1));
  const __m128i rounded =
      _mm_srai_epi32(_mm_add_epi32(_mm_add_epi32(u, _mm_set1_epi32(0x7fff)), lsb), 16);
  const __m128i quiet_nan = _mm_srai_epi32(_mm_or_si128(u, _mm_set1_epi32(0x00400000)), 16);
  const __m128i nan =
      _mm_cmpgt_epi32(_mm_and_si128(u, _mm_set1_epi32(0x7fffffff)), _mm_set1_epi32(0x7f800000));
  return _mm_or_si128(_mm_and_si128(nan, quiet_nan), _mm_andnot_si128(nan, rounded));
}
#endif

// SSE2 where the target has it (every x86-64): the compiler's own vectorisation of the lane loop
// narrows by shuffles, at twice the instructions.
void narrow_bf16(std::int64_t n, const float* in, std::uint16_t* out) {
  std::int64_t i = 0;
#if defined(__SSE2__)
  for (; i + 8 <= n; i += 8) {
    const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i));
    const __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i + 4));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i),
                     _mm_packs_epi32(bf16_of_4(lo), bf16_of_4(hi)));
  }
#endif
  for (; i < n; ++i) out[i] = detail::float_to_bf16(in[i]);
}

// SSE2, which every x86-64 CPU has (16-byte stores); elsewhere a plain copy.
void scalar_stream_copy(void* dst, const void* src, std::size_t n) {
  auto* d = static_cast<char*>(dst);
  const auto* s = static_cast<const char*>(src);
#if defined(__SSE2__)
  const std::size_t head = std::min(n, std::size_t(-reinterpret_cast<std::uintptr_t>(d) & 15));
  std::memcpy(d, s, head);
  d += head, s += head, n -= head;
  for (; n >= 16; n -= 16, d += 16, s += 16)
    _mm_stream_si128(reinterpret_cast<__m128i*>(d),
                     _mm_loadu_si128(reinterpret_cast<const __m128i*>(s)));
#endif
  std::memcpy(d, s, n);
}

}  // namespace

// The lane loop: the definition the SIMD forms match bit for bit.
void scalar_spread_even_odd_16(const void* row, DType dtype, std::int64_t period,
                               const std::uint32_t* signs, std::uint32_t flip, std::int64_t rd,
                               float* out) {
  constexpr std::uint32_t kQuietBit = 0x00400000u, kLowBits = 0x0000ffffu;
  auto* dst = reinterpret_cast<std::uint32_t*>(out);
  for (std::int64_t k = 0; k < rd; k += 16) {
    const std::int64_t column = k < period ? k : k - period;
    std::uint32_t chunk[16];
    for (int i = 0; i < 16; ++i) {
      const std::int64_t c = column + 2 * (i % 8) + i / 8;
      if (dtype == DType::f32)
        std::memcpy(&chunk[i], static_cast<const float*>(row) + c, 4);
      else
        chunk[i] = std::uint32_t(static_cast<const std::uint16_t*>(row)[c]) << 16;
    }
    for (int i = 0; i < 16; ++i) {
      const std::uint32_t bits = chunk[i] ^ (signs ? signs[k + i] : 0u) ^ flip;
      dst[k + i] = (bits & 0x7fffffffu) > 0x7f800000u ? (bits | kQuietBit) & ~kLowBits : bits;
    }
  }
}

const KernelTable& scalar_kernels() {
  static const KernelTable table{"scalar",
                                 forward_permute_any,
                                 forward_dense_any,
                                 scalar_accumulate_product,
                                 nullptr,
                                 forward_norm_permute_any,
                                 nullptr,
                                 scalar_cos_sin,
                                 scalar_cos_sin_rows,
                                 narrow_bf16,
                                 scalar_spread_even_odd_16,
                                 scalar_stream_copy};
  return table;
}

}  // namespace rome::kernels
