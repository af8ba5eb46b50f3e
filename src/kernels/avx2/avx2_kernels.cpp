// AVX2 + FMA + F16C kernels: signed-permutation rotations as in-register permutes.
//
// Same scheme as the AVX-512 kernel with 8-lane vectors. Per batch, the cos/sin row is loaded
// once with the signs of A and B folded in ((±x)·c == x·(±c) and fma(±x, s, t) == fma(x, ±s, t)
// bit for bit) and plan B is classified once per rotation (cached per thread):
//  - pairs:   interleave: every vector swaps its lane pairs (vpermilps);
//  - local:   every output vector permutes its own input vector (vpermps + blend);
//  - half / quarter move: output vector v is input vector v ^ K; the two vectors of a pair are
//             read before either is written (in place safe), no permute;
//  - single / move: every output vector permutes (or is) one input vector, read straight from x
//             (out of place);
//  - general (and single / move in place): the row is widened into an fp32 buffer first and
//             every output vector is built by vpermps (_mm256_permutevar8x32_ps) steps of the
//             plan, blended into a zeroed accumulator.
// Then t = xa · cos (rounded), y = fma(xb, sin, t), one rounding to the storage type: the scalar
// kernel's operation order, so every bit matches it. Rows whose rotary_dim is not a multiple of
// 8 end with masked loads/stores (fp32) or a staging buffer (16-bit types). bf16 is narrowed by
// integer round-to-nearest-even (NaN quietened, subnormals kept), fp16 by F16C (exact).
// Large tensors: prefetch ahead and non-temporal stores, as in the AVX-512 kernel.
// A non-identity A with a lane that has no source (the scalar kernel computes 0 · x there) is
// handed to the scalar kernel.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>
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
// Per-batch state

enum class Kind { pairs, local, half_move, quarter_move, single, move, general };

struct Work {
  const RotationData* r = nullptr;
  std::int64_t rd = 0, hd = 0, V = 0;
  int tail = kW;        // lanes of the last vector
  bool pass = false;    // copy lanes [rd, hd)
  bool stream = false;  // non-temporal stores for 64-byte aligned rows
  std::int64_t pf_bytes = 0, pf_offset = 0;
  int xor_k = 0;             // half / quarter move: output vector v is input vector v ^ xor_k
  const float* C = nullptr;  // cos, sin with the signs of A, B folded in
  const float* S = nullptr;
  float* X = nullptr;                   // the row in fp32 (general)
  const __m256i* idx = nullptr;         // local / single: per output vector
  const __m256* mask = nullptr;         // local / single: lanes with a source (blend mask)
  const std::int32_t* src = nullptr;    // single / move: first element of the source vector
  const std::int32_t* src_n = nullptr;  // lanes of the source vector that exist
  const __m256* a_masks = nullptr;      // general: per plan step
  const __m256* b_masks = nullptr;
};

ROME_INLINE int lanes_of(const Work& w, std::int64_t v) {
  return v == w.V - 1 ? w.tail : kW;
}

ROME_INLINE void prefetch_ahead(const Work& w, const void* x, void* y) {
  const char* px = static_cast<const char*>(x) + w.pf_offset;
  const char* py = static_cast<const char*>(y) + w.pf_offset;
  for (std::int64_t b = 0; b < w.pf_bytes; b += 64) {
    _mm_prefetch(px + b, _MM_HINT_T0);
    if (!w.stream) __asm__ volatile("prefetchw %0" ::"m"(*(py + b)));
  }
}

template <typename L>
ROME_INLINE void pass_through(const Work& w, const typename L::T* x, typename L::T* y) {
  if (w.pass)
    copy_bytes(y + w.rd, x + w.rd, (w.hd - w.rd) * std::int64_t(sizeof(typename L::T)), w.stream);
}

ROME_INLINE __m256 combine(__m256 xa, __m256 xb, const Work& w, std::int64_t v) {
  return avx2::combine(xa, _mm256_load_ps(w.C + kW * v), xb, _mm256_load_ps(w.S + kW * v));
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
ROME_INLINE void rows_local(const Work& w, const ForwardBatch& batch) {
  using T = typename L::T;
  for (std::int64_t n = 0; n < batch.count; ++n) {
    const T* x = static_cast<const T*>(batch.rows[n].x);
    T* y = static_cast<T*>(batch.rows[n].y);
    prefetch_ahead(w, x, y);
    const bool stream = streaming_row<L>(w, y);
    for (std::int64_t v = 0; v < w.V; ++v) {
      const __m256 xv = L::load(x + kW * v, lanes_of(w, v));
      const __m256 xb = kPairs ? _mm256_permute_ps(xv, 0xb1)
                               : _mm256_and_ps(_mm256_permutevar8x32_ps(xv, w.idx[v]), w.mask[v]);
      put<L>(w, stream, y, v, combine(xv, xb, w, v));
    }
    pass_through<L>(w, x, y);
  }
}

// half / quarter move: vectors v and v ^ K swap roles; both are read before either is written.
template <typename L>
ROME_INLINE void rows_xor_move(const Work& w, const ForwardBatch& batch) {
  using T = typename L::T;
  const int K = w.xor_k;
  for (std::int64_t n = 0; n < batch.count; ++n) {
    const T* x = static_cast<const T*>(batch.rows[n].x);
    T* y = static_cast<T*>(batch.rows[n].y);
    prefetch_ahead(w, x, y);
    const bool stream = streaming_row<L>(w, y);
    for (std::int64_t v = 0; v < w.V; ++v) {
      if (v & K) continue;
      const std::int64_t u = v ^ K;
      const __m256 a = L::load(x + kW * v), b = L::load(x + kW * u);
      const __m256 out_v = combine(a, b, w, v), out_u = combine(b, a, w, u);
      put<L>(w, stream, y, v, out_v);
      put<L>(w, stream, y, u, out_u);
    }
    pass_through<L>(w, x, y);
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
ROME_INLINE void row_general(const Work& w, const typename L::T* x, typename L::T* y) {
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
    put<L>(w, stream, y, v, combine(xa, xb, w, v));
  }
}

template <typename L, bool kMove>
ROME_INLINE void row_single(const Work& w, const typename L::T* x, typename L::T* y) {
  const bool stream = streaming_row<L>(w, y);
  for (std::int64_t v = 0; v < w.V; ++v) {
    const __m256 xs = L::load(x + w.src[v], w.src_n[v]);
    const __m256 xb = kMove ? xs : _mm256_and_ps(_mm256_permutevar8x32_ps(xs, w.idx[v]), w.mask[v]);
    put<L>(w, stream, y, v, combine(L::load(x + kW * v, lanes_of(w, v)), xb, w, v));
  }
}

template <typename L>
ROME_INLINE void rows_general(const Work& w, const ForwardBatch& batch) {
  using T = typename L::T;
  for (std::int64_t n = 0; n < batch.count; ++n) {
    const T* x = static_cast<const T*>(batch.rows[n].x);
    T* y = static_cast<T*>(batch.rows[n].y);
    prefetch_ahead(w, x, y);
    row_general<L>(w, x, y);
    pass_through<L>(w, x, y);
  }
}

template <typename L, bool kMove>
ROME_INLINE void rows_single(const Work& w, const ForwardBatch& batch) {
  using T = typename L::T;
  for (std::int64_t n = 0; n < batch.count; ++n) {
    const T* x = static_cast<const T*>(batch.rows[n].x);
    T* y = static_cast<T*>(batch.rows[n].y);
    prefetch_ahead(w, x, y);
    if (static_cast<const void*>(x) == static_cast<const void*>(y))
      row_general<L>(w, x, y);
    else
      row_single<L, kMove>(w, x, y);
    pass_through<L>(w, x, y);
  }
}

template <typename L>
ROME_INLINE void dispatch_rows(Kind kind, const Work& w, const ForwardBatch& batch) {
  switch (kind) {
    case Kind::pairs: return rows_local<L, true>(w, batch);
    case Kind::local: return rows_local<L, false>(w, batch);
    case Kind::half_move:
    case Kind::quarter_move: return rows_xor_move<L>(w, batch);
    case Kind::single: return rows_single<L, false>(w, batch);
    case Kind::move: return rows_single<L, true>(w, batch);
    case Kind::general: return rows_general<L>(w, batch);
  }
}

// ---------------------------------------------------------------------------------------------
// Per-batch preparation

ROME_INLINE __m256 blend_mask(std::uint32_t lanes) {
  const __m256i bits = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  return _mm256_castsi256_ps(
      _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(int(lanes)), bits), bits));
}

Kind classify(const RotationData& r, Work& w, __m256i* idx, __m256* mask, std::int32_t* src,
              std::int32_t* src_n) {
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

// Everything derived from the rotation alone, kept per thread and rebuilt when a batch comes with
// a different rotation (compared by content: a destroyed rotation's address may be reused).
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

  void update(const RotationData& r, Work& w) {
    if (matches(r)) return;
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
    // idx, mask (V vectors each), step masks of B and A, src, src_n (V each).
    const std::size_t bytes = std::size_t(2 * V + a_steps + b_steps) * 32 + std::size_t(V) * 8;
    char* base = static_cast<char*>(storage_.get(bytes));
    auto* idx_v = reinterpret_cast<__m256i*>(base);
    auto* mask_v = reinterpret_cast<__m256*>(idx_v + V);
    auto* b_masks_v = mask_v + V;
    auto* a_masks_v = b_masks_v + b_steps;
    auto* src_v = reinterpret_cast<std::int32_t*>(a_masks_v + a_steps);
    auto* src_n_v = src_v + V;
    w.xor_k = 0;
    kind = classify(r, w, idx_v, mask_v, src_v, src_n_v);
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

 private:
  bool matches(const RotationData& r) const {
    return rd_ == r.rotary_dim && a_identity_ == r.a_identity && equal(b_src_, r.b.src) &&
           equal(b_sign_, r.b.sign) &&
           (r.a_identity || (equal(a_src_, r.a.src) && equal(a_sign_, r.a.sign)));
  }

  std::int64_t rd_ = -1;
  bool a_identity_ = true;
  std::vector<std::int32_t> a_src_, b_src_;
  std::vector<std::int8_t> a_sign_, b_sign_;
  Scratch storage_;
};

struct ThreadState {
  Runs runs;
  Scratch scratch;  // C, S, X of rows longer than the stack buffer
  Prepared prepared;
};
thread_local ThreadState t_state;

template <DType D>
void forward_permute(const RotationData& r, const ForwardBatch& batch) {
  using L = Lanes<D>;
  if (batch.count <= 0) return;
  const VectorPermutePlan& pa = r.avx2.a;
  const VectorPermutePlan& pb = r.avx2.b;
  if (!r.a_identity) {
    for (std::int64_t j = 0; j < r.rotary_dim; ++j)
      if (pa.keep_bits[j] == 0) return scalar_kernels().forward_permute(r, batch);
  }
  Work w;
  w.r = &r;
  w.rd = r.rotary_dim;
  w.hd = r.head_dim;
  w.V = (w.rd + kW - 1) / kW;
  w.tail = w.rd % kW ? int(w.rd % kW) : kW;
  w.pass = batch.copy_passthrough && w.hd > w.rd;
  const std::int64_t es = sizeof(typename L::T);
  ThreadState& state = t_state;
  const Traffic traffic = estimate_traffic(batch, w.hd * es, state.runs);
  w.stream = traffic.stream;
  if (traffic.prefetch) {
    w.pf_bytes = (w.pass ? w.hd : w.rd) * es;
    w.pf_offset = (traffic.contiguous ? kPrefetchRowsContiguous : kPrefetchRows) * w.hd * es;
    for (std::int64_t j = 0; j < w.rd; j += 16) {
      _mm_prefetch(reinterpret_cast<const char*>(batch.cos + kPrefetchRows * w.rd + j),
                   _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(batch.sin + kPrefetchRows * w.rd + j),
                   _MM_HINT_T0);
    }
  }

  // Per batch: C, S, X (V·8 floats each). The permute data comes from the thread's cache.
  const std::int64_t V = w.V;
  constexpr std::int64_t kStackVectors = 32;
  alignas(64) float stack[3 * kStackVectors * kW];
  float* C = V <= kStackVectors
                 ? stack
                 : static_cast<float*>(state.scratch.get(std::size_t(3 * V * kW) * sizeof(float)));
  float* S = C + V * kW;
  w.X = S + V * kW;
  w.C = C;
  w.S = S;
  {
    const float* cos = batch.cos;
    const float* sin = batch.sin;
    const auto* a_signs = reinterpret_cast<const float*>(pa.sign_bits.data());
    const auto* b_signs = reinterpret_cast<const float*>(pb.sign_bits.data());
    const bool a_identity = r.a_identity;
    for (std::int64_t v = 0; v < V; ++v) {
      const int n = lanes_of(w, v);
      __m256 c = Lanes<DType::f32>::load(cos + kW * v, n);
      const __m256 s = Lanes<DType::f32>::load(sin + kW * v, n);
      if (!a_identity) c = _mm256_xor_ps(c, _mm256_loadu_ps(a_signs + kW * v));
      _mm256_store_ps(C + kW * v, c);
      _mm256_store_ps(S + kW * v, _mm256_xor_ps(s, _mm256_loadu_ps(b_signs + kW * v)));
    }
  }
  Prepared& prepared = state.prepared;
  prepared.update(r, w);
  const Kind kind = prepared.kind;
  w.xor_k = prepared.xor_k;
  w.idx = prepared.idx;
  w.mask = prepared.mask;
  w.src = prepared.src;
  w.src_n = prepared.src_n;
  w.a_masks = prepared.a_masks;
  w.b_masks = prepared.b_masks;
  dispatch_rows<L>(kind, w, batch);
  // Non-temporal stores are weakly ordered: make them visible before the batch is reported done.
  if (w.stream) _mm_sfence();
}

void forward_permute_any(const RotationData& r, const ForwardBatch& b) {
  switch (b.dtype) {
    case DType::f32: return forward_permute<DType::f32>(r, b);
    case DType::f16: return forward_permute<DType::f16>(r, b);
    case DType::bf16: return forward_permute<DType::bf16>(r, b);
    default: return scalar_kernels().forward_permute(r, b);
  }
}

}  // namespace

const KernelTable& avx2_kernels() {
  static const KernelTable table{"avx2", forward_permute_any, avx2_forward_dense,
                                 avx2_accumulate_product};
  return table;
}

}  // namespace rome::kernels
