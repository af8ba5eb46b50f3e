// AVX2 + FMA + F16C kernels: signed-permutation rotations as in-register permutes.
//
// The kernel is common/permute-inl.hpp over 8-lane traits (vpermps with a blend mask, masked
// loads/stores for fp32 tails, a staging buffer for 16-bit ones). Here is what only AVX2 has:
// the kinds that replace AVX-512's two-source permutes (vpermt2ps), and a bf16 path:
//  - deinterleave: interleave_half (DeepSeek MLA): output vectors u and V/2 + u are the even and
//             the odd lanes of input vectors 2u and 2u + 1 (bf16: a shift and a mask per 16
//             lanes; others: two shuffles, two lane permutes), two of each narrowed and stored
//             at once;
//  - shifted: every output vector is a lane blend of at most three unaligned loads of the row
//             widened into an fp32 buffer (block diagonals such as 44+44+40); shifted_two when
//             two loads always do (every half-block at least 8 lanes): no branches, two vectors
//             per step, bf16 narrowed and packed as a pair (rows of 44/44/40 and 44/42/42 read
//             their partner lanes from registers instead, see below);
//  - general: vpermps (_mm256_permutevar8x32_ps) steps of the plan, blended into a zeroed
//             accumulator;
//  - bf16 rows of the pairs, half and quarter kinds, and of shifted_two where every 16 lanes take
//    B from at most two offsets (3D RoPE; 44/44/40 and 44/42/42 on compiled layouts that keep the
//    row in registers, which fp16 rows take too on natural tables), go 16 lanes at a time on
//    tables in even/odd order
//    (TableLayout::even_odd_16): no permute, no pack (8-lane bf16 vectors cost a vpmovzx to
//    widen and a pack and a lane-crossing shuffle to narrow).
// 16-bit rows take the one-fma epilogue (kernel_api.hpp: single_fma_epilogue), fp32 rows the
// compensated one, two outputs at a time (epilogue_pair) unguarded and redone guarded only when a
// result is NaN; bf16 narrows without its NaN case where kernel_api.hpp's
// nan_results_low_bits_zero allows. bf16 is narrowed by integer round-to-nearest-even (NaN
// quietened, subnormals kept), fp16 by F16C (exact).
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <new>
#include <type_traits>
#include <utility>
#include <vector>

#include "../../core/convert.hpp"
#include "../common/permute-inl.hpp"
#include "../common/stream_copy-inl.hpp"
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
using namespace permute;

// Two outputs of the epilogue. The compensated one runs without its guard and is redone with it
// when a result is NaN (the only case where the guard can matter; see combine_unguarded); the
// one-fma one has no guard.
template <bool kOneFma>
ROME_INLINE void epilogue_pair(__m256 a0, __m256 c0, __m256 b0, __m256 s0, __m256 a1, __m256 c1,
                               __m256 b1, __m256 s1, __m256& out0, __m256& out1) {
  if constexpr (kOneFma) {
    out0 = combine_one_fma(a0, c0, b0, s0);
    out1 = combine_one_fma(a1, c1, b1, s1);
  } else {
    out0 = combine_unguarded(a0, c0, b0, s0);
    out1 = combine_unguarded(a1, c1, b1, s1);
    if (__builtin_expect(any_nan(out0, out1), 0)) {
      out0 = avx2::combine(a0, c0, b0, s0);
      out1 = avx2::combine(a1, c1, b1, s1);
    }
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

ROME_INLINE __m256 blend_mask(std::uint32_t lanes) {
  const __m256i bits = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  return _mm256_castsi256_ps(
      _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(int(lanes)), bits), bits));
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

// The traits of common/permute-inl.hpp: a lane count for tails, a blend mask per permute.
struct Avx2 {
  using F = __m256;
  using Count = int;
  using Index = __m256i;
  using Mask = __m256;
  static constexpr int kLanes = kW;
  static constexpr Count kAll = kW;
  // Shifted loads reach up to 7 lanes either side of X; bf16 shifted rows keep two copies of the
  // row, each with 16 lanes of padding either side (rows_bf16_shifted).
  static constexpr int kPadVectors = 4;
  static ROME_INLINE Count lanes(int n) { return n; }
  static ROME_INLINE std::uint32_t bits(Count n) { return (1u << n) - 1; }
  static ROME_INLINE F load(const float* p) { return _mm256_load_ps(p); }
  static ROME_INLINE void store(float* p, F v) { _mm256_store_ps(p, v); }
  static ROME_INLINE F combine(F xa, F c, F xb, F s) { return avx2::combine(xa, c, xb, s); }
  static ROME_INLINE F combine_one_fma(F xa, F c, F xb, F s) {
    return avx2::combine_one_fma(xa, c, xb, s);
  }
  template <bool kOneFma>
  static ROME_INLINE void epilogue_pair(F a0, F c0, F b0, F s0, F a1, F c1, F b1, F s1, F& out0,
                                        F& out1) {
    kernels::epilogue_pair<kOneFma>(a0, c0, b0, s0, a1, c1, b1, s1, out0, out1);
  }
  static ROME_INLINE F swap_pairs(F x) { return _mm256_permute_ps(x, 0xb1); }
  static ROME_INLINE F permute(F x, Index idx, Mask mask) {
    return _mm256_and_ps(_mm256_permutevar8x32_ps(x, idx), mask);
  }
  static ROME_INLINE Index index(const std::int32_t* lanes) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lanes));
  }
  static ROME_INLINE Mask mask(std::uint32_t lanes) { return blend_mask(lanes); }
  struct GeneralPlan {
    const PermuteStep* steps;
    const std::int32_t* begin;
    const __m256* masks;
  };
  template <class W>
  static ROME_INLINE GeneralPlan general_plan(const W& w, bool a) {
    const VectorPermutePlan& p = a ? w.r->avx2.a : w.r->avx2.b;
    return {p.steps.data(), p.step_begin.data(), a ? w.a_masks : w.b_masks};
  }
  static ROME_INLINE F permute_plan(const GeneralPlan& p, std::int64_t v, const float* X) {
    return permute_vector(p.steps, p.masks, p.begin[v], p.begin[v + 1], X);
  }
  // kernel_support.hpp: prefetch_distance.
  static ROME_INLINE void prefetch_to_l2(const char* p) { _mm_prefetch(p, _MM_HINT_T1); }
  static ROME_INLINE void copy_bytes(void* dst, const void* src, std::int64_t bytes, bool stream) {
    avx2::copy_bytes(dst, src, bytes, stream);
  }
  static ROME_INLINE void fence() { _mm_sfence(); }
  static ROME_INLINE bool equal_bytes(const void* a, const void* b, std::size_t n) {
    return kernels::equal_bytes(a, b, n);
  }
};

// shifted: output vector v takes its B lanes from at most kMaxShifts unaligned loads of the
// widened row, X[8v + d .. 8v + d + 8) for a few offsets d, blended by lane (block diagonals
// whose blocks are not multiples of 8 lanes, e.g. 3D RoPE 44+44+40: a vector straddles at most
// two half-blocks, so two or three loads replace a chain of cross-lane permutes).
// shifted_two: every vector has a B source in every lane from at most two loads, the row is
// whole vectors and an even number of them (3D RoPE such as 16+56+56 or 88+88+80: every
// half-block has at least 8 lanes): two loads and one blend per vector, no branches, two vectors
// per step. 44+44+40 and 44+42+42 take the register rows below instead.
constexpr int kMaxShifts = 3;

struct Plan : PlanBase<Avx2> {
  const __m256* a_masks = nullptr;  // general: per plan step
  const __m256* b_masks = nullptr;
  const std::int32_t* shift_count = nullptr;   // shifted: per output vector
  const std::int32_t* shift_offset = nullptr;  // shifted: kMaxShifts per output vector
  const __m256* shift_mask = nullptr;
  // shifted_two rotations whose every 16 lanes take B from at most two offsets (bf16 rows run
  // 16 lanes at a time on them): two offsets and a byte blend mask per 16 lanes.
  bool bf16_chunks = false;
  const std::int32_t* chunk_offset = nullptr;
  const __m256i* chunk_mask = nullptr;
  // bf16_chunks rotations that are a compiled 3D layout (kBlocks3d; rows of every dtype): which
  // one, 1-based (0: none).
  int layout_3d = 0;
};
using Work = permute::Work<Plan>;

// The row loops' type parameter: the storage type's lanes and what the tile's values allow
// (kernel_api.hpp: nan_results_low_bits_zero).
template <DType D, bool kNanLowBitsZero>
struct RowLanes : std::conditional_t<D == DType::bf16 && kNanLowBitsZero,
                                     Lanes16<Bf16NanLowBitsZero>, Lanes<D>> {
  static constexpr DType kDType = D;
  static constexpr bool kNarrowWithoutNanCheck = kNanLowBitsZero;
};

// ---------------------------------------------------------------------------------------------
// Row loops of AVX2's own kinds

// The row is widened into X (a vector of padding before it and at least one after: a shifted load
// may start up to 7 lanes before the row or end up to 7 lanes past it; those lanes are never
// selected).
template <typename L>
ROME_INLINE void rows_shifted(const Work& w, const ForwardTile& tile) {
  float* const X = w.X + kW;
  for_rows<L>(w, tile, [&](const Row<L>& row, bool stream) ROME_INLINE_LAMBDA {
    widen_row<L>(w, row.x, X);
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
      put<L>(w, stream, row.y, v, combine<L>(w, _mm256_load_ps(at), xb, row, v));
    }
  });
}

// Output vectors v and v + 1 of a row, a·c + b·s from the row's tables C and S at vector v. bf16
// with no NaN result (the common case) narrows and packs both at once: one 32-byte store, no
// 16-byte pack and extract per vector.
template <typename L>
ROME_INLINE void put_pair(const Work& w, bool stream, typename L::T* y, std::int64_t v, __m256 a0,
                          __m256 b0, __m256 a1, __m256 b1, const float* C, const float* S) {
  constexpr bool kOneFma = kOneFmaRows<L>;
  if constexpr (L::kDType == DType::bf16) {
    const __m256 out0 = combine_one_fma(a0, _mm256_load_ps(C), b0, _mm256_load_ps(S));
    const __m256 out1 = combine_one_fma(a1, _mm256_load_ps(C + kW), b1, _mm256_load_ps(S + kW));
    if (L::kNarrowWithoutNanCheck || __builtin_expect(!any_nan(out0, out1), 1)) {
      auto* at = reinterpret_cast<__m256i*>(y + kW * v);
      const __m256i packed = narrow_bf16_pair_not_nan(out0, out1);
      if (stream)
        _mm256_stream_si256(at, packed);
      else
        _mm256_storeu_si256(at, packed);
      return;
    }
    // A NaN result: with the NaN case of the narrowing.
    put<L>(w, stream, y, v, out0);
    put<L>(w, stream, y, v + 1, out1);
  } else {
    __m256 out0, out1;
    epilogue_pair<kOneFma>(a0, _mm256_load_ps(C), b0, _mm256_load_ps(S), a1, _mm256_load_ps(C + kW),
                           b1, _mm256_load_ps(S + kW), out0, out1);
    put<L>(w, stream, y, v, out0);
    put<L>(w, stream, y, v + 1, out1);
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
  for_rows<L>(w, tile, [&](const Row<L>& row, bool stream) ROME_INLINE_LAMBDA {
    for (std::int64_t j = 0; j < kW * w.V; j += 2 * kW) {  // two vectors per step (V is even)
      _mm256_store_ps(X + j, L::load(row.x + j));
      _mm256_store_ps(X + j + kW, L::load(row.x + j + kW));
    }
    for (std::int64_t v = 0; v < w.V; v += 2)
      put_pair<L>(w, stream, row.y, v, _mm256_load_ps(X + kW * v), b_lanes(v),
                  _mm256_load_ps(X + kW * (v + 1)), b_lanes(v + 1), row.C + kW * v, row.S + kW * v);
  });
}

// bf16 rows, 16 lanes at a time without any permute: the 16 values of one 32-byte load split
// into their even lanes (shifted up) and odd lanes (masked), and the tables come in that order
// (TableLayout::even_odd_16). Interleave pairs an even lane with the odd lane beside it; half
// and quarter pair chunk c with chunk c ^ K; 3D rows take their partner lanes from registers
// (rows_16bit_3d) or shifted loads (rows_bf16_shifted). The outputs are rounded as Bf16::narrow
// does and
// merged back by a shift and a word blend: no vpmovzx, pack or lane-crossing shuffle (the
// splitting and rounding helpers are in avx2_lanes.hpp, shared with the QK-norm kernel).
template <bool kStream>
ROME_INLINE void store_bf16(std::uint16_t* p, __m256i w) {
  if constexpr (kStream)
    _mm256_stream_si256(reinterpret_cast<__m256i*>(p), w);
  else
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), w);
}

// Output chunk c from input chunks c (a) and its partner (b): y = a·C + b'·S, where b' is b
// (half, quarter) or a with even and odd swapped (interleave), in one fma (bf16 rows). The fast
// path skips the rounding's NaN case; a chunk with a NaN among its results is narrowed with it.
// Without the NaN check when every NaN result has 16 zero low bits: rounding then leaves its high
// half as it is, already quiet (the fma quietened it), which is what the NaN case would make of it.
template <bool kPairs, bool kNoNanCheck, bool kStream>
ROME_INLINE void bf16_chunk(const EvenOdd& a, const EvenOdd& b, const float* C, const float* S,
                            std::uint16_t* y) {
  const __m256 b_even = kPairs ? a.odd : b.even, b_odd = kPairs ? a.even : b.odd;
  const __m256 c_even = _mm256_load_ps(C), c_odd = _mm256_load_ps(C + kW);
  const __m256 s_even = _mm256_load_ps(S), s_odd = _mm256_load_ps(S + kW);
  const __m256 even = combine_one_fma(a.even, c_even, b_even, s_even);
  const __m256 odd = combine_one_fma(a.odd, c_odd, b_odd, s_odd);
  if (kNoNanCheck || __builtin_expect(!any_nan(even, odd), 1)) {
    store_bf16<kStream>(
        y, merge_bf16_even_odd(round_bf16_high_not_nan(even), round_bf16_high_not_nan(odd)));
    return;
  }
  store_bf16<kStream>(y, merge_bf16_even_odd(round_bf16_high(even), round_bf16_high(odd)));
}

template <typename L, bool kStream>
ROME_INLINE void row_bf16_pairs(std::int64_t chunks, const Row<L>& row) {
  for (std::int64_t c = 0; c < 16 * chunks; c += 16) {
    const EvenOdd a = split_bf16(row.x + c);
    bf16_chunk<true, L::kNarrowWithoutNanCheck, kStream>(a, a, row.C + c, row.S + c, row.y + c);
  }
}

template <typename L>
ROME_INLINE void rows_bf16_pairs(const Work& w, const ForwardTile& tile) {
  // The common widths with the chunk count a constant (permute::fixed_width_rows).
  if (fixed_width_rows<L>(
          w, tile, [](auto lanes, const Row<L>& row, auto stream) ROME_INLINE_LAMBDA {
            row_bf16_pairs<L, decltype(stream)::value>(decltype(lanes)::value / 16, row);
          }))
    return;
  const std::int64_t chunks = w.rd / 16;
  for_rows<L>(w, tile, [&](const Row<L>& row, bool stream) ROME_INLINE_LAMBDA {
    if (stream)
      row_bf16_pairs<L, true>(chunks, row);
    else
      row_bf16_pairs<L, false>(chunks, row);
  });
}

// Chunks c and c + K (lanes 16c.. and 16(c + K)..) swap roles, for c in the first K chunks of
// every 2K; both are read before either is written (in place safe).
template <typename L, bool kStream>
ROME_INLINE void row_bf16_xor(std::int64_t chunks, std::int64_t K, const Row<L>& row) {
  const std::int64_t d = 16 * K;
  for (std::int64_t c0 = 0; c0 < 16 * chunks; c0 += 2 * d) {
    for (std::int64_t c = c0; c < c0 + d; c += 16) {
      const EvenOdd a = split_bf16(row.x + c), b = split_bf16(row.x + c + d);
      constexpr bool kNoCheck = L::kNarrowWithoutNanCheck;
      bf16_chunk<false, kNoCheck, kStream>(a, b, row.C + c, row.S + c, row.y + c);
      bf16_chunk<false, kNoCheck, kStream>(b, a, row.C + c + d, row.S + c + d, row.y + c + d);
    }
  }
}

template <typename L>
ROME_INLINE void rows_bf16_xor(const Work& w, const ForwardTile& tile) {
  const std::int64_t chunks = w.rd / 16, K = w.xor_k / 2;
  // The half rotation (chunk c pairs with c + chunks / 2) and the quarter one (or two half
  // blocks: c + chunks / 4) at the common widths, K a constant.
  auto fixed = [&](auto parts) ROME_INLINE_LAMBDA {
    return fixed_width_rows<L>(
        w, tile, [](auto lanes, const Row<L>& row, auto stream) ROME_INLINE_LAMBDA {
          constexpr std::int64_t kChunks = decltype(lanes)::value / 16;
          row_bf16_xor<L, decltype(stream)::value>(kChunks, kChunks / decltype(parts)::value, row);
        });
  };
  if (2 * K == chunks && fixed(std::integral_constant<std::int64_t, 2>{})) return;
  if (4 * K == chunks && fixed(std::integral_constant<std::int64_t, 4>{})) return;
  for_rows<L>(w, tile, [&](const Row<L>& row, bool stream) ROME_INLINE_LAMBDA {
    if (stream)
      row_bf16_xor<L, true>(chunks, K, row);
    else
      row_bf16_xor<L, false>(chunks, K, row);
  });
}

// bf16 rows of shifted_two rotations whose every 16 lanes take B from at most two offsets (3D
// RoPE other than the compiled layouts below, e.g. 16/56/56 or 88/88/80): the shifted loads and
// their blend act on the bf16 values, 16 lanes per load, and the result splits into even and odd
// lanes as above (no widening, no pack). They read a copy of the row with 16 lanes of zeros
// either side: a shifted load reaches up to 15 lanes past either end of the row, and in place
// the outputs overwrite lanes that later chunks still take B from.
ROME_INLINE void copy_row_bf16(const std::uint16_t* x, std::int64_t rd, std::uint16_t* copy) {
  for (std::int64_t c = 0; c < rd; c += 16)
    _mm256_store_si256(reinterpret_cast<__m256i*>(copy + c),
                       _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + c)));
}

template <typename L, bool kStream>
ROME_INLINE void row_bf16_shifted(const Work& w, const Row<L>& row, const std::uint16_t* copy) {
  for (std::int64_t c = 0, k = 0; c < w.rd; c += 16, ++k) {
    const std::int32_t* d = w.chunk_offset + 2 * k;
    const __m256i b = _mm256_blendv_epi8(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(copy + c + d[0])),
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(copy + c + d[1])), w.chunk_mask[k]);
    constexpr bool kNoCheck = L::kNarrowWithoutNanCheck;
    bf16_chunk<false, kNoCheck, kStream>(split_bf16(copy + c), split_bf16(b), row.C + c, row.S + c,
                                         row.y + c);
  }
}

// Each row is copied while the previous one is rotated, from the other of two copies: a shifted
// load spans two of the copying stores, and a load overlapping two stores still in the store
// buffer cannot take its data from them; it waits until they reach L1 (3D 44/44/40 in L1,
// 1 thread: 16.0 -> 14.8 us per call on an AVX2 EPYC).
template <typename L>
ROME_INLINE void rows_bf16_shifted(const Work& w, const ForwardTile& tile) {
  const std::int64_t pitch = w.rd + 32;
  std::uint16_t* const copies[2] = {reinterpret_cast<std::uint16_t*>(w.X) + 16,
                                    reinterpret_cast<std::uint16_t*>(w.X) + 16 + pitch};
  const __m256i zero = _mm256_setzero_si256();
  for (std::uint16_t* copy : copies) {
    _mm256_store_si256(reinterpret_cast<__m256i*>(copy - 16), zero);
    _mm256_store_si256(reinterpret_cast<__m256i*>(copy + w.rd), zero);
  }
  int next = 0;
  // The row copied last and not yet rotated. A flag of its own: testing pending.x instead took
  // 5% longer per call in L1 (3D 44/44/40, 14.5 against 13.8 us).
  Row<L> pending{};
  bool pending_stream = false, have_pending = false;
  auto rotate = [&](const Row<L>& row, bool stream, const std::uint16_t* copy) ROME_INLINE_LAMBDA {
    if (stream)
      row_bf16_shifted<L, true>(w, row, copy);
    else
      row_bf16_shifted<L, false>(w, row, copy);
  };
  for_rows<L>(w, tile, [&](const Row<L>& row, bool stream) ROME_INLINE_LAMBDA {
    copy_row_bf16(row.x, w.rd, copies[next]);
    if (have_pending) rotate(pending, pending_stream, copies[next ^ 1]);
    pending = row;
    pending_stream = stream;
    have_pending = true;
    next ^= 1;
  });
  if (have_pending) rotate(pending, pending_stream, copies[next ^ 1]);
}

// 3D RoPE rows of the layouts video models use (44/44/40, and Wan's 44/42/42, half rotation in
// each block, rotary_dim 128), 16-bit rows here (fp32 below): chunk c's B lanes lie plus[c] lanes
// after it and minus[c] lanes before it (0: none). Each chunk of x is loaded once into a register
// (fp16 reads its A lanes again, widening from memory); the lanes before a chunk come from the
// previous two chunks' registers by a byte funnel shift, so in place nothing is read after it was
// written and the row needs no copy, and the lanes after come from an unaligned load of x inside
// the row (in place they are written later) or, at the row's end, from the next chunk's register.
// The 16-bit lanes move as they are; bf16 then splits into even and odd lanes (tables in even/odd
// order), fp16 widens each half by F16C (natural tables). Paired against what they replace (AVX2
// Zen 3, 44/44/40 in place, 1 thread): bf16 against row copies 0.60x the time in L2, 0.72-0.80x on
// the seed tensor from DRAM; fp16 against the widened fp32 row 0.60x and 0.57x.
constexpr int kBlocks3d[][3] = {{44, 44, 40}, {44, 42, 42}};

// Where lane j of half rotations in `blocks` takes B from: +h lanes in the first half of a block
// of 2h lanes, -h in its second.
constexpr int partner_offset_3d(const int (&blocks)[3], int j) {
  int start = 0;
  for (int size : blocks) {
    if (j < start + size) return j < start + size / 2 ? size / 2 : -(size / 2);
    start += size;
  }
  return 0;
}

// The same per vector of kLanes lanes over 128 lanes: B lies plus[v] lanes after it and minus[v]
// before it (0: none), `before` is the blend mask of the lanes that take B from before (16-bit
// words for 16-lane chunks, dwords for 8 fp32 lanes).
template <int kLanes>
struct Layout3d {
  using Word = std::conditional_t<kLanes == 16, std::uint16_t, std::uint32_t>;
  std::int32_t plus[128 / kLanes] = {}, minus[128 / kLanes] = {};
  alignas(32) Word before[128 / kLanes][kLanes] = {};
};
template <int kLanes>
constexpr Layout3d<kLanes> layout_3d(const int (&blocks)[3]) {
  Layout3d<kLanes> out;
  for (int j = 0; j < 128; ++j) {
    const int offset = partner_offset_3d(blocks, j);
    (offset > 0 ? out.plus : out.minus)[j / kLanes] = offset > 0 ? offset : -offset;
    out.before[j / kLanes][j % kLanes] = offset < 0 ? typename Layout3d<kLanes>::Word(~0u) : 0;
  }
  return out;
}
// The kernels' assumptions: every vector takes B from at most one offset each way (each half of
// a block is at least 16 lanes, so no vector meets two blocks' first or second halves), partners
// strictly between 16 and 32 lanes away and not a whole number of vectors (the funnels shift by
// 1-31 bytes), nothing after the last vector.
template <int kLanes>
constexpr bool layout_3d_fits(const int (&blocks)[3]) {
  const Layout3d<kLanes> layout = layout_3d<kLanes>(blocks);
  if (blocks[0] + blocks[1] + blocks[2] != 128 || layout.plus[128 / kLanes - 1] != 0) return false;
  for (int size : blocks)
    if (size % 2 != 0 || size / 2 <= 16 || size / 2 >= 32 || (size / 2) % 8 == 0) return false;
  return true;
}
static_assert(layout_3d_fits<16>(kBlocks3d[0]) && layout_3d_fits<16>(kBlocks3d[1]));
static_assert(layout_3d_fits<8>(kBlocks3d[0]) && layout_3d_fits<8>(kBlocks3d[1]));
constexpr Layout3d<16> kLayouts3d[] = {layout_3d<16>(kBlocks3d[0]), layout_3d<16>(kBlocks3d[1])};
constexpr Layout3d<8> kLayouts3dF32[] = {layout_3d<8>(kBlocks3d[0]), layout_3d<8>(kBlocks3d[1])};

// Bytes [N, N + 32) of the 64 bytes lo, hi (lo first), 0 < N < 32.
template <int N>
ROME_INLINE __m256i funnel_bytes(__m256i lo, __m256i hi) {
  static_assert(N > 0 && N < 32);
  const __m256i middle = _mm256_permute2x128_si256(lo, hi, 0x21);
  if constexpr (N < 16)
    return _mm256_alignr_epi8(middle, lo, N);
  else if constexpr (N == 16)
    return middle;
  else
    return _mm256_alignr_epi8(hi, middle, N - 16);
}

// x[I] or zero where I is outside the row's vectors.
template <int I, int N>
ROME_INLINE __m256i vector_or_zero(const __m256i (&x)[N]) {
  if constexpr (I >= 0 && I < N)
    return x[I];
  else
    return _mm256_setzero_si256();
}

// The blend mask of vector v's lanes that take B from before it.
template <int kLanes>
ROME_INLINE __m256i before_mask(const Layout3d<kLanes>& layout, int v) {
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(layout.before[v]));
}

template <int kLayoutIndex, typename L, bool kStream>
ROME_INLINE void row_16bit_3d(const Row<L>& row) {
  constexpr const Layout3d<16>& kLayout = kLayouts3d[kLayoutIndex];
  const auto load = [&](int c) ROME_INLINE_LAMBDA {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row.x + 16 * c));
  };
  const __m256i zero = _mm256_setzero_si256();
  __m256i x[8];
  x[0] = load(0);
  [&]<int... C>(std::integer_sequence<int, C...>) ROME_INLINE_LAMBDA {
    (
        [&] {
          constexpr int plus = kLayout.plus[C], minus = kLayout.minus[C];
          // The next chunk is needed now where the lanes after this one run past the row.
          constexpr bool plus_from_next = plus > 0 && 16 * C + plus + 16 > 128;
          if constexpr (C + 1 < 8) x[C + 1] = load(C + 1);
          __m256i after = zero, before = zero;
          if constexpr (plus_from_next)
            after = funnel_bytes<2 * (plus - 16)>(x[C + 1], zero);
          else if constexpr (plus > 0)
            after = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row.x + 16 * C + plus));
          if constexpr (minus > 0)
            before =
                funnel_bytes<64 - 2 * minus>(vector_or_zero<C - 2>(x), vector_or_zero<C - 1>(x));
          const __m256i b = plus == 0 ? before
                            : minus == 0
                                ? after
                                : _mm256_blendv_epi8(after, before, before_mask(kLayout, C));
          const float* c = row.C + 16 * C;
          const float* s = row.S + 16 * C;
          auto* y = row.y + 16 * C;
          if constexpr (L::kDType == DType::bf16) {
            bf16_chunk<false, L::kNarrowWithoutNanCheck, kStream>(split_bf16(x[C]), split_bf16(b),
                                                                  c, s, y);
          } else {  // fp16: natural lanes, widened and narrowed by F16C
            const __m256 b_low = _mm256_cvtph_ps(_mm256_castsi256_si128(b));
            const __m256 b_high = _mm256_cvtph_ps(_mm256_extracti128_si256(b, 1));
            const __m256 low = combine_one_fma(L::load(row.x + 16 * C), _mm256_load_ps(c), b_low,
                                               _mm256_load_ps(s));
            const __m256 high =
                combine_one_fma(L::load(row.x + 16 * C + kW), _mm256_load_ps(c + kW), b_high,
                                _mm256_load_ps(s + kW));
            if constexpr (kStream) {
              L::stream(y, low);
              L::stream(y + kW, high);
            } else {
              L::store(y, low);
              L::store(y + kW, high);
            }
          }
        }(),
        ...);
  }
  (std::make_integer_sequence<int, 8>{});
}

template <int kLayoutIndex, typename L>
ROME_INLINE void rows_16bit_3d(const Work& w, const ForwardTile& tile) {
  // The compiled layouts are 128 lanes wide (permute::for_fixed_rows).
  if (for_fixed_rows<L, 128 * 2>(w, tile, [](const Row<L>& row, auto stream) ROME_INLINE_LAMBDA {
        row_16bit_3d<kLayoutIndex, L, decltype(stream)::value>(row);
      }))
    return;
  for_rows<L>(w, tile, [&](const Row<L>& row, bool stream) ROME_INLINE_LAMBDA {
    if (stream)
      row_16bit_3d<kLayoutIndex, L, true>(row);
    else
      row_16bit_3d<kLayoutIndex, L, false>(row);
  });
}

// fp32 rows of the same layouts, 8 lanes a vector, two vectors a step (put_pair's epilogue): the
// lanes before vector v come from the registers of the vectors 2-4 before it, those after it from
// an unaligned load inside the row or the registers of the vectors after it; a vector with both
// blends them. They used to read shifted loads of a copy of the row.
template <int kLayoutIndex, typename L>
ROME_INLINE void row_f32_3d(const Work& w, bool stream, const Row<L>& row) {
  constexpr const Layout3d<8>& kLayout = kLayouts3dF32[kLayoutIndex];
  const auto load = [&](int v) ROME_INLINE_LAMBDA {
    return _mm256_castps_si256(_mm256_loadu_ps(row.x + kW * v));
  };
  const __m256i zero = _mm256_setzero_si256();
  __m256i x[16];
  for (int v = 0; v < 4; ++v) x[v] = load(v);
  // Lanes [8v + offset, 8v + offset + 8) of the row from registers (zero before the row's start
  // and past its end).
  const auto lanes_at = [&]<int V, int kOffset>() ROME_INLINE_LAMBDA {
    constexpr int first = 8 * V + kOffset, q = first >= 0 ? first / 8 : -((7 - first) / 8);
    constexpr int r = first - 8 * q;
    static_assert(r != 0, "layout_3d_fits: partners are not whole vectors away");
    return funnel_bytes<4 * r>(vector_or_zero<q>(x), vector_or_zero<q + 1>(x));
  };
  const auto b_of = [&]<int V>() ROME_INLINE_LAMBDA {
    constexpr int plus = kLayout.plus[V], minus = kLayout.minus[V];
    __m256i after = zero, before = zero;
    if constexpr (plus > 0 && 8 * V + plus + 8 <= 128)
      after = _mm256_castps_si256(_mm256_loadu_ps(row.x + kW * V + plus));
    else if constexpr (plus > 0)
      after = lanes_at.template operator()<V, plus>();
    if constexpr (minus > 0) before = lanes_at.template operator()<V, -minus>();
    if constexpr (plus == 0) return _mm256_castsi256_ps(before);
    if constexpr (minus == 0) return _mm256_castsi256_ps(after);
    return _mm256_castsi256_ps(_mm256_blendv_epi8(after, before, before_mask(kLayout, V)));
  };
  [&]<int... P>(std::integer_sequence<int, P...>) ROME_INLINE_LAMBDA {
    (
        [&] {
          constexpr int v = 2 * P;
          if constexpr (v + 4 < 16) x[v + 4] = load(v + 4);
          if constexpr (v + 5 < 16) x[v + 5] = load(v + 5);
          const __m256 b0 = b_of.template operator()<v>();
          const __m256 b1 = b_of.template operator()<v + 1>();
          put_pair<L>(w, stream, row.y, v, _mm256_castsi256_ps(x[v]), b0,
                      _mm256_castsi256_ps(x[v + 1]), b1, row.C + kW * v, row.S + kW * v);
        }(),
        ...);
  }
  (std::make_integer_sequence<int, 8>{});
}

template <int kLayoutIndex, typename L>
ROME_INLINE void rows_f32_3d(const Work& w, const ForwardTile& tile) {
  if (for_fixed_rows<L, 128 * 4>(w, tile, [&](const Row<L>& row, auto stream) ROME_INLINE_LAMBDA {
        row_f32_3d<kLayoutIndex, L>(w, stream, row);
      }))
    return;
  for_rows<L>(w, tile, [&](const Row<L>& row, bool stream) ROME_INLINE_LAMBDA {
    row_f32_3d<kLayoutIndex, L>(w, stream, row);
  });
}

// Rows of the compiled 3D layout w.layout_3d, by dtype.
template <typename L>
ROME_INLINE void rows_3d(const Work& w, const ForwardTile& tile) {
  auto rows = [&]<int kLayoutIndex>() ROME_INLINE_LAMBDA {
    if constexpr (L::kDType == DType::f32)
      rows_f32_3d<kLayoutIndex, L>(w, tile);
    else
      rows_16bit_3d<kLayoutIndex, L>(w, tile);
  };
  static_assert(std::size(kBlocks3d) == 2);
  if (w.layout_3d == 1)
    rows.template operator()<0>();
  else
    rows.template operator()<1>();
}

// Output vector u takes A from the even lanes and B from the odd lanes of input vectors 2u and
// 2u + 1, output vector H + u the other way round; two of each at a time (put_pair) while they
// last. bf16 splits each 16 lanes by a shift and a mask (split_bf16), other types by shuffles of
// the widened vectors. In place the row is copied into X first (bf16 as it is, others widened):
// output H + u would overwrite an input vector not yet read.
template <typename L>
ROME_INLINE void rows_deinterleave(const Work& w, const ForwardTile& tile) {
  const std::int64_t H = w.V / 2;
  for_rows<L>(w, tile, [&](const Row<L>& row, bool stream) ROME_INLINE_LAMBDA {
    const bool in_place = static_cast<const void*>(row.x) == static_cast<const void*>(row.y);
    [[maybe_unused]] const auto* bf16_copy = reinterpret_cast<const typename L::T*>(w.X);
    if (in_place) {
      if constexpr (L::kDType == DType::bf16)
        copy_row_bf16(row.x, w.rd, reinterpret_cast<std::uint16_t*>(w.X));
      else
        for (std::int64_t v = 0; v < w.V; ++v)
          _mm256_store_ps(w.X + kW * v, L::load(row.x + kW * v));
    }
    auto split = [&](std::int64_t u) ROME_INLINE_LAMBDA {
      const std::int64_t at = 2 * kW * u;
      if constexpr (L::kDType == DType::bf16)
        return split_bf16(in_place ? bf16_copy + at : row.x + at);
      else
        return in_place ? split_even_odd(_mm256_load_ps(w.X + at), _mm256_load_ps(w.X + at + kW))
                        : split_even_odd(L::load(row.x + at), L::load(row.x + at + kW));
    };
    std::int64_t u = 0;
    for (; u + 1 < H; u += 2) {
      const EvenOdd e0 = split(u), e1 = split(u + 1);
      put_pair<L>(w, stream, row.y, u, e0.even, e0.odd, e1.even, e1.odd, row.C + kW * u,
                  row.S + kW * u);
      put_pair<L>(w, stream, row.y, H + u, e0.odd, e0.even, e1.odd, e1.even, row.C + kW * (H + u),
                  row.S + kW * (H + u));
    }
    if (u < H) {
      const EvenOdd eo = split(u);
      const __m256 cu = _mm256_load_ps(row.C + kW * u), su = _mm256_load_ps(row.S + kW * u);
      const __m256 ch = _mm256_load_ps(row.C + kW * (H + u));
      const __m256 sh = _mm256_load_ps(row.S + kW * (H + u));
      __m256 lo, hi;
      epilogue_pair<kOneFmaRows<L>>(eo.even, cu, eo.odd, su, eo.odd, ch, eo.even, sh, lo, hi);
      put<L>(w, stream, row.y, u, lo);
      put<L>(w, stream, row.y, H + u, hi);
    }
  });
}

// Whether bf16 rows of this plan run 16 lanes at a time on even/odd tables.
bool even_odd_kind(const Plan& p, std::int64_t rd) {
  if (p.kind == Kind::pairs) return rd % 16 == 0;
  if (p.kind == Kind::half_move || p.kind == Kind::quarter_move) return p.xor_k % 2 == 0;
  return p.kind == Kind::shifted_two && p.bf16_chunks;
}

template <typename L>
ROME_INLINE void dispatch_rows(Kind kind, const Work& w, const ForwardTile& tile) {
  // layout_3d is set only with bf16_chunks, where bf16 tables are in even/odd order.
  if (kind == Kind::shifted_two && w.layout_3d > 0) return rows_3d<L>(w, tile);
  if constexpr (L::kDType == DType::bf16) {
    if (even_odd_kind(w, w.rd)) {
      if (kind == Kind::pairs) return rows_bf16_pairs<L>(w, tile);
      if (kind == Kind::shifted_two) return rows_bf16_shifted<L>(w, tile);
      return rows_bf16_xor<L>(w, tile);
    }
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

// The slot of offset `off` among the n offsets in d, appending it while fewer than `most` are
// taken; -1 when it would be one too many.
int offset_slot(std::int32_t* d, int& n, int most, std::int32_t off) {
  int i = 0;
  while (i < n && d[i] != off) ++i;
  if (i < n) return i;
  if (n == most) return -1;
  d[n] = off;
  return n++;
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
      const int i = offset_slot(d, n, kMaxShifts, r.b.src[j] - std::int32_t(j));
      if (i < 0) return false;
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

// The two offsets and the byte blend mask of every 16 lanes (bf16_chunks); false when some 16
// lanes take B from more than two offsets. Call on shifted_two rotations only (whole 16-lane
// chunks, every lane with a B source).
bool classify_chunks(const RotationData& r, const Work& w, std::int32_t* offset, __m256i* mask) {
  for (std::int64_t k = 0; k < w.rd / 16; ++k) {
    std::int32_t d[2] = {};
    int n = 0;
    alignas(32) std::uint16_t second[16] = {};
    for (int l = 0; l < 16; ++l) {
      const std::int64_t j = 16 * k + l;
      const int i = offset_slot(d, n, 2, r.b.src[j] - std::int32_t(j));
      if (i < 0) return false;
      second[l] = i == 1 ? 0xffff : 0;
    }
    offset[2 * k] = d[0];
    offset[2 * k + 1] = n == 2 ? d[1] : d[0];
    mask[k] = _mm256_load_si256(reinterpret_cast<const __m256i*>(second));
  }
  return true;
}

// Which compiled 3D layout (1-based index into kBlocks3d, 0: none) B is: every lane's partner
// offset as the blocks give it.
int classify_3d(const RotationData& r, const Work& w) {
  if (w.rd != 128) return 0;
  for (int i = 0; i < int(std::size(kBlocks3d)); ++i) {
    bool match = true;
    for (std::int64_t j = 0; j < 128 && match; ++j)
      match = r.b.sign[j] != 0 && r.b.src[j] - j == partner_offset_3d(kBlocks3d[i], int(j));
    if (match) return i + 1;
  }
  return 0;
}

// The plan of a rotation, its arrays in `storage`: idx, mask (V vectors each), step masks of B
// and A, shift masks (kMaxShifts·V), chunk masks (V/2), src, src_n, shift_count (V each),
// shift_offset (kMaxShifts·V), chunk offsets (V).
Plan build_plan(const RotationData& r, const Work& w, Scratch& storage) {
  const VectorPermutePlan& pa = r.avx2.a;
  const VectorPermutePlan& pb = r.avx2.b;
  const std::int64_t V = w.V;
  const std::int64_t a_steps = r.a_identity ? 0 : std::int64_t(pa.steps.size());
  const std::int64_t b_steps = std::int64_t(pb.steps.size());
  const std::int64_t chunks = V / 2;
  const std::size_t bytes = std::size_t(2 * V + a_steps + b_steps + kMaxShifts * V + chunks) * 32 +
                            std::size_t(V) * 16 + std::size_t(kMaxShifts * V) * 4;
  char* base = static_cast<char*>(storage.get(bytes));
  auto* idx = reinterpret_cast<__m256i*>(base);
  auto* mask = reinterpret_cast<__m256*>(idx + V);
  auto* b_masks = mask + V;
  auto* a_masks = b_masks + b_steps;
  auto* shift_mask = a_masks + a_steps;
  auto* chunk_mask = reinterpret_cast<__m256i*>(shift_mask + kMaxShifts * V);
  auto* src = reinterpret_cast<std::int32_t*>(chunk_mask + chunks);
  auto* src_n = src + V;
  auto* shift_count = src_n + V;
  auto* shift_offset = shift_count + V;
  auto* chunk_offset = shift_offset + kMaxShifts * V;
  Plan p;
  p.kind = is_deinterleave(r, w) ? Kind::deinterleave : classify(pb, w, p, idx, mask, src, src_n);
  if (p.kind == Kind::general && r.a_identity &&
      classify_shifted(r, w, shift_count, shift_offset, shift_mask))
    p.kind = two_shifts(r, w, shift_count) ? Kind::shifted_two : Kind::shifted;
  p.bf16_chunks = p.kind == Kind::shifted_two && classify_chunks(r, w, chunk_offset, chunk_mask);
  if (p.bf16_chunks) p.layout_3d = classify_3d(r, w);
  for (std::int64_t i = 0; i < b_steps; ++i) b_masks[i] = blend_mask(pb.steps[i].lanes);
  for (std::int64_t i = 0; i < a_steps; ++i) a_masks[i] = blend_mask(pa.steps[i].lanes);
  p.idx = idx;
  p.mask = mask;
  p.src = src;
  p.src_n = src_n;
  p.a_masks = a_masks;
  p.b_masks = b_masks;
  p.shift_count = shift_count;
  p.shift_offset = shift_offset;
  p.shift_mask = shift_mask;
  p.chunk_offset = chunk_offset;
  p.chunk_mask = chunk_mask;
  return p;
}

TableLayout table_layout(const RotationData& r, DType dtype) {
  if (dtype != DType::bf16 || r.kind != Rotation::Kind::signed_permutation)
    return TableLayout::natural;
  const Work w = work_for<Plan>(r);
  const Plan& p = prepared_plan(r, w, build_plan);
  return even_odd_kind(p, w.rd) ? TableLayout::even_odd_16 : TableLayout::natural;
}

template <DType D>
void forward_permute(const RotationData& r, const ForwardTile& tile) {
  auto token_rows = [&](Kind kind, const Work& w, const ForwardTile& run) ROME_INLINE_LAMBDA {
    if constexpr (D == DType::bf16)
      if (nan_results_low_bits_zero(run)) return dispatch_rows<RowLanes<D, true>>(kind, w, run);
    dispatch_rows<RowLanes<D, false>>(kind, w, run);
  };
  forward_tile<Plan>(r, tile, build_plan,
                     [&](Kind kind, const Work& w, const ForwardTile& tokens) ROME_INLINE_LAMBDA {
                       for (std::int64_t t = 0; t < tokens.tokens; ++t)
                         token_rows(kind, w, tokens.token(t));
                     });
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

// KernelTable::spread_even_odd_16, 16 lanes a step (fp32: two shuffles and two lane permutes;
// bf16: a shift and a mask); half-width rows split each chunk once for both halves. The NaN rule
// runs only over a row with a NaN in it, which almost no table row has: one unordered compare of
// each chunk's two halves finds them (sign words and flip are sign bits: they cannot make or
// unmake a NaN).
template <bool kBf16, bool kSigns>
void spread_even_odd_16_of(const void* row, std::int64_t period, const std::uint32_t* signs,
                           std::uint32_t flip, std::int64_t rd, float* out) {
  const __m256 flip_bits = _mm256_castsi256_ps(_mm256_set1_epi32(int(flip)));
  __m256 unordered = _mm256_setzero_ps();
  auto put = [&](std::int64_t k, __m256 even, __m256 odd) ROME_INLINE_LAMBDA {
    if constexpr (kSigns) {
      even = _mm256_xor_ps(even, _mm256_loadu_ps(reinterpret_cast<const float*>(signs + k)));
      odd = _mm256_xor_ps(odd, _mm256_loadu_ps(reinterpret_cast<const float*>(signs + k + kW)));
    }
    _mm256_storeu_ps(out + k, even);
    _mm256_storeu_ps(out + k + kW, odd);
  };
  const bool halves = period < rd;
  for (std::int64_t k = 0; k < period; k += 16) {
    EvenOdd chunk;
    if constexpr (kBf16) {
      chunk = split_bf16(static_cast<const std::uint16_t*>(row) + k);
    } else {
      const float* p = static_cast<const float*>(row) + k;
      chunk = split_even_odd(_mm256_loadu_ps(p), _mm256_loadu_ps(p + kW));
    }
    unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(chunk.even, chunk.odd, _CMP_UNORD_Q));
    const __m256 even = _mm256_xor_ps(chunk.even, flip_bits);
    const __m256 odd = _mm256_xor_ps(chunk.odd, flip_bits);
    put(k, even, odd);
    if (halves) put(k + period, even, odd);
  }
  if (_mm256_testz_ps(unordered, unordered)) return;
  const __m256 quiet = _mm256_castsi256_ps(_mm256_set1_epi32(0x00400000));
  const __m256 low_bits = _mm256_castsi256_ps(_mm256_set1_epi32(0x0000ffff));
  for (std::int64_t k = 0; k < rd; k += kW) {
    const __m256 v = _mm256_loadu_ps(out + k), nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
    _mm256_storeu_ps(out + k, _mm256_or_ps(_mm256_andnot_ps(_mm256_and_ps(nan, low_bits), v),
                                           _mm256_and_ps(nan, quiet)));
  }
}

void spread_even_odd_16(const void* row, DType dtype, std::int64_t period,
                        const std::uint32_t* signs, std::uint32_t flip, std::int64_t rd,
                        float* out) {
  const bool bf16 = dtype == DType::bf16;
  if (signs)
    return bf16 ? spread_even_odd_16_of<true, true>(row, period, signs, flip, rd, out)
                : spread_even_odd_16_of<false, true>(row, period, signs, flip, rd, out);
  bf16 ? spread_even_odd_16_of<true, false>(row, period, signs, flip, rd, out)
       : spread_even_odd_16_of<false, false>(row, period, signs, flip, rd, out);
}

}  // namespace

const KernelTable& avx2_kernels() {
  static const KernelTable table{"avx2",
                                 forward_permute_any,
                                 avx2_forward_dense,
                                 avx2_accumulate_product,
                                 table_layout,
                                 avx2_forward_norm_permute,
                                 avx2_norm_table_layout,
                                 avx2_cos_sin,
                                 avx2_cos_sin_rows,
                                 narrow_bf16,
                                 spread_even_odd_16,
                                 stream_copy_with<Avx2>};
  return table;
}

}  // namespace rome::kernels
