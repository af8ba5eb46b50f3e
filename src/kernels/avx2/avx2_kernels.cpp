// AVX2 + FMA + F16C kernels: signed-permutation rotations as in-register permutes.
//
// The core hands over tiles of rows with their table rows, the signs of A and B already folded
// in ((±x)·c == x·(±c) and fma(±x, s, t) == fma(x, ±s, t) bit for bit). Plan B is classified
// once per rotation (cached per thread):
//  - pairs:   interleave: every vector swaps its lane pairs (vpermilps);
//  - local:   every output vector permutes its own input vector (vpermps + blend);
//  - half / quarter move: output vector v is input vector v ^ K; the two vectors of a pair are
//             read before either is written (in place safe), no permute;
//  - single / move: every output vector permutes (or is) one input vector, read straight from x
//             (out of place);
//  - deinterleave: interleave_half (DeepSeek MLA): output vectors u and V/2 + u are the even and
//             the odd lanes of input vectors 2u and 2u + 1 (two shuffles, two lane permutes);
//  - shifted: every output vector is a lane blend of at most three unaligned loads of the row
//             widened into an fp32 buffer (block diagonals such as 44+44+40); shifted_two when
//             two loads always do (every half-block at least 8 lanes): no branches, two vectors
//             per step, bf16 narrowed and packed as a pair;
//  - general (and single / move in place): the row is widened into an fp32 buffer first and
//             every output vector is built by vpermps (_mm256_permutevar8x32_ps) steps of the
//             plan, blended into a zeroed accumulator.
// bf16 rows of the pairs, half and quarter kinds go 16 lanes at a time on tables in even/odd
// order (TableLayout::even_odd_16): no permute, no pack. The epilogue is avx2::combine
// (combine_lane's compensated xa·c + xb·s, operation for operation), or one fma where xa·c is exact
// (combine_exact_product; kernel_api.hpp's exact_products), then one rounding to the storage type,
// so every bit matches the scalar kernel. Rows whose rotary_dim is not a multiple of 8 end with
// masked loads/stores (fp32) or a staging buffer (16-bit types). bf16 is narrowed by integer
// round-to-nearest-even (NaN quietened, subnormals kept), fp16 by F16C (exact). Non-temporal stores
// only when the core asks (out of place, large outputs: rope_forward.cpp).
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>
#include <type_traits>
#include <vector>

#include "../../core/convert.hpp"
#include "../dense_kernels.hpp"
#include "../kernel_api.hpp"
#include "../kernel_support.hpp"
#include "avx2_lanes.hpp"

namespace rome::kernels {
namespace {

using detail::PermuteStep;
using detail::RotationData;
using detail::VectorPermutePlan;
using namespace avx2;

// ---------------------------------------------------------------------------------------------
// Per-call state

enum class Kind {
  pairs,
  local,
  half_move,
  quarter_move,
  single,
  move,
  deinterleave,
  shifted,
  shifted_two,
  general
};

// shifted: output vector v takes its B lanes from at most kMaxShifts unaligned loads of the
// widened row, X[8v + d .. 8v + d + 8) for a few offsets d, blended by lane (block diagonals
// whose blocks are not multiples of 8 lanes, e.g. 3D RoPE 44+44+40: a vector straddles at most
// two half-blocks, so two or three loads replace a chain of cross-lane permutes).
// shifted_two: every vector has a B source in every lane from at most two loads, the row is
// whole vectors and an even number of them (3D RoPE 44+44+40 and 16+56+56: every half-block has
// at least 8 lanes): two loads and one blend per vector, no branches, two vectors per step.
constexpr int kMaxShifts = 3;

struct Work {
  const RotationData* r = nullptr;
  std::int64_t rd = 0, hd = 0, V = 0;
  int tail = kW;                 // lanes of the last vector
  bool pass = false;             // copy lanes [rd, hd)
  bool stream = false;           // non-temporal stores for 64-byte aligned rows
  int xor_k = 0;                 // half / quarter move: output vector v is input vector v ^ xor_k
  float* X = nullptr;            // the row in fp32 (general)
  const __m256i* idx = nullptr;  // local / single: per output vector
  const __m256* mask = nullptr;  // local / single: lanes with a source (blend mask)
  const std::int32_t* src = nullptr;    // single / move: first element of the source vector
  const std::int32_t* src_n = nullptr;  // lanes of the source vector that exist
  const __m256* a_masks = nullptr;      // general: per plan step
  const __m256* b_masks = nullptr;
  const std::int32_t* shift_count = nullptr;   // shifted: per output vector
  const std::int32_t* shift_offset = nullptr;  // shifted: kMaxShifts per output vector
  const __m256* shift_mask = nullptr;
};

ROME_INLINE int lanes_of(const Work& w, std::int64_t v) {
  return v == w.V - 1 ? w.tail : kW;
}

// The row loops' type parameter: the storage type's lanes and what the tile's values allow
// (kernel_api.hpp: exact_products, nan_results_low_bits_zero).
template <DType D, bool kExact, bool kNanLowBitsZero>
struct RowLanes : std::conditional_t<D == DType::bf16 && kNanLowBitsZero,
                                     Lanes16<Bf16NanLowBitsZero>, Lanes<D>> {
  static constexpr DType kDType = D;
  static constexpr bool kExactProducts = kExact;
  static constexpr bool kNarrowWithoutNanCheck = kNanLowBitsZero;
};

template <typename L>
using Row = TileRow<typename L::T>;

// Also asks for the x bytes 4 KiB further along the stream, as the AVX-512 kernel does (one
// core stalls on x's loads with the hardware prefetchers alone; BENCHMARKS.md). Prefetches never
// fault, so the address may lie past the tensor; rows over 1 KiB are runs the prefetchers follow.
template <typename L>
ROME_INLINE Row<L> row_of(const Work& w, const ForwardTile& tile, std::int64_t n) {
  const std::int64_t bytes = w.hd * std::int64_t(sizeof(typename L::T));
  if (bytes <= 1024) {
    const char* next = static_cast<const char*>(tile.x_row(n)) + (tile.x_step < 0 ? -4096 : 4096);
    for (std::int64_t b = 0; b < bytes; b += 64) _mm_prefetch(next + b, _MM_HINT_T0);
  }
  return tile_row<typename L::T>(tile, n);
}

template <typename L>
ROME_INLINE void pass_through(const Work& w, const typename L::T* x, typename L::T* y) {
  if (w.pass)
    copy_bytes(y + w.rd, x + w.rd, (w.hd - w.rd) * std::int64_t(sizeof(typename L::T)), w.stream);
}

template <bool kExact>
ROME_INLINE __m256 epilogue(__m256 xa, __m256 c, __m256 xb, __m256 s) {
  return kExact ? combine_exact_product(xa, c, xb, s) : avx2::combine(xa, c, xb, s);
}

template <typename L>
ROME_INLINE __m256 combine(__m256 xa, __m256 xb, const Row<L>& row, std::int64_t v) {
  return epilogue<L::kExactProducts>(xa, _mm256_load_ps(row.C + kW * v), xb,
                                     _mm256_load_ps(row.S + kW * v));
}

// Two outputs of the epilogue. The compensated one runs without its guard and is redone with it
// when a result is NaN (the only case where the guard can matter; see combine_unguarded); the
// exact-product one has no guard.
template <bool kExact>
ROME_INLINE void epilogue_pair(__m256 a0, __m256 c0, __m256 b0, __m256 s0, __m256 a1, __m256 c1,
                               __m256 b1, __m256 s1, __m256& out0, __m256& out1) {
  if constexpr (kExact) {
    out0 = combine_exact_product(a0, c0, b0, s0);
    out1 = combine_exact_product(a1, c1, b1, s1);
  } else {
    out0 = combine_unguarded(a0, c0, b0, s0);
    out1 = combine_unguarded(a1, c1, b1, s1);
    if (__builtin_expect(any_nan(out0, out1), 0)) {
      out0 = avx2::combine(a0, c0, b0, s0);
      out1 = avx2::combine(a1, c1, b1, s1);
    }
  }
}

template <typename L>
ROME_INLINE bool streaming_row(const Work& w, const typename L::T* y) {
  return w.stream && (w.rd * std::int64_t(sizeof(typename L::T))) % 64 == 0 &&
         (reinterpret_cast<std::uintptr_t>(y) & 63) == 0;
}

template <typename L>
ROME_INLINE void put(const Work& w, bool stream, typename L::T* y, std::int64_t v, __m256 out) {
  if (stream)
    L::stream(y + kW * v, out);
  else
    L::store(y + kW * v, out, lanes_of(w, v));
}

// ---------------------------------------------------------------------------------------------
// Row loops

// pairs / local: each output vector from its own input vector.
template <typename L, bool kPairs>
ROME_INLINE void rows_local(const Work& w, const ForwardTile& tile) {
  for (std::int64_t n = 0; n < tile.count; ++n) {
    const Row<L> row = row_of<L>(w, tile, n);
    const bool stream = streaming_row<L>(w, row.y);
    for (std::int64_t v = 0; v < w.V; ++v) {
      const __m256 xv = L::load(row.x + kW * v, lanes_of(w, v));
      const __m256 xb = kPairs ? _mm256_permute_ps(xv, 0xb1)
                               : _mm256_and_ps(_mm256_permutevar8x32_ps(xv, w.idx[v]), w.mask[v]);
      put<L>(w, stream, row.y, v, combine<L>(xv, xb, row, v));
    }
    pass_through<L>(w, row.x, row.y);
  }
}

// half / quarter move: vectors v and v ^ K swap roles; both are read before either is written.
template <typename L>
ROME_INLINE void rows_xor_move(const Work& w, const ForwardTile& tile) {
  const std::int64_t K = w.xor_k;
  for (std::int64_t n = 0; n < tile.count; ++n) {
    const Row<L> row = row_of<L>(w, tile, n);
    const bool stream = streaming_row<L>(w, row.y);
    for (std::int64_t v0 = 0; v0 < w.V; v0 += 2 * K) {
      for (std::int64_t v = v0; v < v0 + K; ++v) {
        const std::int64_t u = v + K;
        const __m256 a = L::load(row.x + kW * v), b = L::load(row.x + kW * u);
        const __m256 cv = _mm256_load_ps(row.C + kW * v), sv = _mm256_load_ps(row.S + kW * v);
        const __m256 cu = _mm256_load_ps(row.C + kW * u), su = _mm256_load_ps(row.S + kW * u);
        __m256 out_v, out_u;
        epilogue_pair<L::kExactProducts>(a, cv, b, sv, b, cu, a, su, out_v, out_u);
        put<L>(w, stream, row.y, v, out_v);
        put<L>(w, stream, row.y, u, out_u);
      }
    }
    pass_through<L>(w, row.x, row.y);
  }
}

// One output vector of x·P for a plan P, from the fp32 row X.
ROME_INLINE __m256 permute_vector(const PermuteStep* steps, const __m256* masks, std::int32_t begin,
                                  std::int32_t end, const float* X) {
  if (begin == end) return _mm256_setzero_ps();
  auto step = [&](std::int32_t i) {
    return _mm256_permutevar8x32_ps(
        _mm256_load_ps(X + kW * steps[i].src0),
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(steps[i].idx)));
  };
  __m256 acc = _mm256_and_ps(step(begin), masks[begin]);
  for (std::int32_t i = begin + 1; i < end; ++i) acc = _mm256_blendv_ps(acc, step(i), masks[i]);
  return acc;
}

template <typename L>
ROME_INLINE void row_general(const Work& w, const Row<L>& row) {
  const typename L::T* x = row.x;
  typename L::T* y = row.y;
  const RotationData& r = *w.r;
  const VectorPermutePlan& pa = r.avx2.a;
  const VectorPermutePlan& pb = r.avx2.b;
  float* X = w.X;
  for (std::int64_t v = 0; v < w.V; ++v)
    _mm256_store_ps(X + kW * v, L::load(x + kW * v, lanes_of(w, v)));
  const bool stream = streaming_row<L>(w, y);
  for (std::int64_t v = 0; v < w.V; ++v) {
    const __m256 xb =
        permute_vector(pb.steps.data(), w.b_masks, pb.step_begin[v], pb.step_begin[v + 1], X);
    const __m256 xa = r.a_identity ? _mm256_load_ps(X + kW * v)
                                   : permute_vector(pa.steps.data(), w.a_masks, pa.step_begin[v],
                                                    pa.step_begin[v + 1], X);
    put<L>(w, stream, y, v, combine<L>(xa, xb, row, v));
  }
}

template <typename L, bool kMove>
ROME_INLINE void row_single(const Work& w, const Row<L>& row) {
  const bool stream = streaming_row<L>(w, row.y);
  for (std::int64_t v = 0; v < w.V; ++v) {
    const __m256 xs = L::load(row.x + w.src[v], w.src_n[v]);
    const __m256 xb = kMove ? xs : _mm256_and_ps(_mm256_permutevar8x32_ps(xs, w.idx[v]), w.mask[v]);
    put<L>(w, stream, row.y, v, combine<L>(L::load(row.x + kW * v, lanes_of(w, v)), xb, row, v));
  }
}

// The row is widened into X (one vector of padding each side: a shifted load may start up to 7
// lanes before the row or end up to 7 lanes past it; those lanes are never selected).
template <typename L>
ROME_INLINE void rows_shifted(const Work& w, const ForwardTile& tile) {
  float* X = w.X + kW;
  for (std::int64_t n = 0; n < tile.count; ++n) {
    const Row<L> row = row_of<L>(w, tile, n);
    for (std::int64_t v = 0; v < w.V; ++v)
      _mm256_store_ps(X + kW * v, L::load(row.x + kW * v, lanes_of(w, v)));
    const bool stream = streaming_row<L>(w, row.y);
    for (std::int64_t v = 0; v < w.V; ++v) {
      const std::int32_t* d = w.shift_offset + kMaxShifts * v;
      const __m256* m = w.shift_mask + kMaxShifts * v;
      const float* at = X + kW * v;
      __m256 xb = _mm256_setzero_ps();
      switch (w.shift_count[v]) {
        case 3: xb = _mm256_and_ps(_mm256_loadu_ps(at + d[2]), m[2]); [[fallthrough]];
        case 2: xb = _mm256_blendv_ps(xb, _mm256_loadu_ps(at + d[1]), m[1]); [[fallthrough]];
        case 1: xb = _mm256_blendv_ps(xb, _mm256_loadu_ps(at + d[0]), m[0]); break;
        default: break;
      }
      put<L>(w, stream, row.y, v, combine<L>(_mm256_load_ps(at), xb, row, v));
    }
    pass_through<L>(w, row.x, row.y);
  }
}

template <typename L>
ROME_INLINE void rows_shifted_two(const Work& w, const ForwardTile& tile) {
  float* X = w.X + kW;
  auto b_lanes = [&](std::int64_t v) {
    const std::int32_t* d = w.shift_offset + kMaxShifts * v;
    const float* at = X + kW * v;
    return _mm256_blendv_ps(_mm256_loadu_ps(at + d[0]), _mm256_loadu_ps(at + d[1]),
                            w.shift_mask[kMaxShifts * v + 1]);
  };
  for (std::int64_t n = 0; n < tile.count; ++n) {
    const Row<L> row = row_of<L>(w, tile, n);
    for (std::int64_t j = 0; j < kW * w.V; j += 2 * kW) {  // two vectors per step (V is even)
      _mm256_store_ps(X + j, L::load(row.x + j));
      _mm256_store_ps(X + j + kW, L::load(row.x + j + kW));
    }
    const bool stream = streaming_row<L>(w, row.y);
    for (std::int64_t v = 0; v < w.V; v += 2) {
      const __m256 a0 = _mm256_load_ps(X + kW * v), a1 = _mm256_load_ps(X + kW * (v + 1));
      const __m256 b0 = b_lanes(v), b1 = b_lanes(v + 1);
      const float* C = row.C + kW * v;
      const float* S = row.S + kW * v;
      if constexpr (L::kDType == DType::bf16) {
        // bf16: no NaN lane (the common case) narrows and packs both vectors at once.
        constexpr bool kExact = L::kExactProducts, kNoCheck = L::kNarrowWithoutNanCheck;
        const __m256 out0 =
            kExact ? combine_exact_product(a0, _mm256_load_ps(C), b0, _mm256_load_ps(S))
                   : combine_unguarded(a0, _mm256_load_ps(C), b0, _mm256_load_ps(S));
        const __m256 out1 =
            kExact ? combine_exact_product(a1, _mm256_load_ps(C + kW), b1, _mm256_load_ps(S + kW))
                   : combine_unguarded(a1, _mm256_load_ps(C + kW), b1, _mm256_load_ps(S + kW));
        if (kNoCheck || __builtin_expect(!any_nan(out0, out1), 1)) {
          auto* y = reinterpret_cast<__m256i*>(row.y + kW * v);
          const __m256i packed = narrow_bf16_pair_not_nan(out0, out1);
          if (stream)
            _mm256_stream_si256(y, packed);
          else
            _mm256_storeu_si256(y, packed);
          continue;
        }
        // A NaN result: the exact way, with the NaN case of the narrowing.
        put<L>(w, stream, row.y, v, epilogue<kExact>(a0, _mm256_load_ps(C), b0, _mm256_load_ps(S)));
        put<L>(w, stream, row.y, v + 1,
               epilogue<kExact>(a1, _mm256_load_ps(C + kW), b1, _mm256_load_ps(S + kW)));
      } else {
        __m256 out0, out1;
        epilogue_pair<L::kExactProducts>(a0, _mm256_load_ps(C), b0, _mm256_load_ps(S), a1,
                                         _mm256_load_ps(C + kW), b1, _mm256_load_ps(S + kW), out0,
                                         out1);
        put<L>(w, stream, row.y, v, out0);
        put<L>(w, stream, row.y, v + 1, out1);
      }
    }
    pass_through<L>(w, row.x, row.y);
  }
}

template <typename L>
ROME_INLINE void rows_general(const Work& w, const ForwardTile& tile) {
  for (std::int64_t n = 0; n < tile.count; ++n) {
    const Row<L> row = row_of<L>(w, tile, n);
    row_general<L>(w, row);
    pass_through<L>(w, row.x, row.y);
  }
}

template <typename L, bool kMove>
ROME_INLINE void rows_single(const Work& w, const ForwardTile& tile) {
  for (std::int64_t n = 0; n < tile.count; ++n) {
    const Row<L> row = row_of<L>(w, tile, n);
    if (static_cast<const void*>(row.x) == static_cast<const void*>(row.y))
      row_general<L>(w, row);
    else
      row_single<L, kMove>(w, row);
    pass_through<L>(w, row.x, row.y);
  }
}

// bf16 rows, 16 lanes at a time without any permute: the 16 values of one 32-byte load split
// into their even lanes (shifted up) and odd lanes (masked), and the tables come in that order
// (TableLayout::even_odd_16). Interleave pairs an even lane with the odd lane beside it; half
// and quarter pair chunk c with chunk c ^ K. The outputs are rounded as Bf16::narrow does and
// merged back by a shift, a mask and an or: no vpmovzx, pack or lane-crossing shuffle (the
// splitting and rounding helpers are in avx2_lanes.hpp, shared with the QK-norm kernel).
template <bool kStream>
ROME_INLINE void store_bf16(std::uint16_t* p, __m256i w) {
  if constexpr (kStream)
    _mm256_stream_si256(reinterpret_cast<__m256i*>(p), w);
  else
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), w);
}

// Output chunk c from input chunks c (a) and its partner (b): y = a·C + b'·S, where b' is b
// (half, quarter) or a with even and odd swapped (interleave). The fast path skips both NaN
// guards (the compensated epilogue's and the rounding's); a chunk with a NaN among its results,
// which is exactly where a guard can matter, is redone the exact way. Without the NaN check when
// every NaN result has 16 zero low bits: rounding then leaves its high half as it is, already
// quiet (the fma quietened it), which is what the NaN case would make of it.
template <bool kPairs, bool kExact, bool kNoNanCheck, bool kStream>
ROME_INLINE void bf16_chunk(const EvenOdd& a, const EvenOdd& b, const float* C, const float* S,
                            std::uint16_t* y) {
  const __m256 b_even = kPairs ? a.odd : b.even, b_odd = kPairs ? a.even : b.odd;
  const __m256 c_even = _mm256_load_ps(C), c_odd = _mm256_load_ps(C + kW);
  const __m256 s_even = _mm256_load_ps(S), s_odd = _mm256_load_ps(S + kW);
  __m256 even = kExact ? combine_exact_product(a.even, c_even, b_even, s_even)
                       : combine_unguarded(a.even, c_even, b_even, s_even);
  __m256 odd = kExact ? combine_exact_product(a.odd, c_odd, b_odd, s_odd)
                      : combine_unguarded(a.odd, c_odd, b_odd, s_odd);
  const __m256i high = _mm256_set1_epi32(int(0xffff0000u));
  if (kNoNanCheck || __builtin_expect(!any_nan(even, odd), 1)) {
    store_bf16<kStream>(y, _mm256_or_si256(_mm256_srli_epi32(round_bf16_high_not_nan(even), 16),
                                           _mm256_and_si256(round_bf16_high_not_nan(odd), high)));
    return;
  }
  if constexpr (!kExact) {
    even = avx2::combine(a.even, c_even, b_even, s_even);
    odd = avx2::combine(a.odd, c_odd, b_odd, s_odd);
  }
  store_bf16<kStream>(y, _mm256_or_si256(_mm256_srli_epi32(round_bf16_high(even), 16),
                                         _mm256_and_si256(round_bf16_high(odd), high)));
}

template <typename L, bool kStream>
ROME_INLINE void row_bf16_pairs(std::int64_t chunks, const Row<L>& row) {
  for (std::int64_t c = 0; c < 16 * chunks; c += 16) {
    const EvenOdd a = split_bf16(row.x + c);
    bf16_chunk<true, L::kExactProducts, L::kNarrowWithoutNanCheck, kStream>(a, a, row.C + c,
                                                                            row.S + c, row.y + c);
  }
}

template <typename L>
ROME_INLINE void rows_bf16_pairs(const Work& w, const ForwardTile& tile) {
  const std::int64_t chunks = w.rd / 16;
  for (std::int64_t n = 0; n < tile.count; ++n) {
    const Row<L> row = row_of<L>(w, tile, n);
    if (streaming_row<L>(w, row.y))
      row_bf16_pairs<L, true>(chunks, row);
    else
      row_bf16_pairs<L, false>(chunks, row);
    pass_through<L>(w, row.x, row.y);
  }
}

// Chunks c and c + K (lanes 16c.. and 16(c + K)..) swap roles, for c in the first K chunks of
// every 2K; both are read before either is written (in place safe).
template <typename L, bool kStream>
ROME_INLINE void row_bf16_xor(std::int64_t chunks, std::int64_t K, const Row<L>& row) {
  const std::int64_t d = 16 * K;
  for (std::int64_t c0 = 0; c0 < 16 * chunks; c0 += 2 * d) {
    for (std::int64_t c = c0; c < c0 + d; c += 16) {
      const EvenOdd a = split_bf16(row.x + c), b = split_bf16(row.x + c + d);
      constexpr bool kExact = L::kExactProducts, kNoCheck = L::kNarrowWithoutNanCheck;
      bf16_chunk<false, kExact, kNoCheck, kStream>(a, b, row.C + c, row.S + c, row.y + c);
      bf16_chunk<false, kExact, kNoCheck, kStream>(b, a, row.C + c + d, row.S + c + d,
                                                   row.y + c + d);
    }
  }
}

template <typename L>
ROME_INLINE void rows_bf16_xor(const Work& w, const ForwardTile& tile) {
  const std::int64_t chunks = w.rd / 16, K = w.xor_k / 2;
  for (std::int64_t n = 0; n < tile.count; ++n) {
    const Row<L> row = row_of<L>(w, tile, n);
    if (streaming_row<L>(w, row.y))
      row_bf16_xor<L, true>(chunks, K, row);
    else
      row_bf16_xor<L, false>(chunks, K, row);
    pass_through<L>(w, row.x, row.y);
  }
}

// Output vector u takes A from the even lanes and B from the odd lanes of input vectors 2u and
// 2u + 1, output vector V/2 + u the other way round. In place the row is widened into X first:
// output V/2 + u would overwrite an input vector not yet read.
template <typename L>
ROME_INLINE void rows_deinterleave(const Work& w, const ForwardTile& tile) {
  const std::int64_t H = w.V / 2;
  for (std::int64_t n = 0; n < tile.count; ++n) {
    const Row<L> row = row_of<L>(w, tile, n);
    const bool in_place = static_cast<const void*>(row.x) == static_cast<const void*>(row.y);
    if (in_place)
      for (std::int64_t v = 0; v < w.V; ++v) _mm256_store_ps(w.X + kW * v, L::load(row.x + kW * v));
    const bool stream = streaming_row<L>(w, row.y);
    for (std::int64_t u = 0; u < H; ++u) {
      const std::int64_t at = 2 * kW * u;
      const EvenOdd eo =
          in_place ? split_even_odd(_mm256_load_ps(w.X + at), _mm256_load_ps(w.X + at + kW))
                   : split_even_odd(L::load(row.x + at), L::load(row.x + at + kW));
      const __m256 cu = _mm256_load_ps(row.C + kW * u), su = _mm256_load_ps(row.S + kW * u);
      const __m256 ch = _mm256_load_ps(row.C + kW * (H + u));
      const __m256 sh = _mm256_load_ps(row.S + kW * (H + u));
      __m256 lo, hi;
      epilogue_pair<L::kExactProducts>(eo.even, cu, eo.odd, su, eo.odd, ch, eo.even, sh, lo, hi);
      put<L>(w, stream, row.y, u, lo);
      put<L>(w, stream, row.y, H + u, hi);
    }
    pass_through<L>(w, row.x, row.y);
  }
}

// Whether bf16 rows of this kind run 16 lanes at a time on even/odd tables.
bool even_odd_kind(Kind kind, std::int64_t rd, int xor_k) {
  if (kind == Kind::pairs) return rd % 16 == 0;
  if (kind == Kind::half_move || kind == Kind::quarter_move) return xor_k % 2 == 0;
  return false;
}

template <typename L>
ROME_INLINE void dispatch_rows(Kind kind, const Work& w, const ForwardTile& tile) {
  if constexpr (L::kDType == DType::bf16) {
    if (even_odd_kind(kind, w.rd, w.xor_k))
      return kind == Kind::pairs ? rows_bf16_pairs<L>(w, tile) : rows_bf16_xor<L>(w, tile);
  }
  switch (kind) {
    case Kind::pairs: return rows_local<L, true>(w, tile);
    case Kind::local: return rows_local<L, false>(w, tile);
    case Kind::half_move:
    case Kind::quarter_move: return rows_xor_move<L>(w, tile);
    case Kind::single: return rows_single<L, false>(w, tile);
    case Kind::move: return rows_single<L, true>(w, tile);
    case Kind::deinterleave: return rows_deinterleave<L>(w, tile);
    case Kind::shifted: return rows_shifted<L>(w, tile);
    case Kind::shifted_two: return rows_shifted_two<L>(w, tile);
    case Kind::general: return rows_general<L>(w, tile);
  }
}

// ---------------------------------------------------------------------------------------------
// Per-rotation preparation

ROME_INLINE __m256 blend_mask(std::uint32_t lanes) {
  const __m256i bits = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  return _mm256_castsi256_ps(
      _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(int(lanes)), bits), bits));
}

// interleave_half on whole vectors: A takes lane 2j (j < h) or 2(j - h) + 1, B the other lane of
// the pair (signs are in the tables).
bool is_deinterleave(const RotationData& r, const Work& w) {
  const std::int64_t h = w.rd / 2;
  if (r.a_identity || w.rd % (2 * kW) != 0) return false;
  for (std::int64_t j = 0; j < w.rd; ++j) {
    const std::int32_t even = std::int32_t(2 * (j < h ? j : j - h)), odd = even + 1;
    if (r.a.sign[j] == 0 || r.b.sign[j] == 0 || r.a.src[j] != (j < h ? even : odd) ||
        r.b.src[j] != (j < h ? odd : even))
      return false;
  }
  return true;
}

Kind classify(const RotationData& r, Work& w, __m256i* idx, __m256* mask, std::int32_t* src,
              std::int32_t* src_n) {
  if (is_deinterleave(r, w)) return Kind::deinterleave;
  if (!r.a_identity) return Kind::general;
  const VectorPermutePlan& pb = r.avx2.b;
  bool local = true, move = true, pairs = true, half = true, quarter = true;
  for (std::int64_t v = 0; v < w.V; ++v) {
    if (pb.step_begin[v + 1] - pb.step_begin[v] != 1) return Kind::general;
    const PermuteStep& s = pb.steps[pb.step_begin[v]];
    const std::uint32_t all = (1u << lanes_of(w, v)) - 1;
    bool iota = true, swap = true;
    for (int l = 0; l < kW; ++l) {
      if (!(s.lanes >> l & 1)) continue;
      iota &= s.idx[l] == l;
      swap &= s.idx[l] == (l ^ 1);
    }
    idx[v] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s.idx));
    mask[v] = blend_mask(s.lanes);
    src[v] = kW * s.src0;
    src_n[v] = lanes_of(w, s.src0);
    const bool full = s.lanes == all;
    local &= s.src0 == v;
    pairs &= s.src0 == v && full && swap;
    move &= full && all == 0xff && src_n[v] == kW && iota;
    half &= s.src0 == (v ^ (w.V / 2));
    quarter &= s.src0 == (v ^ (w.V / 4));
  }
  if (local) return pairs ? Kind::pairs : Kind::local;
  if (move && w.V % 4 == 0 && (half || quarter)) {
    w.xor_k = int(half ? w.V / 2 : w.V / 4);
    return half ? Kind::half_move : Kind::quarter_move;
  }
  return move ? Kind::move : Kind::single;
}

// Offsets and lane masks of the shifted kind; false when some vector needs more than
// kMaxShifts loads.
bool classify_shifted(const RotationData& r, const Work& w, std::int32_t* count,
                      std::int32_t* offset, __m256* mask) {
  for (std::int64_t v = 0; v < w.V; ++v) {
    std::int32_t d[kMaxShifts] = {};
    std::uint32_t lanes[kMaxShifts] = {};
    int n = 0;
    for (int l = 0; l < lanes_of(w, v); ++l) {
      const std::int64_t j = kW * v + l;
      if (r.b.sign[j] == 0) continue;
      const std::int32_t off = r.b.src[j] - std::int32_t(j);
      int i = 0;
      while (i < n && d[i] != off) ++i;
      if (i == n) {
        if (n == kMaxShifts) return false;
        d[n++] = off;
      }
      lanes[i] |= 1u << l;
    }
    count[v] = n;
    for (int i = 0; i < kMaxShifts; ++i) {
      offset[kMaxShifts * v + i] = d[i];
      mask[kMaxShifts * v + i] = blend_mask(lanes[i]);
    }
  }
  return true;
}

// The shifted kind's conditions for shifted_two (see there).
bool two_shifts(const RotationData& r, const Work& w, const std::int32_t* count) {
  if (w.tail != kW || w.V % 2 != 0) return false;
  for (std::int64_t v = 0; v < w.V; ++v)
    if (count[v] < 1 || count[v] > 2) return false;
  for (std::int64_t j = 0; j < w.rd; ++j)
    if (r.b.sign[j] == 0) return false;
  return true;
}

// memcmp(a, b, n) == 0, inline, one branch.
ROME_INLINE bool equal_bytes(const void* a, const void* b, std::size_t n) {
  const auto* p = static_cast<const char*>(a);
  const auto* q = static_cast<const char*>(b);
  __m256i diff = _mm256_setzero_si256();
  for (; n >= 32; n -= 32, p += 32, q += 32)
    diff = _mm256_or_si256(
        diff, _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)),
                               _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q))));
  return _mm256_testz_si256(diff, diff) && std::memcmp(p, q, n) == 0;
}

template <typename T>
ROME_INLINE bool equal(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && equal_bytes(a.data(), b.data(), a.size() * sizeof(T));
}

// Everything derived from the rotation alone, kept per thread and rebuilt when a call comes with
// a different rotation: the same object (address and uid) is taken as is, another one is
// compared by content.
class Prepared {
 public:
  Kind kind = Kind::general;
  int xor_k = 0;
  const __m256i* idx = nullptr;
  const __m256* mask = nullptr;
  const std::int32_t* src = nullptr;
  const std::int32_t* src_n = nullptr;
  const __m256* a_masks = nullptr;
  const __m256* b_masks = nullptr;
  const std::int32_t* shift_count = nullptr;
  const std::int32_t* shift_offset = nullptr;
  const __m256* shift_mask = nullptr;

  void update(const RotationData& r, Work& w) {
    // The same object of the same lineage: nothing to compare (an address reused by another
    // rotation comes with another uid).
    if (&r == last_ && r.uid == last_uid_) return;
    if (!matches(r)) rebuild(r, w);
    last_ = &r;
    last_uid_ = r.uid;
  }

 private:
  void rebuild(const RotationData& r, Work& w) {
    rd_ = r.rotary_dim;
    a_identity_ = r.a_identity;
    b_src_ = r.b.src;
    b_sign_ = r.b.sign;
    a_src_ = r.a_identity ? std::vector<std::int32_t>() : r.a.src;
    a_sign_ = r.a_identity ? std::vector<std::int8_t>() : r.a.sign;
    const VectorPermutePlan& pa = r.avx2.a;
    const VectorPermutePlan& pb = r.avx2.b;
    const std::int64_t V = w.V;
    const std::int64_t a_steps = r.a_identity ? 0 : std::int64_t(pa.steps.size());
    const std::int64_t b_steps = std::int64_t(pb.steps.size());
    // idx, mask (V vectors each), step masks of B and A, shift masks (kMaxShifts·V), src,
    // src_n, shift_count (V each), shift_offset (kMaxShifts·V).
    const std::size_t bytes = std::size_t(2 * V + a_steps + b_steps + kMaxShifts * V) * 32 +
                              std::size_t(V) * 12 + std::size_t(kMaxShifts * V) * 4;
    char* base = static_cast<char*>(storage_.get(bytes));
    auto* idx_v = reinterpret_cast<__m256i*>(base);
    auto* mask_v = reinterpret_cast<__m256*>(idx_v + V);
    auto* b_masks_v = mask_v + V;
    auto* a_masks_v = b_masks_v + b_steps;
    auto* shift_mask_v = a_masks_v + a_steps;
    auto* src_v = reinterpret_cast<std::int32_t*>(shift_mask_v + kMaxShifts * V);
    auto* src_n_v = src_v + V;
    auto* shift_count_v = src_n_v + V;
    auto* shift_offset_v = shift_count_v + V;
    w.xor_k = 0;
    kind = classify(r, w, idx_v, mask_v, src_v, src_n_v);
    if (kind == Kind::general && r.a_identity &&
        classify_shifted(r, w, shift_count_v, shift_offset_v, shift_mask_v))
      kind = two_shifts(r, w, shift_count_v) ? Kind::shifted_two : Kind::shifted;
    shift_count = shift_count_v;
    shift_offset = shift_offset_v;
    shift_mask = shift_mask_v;
    xor_k = w.xor_k;
    for (std::int64_t i = 0; i < b_steps; ++i) b_masks_v[i] = blend_mask(pb.steps[i].lanes);
    for (std::int64_t i = 0; i < a_steps; ++i) a_masks_v[i] = blend_mask(pa.steps[i].lanes);
    idx = idx_v;
    mask = mask_v;
    src = src_v;
    src_n = src_n_v;
    b_masks = b_masks_v;
    a_masks = a_masks_v;
  }

  bool matches(const RotationData& r) const {
    return rd_ == r.rotary_dim && a_identity_ == r.a_identity && equal(b_src_, r.b.src) &&
           equal(b_sign_, r.b.sign) &&
           (r.a_identity || (equal(a_src_, r.a.src) && equal(a_sign_, r.a.sign)));
  }

  const RotationData* last_ = nullptr;
  std::uint64_t last_uid_ = 0;
  std::int64_t rd_ = -1;
  bool a_identity_ = true;
  std::vector<std::int32_t> a_src_, b_src_;
  std::vector<std::int8_t> a_sign_, b_sign_;
  Scratch storage_;
};

struct ThreadState {
  Scratch scratch;  // X of rows longer than the stack buffer
  Prepared prepared;
};
thread_local ThreadState t_state;

Work work_for(const RotationData& r) {
  Work w;
  w.r = &r;
  w.rd = r.rotary_dim;
  w.hd = r.head_dim;
  w.V = (w.rd + kW - 1) / kW;
  w.tail = w.rd % kW ? int(w.rd % kW) : kW;
  return w;
}

TableLayout table_layout(const RotationData& r, DType dtype) {
  if (dtype != DType::bf16 || r.kind != Rotation::Kind::signed_permutation)
    return TableLayout::natural;
  Work w = work_for(r);
  Prepared& prepared = t_state.prepared;
  prepared.update(r, w);
  return even_odd_kind(prepared.kind, w.rd, prepared.xor_k) ? TableLayout::even_odd_16
                                                            : TableLayout::natural;
}

template <DType D>
void forward_permute(const RotationData& r, const ForwardTile& tile) {
  if (tile.count <= 0) return;
  Work w = work_for(r);
  w.pass = tile.copy_passthrough && w.hd > w.rd;
  w.stream = tile.stream;
  ThreadState& state = t_state;
  // X: the row widened to fp32 (general and shifted rows, deinterleave in place; with a vector of
  // padding each side);
  // the permute data comes from the thread's cache.
  constexpr std::int64_t kStackVectors = 32;
  alignas(64) float stack[kStackVectors * kW];
  w.X = w.V + 2 <= kStackVectors
            ? stack
            : static_cast<float*>(state.scratch.get(std::size_t((w.V + 2) * kW) * sizeof(float)));
  Prepared& prepared = state.prepared;
  prepared.update(r, w);
  w.xor_k = prepared.xor_k;
  w.idx = prepared.idx;
  w.mask = prepared.mask;
  w.src = prepared.src;
  w.src_n = prepared.src_n;
  w.a_masks = prepared.a_masks;
  w.b_masks = prepared.b_masks;
  w.shift_count = prepared.shift_count;
  w.shift_offset = prepared.shift_offset;
  w.shift_mask = prepared.shift_mask;
  if constexpr (D == DType::f32) {
    dispatch_rows<RowLanes<D, false, false>>(prepared.kind, w, tile);
  } else {
    if (!exact_products(tile))
      dispatch_rows<RowLanes<D, false, false>>(prepared.kind, w, tile);
    else if (nan_results_low_bits_zero(tile))
      dispatch_rows<RowLanes<D, true, D == DType::bf16>>(prepared.kind, w, tile);
    else
      dispatch_rows<RowLanes<D, true, false>>(prepared.kind, w, tile);
  }
  // Non-temporal stores are weakly ordered: make them visible before the tile is reported done.
  if (w.stream) _mm_sfence();
}

void forward_permute_any(const RotationData& r, const ForwardTile& b) {
  switch (b.dtype) {
    case DType::f32: return forward_permute<DType::f32>(r, b);
    case DType::f16: return forward_permute<DType::f16>(r, b);
    case DType::bf16: return forward_permute<DType::bf16>(r, b);
    default: return scalar_kernels().forward_permute(r, b);
  }
}

// 8 lanes at a time (Bf16::narrow, the permute kernels' rounding), the rest lane by lane.
void narrow_bf16(std::int64_t n, const float* in, std::uint16_t* out) {
  std::int64_t i = 0;
  for (; i + kW <= n; i += kW)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), Bf16::narrow(_mm256_loadu_ps(in + i)));
  for (; i < n; ++i) out[i] = detail::float_to_bf16(in[i]);
}

}  // namespace

const KernelTable& avx2_kernels() {
  static const KernelTable table{
      "avx2",       forward_permute_any,       avx2_forward_dense,     avx2_accumulate_product,
      table_layout, avx2_forward_norm_permute, avx2_norm_table_layout, avx2_cos_sin,
      narrow_bf16};
  return table;
}

}  // namespace rome::kernels
