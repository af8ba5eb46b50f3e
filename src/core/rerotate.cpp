// Re-rotation of a paged key cache: per sequence one prepared table row, applied to each of its
// blocks as one kernel tile (table_step 0: the same row for every slot and head).
#include <algorithm>
#include <cstdlib>
#include <new>
#include <string>
#include <vector>

#include "convert.hpp"
#include "dispatch.hpp"
#include "plan.hpp"
#include "rome/error.hpp"
#include "rome/rope.hpp"
#include "thread_pool.hpp"

namespace rome {
namespace {

using std::int64_t;
using std::to_string;

int64_t load_index(const ConstTensorView& v, int64_t offset) {
  return v.dtype == DType::i32 ? int64_t(static_cast<const std::int32_t*>(v.data)[offset])
                               : static_cast<const std::int64_t*>(v.data)[offset];
}

void require_index_tensor(const ConstTensorView& v, const char* name, int rank) {
  if (v.rank != rank)
    fail(Status::invalid_argument, name, rank == 1 ? "rank 1 [num_seqs]" : "rank 2",
         "rank " + to_string(v.rank) + " " + shape_string(v));
  if (v.dtype != DType::i32 && v.dtype != DType::i64)
    fail(Status::invalid_argument, std::string(name) + ".dtype", "int32 or int64",
         dtype_name(v.dtype));
  if (v.numel() > 0 && !v.data) fail(Status::invalid_argument, name, "a data pointer", "null");
}

struct Block {
  int64_t seq, block, slots;
};

}  // namespace

void rerotate_paged(const Rotation& rotation, const Tables& tables, const PagedKeys& keys,
                    const ExecOptions& options) {
  detail::check_environment();
  detail::check_options(options);
  const TensorView& cache = keys.cache;
  if (cache.rank != 4)
    fail(Status::invalid_argument, "cache", "rank 4 [num_blocks, block_size, heads, head_dim]",
         "rank " + to_string(cache.rank) + " " + shape_string(cache));
  if (tables.is_cache())
    fail(Status::invalid_argument, "tables", "direct tables [num_seqs, width] (no positions)",
         "positions");
  require_index_tensor(keys.block_table, "block_table", 2);
  require_index_tensor(keys.seq_lens, "seq_lens", 1);
  const int64_t num_blocks = cache.shape[0], block_size = cache.shape[1];
  const int64_t num_seqs = keys.seq_lens.shape[0], max_blocks = keys.block_table.shape[1];
  if (keys.block_table.shape[0] != num_seqs)
    fail(Status::invalid_argument, "block_table",
         "[num_seqs, max_blocks] with num_seqs " + to_string(num_seqs) + " (seq_lens' size)",
         shape_string(keys.block_table));

  // The whole cache checked as one operand (dtype, head_dim, strides, distinct elements).
  const Operand whole{as_const(cache), cache};
  const detail::NarrowedOperand narrowed =
      detail::narrow_operand("cache", whole, rotation.head_dim(), rotation.lane_offset());
  const Rotation inner = rotation.unshifted();
  const int64_t head_dim = inner.head_dim();

  // The table rows through the forward planner: a [num_seqs, head_dim] view whose rows are all
  // the cache's first row (read only, never written) gives one outer index per sequence.
  ConstTensorView probe = narrowed.operand.in;
  probe.rank = 2;
  probe.shape[0] = num_seqs;
  probe.strides[0] = 0;
  probe.shape[1] = head_dim;
  probe.strides[1] = 1;
  const bool has_work = num_seqs > 0 && cache.numel() > 0;
  if (!has_work) probe.shape[0] = 0;
  const detail::ForwardPlan plan =
      detail::plan_forward(inner, tables, Operand{probe, {}}, nullptr, /*q_written=*/false);

  // Every sequence's blocks, checked before anything is written.
  std::vector<Block> blocks;
  std::vector<bool> owned(std::size_t(num_blocks), false);
  const int64_t bt0 = keys.block_table.strides[0], bt1 = keys.block_table.strides[1];
  for (int64_t b = 0; b < num_seqs; ++b) {
    const int64_t len = load_index(keys.seq_lens, b * keys.seq_lens.strides[0]);
    if (len < 0 || len > max_blocks * block_size)
      fail(Status::out_of_range, "seq_lens[" + to_string(b) + "]",
           "a length in [0, " + to_string(max_blocks * block_size) + "] (max_blocks × block_size)",
           to_string(len));
    for (int64_t i = 0; i * block_size < len; ++i) {
      const int64_t id = load_index(keys.block_table, b * bt0 + i * bt1);
      const std::string where = "block_table[" + to_string(b) + ", " + to_string(i) + "]";
      if (id < 0 || id >= num_blocks)
        fail(Status::out_of_range, where, "a block in [0, " + to_string(num_blocks) + ")",
             to_string(id));
      if (owned[std::size_t(id)])
        fail(Status::invalid_argument, where,
             "a block no other sequence (or slot of this one) re-rotates", to_string(id));
      owned[std::size_t(id)] = true;
      blocks.push_back({b, id, std::min(block_size, len - i * block_size)});
    }
  }
  if (blocks.empty() || !has_work) return;

  // Not a structured binding: the worker lambda below captures the kernel (clang-14 rejects
  // capturing bindings).
  const detail::ForwardKernel kernel = detail::forward_kernel(inner, plan.dtype);
  const kernels::TableLayout layout = kernel.layout;
  const bool nans_low_bits_zero = detail::table_nans_low_bits_zero(plan, layout);

  // One prepared row per sequence.
  const int64_t rd = inner.rotary_dim();
  const int64_t stride = (rd + 15) / 16 * 16;
  const std::size_t floats = std::size_t(2 * num_seqs * stride + 2 * rd + 16);
  float* buffer =
      static_cast<float*>(std::aligned_alloc(64, (floats * sizeof(float) + 63) / 64 * 64));
  if (!buffer) throw std::bad_alloc();
  struct Free {
    float* p;
    ~Free() { std::free(p); }
  } free_buffer{buffer};
  float* cos = buffer;
  float* sin = cos + num_seqs * stride;
  float* row_cos = sin + num_seqs * stride;
  float* row_sin = row_cos + rd;
  for (int64_t b = 0; b < num_seqs; ++b) {
    int64_t outer[kMaxRank] = {b};
    detail::prepare_table_tile(plan, outer, 1, stride, layout, cos + b * stride, sin + b * stride,
                               row_cos, row_sin);
  }

  // Rows of a block: slots × heads. One tile when the two axes flatten into one stride.
  const TensorView& v = narrowed.operand.out;
  const int64_t es = dtype_size(v.dtype);
  const int64_t heads = v.shape[2];
  const bool flat = v.strides[1] == heads * v.strides[2] || heads == 1;
  const int64_t row_step = heads == 1 ? v.strides[1] : v.strides[2];
  int64_t touched = 0;
  for (const Block& blk : blocks) touched += blk.slots;
  int threads = detail::resolve_threads(options.num_threads);
  threads = detail::threads_for_bytes(options, 2 * touched * heads * head_dim * es, threads);
  const detail::RotationData& r = inner.data();
  detail::parallel_for(options, int64_t(blocks.size()), threads, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const Block& blk = blocks[std::size_t(i)];
      kernels::ForwardTile tile{};
      tile.cos = cos + blk.seq * stride;
      tile.sin = sin + blk.seq * stride;
      tile.table_step = 0;
      tile.dtype = v.dtype;
      tile.table_nans_low_bits_zero = nans_low_bits_zero;
      char* base = static_cast<char*>(v.data) + blk.block * v.strides[0] * es;
      if (flat) {
        tile.x = tile.y = base;
        tile.x_step = tile.y_step = row_step * es;
        tile.count = blk.slots * heads;
        kernel.fn(r, tile);
        continue;
      }
      tile.x_step = tile.y_step = v.strides[2] * es;
      tile.count = heads;
      for (int64_t s = 0; s < blk.slots; ++s) {
        tile.y = base + s * v.strides[1] * es;
        tile.x = tile.y;
        kernel.fn(r, tile);
      }
    }
  });
}

}  // namespace rome
