// The forward executor. Work is cut into tiles: a run of consecutive tokens (outer indices along
// the last outer axis) × every head of q and k. Each tile's table rows are expanded once (width,
// positions gather, signs folded) into a buffer read from L2 or L3 by all of its heads. Inside a
// tile the rows go in the order that walks memory contiguously (Executor::head_major): BNSD-like
// layouts a few heads at a time over the tile's tokens (each head a run of several KB), BSND and
// packed [T, H·D] layouts one token at a time over its heads, a permute kernel taking all the
// tile's tokens in one call. For permute kernels, tiles of fewer than kHeadMajorTokens tokens go
// token by token whatever the layout.
#include <algorithm>
#include <cstdlib>
#include <mutex>
#include <new>
#include <thread>
#include <vector>

#include "dispatch.hpp"
#include "plan.hpp"
#include "rome/rope.hpp"
#include "thread_pool.hpp"
#include "walk.hpp"

namespace rome {
namespace {

using detail::ForwardPlan;
using detail::InnerAxes;
using detail::OperandPlan;
using kernels::ForwardTile;

constexpr std::int64_t kMaxAutoTileTokens = 1024;
// Tokens per tile below which a permute kernel walks a tile token by token, whatever the layout.
constexpr std::int64_t kHeadMajorTokens = 32;
// Heads a permute kernel takes token by token in a head-major tile: each token's table row is
// read once for all of them, and they are this many streams through memory (twice that out of
// place). One head per call re-read the table row (1 KiB at rotary dim 128) from L2 for every
// 256-byte bf16 row; all 24 heads of the seed tensor were too many streams. Paired on an AVX-512
// Zen 4, seed tensor, 1 thread: 4 heads took 0.56x the time of one in place and 0.70x out of
// place; 2, 3, 6 and 8 heads were no better than 4 (BENCHMARKS.md, twenty-fifth session).
constexpr std::int64_t kHeadsPerGroup = 4;

// Grows on demand, 64-byte aligned, never shrinks: no allocation once warm.
class TileBuffer {
 public:
  ~TileBuffer() { std::free(data_); }
  float* get(std::size_t floats) {
    if (floats > size_) {
      std::free(data_);
      size_ = (floats + 15) / 16 * 16;
      data_ = static_cast<float*>(std::aligned_alloc(64, size_ * sizeof(float)));
      if (!data_) {
        size_ = 0;
        throw std::bad_alloc();
      }
    }
    return data_;
  }

 private:
  float* data_ = nullptr;
  std::size_t size_ = 0;
};

// The distinct threads that ran a call's ranges (for last_call_threads).
class ThreadCounter {
 public:
  void note() {
    const std::thread::id id = std::this_thread::get_id();
    std::lock_guard<std::mutex> lock(mutex_);
    if (std::find(ids_.begin(), ids_.end(), id) == ids_.end()) ids_.push_back(id);
  }
  int count() const { return int(ids_.size()); }

 private:
  std::mutex mutex_;
  std::vector<std::thread::id> ids_;
};

thread_local int t_last_call_threads = 0;

struct Executor {
  const ForwardPlan* plan;
  kernels::ForwardFn kernel;
  std::int64_t line_length;  // tokens along the last outer axis (1 without outer axes)
  std::int64_t tile_tokens;
  std::int64_t tiles_per_line;
  std::int64_t parts;         // ranges each tile's rows are cut into (few tokens, many threads)
  std::int64_t table_stride;  // floats per prepared table row
  kernels::TableLayout layout;
  bool large_output;              // larger than 3/4 of one thread's share of the L3: stream it
  bool token_runs;                // the kernel takes several tokens per call
  bool table_nans_low_bits_zero;  // kernel_api.hpp: ForwardTile

  std::int64_t items() const { return plan->outer_total / line_length * tiles_per_line * parts; }
  void run(std::int64_t begin, std::int64_t end) const;
  bool head_major(const OperandPlan& op, std::int64_t tokens) const;
  bool interleave_tokens(std::int64_t tokens) const;
  void rotate(const OperandPlan& op, const std::int64_t* outer, std::int64_t tokens,
              std::int64_t token_begin, std::int64_t token_end, std::int64_t row_begin,
              std::int64_t row_end, const float* cos, const float* sin) const;
};

// Whether the operand's rows go to the kernel head by head over the tile's tokens (a permute
// kernel: kHeadsPerGroup heads per call, token by token), rather than one token at a time over all
// its heads: heads further apart than tokens (BNSD-like) go head-major, so each head's rows are one
// contiguous run. Token by token over all heads a BNSD tile is as many interleaved streams as it
// has heads (twice that out of place), 256 bytes at a time (paired, AVX2 Zen 3, bf16: q
// [1,32,4096,128] + k [1,8,4096,128] out of place, one head per call took 0.68x the time of that
// on 1 thread and 0.72x on 2; BENCHMARKS.md, twenty-first session). Below kHeadMajorTokens tokens
// the extra calls cost more than the order saves (T = 4, one head per call: 1.3x; not measured
// again with four).
bool Executor::head_major(const OperandPlan& op, std::int64_t tokens) const {
  if (tokens <= 1) return false;
  if (op.inner.count == 0) return true;  // one row per token
  if (token_runs && tokens < kHeadMajorTokens) return false;
  const int last = plan->outer_count - 1;
  const std::int64_t token_in = last >= 0 ? op.outer_in[last] : 0;
  return std::abs(token_in) <= std::abs(op.inner.in_stride[op.inner.count - 1]);
}

// q and k both token-major with the same token stride (in and out): rows of one buffer that
// join_k_to_q could not make one operand (k not right after q, other strides, several inner
// axes). Separate q and k tensors keep one pass each (two contiguous streams).
bool Executor::interleave_tokens(std::int64_t tokens) const {
  const ForwardPlan& p = *plan;
  const int last = p.outer_count - 1;
  if (!p.has_k || last < 0 || head_major(p.q, tokens) || head_major(p.k, tokens) ||
      p.q.outer_in[last] != p.k.outer_in[last] || p.q.outer_out[last] != p.k.outer_out[last])
    return false;
  // One buffer: k's rows start within one token row of q's (separate tensors of equal shape
  // have the same strides but lie apart).
  const std::int64_t row_in = std::abs(p.q.outer_in[last]) * dtype_size(p.dtype);
  const std::int64_t row_out = std::abs(p.q.outer_out[last]) * dtype_size(p.dtype);
  return std::abs(p.k.in_base - p.q.in_base) < row_in &&
         std::abs(p.k.out_base - p.q.out_base) < row_out;
}

// Rows [row_begin, row_end) of one operand over the tile's tokens: all of them when head-major,
// else tokens [token_begin, token_end).
void Executor::rotate(const OperandPlan& op, const std::int64_t* outer, std::int64_t tokens,
                      std::int64_t token_begin, std::int64_t token_end, std::int64_t row_begin,
                      std::int64_t row_end, const float* cos, const float* sin) const {
  if (row_begin >= row_end) return;
  const ForwardPlan& p = *plan;
  const std::int64_t es = dtype_size(p.dtype);
  std::int64_t in0 = 0, out0 = 0;
  for (int i = 0; i < p.outer_count; ++i) {
    in0 += outer[i] * op.outer_in[i];
    out0 += outer[i] * op.outer_out[i];
  }
  const int last = p.outer_count - 1;
  const std::int64_t token_in = last >= 0 ? op.outer_in[last] : 0;
  const std::int64_t token_out = last >= 0 ? op.outer_out[last] : 0;
  ForwardTile tile{};
  tile.cos = cos;
  tile.sin = sin;
  tile.dtype = p.dtype;
  tile.copy_passthrough = !op.in_place && p.rotation->head_dim > p.rotation->rotary_dim;
  tile.stream = large_output && !op.in_place;
  tile.table_nans_low_bits_zero = table_nans_low_bits_zero;
  const int inner_last = op.inner.count - 1;
  if (head_major(op, tokens)) {
    if (token_runs && inner_last >= 0) {
      // kHeadsPerGroup heads per call, token by token: each token's table row serves all of them.
      tile.x_step = op.inner.in_stride[inner_last] * es;
      tile.y_step = op.inner.out_stride[inner_last] * es;
      tile.tokens = tokens;
      tile.x_token_step = token_in * es;
      tile.y_token_step = token_out * es;
      tile.table_token_step = table_stride;
      detail::walk_runs(op.inner, row_begin, row_end,
                        [&](std::int64_t in, std::int64_t out, std::int64_t length) {
                          for (std::int64_t h = 0; h < length; h += kHeadsPerGroup) {
                            tile.x = op.in_base + (in0 + in) * es + h * tile.x_step;
                            tile.y = op.out_base + (out0 + out) * es + h * tile.y_step;
                            tile.count = std::min(kHeadsPerGroup, length - h);
                            kernel(*p.rotation, tile);
                          }
                        });
      return;
    }
    // One call per head: its rows over the tile's tokens, one table row each.
    tile.table_step = table_stride;
    tile.count = tokens;
    tile.x_step = token_in * es;
    tile.y_step = token_out * es;
    detail::walk_rows(op.inner, row_begin, row_end, [&](std::int64_t in, std::int64_t out) {
      tile.x = op.in_base + (in0 + in) * es;
      tile.y = op.out_base + (out0 + out) * es;
      kernel(*p.rotation, tile);
    });
    return;
  }
  // Each token's runs of heads on the token's table row: a permute kernel takes every token of
  // the range in one call, other kernels one token per call.
  tile.x_step = inner_last >= 0 ? op.inner.in_stride[inner_last] * es : 0;
  tile.y_step = inner_last >= 0 ? op.inner.out_stride[inner_last] * es : 0;
  tile.tokens = token_runs ? token_end - token_begin : 1;
  tile.x_token_step = token_in * es;  // also where a one-token call's kernel prefetches
  tile.y_token_step = token_out * es;
  tile.table_token_step = table_stride;
  for (std::int64_t t = token_begin; t < token_end; t += tile.tokens) {
    tile.cos = cos + t * table_stride;
    tile.sin = sin + t * table_stride;
    const std::int64_t in_t = in0 + t * token_in, out_t = out0 + t * token_out;
    detail::walk_runs(op.inner, row_begin, row_end,
                      [&](std::int64_t in, std::int64_t out, std::int64_t length) {
                        tile.x = op.in_base + (in_t + in) * es;
                        tile.y = op.out_base + (out_t + out) * es;
                        tile.count = length;
                        kernel(*p.rotation, tile);
                      });
  }
}

void Executor::run(std::int64_t begin, std::int64_t end) const {
  const ForwardPlan& p = *plan;
  thread_local TileBuffer tables, scratch;
  // sin 1 KiB + 64 bytes after cos's end: their rows never share an address modulo 4 KiB, which
  // would make loads of one wait on stores to the other (4K aliasing).
  constexpr std::int64_t kSkew = 272;
  float* cos = tables.get(std::size_t(2 * tile_tokens * table_stride + kSkew));
  float* sin = cos + tile_tokens * table_stride + kSkew;
  const std::int64_t rd = p.rotation->rotary_dim;
  float* row_cos = scratch.get(std::size_t(2 * rd));
  float* row_sin = row_cos + rd;
  const std::int64_t q_rows = p.q.inner.rows, k_rows = p.has_k ? p.k.inner.rows : 0;
  const std::int64_t rows = q_rows + k_rows;
  std::int64_t outer[kMaxRank] = {};
  std::int64_t prepared_tile = -1;
  for (std::int64_t item = begin; item < end; ++item) {
    const std::int64_t tile_index = item / parts, part = item % parts;
    const std::int64_t line = tile_index / tiles_per_line;
    const std::int64_t first = tile_index % tiles_per_line * tile_tokens;
    const std::int64_t tokens = std::min(tile_tokens, line_length - first);
    detail::unravel(line * line_length + first, p.outer_size, p.outer_count, outer);
    if (tile_index != prepared_tile) {
      detail::prepare_table_tile(p, outer, tokens, table_stride, layout, cos, sin, row_cos,
                                 row_sin);
      prepared_tile = tile_index;
    }
    const std::int64_t r0 = rows * part / parts, r1 = rows * (part + 1) / parts;
    const std::int64_t q0 = std::min(r0, q_rows), q1 = std::min(r1, q_rows);
    const std::int64_t k0 = std::max(r0 - q_rows, std::int64_t(0));
    const std::int64_t k1 = std::max(r1 - q_rows, std::int64_t(0));
    if (interleave_tokens(tokens)) {
      // Token-major q and k rows in one buffer: token t's q heads, then its k heads. One pass of
      // q over the tile then one of k would walk the same memory twice, each time with gaps
      // (measured on packed qkv slices before they were joined: 29% slower on Qwen3-8B's shapes).
      for (std::int64_t t = 0; t < tokens; ++t) {
        rotate(p.q, outer, tokens, t, t + 1, q0, q1, cos, sin);
        rotate(p.k, outer, tokens, t, t + 1, k0, k1, cos, sin);
      }
    } else {
      rotate(p.q, outer, tokens, 0, tokens, q0, q1, cos, sin);
      if (p.has_k) rotate(p.k, outer, tokens, 0, tokens, k0, k1, cos, sin);
    }
  }
}

// k's heads right after q's, with the same strides, in and out: the q and k slices of a packed
// qkv buffer. They become one operand, so that a kernel call takes every head of a tile's tokens
// instead of two calls per token (one for q, one for k). Each row keeps its table row: q and k
// share the outer axes. A single head (no inner axis, e.g. MQA's k) joins with the other's stride.
void join_k_to_q(ForwardPlan& p) {
  if (!p.has_k || p.q.in_place != p.k.in_place || p.q.inner.count > 1 || p.k.inner.count > 1 ||
      p.q.inner.count + p.k.inner.count == 0)
    return;
  const InnerAxes& with_axis = p.q.inner.count == 1 ? p.q.inner : p.k.inner;
  const std::int64_t in_stride = with_axis.in_stride[0], out_stride = with_axis.out_stride[0];
  auto heads_of = [&](const InnerAxes& a) { return a.count == 1 ? a.size[0] : 1; };
  auto same_strides = [&](const InnerAxes& a) {
    return a.count == 0 || (a.in_stride[0] == in_stride && a.out_stride[0] == out_stride);
  };
  if (!same_strides(p.q.inner) || !same_strides(p.k.inner)) return;
  for (int i = 0; i < p.outer_count; ++i)
    if (p.q.outer_in[i] != p.k.outer_in[i] || p.q.outer_out[i] != p.k.outer_out[i]) return;
  const std::int64_t es = dtype_size(p.dtype), q_heads = heads_of(p.q.inner);
  if (p.k.in_base != p.q.in_base + q_heads * in_stride * es ||
      p.k.out_base != p.q.out_base + q_heads * out_stride * es)
    return;
  InnerAxes joined;
  joined.count = 1;
  joined.size[0] = q_heads + heads_of(p.k.inner);
  joined.in_stride[0] = in_stride;
  joined.out_stride[0] = out_stride;
  joined.rows = joined.size[0];
  p.q.inner = joined;
  p.has_k = false;
}

// Tokens per tile: the tile's table rows (cos and sin) fill L2. Head-major tiles read each row
// once per group of heads, from L2 or L3; longer tiles are longer runs per head. Paired on an
// AVX-512 Zen 4 (1 MiB L2, seed tensor): 1024 tokens took 0.88-1.0x the time of 256 (BNSD, 4 heads
// per group) and 0.95-0.97x (BSND), on 1 and 2 threads.
std::int64_t auto_tile_tokens(std::int64_t table_stride) {
  const std::int64_t budget = detail::cache_sizes().l2;
  return std::clamp<std::int64_t>(budget / (2 * table_stride * std::int64_t(sizeof(float))), 1,
                                  kMaxAutoTileTokens);
}

}  // namespace

void rope_forward(const Rotation& rotation, const Tables& tables, const Operand& q,
                  const Operand* k, const ExecOptions& options) {
  if (const std::int64_t offset = rotation.lane_offset(); offset > 0) {
    // The rotated lanes as heads of their own; the leading lanes are copied once all succeeded.
    const std::int64_t hd = rotation.head_dim();
    const detail::NarrowedOperand nq = detail::narrow_operand("q", q, hd, offset);
    detail::NarrowedOperand nk;
    if (k) nk = detail::narrow_operand("k", *k, hd, offset);
    rope_forward(rotation.unshifted(), tables, nq.operand, k ? &nk.operand : nullptr, options);
    if (!nq.in_place) detail::copy_leading_lanes(q.in, q.out, offset);
    if (k && !nk.in_place) detail::copy_leading_lanes(k->in, k->out, offset);
    return;
  }
  detail::check_environment();
  detail::check_options(options);
  ForwardPlan plan = detail::plan_forward(rotation, tables, q, k);
  join_k_to_q(plan);
  const std::int64_t rows = plan.q.inner.rows + (plan.has_k ? plan.k.inner.rows : 0);
  t_last_call_threads = 0;
  if (plan.outer_total == 0 || rows == 0) return;
  const detail::ForwardKernel kernel = detail::forward_kernel(rotation, plan.dtype);
  int threads = detail::resolve_threads(options.num_threads);
  threads = detail::threads_for_bytes(options, plan.bytes_moved, threads);

  Executor ex{};
  ex.plan = &plan;
  ex.kernel = kernel.fn;
  ex.layout = kernel.layout;
  ex.token_runs = kernel.token_runs;
  ex.line_length = plan.outer_count > 0 ? plan.outer_size[plan.outer_count - 1] : 1;
  const std::int64_t lines = plan.outer_total / ex.line_length;
  ex.table_stride = (rotation.rotary_dim() + 15) / 16 * 16;
  std::int64_t tile_tokens =
      options.tile_tokens > 0 ? options.tile_tokens : auto_tile_tokens(ex.table_stride);
  // Enough tiles for every thread to get several (unless the caller fixed the tile size).
  const std::int64_t wanted = threads > 1 ? 4 * std::int64_t(threads) : 1;
  if (options.tile_tokens == 0 &&
      lines * ((ex.line_length + tile_tokens - 1) / tile_tokens) < wanted) {
    const std::int64_t per_line = (wanted + lines - 1) / lines;
    tile_tokens = std::max<std::int64_t>(1, (ex.line_length + per_line - 1) / per_line);
  }
  ex.tile_tokens = std::min(tile_tokens, ex.line_length);
  ex.tiles_per_line = (ex.line_length + ex.tile_tokens - 1) / ex.tile_tokens;
  // Few tokens (decode): cut each tile's rows instead.
  const std::int64_t tiles = lines * ex.tiles_per_line;
  ex.parts = tiles < wanted ? std::min(rows, (wanted + tiles - 1) / tiles) : 1;
  // Non-temporal stores pay only when the output cannot stay in the last-level cache, and never
  // in place: there they would evict the lines just read (on some CPUs serialising every line).
  ex.large_output = detail::outgrows_cache_share(plan.bytes_moved / 2);
  ex.table_nans_low_bits_zero = detail::table_nans_low_bits_zero(plan, ex.layout);

  if (threads <= 1 || ex.items() == 1) {
    // detail::parallel_for would run it inline: no counter (a lock and an allocation) needed.
    ex.run(0, ex.items());
    t_last_call_threads = 1;
    return;
  }
  ThreadCounter counter;
  detail::parallel_for(options, ex.items(), threads, [&](std::int64_t b, std::int64_t e) {
    counter.note();
    ex.run(b, e);
  });
  t_last_call_threads = counter.count();
}

void rope_check(const Rotation& rotation, const Tables& tables, const Operand& q,
                const Operand* k) {
  const detail::MetadataOnly metadata_only;
  if (const std::int64_t offset = rotation.lane_offset(); offset > 0) {
    const std::int64_t hd = rotation.head_dim();
    const detail::NarrowedOperand nq = detail::narrow_operand("q", q, hd, offset);
    detail::NarrowedOperand nk;
    if (k) nk = detail::narrow_operand("k", *k, hd, offset);
    detail::plan_forward(rotation.unshifted(), tables, nq.operand, k ? &nk.operand : nullptr);
    return;
  }
  detail::plan_forward(rotation, tables, q, k);
}

int last_call_threads() noexcept {
  return t_last_call_threads;
}

}  // namespace rome
