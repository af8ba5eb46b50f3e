// The signed-permutation forward kernel, written once over an ISA traits type and compiled into
// each SIMD kernel library (anonymous namespace: every copy keeps its own flags).
//
// The core hands over tiles of rows with their table rows, the signs of A and B already folded
// in: (±x)·c == x·(±c) and fma(±x, s, t) == fma(x, ±s, t) bit for bit. Plan B is classified once
// per rotation (cached per thread, rebuilt when a call brings another rotation):
//  - pairs:   interleave: every vector swaps its lane pairs;
//  - local:   every output vector permutes its own input vector;
//  - half / quarter move: output vector v is input vector v ^ V/2 or v ^ V/4, no permute;
//  - single / move: every output vector permutes (or is) one input vector, read straight from x
//             out of place; in place the row goes the general way;
//  - general: the row is widened into an fp32 buffer and every output vector is built by the
//             ISA's permute steps of the plan (the ISA files add their own kinds for it).
// Here are the per-call setup, the classification, the per-thread cache and the row loops of
// any rotary dim; an ISA file adds the loops only it has and dispatches. The epilogue is the
// ISA's combine (combine_lane operation for operation) or, for 16-bit x, its one-fma form
// (kernel_api.hpp's single_fma_epilogue), one rounding to the storage type: every bit matches the
// scalar kernel. Non-temporal stores only when the core asks and the row is 64-byte aligned.
//
// Traits I: F (kLanes fp32 lanes); Count (lanes of a vector: a count or a mask) with kAll,
// lanes(n) (the first n) and bits(Count); Index / Mask (a vector's permute index and the lanes
// it fills) with index(const int32_t*) and mask(uint32_t); load / store (aligned fp32);
// combine, combine_one_fma, epilogue_pair<kOneFma> (rows_xor_move only); swap_pairs, permute(x,
// Index, Mask); GeneralPlan, general_plan(work, a) and permute_plan(plan, v, X); prefetch_to_l2,
// copy_bytes, fence, equal_bytes. Storage-type lanes L: T, load / store (whole or Count lanes),
// stream.
#pragma once

#include <cstdint>
#include <type_traits>
#include <vector>

#include "../kernel_api.hpp"
#include "../kernel_support.hpp"

namespace rome::kernels::permute {
namespace {

using detail::PermuteStep;
using detail::RotationData;
using detail::VectorPermutePlan;

enum class Kind {
  pairs,
  local,
  half_move,
  quarter_move,
  single,
  move,
  deinterleave,  // AVX2 only
  shifted,       // AVX2 only
  shifted_two,   // AVX2 only
  general
};

// Per-rotation data of the shared kinds; an ISA's plan type derives from it.
template <class I>
struct PlanBase {
  using Isa = I;
  Kind kind = Kind::general;
  int xor_k = 0;                             // half / quarter move: input vector v ^ xor_k
  const typename I::Index* idx = nullptr;    // local / single: per output vector
  const typename I::Mask* mask = nullptr;    // local / single: lanes with a source
  const std::int32_t* src = nullptr;         // single / move: first element of the source vector
  const typename I::Count* src_n = nullptr;  // lanes of the source vector that exist
};

// Per-call state: the rotation's sizes, the tile's options, the cached plan P.
template <class P>
struct Work : P {
  using I = typename P::Isa;
  const RotationData* r = nullptr;
  std::int64_t rd = 0, hd = 0, V = 0;
  typename I::Count tail = I::kAll;  // lanes of the last vector
  bool pass = false;                 // copy lanes [rd, hd)
  bool stream = false;               // non-temporal stores for 64-byte aligned rows
  float* X = nullptr;                // the row in fp32 (general rows), or ISA row copies
};

template <class W>
ROME_INLINE typename W::I::Count lanes_of(const W& w, std::int64_t v) {
  return v == w.V - 1 ? w.tail : W::I::kAll;
}

template <class P>
Work<P> work_for(const RotationData& r) {
  using I = typename P::Isa;
  constexpr int kW = I::kLanes;
  Work<P> w;
  w.r = &r;
  w.rd = r.rotary_dim;
  w.hd = r.head_dim;
  w.V = (w.rd + kW - 1) / kW;
  w.tail = I::lanes(w.rd % kW ? int(w.rd % kW) : kW);
  return w;
}

template <class L>
using Row = TileRow<typename L::T>;

// Row n, and a prefetch of its x bytes `ahead` (prefetch_distance) bytes further along. Prefetches
// never fault, so the address may lie past the tensor. Rows over 1 KiB are long runs the
// prefetchers follow alone.
template <class L, class W>
ROME_INLINE Row<L> row_of(const W& w, const ForwardTile& tile, std::int64_t n, std::int64_t ahead) {
  const std::int64_t bytes = w.hd * std::int64_t(sizeof(typename L::T));
  if (bytes <= 1024) {
    const char* next = static_cast<const char*>(tile.x_row(n)) + ahead;
    for (std::int64_t b = 0; b < bytes; b += 64) W::I::prefetch_to_l2(next + b);
  }
  return tile_row<typename L::T>(tile, n);
}

template <class L, class W>
ROME_INLINE void pass_through(const W& w, const typename L::T* x, typename L::T* y) {
  if (w.pass)
    W::I::copy_bytes(y + w.rd, x + w.rd, (w.hd - w.rd) * std::int64_t(sizeof(typename L::T)),
                     w.stream);
}

// Rows of 16-bit storage take the one-fma epilogue (kernel_api.hpp: single_fma_epilogue).
template <class L>
constexpr bool kOneFmaRows = sizeof(typename L::T) == 2;

template <class L, class W, class F>
ROME_INLINE F combine(const W& w, F xa, F xb, const Row<L>& row, std::int64_t v) {
  using I = typename W::I;
  const F c = I::load(row.C + I::kLanes * v), s = I::load(row.S + I::kLanes * v);
  if constexpr (kOneFmaRows<L>)
    return I::combine_one_fma(xa, c, xb, s);
  else
    return I::combine(xa, c, xb, s);
}

template <class L, class W>
ROME_INLINE bool streaming_row(const W& w, const typename L::T* y) {
  return w.stream && (w.rd * std::int64_t(sizeof(typename L::T))) % 64 == 0 &&
         (reinterpret_cast<std::uintptr_t>(y) & 63) == 0;
}

template <class L, class W, class F>
ROME_INLINE void put(const W& w, bool stream, typename L::T* y, std::int64_t v, F out) {
  if (stream)
    L::stream(y + W::I::kLanes * v, out);
  else
    L::store(y + W::I::kLanes * v, out, lanes_of(w, v));
}

// Runs body(row, stream) on every row of a one-token tile (stream: streaming_row), then copies
// the row's pass-through lanes.
template <class L, class W, class Body>
ROME_INLINE void for_rows(const W& w, const ForwardTile& tile, Body body) {
  const std::int64_t ahead = prefetch_distance(tile);
  for (std::int64_t n = 0; n < tile.count; ++n) {
    const Row<L> row = row_of<L>(w, tile, n, ahead);
    body(row, streaming_row<L>(w, row.y));
    pass_through<L>(w, row.x, row.y);
  }
}

// for_rows for rows of a width known at compile time (kBytes of x each, no pass-through lanes)
// whose streaming is the same for every row: body(row, std::bool_constant<stream>) with the row
// loops unrolled, the prefetches counted and streaming decided once per run, so that the
// per-row bookkeeping stops costing about a fifth of a bf16 half row (rd 128: 200 -> 153
// instructions a row, callgrind). False, running nothing, for a run that does not qualify.
template <class L, std::int64_t kBytes, class W, class Body>
ROME_INLINE bool for_fixed_rows(const W& w, const ForwardTile& tile, Body body) {
  if (w.pass || w.rd * std::int64_t(sizeof(typename L::T)) != kBytes) return false;
  const bool stream_all = w.stream && kBytes % 64 == 0 &&
                          (reinterpret_cast<std::uintptr_t>(tile.y) & 63) == 0 &&
                          (tile.count == 1 || tile.y_step % 64 == 0);
  if (w.stream && !stream_all) return false;
  const std::int64_t ahead = prefetch_distance(tile);
  auto run = [&](auto stream) ROME_INLINE_LAMBDA {
    for (std::int64_t n = 0; n < tile.count; ++n) {
      const char* next = static_cast<const char*>(tile.x_row(n)) + ahead;
      for (std::int64_t b = 0; b < kBytes; b += 64) W::I::prefetch_to_l2(next + b);
      body(tile_row<typename L::T>(tile, n), stream);
    }
  };
  if (stream_all)
    run(std::true_type{});
  else
    run(std::false_type{});
  return true;
}

// for_fixed_rows at the common rotary widths (64, 128 or 256 lanes): body(lanes, row, stream)
// with lanes an integral constant. False where the run does not qualify.
template <class L, class W, class Body>
ROME_INLINE bool fixed_width_rows(const W& w, const ForwardTile& tile, Body body) {
  constexpr std::int64_t kEs = std::int64_t(sizeof(typename L::T));
  auto with = [&](auto lanes) ROME_INLINE_LAMBDA {
    return for_fixed_rows<L, decltype(lanes)::value * kEs>(
        w, tile,
        [&](const Row<L>& row, auto stream) ROME_INLINE_LAMBDA { body(lanes, row, stream); });
  };
  switch (w.rd) {
    case 64: return with(std::integral_constant<std::int64_t, 64>{});
    case 128: return with(std::integral_constant<std::int64_t, 128>{});
    case 256: return with(std::integral_constant<std::int64_t, 256>{});
    default: return false;
  }
}

// The row x widened into the fp32 buffer X (whole vectors, then the last one by its lanes).
template <class L, class W>
ROME_INLINE void widen_row(const W& w, const typename L::T* x, float* X) {
  constexpr int kW = W::I::kLanes;
  const std::int64_t last = w.V - 1;
  for (std::int64_t v = 0; v < last; ++v) W::I::store(X + kW * v, L::load(x + kW * v));
  W::I::store(X + kW * last, L::load(x + kW * last, w.tail));
}

// ---------------------------------------------------------------------------------------------
// Row loops of any rotary dim

// pairs / local: each output vector from its own input vector.
template <class L, bool kPairs, class W>
ROME_INLINE void rows_local(const W& w, const ForwardTile& tile) {
  using I = typename W::I;
  constexpr int kW = I::kLanes;
  if constexpr (kPairs) {
    auto fixed = [&](auto lanes, const Row<L>& row, auto stream) ROME_INLINE_LAMBDA {
      for (std::int64_t v = 0; v < decltype(lanes)::value / kW; ++v) {
        const auto xv = L::load(row.x + kW * v);
        put<L>(w, stream, row.y, v, combine<L>(w, xv, I::swap_pairs(xv), row, v));
      }
    };
    if (fixed_width_rows<L>(w, tile, fixed)) return;
  }
  for_rows<L>(w, tile, [&](const Row<L>& row, bool stream) ROME_INLINE_LAMBDA {
    for (std::int64_t v = 0; v < w.V; ++v) {
      const auto xv = L::load(row.x + kW * v, lanes_of(w, v));
      const auto xb = kPairs ? I::swap_pairs(xv) : I::permute(xv, w.idx[v], w.mask[v]);
      put<L>(w, stream, row.y, v, combine<L>(w, xv, xb, row, v));
    }
  });
}

// half / quarter move: vectors v and v ^ K swap roles; both are read before either is written.
template <class L, class W>
ROME_INLINE void rows_xor_move(const W& w, const ForwardTile& tile) {
  using I = typename W::I;
  constexpr int kW = I::kLanes;
  const std::int64_t K = w.xor_k;
  // Vectors v and v + step of each 2·step, for v < V.
  auto row_of_vectors = [&](std::int64_t V, std::int64_t step, const Row<L>& row,
                            auto stream) ROME_INLINE_LAMBDA {
    for (std::int64_t v0 = 0; v0 < V; v0 += 2 * step) {
      for (std::int64_t v = v0; v < v0 + step; ++v) {
        const std::int64_t u = v + step;
        const auto a = L::load(row.x + kW * v), b = L::load(row.x + kW * u);
        const auto cv = I::load(row.C + kW * v), sv = I::load(row.S + kW * v);
        const auto cu = I::load(row.C + kW * u), su = I::load(row.S + kW * u);
        decltype(I::load(row.C)) out_v, out_u;
        I::template epilogue_pair<kOneFmaRows<L>>(a, cv, b, sv, b, cu, a, su, out_v, out_u);
        put<L>(w, stream, row.y, v, out_v);
        put<L>(w, stream, row.y, u, out_u);
      }
    }
  };
  // The half rotation (vector v pairs with v + V / 2) and the quarter one (or two half blocks:
  // v + V / 4) at the common widths, K a constant.
  auto fixed = [&](auto parts) ROME_INLINE_LAMBDA {
    return fixed_width_rows<L>(w, tile,
                               [&](auto lanes, const Row<L>& row, auto stream) ROME_INLINE_LAMBDA {
                                 constexpr std::int64_t kV = decltype(lanes)::value / kW;
                                 row_of_vectors(kV, kV / decltype(parts)::value, row, stream);
                               });
  };
  if (2 * K == w.V && fixed(std::integral_constant<std::int64_t, 2>{})) return;
  if (4 * K == w.V && fixed(std::integral_constant<std::int64_t, 4>{})) return;
  for_rows<L>(w, tile, [&](const Row<L>& row, bool stream) ROME_INLINE_LAMBDA {
    row_of_vectors(w.V, K, row, stream);
  });
}

// general (and single / move in place): the row is widened into X first.
template <class L, class W>
ROME_INLINE void row_general(const W& w, const Row<L>& row, bool stream) {
  using I = typename W::I;
  constexpr int kW = I::kLanes;
  const bool a_identity = w.r->a_identity;
  const typename I::GeneralPlan pa = I::general_plan(w, true), pb = I::general_plan(w, false);
  float* const X = w.X;
  widen_row<L>(w, row.x, X);
  for (std::int64_t v = 0; v < w.V; ++v) {
    const auto xb = I::permute_plan(pb, v, X);
    const auto xa = a_identity ? I::load(X + kW * v) : I::permute_plan(pa, v, X);
    put<L>(w, stream, row.y, v, combine<L>(w, xa, xb, row, v));
  }
}

// single / move out of place: sources read straight from x.
template <class L, bool kMove, class W>
ROME_INLINE void row_single(const W& w, const Row<L>& row, bool stream) {
  using I = typename W::I;
  constexpr int kW = I::kLanes;
  for (std::int64_t v = 0; v < w.V; ++v) {
    const auto xs = L::load(row.x + w.src[v], w.src_n[v]);
    const auto xb = kMove ? xs : I::permute(xs, w.idx[v], w.mask[v]);
    const auto xa = L::load(row.x + kW * v, lanes_of(w, v));
    put<L>(w, stream, row.y, v, combine<L>(w, xa, xb, row, v));
  }
}

template <class L, class W>
ROME_INLINE void rows_general(const W& w, const ForwardTile& tile) {
  for_rows<L>(w, tile, [&](const Row<L>& row, bool stream) ROME_INLINE_LAMBDA {
    row_general<L>(w, row, stream);
  });
}

template <class L, bool kMove, class W>
ROME_INLINE void rows_single(const W& w, const ForwardTile& tile) {
  for_rows<L>(w, tile, [&](const Row<L>& row, bool stream) ROME_INLINE_LAMBDA {
    if (static_cast<const void*>(row.x) == static_cast<const void*>(row.y))
      row_general<L>(w, row, stream);
    else
      row_single<L, kMove>(w, row, stream);
  });
}

// ---------------------------------------------------------------------------------------------
// Per-rotation preparation

// Classifies plan B (A must be the identity for anything but general) and fills the per-vector
// permute data: idx, mask, src, src_n (V each) and plan.xor_k.
template <class P>
Kind classify(const VectorPermutePlan& pb, const Work<P>& w, P& plan, typename P::Isa::Index* idx,
              typename P::Isa::Mask* mask, std::int32_t* src, typename P::Isa::Count* src_n) {
  using I = typename P::Isa;
  constexpr int kW = I::kLanes;
  if (!w.r->a_identity) return Kind::general;
  bool local = true, move = true, pairs = true, half = true, quarter = true;
  for (std::int64_t v = 0; v < w.V; ++v) {
    if (pb.step_begin[v + 1] - pb.step_begin[v] != 1) return Kind::general;
    const PermuteStep& s = pb.steps[pb.step_begin[v]];
    alignas(64) std::int32_t lane_idx[kW];
    bool iota = true, swap = true;
    for (int l = 0; l < kW; ++l) {
      // One source vector: src1 unused (or equal to src0).
      if (s.src1 != s.src0 && s.idx[l] >= kW) return Kind::general;
      lane_idx[l] = s.idx[l] & (kW - 1);
      if (!(s.lanes >> l & 1)) continue;
      iota &= lane_idx[l] == l;
      swap &= lane_idx[l] == (l ^ 1);
    }
    idx[v] = I::index(lane_idx);
    mask[v] = I::mask(s.lanes);
    src[v] = kW * s.src0;
    src_n[v] = lanes_of(w, s.src0);
    const bool full = s.lanes == I::bits(lanes_of(w, v));
    local &= s.src0 == v;
    pairs &= s.src0 == v && full && swap;
    move &= full && lanes_of(w, v) == I::kAll && src_n[v] == I::kAll && iota;
    half &= s.src0 == (v ^ (w.V / 2));
    quarter &= s.src0 == (v ^ (w.V / 4));
  }
  if (local) return pairs ? Kind::pairs : Kind::local;
  // The move kinds' rows pair vector v with v + K in each 2K (rows_xor_move) or with v ^ K
  // (AVX-512's fixed rows): the same vector, and the source classified here, only for K a power
  // of two (V = 24, K = 6: vector 2 takes 4, not 8). Other steps run as plain moves.
  const auto power_of_two = [](std::int64_t k) { return k > 0 && (k & (k - 1)) == 0; };
  half = half && power_of_two(w.V / 2);
  quarter = quarter && power_of_two(w.V / 4);
  if (move && w.V % 4 == 0 && (half || quarter)) {
    plan.xor_k = int(half ? w.V / 2 : w.V / 4);
    return half ? Kind::half_move : Kind::quarter_move;
  }
  return move ? Kind::move : Kind::single;
}

template <class I, class T>
ROME_INLINE bool equal(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && I::equal_bytes(a.data(), b.data(), a.size() * sizeof(T));
}

// Everything derived from the rotation alone, kept per thread and rebuilt (by the ISA's `build`)
// when a call comes with a different rotation: the same object (address and uid) is taken as is,
// another one is compared by content.
template <class P>
class Prepared {
 public:
  P plan;

  template <class Build>
  void update(const RotationData& r, const Work<P>& w, Build build) {
    // The same object of the same lineage: nothing to compare (an address reused by another
    // rotation comes with another uid).
    if (&r == last_ && r.uid == last_uid_) return;
    if (!matches(r)) {
      rd_ = r.rotary_dim;
      a_identity_ = r.a_identity;
      b_src_ = r.b.src;
      b_sign_ = r.b.sign;
      a_src_ = r.a_identity ? std::vector<std::int32_t>() : r.a.src;
      a_sign_ = r.a_identity ? std::vector<std::int8_t>() : r.a.sign;
      plan = build(r, w, storage_);
    }
    last_ = &r;
    last_uid_ = r.uid;
  }

 private:
  using I = typename P::Isa;

  bool matches(const RotationData& r) const {
    return rd_ == r.rotary_dim && a_identity_ == r.a_identity && equal<I>(b_src_, r.b.src) &&
           equal<I>(b_sign_, r.b.sign) &&
           (r.a_identity || (equal<I>(a_src_, r.a.src) && equal<I>(a_sign_, r.a.sign)));
  }

  const RotationData* last_ = nullptr;
  std::uint64_t last_uid_ = 0;
  std::int64_t rd_ = -1;
  bool a_identity_ = true;
  std::vector<std::int32_t> a_src_, b_src_;
  std::vector<std::int8_t> a_sign_, b_sign_;
  Scratch storage_;  // the plan's arrays
};

template <class P>
struct ThreadState {
  Scratch scratch;  // X of rows longer than the stack buffer
  Prepared<P> prepared;
};
// A function-local thread_local, not a thread_local variable template: g++ 12 never destroyed the
// latter's instances at thread exit (LeakSanitizer: every pool thread's plan arrays leaked).
template <class P>
ThreadState<P>& thread_state() {
  thread_local ThreadState<P> state;
  return state;
}

// The plan of rotation r, from the thread's cache.
template <class P, class Build>
ROME_INLINE const P& prepared_plan(const RotationData& r, const Work<P>& w, Build build) {
  Prepared<P>& prepared = thread_state<P>().prepared;
  prepared.update(r, w, build);
  return prepared.plan;
}

// One tile: sets up the Work (X: the row widened to fp32, or row copies an ISA's kinds keep,
// with I::kPadVectors vectors of padding, on the stack when small), runs rows(kind, w, tile),
// which takes each token's run of rows in turn (tile.token(t)), and fences non-temporal stores,
// which are weakly ordered, before the tile is reported done. The token loop stays outside the
// row loops: inside them it cost the register-row kernels registers (3D 44/44/40 in place,
// 1 thread: 1.50 -> 2.0x the copy).
template <class P, class Build, class Rows>
ROME_INLINE void forward_tile(const RotationData& r, const ForwardTile& tile, Build build,
                              Rows rows) {
  using I = typename P::Isa;
  if (tile.count <= 0 || tile.tokens <= 0) return;
  Work<P> w = work_for<P>(r);
  w.pass = tile.copy_passthrough && w.hd > w.rd;
  w.stream = tile.stream;
  constexpr std::int64_t kStackFloats = 256;
  alignas(64) float stack[kStackFloats];
  const std::int64_t floats = (w.V + I::kPadVectors) * I::kLanes;
  w.X =
      floats <= kStackFloats
          ? stack
          : static_cast<float*>(thread_state<P>().scratch.get(std::size_t(floats) * sizeof(float)));
  static_cast<P&>(w) = prepared_plan(r, w, build);
  // A copy whose address no out-of-line call sees: the row loops' stores cannot alias it, so its
  // fields stay in registers (w went to build; a row dispatch kept out of line copies it again).
  const Work<P> work = w;
  rows(work.kind, work, tile);
  if (work.stream) I::fence();
}

}  // namespace
}  // namespace rome::kernels::permute
