// AVX-512 kernels (F, BW, VL, DQ; BF16 when the CPU has it): signed-permutation rotations as
// in-register permutes.
//
// The kernel is common/permute-inl.hpp over 16-lane traits: vpermps (_mm512_maskz_permutexvar_ps)
// under a lane mask, masked loads/stores for tails, and for the general kind vpermt2ps
// (_mm512_permutex2var_ps) over pairs of input vectors, blended under lane masks. Here is what
// only AVX-512 has: rotary dims 64, 128 and 256 keep the whole row in registers (up to 16 of the
// 32 zmm), every kind through one loop over VC vectors, the general one by vpermt2ps: over plans
// compiled in (CompiledPermute) for the 3D splits 44/44/40 and 44/42/42 and interleave-half 64
// and 128, else over pair tables built per rotation (AVX2 has own kinds for some of these); such
// a row is stored after all of it is computed, so in place is safe.
//
// bf16 is narrowed with vcvtne2ps2bf16 / vcvtneps2bf16 when the CPU has AVX512-BF16 (they flush
// subnormals, so a row holding one takes the integer round-to-nearest-even path), else with
// integer arithmetic; fp16 uses vcvtps2ph / vcvtph2ps, exact both ways.
#include <array>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <new>
#include <vector>

#include "../../core/convert.hpp"
#include "../common/permute-inl.hpp"
#include "../common/stream_copy-inl.hpp"
#include "../dense_kernels.hpp"
#include "../kernel_api.hpp"
#include "../kernel_support.hpp"
#include "avx512_lanes.hpp"

namespace rome::kernels {
namespace {

using detail::PermuteStep;
using detail::RotationData;
using detail::SignedPermutation;
using detail::VectorPermutePlan;
using namespace avx512;
using namespace permute;

// One output vector of x·P for a plan P, from the fp32 row X.
ROME_INLINE __m512 permute_vector(const PermuteStep* s, const PermuteStep* end, const float* X) {
  if (s == end) return _mm512_setzero_ps();
  __m512 acc = _mm512_maskz_permutex2var_ps(
      __mmask16(s->lanes), _mm512_load_ps(X + kW * s->src0),
      _mm512_loadu_si512(reinterpret_cast<const void*>(s->idx)), _mm512_load_ps(X + kW * s->src1));
  for (++s; s != end; ++s)
    acc = _mm512_mask_mov_ps(
        acc, __mmask16(s->lanes),
        _mm512_permutex2var_ps(_mm512_load_ps(X + kW * s->src0),
                               _mm512_loadu_si512(reinterpret_cast<const void*>(s->idx)),
                               _mm512_load_ps(X + kW * s->src1)));
  return acc;
}

// memcmp(a, b, n) == 0, inline, one branch.
ROME_INLINE bool equal_bytes(const void* a, const void* b, std::size_t n) {
  const auto* p = static_cast<const char*>(a);
  const auto* q = static_cast<const char*>(b);
  __m512i diff = _mm512_setzero_si512();
  for (; n >= 64; n -= 64, p += 64, q += 64)
    diff = _mm512_or_si512(diff, _mm512_xor_si512(_mm512_loadu_si512(p), _mm512_loadu_si512(q)));
  const __mmask64 m = _bzhi_u64(~std::uint64_t(0), unsigned(n));
  diff = _mm512_or_si512(
      diff, _mm512_xor_si512(_mm512_maskz_loadu_epi8(m, p), _mm512_maskz_loadu_epi8(m, q)));
  return _mm512_test_epi64_mask(diff, diff) == 0;
}

// The traits of common/permute-inl.hpp: lane masks for tails and permutes.
struct Avx512 {
  using F = __m512;
  using Count = __mmask16;
  using Index = __m512i;
  using Mask = __mmask16;
  static constexpr int kLanes = kW;
  static constexpr Count kAll = 0xffff;
  static constexpr int kPadVectors = 0;
  static ROME_INLINE Count lanes(int n) { return first_lanes(n); }
  static ROME_INLINE std::uint32_t bits(Count m) { return m; }
  static ROME_INLINE F load(const float* p) { return _mm512_load_ps(p); }
  static ROME_INLINE void store(float* p, F v) { _mm512_store_ps(p, v); }
  static ROME_INLINE F combine(F xa, F c, F xb, F s) { return avx512::combine(xa, c, xb, s); }
  static ROME_INLINE F combine_one_fma(F xa, F c, F xb, F s) {
    return avx512::combine_one_fma(xa, c, xb, s);
  }
  static ROME_INLINE F swap_pairs(F x) { return _mm512_permute_ps(x, 0xb1); }
  static ROME_INLINE F permute(F x, Index idx, Mask mask) {
    return _mm512_maskz_permutexvar_ps(mask, idx, x);
  }
  static ROME_INLINE Index index(const std::int32_t* lanes) { return _mm512_loadu_si512(lanes); }
  static ROME_INLINE Mask mask(std::uint32_t lanes) { return Mask(lanes); }
  struct GeneralPlan {
    const PermuteStep* steps;
    const std::int32_t* begin;
  };
  template <class W>
  static ROME_INLINE GeneralPlan general_plan(const W& w, bool a) {
    const VectorPermutePlan& p = a ? w.r->avx512.a : w.r->avx512.b;
    return {p.steps.data(), p.step_begin.data()};
  }
  static ROME_INLINE F permute_plan(const GeneralPlan& p, std::int64_t v, const float* X) {
    return permute_vector(p.steps + p.begin[v], p.steps + p.begin[v + 1], X);
  }
  // kernel_support.hpp: prefetch_distance.
  static ROME_INLINE void prefetch_to_l2(const char* p) { _mm_prefetch(p, _MM_HINT_T1); }
  static ROME_INLINE void copy_bytes(void* dst, const void* src, std::int64_t bytes, bool stream) {
    avx512::copy_bytes(dst, src, bytes, stream);
  }
  static ROME_INLINE void fence() { _mm_sfence(); }
  static ROME_INLINE bool equal_bytes(const void* a, const void* b, std::size_t n) {
    return kernels::equal_bytes(a, b, n);
  }
};

// The general kind's plans compiled in (CompiledPermute, below).
enum class CompiledPlan {
  none,
  halves_44_44_40,
  halves_44_42_42,
  interleave_half_64,
  interleave_half_128
};

// general with 4, 8 or 16 vectors: for output vector v and source pair p (input vectors 2p and
// 2p+1) the vpermt2ps index and lane mask, of B and of A (none for a compiled plan).
struct Plan : PlanBase<Avx512> {
  const __m512i* pair_idx_b = nullptr;
  const __m512i* pair_idx_a = nullptr;
  const __mmask16* pair_mask_b = nullptr;
  const __mmask16* pair_mask_a = nullptr;
  CompiledPlan compiled = CompiledPlan::none;  // general: compiled_plan_of
};
using Work = permute::Work<Plan>;

// Lanes of the VC results that are of one of fpclass's classes `kClasses`, ORed.
template <int VC, int kClasses>
ROME_INLINE __mmask16 any_of_class(const __m512* out) {
  __mmask16 found = _mm512_fpclass_ps_mask(out[0], kClasses);
#pragma GCC unroll 16
  for (int v = 1; v < VC; ++v) found = _kor_mask16(found, _mm512_fpclass_ps_mask(out[v], kClasses));
  return found;
}

// vcvtne2ps2bf16 on pairs of vectors; the caller has checked the row for subnormals.
template <typename L, int VC>
ROME_INLINE void store_row_pairs(const Work& w, typename L::T* y, const __m512* out) {
  if (w.stream && (reinterpret_cast<std::uintptr_t>(y) & 63) == 0) {
#pragma GCC unroll 8
    for (int v = 0; v < VC; v += 2)
      _mm512_stream_si512(reinterpret_cast<__m512i*>(y + kW * v),
                          L::narrow_pair(out[v], out[v + 1]));
  } else {
#pragma GCC unroll 8
    for (int v = 0; v < VC; v += 2)
      _mm512_storeu_si512(y + kW * v, L::narrow_pair(out[v], out[v + 1]));
  }
}

// Stores a full row of VC vectors, non-temporally when streaming and aligned.
template <typename L, int VC>
ROME_INLINE void store_row(const Work& w, typename L::T* y, const __m512* out) {
  if constexpr (L::kPairs) {
    const __mmask16 subnormal = any_of_class<VC, 0x20>(out);
    if (__builtin_expect(_kortestz_mask16_u8(subnormal, subnormal), 1))
      return store_row_pairs<L, VC>(w, y, out);
  }
  if (w.stream && (reinterpret_cast<std::uintptr_t>(y) & 63) == 0) {
#pragma GCC unroll 16
    for (int v = 0; v < VC; ++v) L::stream(y + kW * v, out[v]);
  } else {
#pragma GCC unroll 16
    for (int v = 0; v < VC; ++v) L::store(y + kW * v, out[v]);
  }
}

// ---------------------------------------------------------------------------------------------
// Row loops of the rotary dims kept in registers (VC vectors)

// The two sources of an output vector: xa (times cos) and xb (times sin).
struct Sources {
  __m512 a, b;
};

// The row from sources(in, x, v) through the guarded combine, stored: rows_fixed's rows that do
// not narrow in pairs, and redo_row_guarded.
template <typename L, int VC, class SourcesOf>
ROME_INLINE void store_guarded_row(const Work& w, const Row<L>& row, const __m512* in,
                                   SourcesOf& sources) {
  __m512 out[VC];
#pragma GCC unroll 16
  for (int v = 0; v < VC; ++v) {
    const Sources ab = sources(in, row.x, v);
    out[v] = combine<L>(w, ab.a, ab.b, row, v);
  }
  store_row<L, VC>(w, row.y, out);
}

// A row rows_fixed found a NaN or subnormal result in: everything again from memory (the row is
// not written yet, so in place too), narrowed lane by lane with the NaN case. Out of line, so that
// the common path keeps nothing live for it: inlined, the sources and table vectors were spilled to
// the stack on every row (9 stores and 16 register copies per 128-lane row).
template <typename L, int VC, bool kLoadRow, class SourcesOf>
[[gnu::noinline]] void redo_row_guarded(const Work& w, const Row<L>& row, SourcesOf sources) {
  __m512 in[VC];
  if constexpr (kLoadRow) {
#pragma GCC unroll 16
    for (int v = 0; v < VC; ++v) in[v] = L::load(row.x + kW * v);
  }
  store_guarded_row<L, VC>(w, row, in, sources);
}

// Every output vector v is the epilogue of sources(in, x, v), `in` holding the row when kLoadRow;
// the row is stored only after all of it is computed, so in place is safe.
// bf16 rows narrowed in pairs run the one-fma epilogue and classify each result once for both
// rare cases: NaN (the row is redone and narrowed with the NaN case) and subnormal
// (vcvtne2ps2bf16 flushes them). One vfpclassps per vector instead of two, on the port
// the permutes also need.
template <typename L, int VC, bool kLoadRow, class SourcesOf>
ROME_INLINE void rows_fixed(const Work& w, const ForwardTile& tile, SourcesOf sources) {
  for_rows<L>(w, tile, [&](const Row<L>& row, bool) ROME_INLINE_LAMBDA {
    __m512 in[VC], out[VC];
    if constexpr (kLoadRow) {
#pragma GCC unroll 16
      for (int v = 0; v < VC; ++v) in[v] = L::load(row.x + kW * v);
    }
    if constexpr (L::kPairs) {
      static_assert(kOneFmaRows<L>, "pair narrowing is for bf16 rows only");
#pragma GCC unroll 16
      for (int v = 0; v < VC; ++v) {
        const Sources ab = sources(in, row.x, v);
        const __m512 c = _mm512_load_ps(row.C + kW * v), s = _mm512_load_ps(row.S + kW * v);
        out[v] = avx512::combine_one_fma(ab.a, c, ab.b, s);
      }
      const __mmask16 nan_or_subnormal = any_of_class<VC, 0x81 | 0x20>(out);
      if (__builtin_expect(_kortestz_mask16_u8(nan_or_subnormal, nan_or_subnormal), 1))
        return store_row_pairs<L, VC>(w, row.y, out);
      return redo_row_guarded<L, VC, kLoadRow>(w, row, sources);
    }
    store_guarded_row<L, VC>(w, row, in, sources);
  });
}

// pairs / local: each output vector from its own input vector.
template <typename L, int VC, bool kPairs>
ROME_INLINE void rows_local_fixed(const Work& w, const ForwardTile& tile) {
  rows_fixed<L, VC,
             false>(w, tile, [&](const __m512*, const typename L::T* x, int v) ROME_INLINE_LAMBDA {
    const __m512 xv = L::load(x + kW * v);
    return Sources{xv, kPairs ? Avx512::swap_pairs(xv) : Avx512::permute(xv, w.idx[v], w.mask[v])};
  });
}

// half / quarter move: output vector v is input vector v ^ K.
template <typename L, int VC, int K>
ROME_INLINE void rows_xor_move_fixed(const Work& w, const ForwardTile& tile) {
  rows_fixed<L, VC, true>(w, tile,
                          [&](const __m512* in, const typename L::T*, int v) ROME_INLINE_LAMBDA {
                            return Sources{in[v], in[v ^ K]};
                          });
}

// single / move: sources re-read from x.
template <typename L, int VC, bool kMove>
ROME_INLINE void rows_single_fixed(const Work& w, const ForwardTile& tile) {
  rows_fixed<L, VC, false>(
      w, tile, [&](const __m512*, const typename L::T* x, int v) ROME_INLINE_LAMBDA {
        const __m512 xs = L::load(x + w.src[v]);
        return Sources{L::load(x + kW * v), kMove ? xs : Avx512::permute(xs, w.idx[v], w.mask[v])};
      });
}

// One output vector of x·P from the row in registers, P given per source pair.
template <int VC>
ROME_INLINE __m512 permute_pairs(const __m512* in, const __m512i* idx, const __mmask16* mask) {
  __m512 acc = _mm512_setzero_ps();
#pragma GCC unroll 8
  for (int p = 0; p < VC / 2; ++p)
    if (mask[p])
      acc = _mm512_mask_mov_ps(acc, mask[p],
                               _mm512_permutex2var_ps(in[2 * p], idx[p], in[2 * p + 1]));
  return acc;
}

// general: vpermt2ps over the row in registers, by the pair tables.
template <typename L, int VC>
ROME_INLINE void rows_general_fixed(const Work& w, const ForwardTile& tile) {
  const bool a_identity = w.r->a_identity;
  constexpr int P = VC / 2;
  rows_fixed<L, VC, true>(
      w, tile, [&](const __m512* in, const typename L::T*, int v) ROME_INLINE_LAMBDA {
        const __m512 xb = permute_pairs<VC>(in, w.pair_idx_b + v * P, w.pair_mask_b + v * P);
        return Sources{
            a_identity ? in[v] : permute_pairs<VC>(in, w.pair_idx_a + v * P, w.pair_mask_a + v * P),
            xb};
      });
}

// ---------------------------------------------------------------------------------------------
// Permutations compiled in: 3D RoPE's splits and DeepSeek MLA's interleave-half

// A permutation of VC vectors as vpermt2ps steps whose source vectors are constants. The general
// kind's pair tables pair sources rigidly (2p, 2p+1) and skip empty pairs by branching on their
// masks; here output vector v's first step permutes its first two sources and every further step
// merges one more source under its lanes (vpermt2ps with merge masking keeps the accumulator's
// other lanes), so k >= 2 sources cost k - 1 permutes (one source, one) and no blend or branch.
template <int VC>
struct CompiledPermute {
  static constexpr int kLanes = VC * kW, kMaxSteps = VC * (VC - 1);
  alignas(64) std::int32_t idx[kMaxSteps][kW] = {};
  std::array<std::int32_t, kLanes> src = {};  // the source lane of every output lane
  std::int32_t begin[VC + 1] = {};            // steps of output vector v: [begin[v], begin[v + 1])
  std::int32_t first[kMaxSteps] = {}, second[kMaxSteps] = {};  // source vectors of a step
  std::uint16_t lanes[kMaxSteps] = {};

  constexpr explicit CompiledPermute(const std::array<std::int32_t, kLanes>& source) : src(source) {
    int step = 0;
    for (int v = 0; v < VC; ++v) {
      begin[v] = step;
      int sources[VC] = {}, n = 0;  // in first-use order
      for (int l = 0; l < kW; ++l) {
        const int s = src[v * kW + l] / kW;
        bool seen = false;
        for (int i = 0; i < n; ++i) seen = seen || sources[i] == s;
        if (!seen) sources[n++] = s;
      }
      // Step 0: sources 0 and 1 (tables a and b); step k > 0: source k + 1 (table b).
      for (int k = 0; k < (n > 1 ? n - 1 : 1); ++k, ++step) {
        first[step] = sources[0];
        second[step] = k == 0 ? sources[n > 1 ? 1 : 0] : sources[k + 1];
        for (int l = 0; l < kW; ++l) {
          const int s = src[v * kW + l] / kW, from = src[v * kW + l] % kW;
          if (k == 0 && s == sources[0])
            idx[step][l] = from;
          else if (s == second[step] && (k > 0 || n > 1))
            idx[step][l] = from + kW;
          else
            continue;
          lanes[step] = std::uint16_t(lanes[step] | (1u << l));
        }
      }
    }
    begin[VC] = step;
  }

  // Whether p (every lane read) is this permutation.
  bool is(const SignedPermutation& p) const {
    for (int j = 0; j < kLanes; ++j)
      if (p.sign[j] == 0 || p.src[j] != src[j]) return false;
    return true;
  }
};

// Rotation by halves within consecutive blocks (3D RoPE with each axis rotated as 'half').
template <int N>
constexpr std::array<std::int32_t, N> block_halves(std::initializer_list<int> blocks) {
  std::array<std::int32_t, N> src = {};
  int lane = 0;
  for (int b : blocks)
    for (int i = 0; i < b; ++i, ++lane) src[lane] = lane + (i < b / 2 ? b / 2 : -b / 2);
  return src;
}

// Rotation::interleave_half: A de-interleaves (evens, then odds), B = A · half.
template <int N>
constexpr std::array<std::int32_t, N> deinterleave(bool rotated) {
  std::array<std::int32_t, N> src = {};
  for (int j = 0; j < N; ++j)
    src[j] = (j < N / 2) != rotated ? 2 * (j % (N / 2)) : 2 * (j % (N / 2)) + 1;
  return src;
}

constexpr CompiledPermute<8> kHalves_44_44_40(block_halves<128>({44, 44, 40}));  // the seed's
constexpr CompiledPermute<8> kHalves_44_42_42(block_halves<128>({44, 42, 42}));  // Wan's split
constexpr CompiledPermute<4> kDeinterleave_64(deinterleave<64>(false));  // DeepSeek MLA's rope
constexpr CompiledPermute<4> kDeinterleaveRotated_64(deinterleave<64>(true));
constexpr CompiledPermute<8> kDeinterleave_128(deinterleave<128>(false));
constexpr CompiledPermute<8> kDeinterleaveRotated_128(deinterleave<128>(true));

// A rotation whose plans are compiled in: B, and A unless it is the identity.
template <int VC>
struct CompiledRotation {
  const CompiledPermute<VC>* a;
  const CompiledPermute<VC>& b;
};
constexpr CompiledRotation<8> kRotation_44_44_40{nullptr, kHalves_44_44_40};
constexpr CompiledRotation<8> kRotation_44_42_42{nullptr, kHalves_44_42_42};
constexpr CompiledRotation<4> kInterleaveHalf_64{&kDeinterleave_64, kDeinterleaveRotated_64};
constexpr CompiledRotation<8> kInterleaveHalf_128{&kDeinterleave_128, kDeinterleaveRotated_128};

// Steps S..End of one output vector after its first: each merges one more source.
template <int VC, const CompiledPermute<VC>& P, int S, int End>
ROME_INLINE __m512 merge_sources(__m512 acc, const __m512* in) {
  if constexpr (S == End) {
    return acc;
  } else {
    const __m512i idx = _mm512_load_si512(P.idx[S]);
    return merge_sources<VC, P, S + 1, End>(
        _mm512_mask_permutex2var_ps(acc, __mmask16(P.lanes[S]), idx, in[P.second[S]]), in);
  }
}

template <int VC, const CompiledPermute<VC>& P, int V>
ROME_INLINE __m512 compiled_vector(const __m512* in) {
  constexpr int S = P.begin[V];
  const __m512i idx = _mm512_load_si512(P.idx[S]);
  const __m512 acc =
      _mm512_maskz_permutex2var_ps(__mmask16(P.lanes[S]), in[P.first[S]], idx, in[P.second[S]]);
  return merge_sources<VC, P, S + 1, P.begin[V + 1]>(acc, in);
}

template <int VC, const CompiledRotation<VC>& R, int V>
ROME_INLINE Sources compiled_sources(const __m512* in) {
  if constexpr (R.a == nullptr)
    return Sources{in[V], compiled_vector<VC, R.b, V>(in)};
  else
    return Sources{compiled_vector<VC, *R.a, V>(in), compiled_vector<VC, R.b, V>(in)};
}

template <typename L, int VC, const CompiledRotation<VC>& R>
ROME_INLINE void rows_compiled(const Work& w, const ForwardTile& tile) {
  static_assert(VC == 4 || VC == 8);
  rows_fixed<L, VC, true>(w, tile,
                          [&](const __m512* in, const typename L::T*, int v) ROME_INLINE_LAMBDA {
                            // v is a constant once rows_fixed's loop is unrolled; the switch folds
                            // away.
                            switch (v) {
                              case 0: return compiled_sources<VC, R, 0>(in);
                              case 1: return compiled_sources<VC, R, 1>(in);
                              case 2: return compiled_sources<VC, R, 2>(in);
                              case 3: return compiled_sources<VC, R, 3>(in);
                              case 4: return compiled_sources<VC, R, (VC == 8 ? 4 : 3)>(in);
                              case 5: return compiled_sources<VC, R, (VC == 8 ? 5 : 3)>(in);
                              case 6: return compiled_sources<VC, R, (VC == 8 ? 6 : 3)>(in);
                              default: return compiled_sources<VC, R, VC - 1>(in);
                            }
                          });
}

// Which rotation compiled in r is (A and B, every lane read).
template <int VC>
bool is_compiled(const RotationData& r, const CompiledRotation<VC>& c) {
  if (r.rotary_dim != VC * kW || (c.a == nullptr) != r.a_identity) return false;
  return c.b.is(r.b) && (c.a == nullptr || c.a->is(r.a));
}
CompiledPlan compiled_plan_of(const RotationData& r) {
  if (is_compiled(r, kRotation_44_44_40)) return CompiledPlan::halves_44_44_40;
  if (is_compiled(r, kRotation_44_42_42)) return CompiledPlan::halves_44_42_42;
  if (is_compiled(r, kInterleaveHalf_64)) return CompiledPlan::interleave_half_64;
  if (is_compiled(r, kInterleaveHalf_128)) return CompiledPlan::interleave_half_128;
  return CompiledPlan::none;
}

template <typename L, int VC>
ROME_INLINE void dispatch_rows(Kind kind, const Work& w, const ForwardTile& tile) {
  if constexpr (VC != 0) {
    switch (kind) {
      case Kind::pairs: return rows_local_fixed<L, VC, true>(w, tile);
      case Kind::local: return rows_local_fixed<L, VC, false>(w, tile);
      case Kind::half_move: return rows_xor_move_fixed<L, VC, VC / 2>(w, tile);
      case Kind::quarter_move: return rows_xor_move_fixed<L, VC, VC / 4>(w, tile);
      case Kind::single: return rows_single_fixed<L, VC, false>(w, tile);
      case Kind::move: return rows_single_fixed<L, VC, true>(w, tile);
      default:  // general (AVX2's kinds never here)
        if constexpr (VC == 8) {
          switch (w.compiled) {
            case CompiledPlan::halves_44_44_40:
              return rows_compiled<L, 8, kRotation_44_44_40>(w, tile);
            case CompiledPlan::halves_44_42_42:
              return rows_compiled<L, 8, kRotation_44_42_42>(w, tile);
            case CompiledPlan::interleave_half_128:
              return rows_compiled<L, 8, kInterleaveHalf_128>(w, tile);
            default: break;
          }
        }
        if constexpr (VC == 4) {
          if (w.compiled == CompiledPlan::interleave_half_64)
            return rows_compiled<L, 4, kInterleaveHalf_64>(w, tile);
        }
        return rows_general_fixed<L, VC>(w, tile);
    }
  } else {
    switch (kind) {
      case Kind::pairs: return rows_local<L, true>(w, tile);
      case Kind::local: return rows_local<L, false>(w, tile);
      case Kind::single: return rows_single<L, false>(w, tile);
      case Kind::half_move:
      case Kind::quarter_move:
      case Kind::move: return rows_single<L, true>(w, tile);
      default: return rows_general<L>(w, tile);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Per-rotation preparation

// Pair tables of the fixed-size general path: V·V/2 entries.
void build_pairs(const SignedPermutation& p, const Work& w, __m512i* out_idx, __mmask16* out_mask) {
  const std::int64_t pairs = w.V / 2, entries = w.V * pairs;
  alignas(64) std::int32_t lanes[kW];
  for (std::int64_t e = 0; e < entries; ++e) {
    const std::int64_t v = e / pairs, pair = e % pairs;
    __mmask16 m = 0;
    for (int l = 0; l < kW; ++l) {
      const std::int64_t j = v * kW + l;
      lanes[l] = 0;
      if (p.sign[j] == 0) continue;
      const std::int64_t s = p.src[j], u = s / kW;
      if (u / 2 != pair) continue;
      lanes[l] = std::int32_t(s % kW + (u % 2) * kW);
      m = __mmask16(m | (1u << l));
    }
    out_idx[e] = _mm512_load_si512(lanes);
    out_mask[e] = m;
  }
}

// The plan of a rotation, its arrays in `storage`: idx (V), pair_idx (2 · entries) vectors; src
// (V); mask, src_n (V), pair_mask (2 · entries).
Plan build_plan(const RotationData& r, const Work& w, Scratch& storage) {
  const std::int64_t V = w.V;
  const bool fixed = w.rd == 64 || w.rd == 128 || w.rd == 256;
  const std::int64_t entries = fixed ? V * (V / 2) : 0;
  const std::size_t bytes =
      std::size_t(V + 2 * entries) * 64 + std::size_t(V) * 8 + std::size_t(2 * entries) * 2;
  char* base = static_cast<char*>(storage.get(bytes));
  auto* idx = reinterpret_cast<__m512i*>(base);
  auto* pairs = idx + V;
  auto* src = reinterpret_cast<std::int32_t*>(pairs + 2 * entries);
  auto* mask = reinterpret_cast<__mmask16*>(src + V);
  auto* src_n = mask + V;
  auto* pair_mask = src_n + V;
  Plan p;
  p.kind = classify(r.avx512.b, w, p, idx, mask, src, src_n);
  p.idx = idx;
  p.src = src;
  p.mask = mask;
  p.src_n = src_n;
  if (p.kind == Kind::general) p.compiled = compiled_plan_of(r);
  if (p.kind == Kind::general && fixed && p.compiled == CompiledPlan::none) {
    build_pairs(r.b, w, pairs, pair_mask);
    p.pair_idx_b = pairs;
    p.pair_mask_b = pair_mask;
    if (!r.a_identity) {
      build_pairs(r.a, w, pairs + entries, pair_mask + entries);
      p.pair_idx_a = pairs + entries;
      p.pair_mask_a = pair_mask + entries;
    }
  }
  return p;
}

template <typename L, int VC>
ROME_INLINE void token_by_token(Kind kind, const Work& w, const ForwardTile& tokens) {
  for (std::int64_t t = 0; t < tokens.tokens; ++t) dispatch_rows<L, VC>(kind, w, tokens.token(t));
}

// Every token's rows, out of line: inlined into forward_tile with every kind and rotary dim, the
// register-row loops spilled more (3D 44/44/40 BSND in place, 2 threads, 5 rounds: 0.97-1.26x
// the copy inlined, 0.99-1.05x out of line). The token loop is in here rather than a call per
// token, which cost head-major tiles (4 rows per token) a fifth of their time (BENCHMARKS.md,
// twenty-fifth session). The Work is copied so that its fields stay in registers (the row
// stores may alias a reference).
template <typename L>
__attribute__((noinline)) void tile_rows(Kind kind, const Work& work, const ForwardTile& tokens) {
  const Work w = work;
  switch (w.rd) {
    case 64: return token_by_token<L, 4>(kind, w, tokens);
    case 128: return token_by_token<L, 8>(kind, w, tokens);
    case 256: return token_by_token<L, 16>(kind, w, tokens);
    default: return token_by_token<L, 0>(kind, w, tokens);
  }
}

template <DType D, typename N>
ROME_INLINE void forward_impl(const RotationData& r, const ForwardTile& tile) {
  forward_tile<Plan>(r, tile, build_plan, tile_rows<Lanes<D, N>>);
}

void forward_f32(const RotationData& r, const ForwardTile& b) {
  forward_impl<DType::f32, NarrowExact>(r, b);
}
void forward_f16(const RotationData& r, const ForwardTile& b) {
  forward_impl<DType::f16, NarrowExact>(r, b);
}
void forward_bf16(const RotationData& r, const ForwardTile& b) {
  forward_impl<DType::bf16, NarrowExact>(r, b);
}
void forward_bf16_insn(const RotationData& r, const ForwardTile& b) {
  forward_impl<DType::bf16, NarrowBf16Insn>(r, b);
}

template <bool kBf16Instructions>
void forward_permute_any(const RotationData& r, const ForwardTile& b) {
  switch (b.dtype) {
    case DType::f32: return forward_f32(r, b);
    case DType::f16: return forward_f16(r, b);
    case DType::bf16: return kBf16Instructions ? forward_bf16_insn(r, b) : forward_bf16(r, b);
    default: return scalar_kernels().forward_permute(r, b);
  }
}

// 16 lanes at a time (bf16_narrow_exact: the permute kernels' rounding without AVX512-BF16,
// which flushes subnormals), the rest lane by lane.
void narrow_bf16(std::int64_t n, const float* in, std::uint16_t* out) {
  std::int64_t i = 0;
  for (; i + kW <= n; i += kW)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i),
                        bf16_narrow_exact(_mm512_loadu_ps(in + i)));
  for (; i < n; ++i) out[i] = detail::float_to_bf16(in[i]);
}

}  // namespace

int avx512_compiled_plan(const detail::RotationData& rotation) {
  return int(compiled_plan_of(rotation));
}

const KernelTable& avx512_kernels(bool avx512_bf16, bool bf16_dot) {
  // The tables differ in the bf16 narrowing of the permute and norm kernels (AVX512-BF16) and in
  // the dense kernel (vdpbf16ps). No AVX-512 kernel asks for even/odd table rows (only tests
  // do): the scalar spread serves.
  auto make = [](ForwardFn permute, ForwardFn dense, NormForwardFn norm) {
    return KernelTable{"avx512",
                       permute,
                       dense,
                       avx512_accumulate_product,
                       nullptr,
                       norm,
                       nullptr,
                       avx512_cos_sin,
                       avx512_cos_sin_rows,
                       narrow_bf16,
                       scalar_spread_even_odd_16,
                       stream_copy_with<Avx512>};
  };
  static const KernelTable table =
      make(forward_permute_any<false>, avx512_forward_dense, avx512_forward_norm_permute);
  static const KernelTable table_bf16 =
      make(forward_permute_any<true>, avx512_forward_dense, avx512_bf16_forward_norm_permute);
  static const KernelTable table_bf16_dot =
      make(forward_permute_any<true>, avx512_bf16_forward_dense, avx512_bf16_forward_norm_permute);
  if (!avx512_bf16) return table;
  return bf16_dot ? table_bf16_dot : table_bf16;
}

}  // namespace rome::kernels
