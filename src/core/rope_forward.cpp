#include <algorithm>
#include <vector>

#include "dispatch.hpp"
#include "plan.hpp"
#include "rome/rope.hpp"
#include "thread_pool.hpp"
#include "walk.hpp"

namespace rome {
namespace {

using detail::ForwardPlan;
using detail::OperandPlan;
using kernels::ForwardBatch;
using kernels::RowRef;

// Below this many bytes a call stays on the calling thread: waking a worker costs more than
// the work (a decode step is a few KiB).
constexpr std::int64_t kParallelBytes = 256 * 1024;

struct ForwardJob {
  const ForwardPlan* plan;
  kernels::ForwardFn kernel;
  std::int64_t parts;  // pieces each outer index's rows are cut into
};

void rotate_rows(const ForwardJob& job, const OperandPlan& op, const std::int64_t* outer,
                 std::int64_t row_begin, std::int64_t row_end, const detail::TableRow& table) {
  if (row_begin >= row_end) return;
  const ForwardPlan& plan = *job.plan;
  const std::int64_t es = dtype_size(plan.dtype);
  std::int64_t in_offset = 0, out_offset = 0;
  for (int i = 0; i < plan.outer_count; ++i) {
    in_offset += outer[i] * op.outer_in[i];
    out_offset += outer[i] * op.outer_out[i];
  }
  RowRef refs[detail::kRowBatch];
  ForwardBatch batch{
      table.cos, table.sin,  refs,
      0,         plan.dtype, !op.in_place && plan.rotation->head_dim > plan.rotation->rotary_dim};
  detail::walk_rows(op.inner, row_begin, row_end, [&](std::int64_t in, std::int64_t out) {
    refs[batch.count++] = {op.in_base + (in_offset + in) * es,
                           op.out_base + (out_offset + out) * es};
    if (batch.count == detail::kRowBatch) {
      job.kernel(*plan.rotation, batch);
      batch.count = 0;
    }
  });
  if (batch.count) job.kernel(*plan.rotation, batch);
}

void run_items(const ForwardJob& job, std::int64_t begin, std::int64_t end) {
  const ForwardPlan& plan = *job.plan;
  thread_local std::vector<float> cos_buffer, sin_buffer;
  const auto rd = std::size_t(plan.rotation->rotary_dim);
  if (cos_buffer.size() < rd) cos_buffer.resize(rd), sin_buffer.resize(rd);
  const std::int64_t q_rows = plan.q.inner.rows, k_rows = plan.has_k ? plan.k.inner.rows : 0;
  const std::int64_t rows = q_rows + k_rows;
  std::int64_t outer[kMaxRank];
  for (std::int64_t item = begin; item < end; ++item) {
    const std::int64_t outer_index = item / job.parts, part = item % job.parts;
    detail::unravel(outer_index, plan.outer_size, plan.outer_count, outer);
    const detail::TableRow table =
        detail::load_table_row(plan, outer, cos_buffer.data(), sin_buffer.data());
    const std::int64_t r0 = rows * part / job.parts, r1 = rows * (part + 1) / job.parts;
    rotate_rows(job, plan.q, outer, std::min(r0, q_rows), std::min(r1, q_rows), table);
    if (plan.has_k)
      rotate_rows(job, plan.k, outer, std::max(r0 - q_rows, std::int64_t(0)),
                  std::max(r1 - q_rows, std::int64_t(0)), table);
  }
}

}  // namespace

void rope_forward(const Rotation& rotation, const Tables& tables, const Operand& q,
                  const Operand* k, const ExecOptions& options) {
  detail::check_environment();
  detail::check_options(options);
  const ForwardPlan plan = detail::plan_forward(rotation, tables, q, k);
  const std::int64_t rows = plan.q.inner.rows + (plan.has_k ? plan.k.inner.rows : 0);
  if (plan.outer_total == 0 || rows == 0) return;
  const kernels::KernelTable& table = detail::active_kernels();
  kernels::ForwardFn kernel = table.forward_permute;
  if (rotation.kind() == Rotation::Kind::dense)
    kernel = table.forward_dense ? table.forward_dense : kernels::scalar_kernels().forward_dense;
  int threads = detail::resolve_threads(options.num_threads);
  if (plan.bytes_moved < kParallelBytes) threads = 1;
  // Few tokens (decode, or tables that vary on every axis but one): cut their rows instead.
  std::int64_t parts = 1;
  if (threads > 1 && plan.outer_total < 4 * threads)
    parts = std::min<std::int64_t>(rows, (4 * threads + plan.outer_total - 1) / plan.outer_total);
  ForwardJob job{&plan, kernel, parts};
  detail::parallel_for(plan.outer_total * parts, threads,
                       [&](std::int64_t b, std::int64_t e) { run_items(job, b, e); });
}

}  // namespace rome
