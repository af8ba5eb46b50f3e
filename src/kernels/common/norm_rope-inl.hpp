// The QK-norm + rotation kernel (kernel_api.hpp's NormForwardFn), written once over an ISA traits
// type and compiled into each SIMD kernel library (anonymous namespace: every copy keeps its own
// flags). Bit-identical to the scalar kernel: the same operations in the same order.
//
// Pass 1 takes the sums of squares of a group of rows in the contract's order: kAccumulators
// accumulators, each the 8 partial sums of kRowsPerVector rows, so the group's fma chains overlap
// (AVX2: 8 rows, one per 8-lane vector, as 4 left the chains latency-bound; AVX-512: 4 of two rows
// per 16-lane vector, since a 16-lane accumulator of one row would sum in another order, but f32
// rows 8 at a time as on AVX2: SumSquares<D>, SumSquaresOf); then 1 / rms of the whole group at
// once (one row's divide-root-divide chain would hold up its rotation).
//
// Pass 2 reads each row again from L1 (no buffer) and forms r·(x_a·C' + x_b·S') with the weight
// folded into the table row once per table row (FoldedRow: the fused executor hands one table row
// to every head of a token). It has vector loops for half rotations whose half is whole chunks and
// interleave rotations of whole chunks, on rows that cannot produce inf or NaN
// (FoldedRow::finite_sum_squares_max): no per-vector test. Every other row (other sizes and
// permutations, rows with inf, NaN or huge values) takes the contract's lane loop,
// store_norm_row_lanes, which is the scalar kernel's code. Before each row of up to 1 KiB it asks
// for the bytes of a row further along (prefetch_distance): one core waits on memory with the
// hardware prefetchers alone (BENCHMARKS.md), and a whole group's lines asked for at once in pass 1
// (32 on AVX2) took 1.14-1.25x as long from DRAM (Qwen3 shapes, T = 4096, 1 and 2 threads).
//
// A chunk is the step of pass 2 along a row, in the table rows' lane order (the Order types):
// NaturalOrder is one vector in lane order. An ISA may add `Bf16Order` for bf16 rows (AVX2: 16
// lanes split into their even and odd lanes by a shift and a mask, tables in even_odd_16 order,
// so no permute, vpmovzx or pack); its `takes(r, kind)` says which rotations it runs.
//
// Traits I: F (kLanes fp32 lanes) with loadu, storeu, set1, add, sub, mul, fma, max, abs,
// any_not_finite, reduce_max, swap_pairs (lane pairs), combine_unguarded and combine_one_fma
// (as avx2_lanes.hpp / avx512_lanes.hpp); Count and lanes(n) (the first n lanes, n > 0),
// load_floats(p, Count), prefetch(p) and prefetch_to_l2(p); pass 1: kRowsPerVector, kAccumulators,
// load_rows<D>(rows, j, n) (lanes [j, j + n) of kRowsPerVector rows, 8 lanes each, zeros past n <=
// 8), split_rows_bf16(rows, j) (.even, .odd of one 16-lane chunk of each row), reduce_rows<A>(acc,
// ss) (each row of A accumulators: ((s0+s4)+(s2+s6)) + ((s1+s5)+(s3+s7))), inverse_rms(ss, rows,
// hd, eps, scale) of the first `rows` of a group's kAccumulators·kRowsPerVector rows. Storage lanes
// L: T, load / store (whole or Count lanes). Order O (NaturalOrder's members): Chunk (kVectors
// vectors, kLanes lanes), load / store of a chunk of the row in table order, swap_pairs (each
// lane's interleave partner), the weights in table order; one whose tables are not natural
// (kNaturalTables) also gives to_natural, and a Bf16Order takes(r, kind) and kLayout.
#pragma once

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#include "../../core/convert.hpp"
#include "../../core/rotation_data.hpp"
#include "../kernel_api.hpp"
#include "../kernel_support.hpp"
#include "norm_fold-inl.hpp"

namespace rome::kernels::norm_rope {
namespace {

using detail::RotationData;

// The rotations with vector loops: half (lane j reads j ± rd/2) and interleave (j reads j ^ 1),
// A = I; everything else takes the lane loop.
enum class NormKind { half, interleave, other };

// Classified once per rotation per thread in each kernel library (kernels keep no other state).
inline NormKind classify_norm(const RotationData& r) {
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

// Whether half / interleave rows are whole chunks of `lanes` (half: its half; interleave:
// rotary_dim).
inline bool whole_chunk_rows(const RotationData& r, NormKind kind, std::int64_t lanes) {
  return (kind == NormKind::half && (r.rotary_dim / 2) % lanes == 0) ||
         (kind == NormKind::interleave && r.rotary_dim % lanes == 0);
}

// The largest sum of squares of a row whose vector loop needs no inf/NaN test, given
// m >= max |cw| + max |sw| of the folded table row (INFINITY for NaN); -1: no row. Such a row has
// no lane of r·(x_a·C' + x_b·S') that is inf or NaN: x is finite (its sum of squares is),
// |x_j| <= sqrt(ss), |C'_j| + |S'_j| <= m, and r <= sqrt(head_dim / ss) (eps >= 0); so every lane
// is at most sqrt(ss)·m <= 1e37 before scaling and sqrt(head_dim)·m <= 1e37 after (the 30x
// margin to FLT_MAX covers fp32's rounding of ss and the underflow of x² or ss / head_dim in the
// subnormal range, which can make r up to about 1.7x larger than the bound).
inline float finite_sum_squares_bound(double m, std::int64_t head_dim) {
  if (!(m * std::sqrt(double(head_dim)) <= 1e37)) return -1.0f;
  return float(std::min(m > 0 ? (1e37 / m) * (1e37 / m) : INFINITY, double(FLT_MAX)));
}

// The N vectors of one chunk (of traits I: a vector type as template argument loses its
// attributes).
template <class I, int N>
struct Vectors {
  typename I::F v[N];
};

// A chunk is one vector in lane order; the table rows and weights are natural.
template <class I, class L>
struct NaturalOrder {
  using T = typename L::T;
  using Chunk = Vectors<I, 1>;
  static constexpr int kVectors = 1;
  static constexpr int kLanes = I::kLanes;
  static constexpr bool kNaturalTables = true;
  static ROME_INLINE Chunk load(const T* x) { return {{L::load(x)}}; }
  static ROME_INLINE Chunk load(const T* x, std::int64_t n) { return {{L::load(x, I::lanes(n))}}; }
  static ROME_INLINE Chunk load_weights(const float* w, std::int64_t n) {
    return {{I::load_floats(w, I::lanes(n))}};
  }
  // store_finite: every lane finite (the vector loop's rows), so no NaN-aware narrowing; store:
  // the first n lanes.
  static ROME_INLINE void store_finite(T* y, const Chunk& c) { L::store(y, c.v[0]); }
  static ROME_INLINE void store(T* y, const Chunk& c, std::int64_t n) {
    L::store(y, c.v[0], I::lanes(n));
  }
  static ROME_INLINE Chunk swap_pairs(const Chunk& c) { return {{I::swap_pairs(c.v[0])}}; }
  static const float* weights_in_table_order(const float* w, std::int64_t, float*) { return w; }
  // Where the storage narrows two vectors in one instruction (AVX-512 bf16 with AVX512-BF16),
  // chunks j and j + kLanes of two places at once: one narrowing per pair and one test of the
  // four results for the rare lane that needs the exact path (the norm kernel was bound by the
  // per-vector test and narrowing, not by memory).
  static constexpr bool kStoresPairs = requires(T * y, typename I::F v) {
    L::store_finite_pairs(y, v, v, y, v, v);
  };
  static ROME_INLINE void store_finite_pairs(T* y0, const Chunk& lo0, const Chunk& hi0, T* y1,
                                             const Chunk& lo1, const Chunk& hi1) {
    L::store_finite_pairs(y0, lo0.v[0], hi0.v[0], y1, lo1.v[0], hi1.v[0]);
  }
};

template <class O>
concept StoresPairs = requires {
  O::kStoresPairs;
}
&&O::kStoresPairs;

template <class I, class O>
ROME_INLINE typename O::Chunk load_table_chunk(const float* p) {
  typename O::Chunk c;
  for (int i = 0; i < O::kVectors; ++i) c.v[i] = I::loadu(p + i * I::kLanes);
  return c;
}

// The table row of a tile row with the weight folded in (fold_norm_weight), refolded only when
// the row changes. Rows of whole chunks fold chunk by chunk, elementwise, from the weights in the
// tables' lane order: the same products as fold_norm_weight, so the same bits.
template <class I, class O>
struct FoldedRow {
  const float* cos = nullptr;
  const float* sin = nullptr;
  float* cw;
  float* sw;
  const float* weights;  // in the tables' lane order
  NormKind kind;
  bool vector_fold;
  std::int64_t head_dim;
  // Rows whose sum of squares is at most this (and whose scale is finite) take the vector loop
  // (finite_sum_squares_bound).
  float finite_sum_squares_max = -1;

  // A local of each call (its table rows may sit where the last call's did), not a thread_local:
  // members read through TLS cost a vzeroupper and a reload per row.
  FoldedRow(float* cw_sw, std::int64_t sw_offset, const float* w, const RotationData& r, NormKind k,
            bool vector_fold_rows)
      : cw(cw_sw),
        sw(cw_sw + sw_offset),
        weights(w),
        kind(k),
        vector_fold(vector_fold_rows),
        head_dim(r.head_dim) {}

  ROME_INLINE void update(const RotationData& r, const float* c, const float* s,
                          const float* weight) {
    if (c != cos || s != sin) refold(r, c, s, weight);
  }

  [[gnu::noinline]] void refold(const RotationData& r, const float* c, const float* s,
                                const float* weight) {
    using F = typename I::F;
    using Chunk = typename O::Chunk;
    const std::int64_t rd = r.rotary_dim, h = rd / 2;
    double m = INFINITY;  // the lane loop's rotations: every row takes it, no bound needed
    if (vector_fold) {
      F most_c = I::set1(0.0f), most_s = I::set1(0.0f), probe = I::set1(0.0f);
      // Lanes [j, j + O::kLanes) with the weights of their A lanes (wa) and B lanes (wb).
      auto fold = [&](std::int64_t j, const Chunk& wa, const Chunk& wb) {
        for (int i = 0; i < O::kVectors; ++i) {
          const std::int64_t k = j + i * I::kLanes;
          const F fc = I::mul(I::loadu(c + k), wa.v[i]);
          const F fs = I::mul(I::loadu(s + k), wb.v[i]);
          I::storeu(cw + k, fc);
          I::storeu(sw + k, fs);
          most_c = I::max(most_c, I::abs(fc));
          most_s = I::max(most_s, I::abs(fs));
          // max may drop a NaN; this sum is not finite wherever a NaN or an infinity went in
          // (or it overflowed: then the bound is merely not taken).
          probe = I::add(probe, I::sub(fc, fs));
        }
      };
      const float* w = weights;
      if (kind == NormKind::half) {  // the B lane of j is j ± h, in either order (h whole chunks)
        for (std::int64_t j = 0; j < h; j += O::kLanes)
          fold(j, load_table_chunk<I, O>(w + j), load_table_chunk<I, O>(w + j + h));
        for (std::int64_t j = h; j < rd; j += O::kLanes)
          fold(j, load_table_chunk<I, O>(w + j), load_table_chunk<I, O>(w + j - h));
      } else {
        for (std::int64_t j = 0; j < rd; j += O::kLanes) {
          const Chunk wa = load_table_chunk<I, O>(w + j);
          fold(j, wa, O::swap_pairs(wa));
        }
      }
      if (!I::any_not_finite(probe))
        m = double(I::reduce_max(most_c)) + double(I::reduce_max(most_s));
    } else {
      fold_norm_weight(r, c, s, weight, cw, sw);
    }
    finite_sum_squares_max = finite_sum_squares_bound(m, head_dim);
    cos = c;
    sin = s;
  }
};

// ---------------------------------------------------------------------------------------------
// Pass 1

template <class I>
constexpr int kGroupRows = (I::kRowsPerVector * I::kAccumulators);  // rows per pass-1 group

// Pass 1's traits for storage type D: I's own, or I::SumSquares<D> where an ISA sums some
// dtypes another way (AVX-512: f32 rows one per 8-lane vector, see avx512_norm_rope.cpp).
template <class I, DType D>
struct SumSquaresOf {
  using type = I;
};
template <class I, DType D>
requires requires {
  typename I::template SumSquares<D>;
}
struct SumSquaresOf<I, D> {
  using type = typename I::template SumSquares<D>;
};

template <DType D>
using Storage = typename detail::Storage<D>::type;

// Sums of squares of A·kRowsPerVector rows in the contract's order (bf16: each whole 16-lane
// chunk's even lanes, then its odd lanes).
template <class I, DType D, int A>
ROME_INLINE void sum_squares(const Storage<D>* const* x, std::int64_t hd, float* ss) {
  using F = typename I::F;
  constexpr int R = I::kRowsPerVector;
  F acc[A];
#pragma GCC unroll 8
  for (int a = 0; a < A; ++a) acc[a] = I::set1(0.0f);
  std::int64_t j = 0;
  if constexpr (D == DType::bf16) {
    for (; j + 16 <= hd; j += 16)
#pragma GCC unroll 8
      for (int a = 0; a < A; ++a) {
        const auto e = I::split_rows_bf16(x + R * a, j);
        acc[a] = I::fma(e.even, e.even, acc[a]);
        acc[a] = I::fma(e.odd, e.odd, acc[a]);
      }
  }
  for (; j < hd; j += 8)  // fma(0, 0, s) == s past hd
#pragma GCC unroll 8
    for (int a = 0; a < A; ++a) {
      const F v = I::template load_rows<D>(x + R * a, j, hd - j);
      acc[a] = I::fma(v, v, acc[a]);
    }
  I::template reduce_rows<A>(acc, ss);
}

// sum_squares of the rows of `accumulators` <= A accumulators, on the smallest power of two of
// them that holds those rows (the rows up to it present: sums past them are computed, unused).
template <class I, DType D, int A>
ROME_INLINE void sum_squares_fewest(const Storage<D>* const* x, int accumulators, std::int64_t hd,
                                    float* ss) {
  static_assert((A & (A - 1)) == 0, "kAccumulators is a power of two");
  if constexpr (A > 1) {
    if (accumulators <= A / 2) return sum_squares_fewest<I, D, A / 2>(x, accumulators, hd, ss);
  }
  sum_squares<I, D, A>(x, hd, ss);
}

// Sums of squares of rows [n, n + count) of the tile, 0 < count <= kGroupRows; ss has kGroupRows
// entries.
template <class I, DType D>
void sum_squares_rows(const ForwardTile& tile, std::int64_t n, int count, std::int64_t hd,
                      float* ss) {
  constexpr int R = I::kRowsPerVector;
  const Storage<D>* x[kGroupRows<I>];
  for (int i = 0; i < count; ++i) x[i] = static_cast<const Storage<D>*>(tile.x_row(n + i));
  // A partial group (a token with fewer heads than a group, or its last ones) takes the fewest
  // accumulators that hold it, the last row standing in for the missing ones (summed one row at a
  // time, a tile of 4 heads took 5% longer on AVX2).
  for (int i = count; i < kGroupRows<I>; ++i) x[i] = x[count - 1];
  sum_squares_fewest<I, D, I::kAccumulators>(x, (count + R - 1) / R, hd, ss);
}

// ---------------------------------------------------------------------------------------------
// Pass 2

// One row of a half or interleave rotation of whole chunks, a row under the finite bound:
// r·(xa·c + xb·s) as combine_lane(_one_fma) forms it, without combine_lane's guard for a
// non-finite xa·c (there is none), scaled once; lanes past rotary_dim (x·r)·w.
template <class I, class O, NormKind K, bool kSingleFma>
ROME_INLINE void rotate_row(const typename O::T* x, typename O::T* y, const float* cw,
                            const float* sw, const float* weights, std::int64_t rd, std::int64_t hd,
                            typename I::F r) {
  using Chunk = typename O::Chunk;
  auto scaled_sum = [&](const Chunk& a, const Chunk& b, std::int64_t j) ROME_INLINE_LAMBDA {
    Chunk out;
    for (int i = 0; i < O::kVectors; ++i) {
      const auto c = I::loadu(cw + j + i * I::kLanes), s = I::loadu(sw + j + i * I::kLanes);
      out.v[i] = I::mul(kSingleFma ? I::combine_one_fma(a.v[i], c, b.v[i], s)
                                   : I::combine_unguarded(a.v[i], c, b.v[i], s),
                        r);
    }
    return out;
  };
  if constexpr (K == NormKind::half) {
    const std::int64_t h = rd / 2;
    std::int64_t j0 = 0;
    if constexpr (StoresPairs<O>) {
      constexpr std::int64_t kL = O::kLanes;
      for (; j0 + 2 * kL <= h; j0 += 2 * kL) {
        const std::int64_t j1 = j0 + h;
        const Chunk a0 = O::load(x + j0), a1 = O::load(x + j0 + kL);
        const Chunk b0 = O::load(x + j1), b1 = O::load(x + j1 + kL);
        O::store_finite_pairs(y + j0, scaled_sum(a0, b0, j0), scaled_sum(a1, b1, j0 + kL), y + j1,
                              scaled_sum(b0, a0, j1), scaled_sum(b1, a1, j1 + kL));
      }
    }
    for (; j0 < h; j0 += O::kLanes) {
      const std::int64_t j1 = j0 + h;
      const Chunk a = O::load(x + j0), b = O::load(x + j1);  // both read before either is written
      const Chunk v0 = scaled_sum(a, b, j0), v1 = scaled_sum(b, a, j1);
      O::store_finite(y + j0, v0);
      O::store_finite(y + j1, v1);
    }
  } else {
    std::int64_t j = 0;
    if constexpr (StoresPairs<O>) {
      constexpr std::int64_t kL = O::kLanes;
      for (; j + 4 * kL <= rd; j += 4 * kL) {
        const Chunk a0 = O::load(x + j), a1 = O::load(x + j + kL);
        const Chunk a2 = O::load(x + j + 2 * kL), a3 = O::load(x + j + 3 * kL);
        O::store_finite_pairs(y + j, scaled_sum(a0, O::swap_pairs(a0), j),
                              scaled_sum(a1, O::swap_pairs(a1), j + kL), y + j + 2 * kL,
                              scaled_sum(a2, O::swap_pairs(a2), j + 2 * kL),
                              scaled_sum(a3, O::swap_pairs(a3), j + 3 * kL));
      }
    }
    for (; j < rd; j += O::kLanes) {
      const Chunk a = O::load(x + j);
      O::store_finite(y + j, scaled_sum(a, O::swap_pairs(a), j));
    }
  }
  for (std::int64_t j = rd; j < hd; j += O::kLanes) {
    const Chunk a = O::load(x + j, hd - j), w = O::load_weights(weights + j, hd - j);
    Chunk out;
    for (int i = 0; i < O::kVectors; ++i) out.v[i] = I::mul(I::mul(a.v[i], r), w.v[i]);
    O::store(y + j, out, hd - j);
  }
}

// The buffers of one call, from the thread's: the row widened for the lane loop, the folded
// table row (cw, sw), the weights in the tables' order and the folded row in natural order.
struct NormBuffers {
  float* row;
  float* cw_sw;
  std::int64_t sw_offset;
  float* weights;
  float* natural;
};

// A row by the contract's lane loop: x widened, the folded row in natural lane order.
template <class I, DType D, class L, class O>
[[gnu::noinline]] void rotate_row_lanes(const RotationData& r, const Storage<D>* x, Storage<D>* y,
                                        float scale, const FoldedRow<I, O>& folded,
                                        const NormParams& norm, const NormBuffers& buffers) {
  const std::int64_t rd = r.rotary_dim, hd = r.head_dim;
  for (std::int64_t j = 0; j < hd; j += I::kLanes)
    I::storeu(buffers.row + j, L::load(x + j, I::lanes(hd - j)));
  const float* cw = folded.cw;
  const float* sw = folded.sw;
  if constexpr (!O::kNaturalTables) {
    O::to_natural(cw, rd, buffers.natural);
    O::to_natural(sw, rd, buffers.natural + rd);
    cw = buffers.natural;
    sw = buffers.natural + rd;
  }
  store_norm_row_lanes<D>(r, buffers.row, scale, cw, sw, norm, y);
}

template <class I, DType D, class L, class O, NormKind K>
[[gnu::noinline]] void norm_rows(const RotationData& r, const ForwardTile& run,
                                 const NormParams& norm, FoldedRow<I, O>& folded,
                                 const NormBuffers& buffers) {
  const std::int64_t rd = r.rotary_dim, hd = r.head_dim;
  using Pass1 = typename SumSquaresOf<I, D>::type;
  constexpr int kGroup = kGroupRows<Pass1>;
  float ss[kGroup] = {}, scales[kGroup];
  // Prefetches go to an address along the walk through memory (prefetch_distance), not a row
  // ahead in the tile (token-major calls hold one token's heads); rows over 1 KiB are long runs
  // the prefetchers follow alone. Into L1, except where a token's rows end before the next token's
  // begin (q or k heads of a packed qkv): the hardware prefetchers lose such streams, and into L1
  // the prefetches held its few miss buffers (kernel_support.hpp). Paired on an AVX-512 Zen 4,
  // Qwen3 shapes, T 4096, 1 thread: prefetching into L2 took 0.84x the time on a packed qkv and
  // 1.02-1.03x on contiguous q and k (BENCHMARKS.md, twenty-fifth session).
  const std::int64_t row_bytes = hd * std::int64_t(sizeof(Storage<D>));
  const std::int64_t prefetch_bytes = row_bytes <= 1024 ? row_bytes : 0;
  const std::int64_t ahead = prefetch_distance(run);
  const bool runs_apart = !token_runs_adjoin(run);
  for (std::int64_t t = 0; t < run.tokens; ++t) {
    const ForwardTile tile = run.token(t);
    // One table row for every row of the token (the fused executor's tiles): folded once here.
    const bool one_table_row = tile.table_step == 0;
    if (one_table_row) folded.update(r, tile.cos_row(0), tile.sin_row(0), norm.weight);
    for (std::int64_t n0 = 0; n0 < tile.count; n0 += kGroup) {
      const int group = int(std::min<std::int64_t>(kGroup, tile.count - n0));
      sum_squares_rows<Pass1, D>(tile, n0, group, hd, ss);
      Pass1::inverse_rms(ss, group, hd, norm.eps, scales);
      // Row n0 + i's x and y, `prefetch` of its bytes `ahead` asked for.
      auto row_pointers = [&](int i, std::int64_t prefetch) ROME_INLINE_LAMBDA {
        const std::int64_t n = n0 + i;
        const auto* x = static_cast<const Storage<D>*>(tile.x_row(n));
        for (std::int64_t b = 0; b < prefetch; b += 64) {
          const char* line = reinterpret_cast<const char*>(x) + ahead + b;
          runs_apart ? I::prefetch_to_l2(line) : I::prefetch(line);
        }
        return std::pair{x, static_cast<Storage<D>*>(tile.y_row(n))};
      };
      auto vector_row = [&](int i) ROME_INLINE_LAMBDA {
        return ss[i] <= folded.finite_sum_squares_max && scales[i] <= FLT_MAX;
      };
      if constexpr (K != NormKind::other) {
        // The common case in a loop without calls, whose stores then cannot touch the folded row
        // and whose constants stay in registers (a call per row forced a reload of both: 9% of
        // this function's instructions, Qwen3 shapes).
        bool every_row_vector = one_table_row;
        for (int i = 0; i < group; ++i) every_row_vector &= vector_row(i);
        if (every_row_vector) {
          const float* cw = folded.cw;
          const float* sw = folded.sw;
          const float* weights = folded.weights;
          auto rows = [&](std::int64_t rd_, std::int64_t hd_, std::int64_t prefetch)
                          ROME_INLINE_LAMBDA {
                            for (int i = 0; i < group; ++i) {
                              const auto [x, y] = row_pointers(i, prefetch);
                              rotate_row<I, O, K, single_fma_epilogue(D)>(
                                  x, y, cw, sw, weights, rd_, hd_, I::set1(scales[i]));
                            }
                          };
          // The common head widths with the widths constants (each call inlined apart): the
          // chunk loops unroll and the prefetches are counted (Qwen3 shapes, AVX2: 209 -> 177
          // instructions a row in this function, callgrind).
          constexpr std::int64_t kEs = std::int64_t(sizeof(Storage<D>));
          switch (rd == hd ? rd : 0) {
            case 64: rows(64, 64, 64 * kEs); break;
            case 128: rows(128, 128, 128 * kEs); break;
            case 256: rows(256, 256, 256 * kEs <= 1024 ? 256 * kEs : 0); break;
            default: rows(rd, hd, prefetch_bytes);
          }
          continue;
        }
      }
      for (int i = 0; i < group; ++i) {
        const auto [x, y] = row_pointers(i, prefetch_bytes);
        folded.update(r, tile.cos_row(n0 + i), tile.sin_row(n0 + i), norm.weight);
        if constexpr (K != NormKind::other) {
          if (vector_row(i)) {
            rotate_row<I, O, K, single_fma_epilogue(D)>(x, y, folded.cw, folded.sw, folded.weights,
                                                        rd, hd, I::set1(scales[i]));
            continue;
          }
        }
        rotate_row_lanes<I, D, L, O>(r, x, y, scales[i], folded, norm, buffers);
      }
    }
  }
}

// Half or interleave rows of whole chunks of order O.
template <class I, DType D, class L, class O>
void norm_rows_in_order(const RotationData& r, const ForwardTile& tile, const NormParams& norm,
                        NormKind kind, const NormBuffers& buffers) {
  const float* weights = O::weights_in_table_order(norm.weight, r.head_dim, buffers.weights);
  FoldedRow<I, O> folded(buffers.cw_sw, buffers.sw_offset, weights, r, kind, true);
  if (kind == NormKind::half)
    return norm_rows<I, D, L, O, NormKind::half>(r, tile, norm, folded, buffers);
  return norm_rows<I, D, L, O, NormKind::interleave>(r, tile, norm, folded, buffers);
}

template <class I>
concept HasBf16Order = requires {
  typename I::Bf16Order;
};

// The NormForwardFn of storage type D with lanes L.
template <class I, DType D, class L>
void forward_norm(const RotationData& r, const ForwardTile& tile, const NormParams& norm) {
  const std::int64_t rd = r.rotary_dim, hd = r.head_dim;
  constexpr std::int64_t kW = I::kLanes;
  const std::int64_t row_floats = (hd + kW - 1) / kW * kW;
  const std::int64_t rd_floats = (rd + 15) / 16 * 16, hd_floats = (hd + 15) / 16 * 16;
  // NormBuffers: row (64-byte aligned), cw and sw, the weights, the natural cw and sw (all read
  // and written unaligned).
  thread_local std::vector<float> buffer;
  const std::size_t need = std::size_t(row_floats + 4 * rd_floats + hd_floats + 16);
  if (buffer.size() < need) buffer.assign(need, 0.0f);
  float* row = reinterpret_cast<float*>((reinterpret_cast<std::uintptr_t>(buffer.data()) + 63) &
                                        ~std::uintptr_t(63));
  float* cw_sw = row + row_floats;
  float* weights = cw_sw + 2 * rd_floats;
  const NormBuffers buffers{row, cw_sw, rd_floats, weights, weights + hd_floats};
  const NormKind kind = classify_norm(r);
  if constexpr (D == DType::bf16 && HasBf16Order<I>) {
    using O = typename I::Bf16Order;
    if (O::takes(r, kind)) return norm_rows_in_order<I, D, L, O>(r, tile, norm, kind, buffers);
  }
  using O = NaturalOrder<I, L>;
  if (whole_chunk_rows(r, kind, O::kLanes))
    return norm_rows_in_order<I, D, L, O>(r, tile, norm, kind, buffers);
  FoldedRow<I, O> folded(buffers.cw_sw, buffers.sw_offset, norm.weight, r, kind, false);
  norm_rows<I, D, L, O, NormKind::other>(r, tile, norm, folded, buffers);
}

// The TableLayoutFn: the order of the tiles forward_norm takes.
template <class I>
TableLayout norm_table_layout(const RotationData& r, DType dtype) {
  if constexpr (HasBf16Order<I>) {
    if (dtype == DType::bf16 && I::Bf16Order::takes(r, classify_norm(r)))
      return I::Bf16Order::kLayout;
  }
  return TableLayout::natural;
}

}  // namespace
}  // namespace rome::kernels::norm_rope
