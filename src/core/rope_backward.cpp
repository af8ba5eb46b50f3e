// Backward of y = (x·A) ⊙ C + (x·B) ⊙ S with the general formulas (no sin negation):
//   dx = (g ⊙ C)·Aᵀ + (g ⊙ S)·Bᵀ,  dC = Σ g ⊙ (x·A),  dS = Σ g ⊙ (x·B),
//   dA = Σ xᵀ·(g ⊙ C),  dB = Σ xᵀ·(g ⊙ S)   (sums over the axes a table or matrix is shared by).
// Signed permutations: portable per-row code (O(D) per row). Dense matrices: the products run
// on the active ISA's fp32 product kernel over batches of rows (O(D²) per row: this is where a
// learned rotation's backward spends its time).
#include <algorithm>
#include <cmath>
#include <vector>

#include "convert.hpp"
#include "dispatch.hpp"
#include "plan.hpp"
#include "rome/rope.hpp"
#include "thread_pool.hpp"
#include "walk.hpp"

namespace rome {
namespace {

using detail::BackwardPlan;
using detail::RotationData;

struct RowMath {
  const RotationData& r;
  // out[j] = (v·M)[j] for M = A (which = 0) or B (which = 1).
  void forward_term(int which, const float* v, float* out) const {
    const std::int64_t rd = r.rotary_dim;
    if (which == 0 && r.a_identity) {
      std::copy(v, v + rd, out);
    } else if (r.kind == Rotation::Kind::signed_permutation) {
      const detail::SignedPermutation& p = which == 0 ? r.a : r.b;
      for (std::int64_t j = 0; j < rd; ++j)
        out[j] = p.sign[j] ? float(p.sign[j]) * v[p.src[j]] : 0.0f;
    } else {
      const float* m = which == 0 ? r.dense_a.data() : r.dense_b.data();
      for (std::int64_t j = 0; j < rd; ++j) {
        double acc = 0;
        for (std::int64_t i = 0; i < rd; ++i) acc += double(v[i]) * m[i * rd + j];
        out[j] = float(acc);
      }
    }
  }
  // out[i] += (u·Mᵀ)[i].
  void add_transposed_term(int which, const float* u, float* out) const {
    const std::int64_t rd = r.rotary_dim;
    if (which == 0 && r.a_identity) {
      for (std::int64_t i = 0; i < rd; ++i) out[i] += u[i];
    } else if (r.kind == Rotation::Kind::signed_permutation) {
      const detail::SignedPermutation& p = which == 0 ? r.a_t : r.b_t;
      for (std::int64_t i = 0; i < rd; ++i)
        if (p.sign[i]) out[i] += float(p.sign[i]) * u[p.src[i]];
    } else {
      const float* m = which == 0 ? r.dense_a.data() : r.dense_b.data();
      for (std::int64_t i = 0; i < rd; ++i) {
        double acc = 0;
        for (std::int64_t j = 0; j < rd; ++j) acc += double(u[j]) * m[i * rd + j];
        out[i] += float(acc);
      }
    }
  }
};

struct Scratch {
  std::vector<float> cos, sin, g, x, u, v, dx, xa, xb;
  std::vector<double> dc, ds;
  void reserve(std::int64_t hd) {
    for (auto* b : {&cos, &sin, &g, &x, &u, &v, &dx, &xa, &xb}) b->resize(hd);
    dc.resize(hd);
    ds.resize(hd);
  }
};

struct OuterOffsets {
  std::int64_t grad, dx, x;  // elements: the first row of grad, dx and x at an outer index
};

OuterOffsets outer_offsets(const BackwardPlan& bp, const std::int64_t* outer) {
  const detail::ForwardPlan& plan = bp.forward;
  OuterOffsets o{0, 0, 0};
  for (int i = 0; i < plan.outer_count; ++i) {
    o.grad += outer[i] * plan.q.outer_in[i];
    o.dx += outer[i] * plan.q.outer_out[i];
    o.x += outer[i] * bp.x.outer_in[i];
  }
  return o;
}

void load_row(const char* base, DType dtype, std::int64_t offset, std::int64_t n, float* out) {
  detail::load_row_any(base + offset * dtype_size(dtype), dtype, n, out);
}

void store_table_gradient(const TensorView& d, const std::int64_t* outer_strides,
                          const std::int64_t* outer, int outer_count, TableWidth width,
                          const double* lanes, std::int64_t rd, bool negate = false) {
  if (!d.data) return;
  const std::int64_t columns = d.shape[d.rank - 1], lane = d.strides[d.rank - 1];
  std::int64_t offset = 0;
  for (int i = 0; i < outer_count; ++i) offset += outer[i] * outer_strides[i];
  char* row = static_cast<char*>(d.data) + offset * dtype_size(d.dtype);
  std::vector<double> sums(columns, 0.0);  // several lanes share a column in half-width tables
  for (std::int64_t j = 0; j < rd; ++j)
    sums[width == TableWidth::full     ? j
         : width == TableWidth::halves ? j % columns
                                       : j / 2] += lanes[j];
  for (std::int64_t c = 0; c < columns; ++c)
    detail::store_any(row, d.dtype, c * lane, float(negate ? -sums[c] : sums[c]));
}

// Processes outer indices [begin, end); accumulates dA/dB into `da`/`db` (rd×rd doubles).
void backward_range(const BackwardPlan& bp, std::int64_t begin, std::int64_t end, double* da,
                    double* db) {
  const detail::ForwardPlan& plan = bp.forward;
  const RotationData& r = *plan.rotation;
  const std::int64_t rd = r.rotary_dim, hd = r.head_dim;
  const RowMath math{r};
  thread_local Scratch s;
  s.reserve(hd);
  const bool want_tables = bp.dcos.data || bp.dsin.data;
  const bool want_x = want_tables || da || db;
  std::int64_t outer[kMaxRank];
  for (std::int64_t item = begin; item < end; ++item) {
    detail::unravel(item, plan.outer_size, plan.outer_count, outer);
    const detail::TableRow t = detail::load_table_row(plan, outer, s.cos.data(), s.sin.data());
    const OuterOffsets off = outer_offsets(bp, outer);
    std::fill(s.dc.begin(), s.dc.end(), 0.0);
    std::fill(s.ds.begin(), s.ds.end(), 0.0);
    std::vector<std::int64_t> x_rows;
    if (want_x)
      detail::walk_rows(bp.x.inner, 0, bp.x.inner.rows,
                        [&](std::int64_t in, std::int64_t) { x_rows.push_back(in); });
    std::int64_t row = 0;
    detail::walk_rows(plan.q.inner, 0, plan.q.inner.rows, [&](std::int64_t in, std::int64_t out) {
      load_row(plan.q.in_base, plan.dtype, off.grad + in, hd, s.g.data());
      for (std::int64_t j = 0; j < rd; ++j) {
        s.u[j] = s.g[j] * t.cos[j];
        s.v[j] = s.g[j] * t.sin[j];
      }
      if (bp.want_dx) {
        std::fill(s.dx.begin(), s.dx.begin() + rd, 0.0f);
        math.add_transposed_term(0, s.u.data(), s.dx.data());
        math.add_transposed_term(1, s.v.data(), s.dx.data());
        for (std::int64_t j = rd; j < hd; ++j) s.dx[j] = s.g[j];  // pass-through lanes
        char* dx = plan.q.out_base + (off.dx + out) * dtype_size(plan.dtype);
        detail::store_row_any(dx, plan.dtype, hd, s.dx.data());
      }
      if (want_x) {
        load_row(bp.x.in_base, bp.x_dtype, off.x + x_rows[row], rd, s.x.data());
        if (want_tables) {
          math.forward_term(0, s.x.data(), s.xa.data());
          math.forward_term(1, s.x.data(), s.xb.data());
          for (std::int64_t j = 0; j < rd; ++j) {
            s.dc[j] += double(s.g[j]) * s.xa[j];
            s.ds[j] += double(s.g[j]) * s.xb[j];
          }
        }
        for (std::int64_t i = 0; da && i < rd; ++i)
          for (std::int64_t j = 0; j < rd; ++j) da[i * rd + j] += double(s.x[i]) * s.u[j];
        for (std::int64_t i = 0; db && i < rd; ++i)
          for (std::int64_t j = 0; j < rd; ++j) db[i * rd + j] += double(s.x[i]) * s.v[j];
      }
      ++row;
    });
    store_table_gradient(bp.dcos, bp.dcos_outer, outer, plan.outer_count, plan.tables.width,
                         s.dc.data(), rd);
    store_table_gradient(bp.dsin, bp.dsin_outer, outer, plan.outer_count, plan.tables.width,
                         s.ds.data(), rd, plan.tables.negate_sin);
  }
}

// Dense rotations: per outer index (one table row), inner rows in batches of kRowBatch staged
// as fp32 matrices G, U = G ⊙ C, V = G ⊙ S and X, then products on the ISA kernel. dA/dB are
// summed in fp32 over kMatrixFlushRows rows (8 batches; fewer at the end of the range) and then
// added to the caller's double accumulators: where the sums are flushed depends only on the
// range, so the result does not depend on the thread count.
constexpr std::int64_t kMatrixFlushRows = 512;
struct DenseScratch {
  std::vector<float> cos, sin, g, u, v, x, xt, dx, xm, pa, pb;
  std::vector<double> dc, ds;
};

void backward_dense_range(const BackwardPlan& bp, const std::vector<float>& a_t,
                          const std::vector<float>& b_t, std::int64_t begin, std::int64_t end,
                          double* da, double* db) {
  const detail::ForwardPlan& plan = bp.forward;
  const RotationData& r = *plan.rotation;
  const kernels::AccumulateProductFn product = detail::active_kernels().accumulate_product;
  const std::int64_t rd = r.rotary_dim, hd = r.head_dim;
  constexpr std::int64_t kBatch = detail::kRowBatch;
  thread_local DenseScratch s;
  for (auto* m : {&s.g, &s.u, &s.v, &s.x, &s.xt, &s.dx, &s.xm}) m->resize(kBatch * hd);
  s.cos.resize(hd);
  s.sin.resize(hd);
  s.pa.assign(da ? rd * rd : 0, 0.0f);
  s.pb.assign(db ? rd * rd : 0, 0.0f);
  std::int64_t pending_rows = 0;  // rows summed into pa/pb since the last flush
  auto flush_matrix_sums = [&] {
    for (auto [dm, p] : {std::pair{da, &s.pa}, std::pair{db, &s.pb}}) {
      if (!dm) continue;
      for (std::int64_t e = 0; e < rd * rd; ++e) dm[e] += (*p)[e];
      std::fill(p->begin(), p->end(), 0.0f);
    }
    pending_rows = 0;
  };
  s.dc.assign(rd, 0.0);
  s.ds.assign(rd, 0.0);
  const bool want_tables = bp.dcos.data || bp.dsin.data;
  const bool want_x = want_tables || da || db;
  // The diagonal blocks of A and B (outside them both are zero): the products for dx and x·M
  // stay inside a block. dA/dB are full matrices (gradients of the zero entries too).
  auto block_products = [&](std::int64_t rows, const float* in, const float* m, float* out) {
    for (const auto& blk : r.dense_blocks)
      product(rows, blk.size, blk.size, in + blk.offset, rd, m + blk.offset * rd + blk.offset, rd,
              out + blk.offset, rd);
  };
  std::int64_t outer[kMaxRank];
  std::int64_t g_rows[kBatch], dx_rows[kBatch], x_rows[kBatch];
  for (std::int64_t item = begin; item < end; ++item) {
    detail::unravel(item, plan.outer_size, plan.outer_count, outer);
    const detail::TableRow t = detail::load_table_row(plan, outer, s.cos.data(), s.sin.data());
    const OuterOffsets off = outer_offsets(bp, outer);
    std::fill(s.dc.begin(), s.dc.end(), 0.0);
    std::fill(s.ds.begin(), s.ds.end(), 0.0);
    for (std::int64_t first = 0; first < plan.q.inner.rows; first += kBatch) {
      const std::int64_t rows = std::min(kBatch, plan.q.inner.rows - first);
      std::int64_t n = 0;
      detail::walk_rows(plan.q.inner, first, first + rows, [&](std::int64_t in, std::int64_t out) {
        g_rows[n] = off.grad + in;
        dx_rows[n++] = off.dx + out;
      });
      if (want_x) {
        n = 0;
        detail::walk_rows(bp.x.inner, first, first + rows,
                          [&](std::int64_t in, std::int64_t) { x_rows[n++] = off.x + in; });
      }
      for (std::int64_t row = 0; row < rows; ++row) {
        float* g = s.g.data() + row * hd;
        load_row(plan.q.in_base, plan.dtype, g_rows[row], hd, g);
        for (std::int64_t j = 0; j < rd; ++j) {
          s.u[row * rd + j] = g[j] * t.cos[j];
          s.v[row * rd + j] = g[j] * t.sin[j];
        }
      }
      if (bp.want_dx) {
        std::fill(s.dx.begin(), s.dx.begin() + rows * rd, 0.0f);
        if (r.a_identity)
          std::copy(s.u.begin(), s.u.begin() + rows * rd, s.dx.begin());
        else
          block_products(rows, s.u.data(), a_t.data(), s.dx.data());
        block_products(rows, s.v.data(), b_t.data(), s.dx.data());
        for (std::int64_t row = 0; row < rows; ++row) {
          char* dx = plan.q.out_base + dx_rows[row] * dtype_size(plan.dtype);
          detail::store_row_any(dx, plan.dtype, rd, s.dx.data() + row * rd);
          if (hd > rd)  // pass-through lanes
            detail::store_row_any(dx + rd * dtype_size(plan.dtype), plan.dtype, hd - rd,
                                  s.g.data() + row * hd + rd);
        }
      }
      if (!want_x) continue;
      for (std::int64_t row = 0; row < rows; ++row)
        load_row(bp.x.in_base, bp.x_dtype, x_rows[row], rd, s.x.data() + row * rd);
      if (want_tables) {
        for (int which = 0; which < 2; ++which) {
          const float* xm = s.x.data();  // x·A with A = I
          if (which == 1 || !r.a_identity) {
            std::fill(s.xm.begin(), s.xm.begin() + rows * rd, 0.0f);
            block_products(rows, s.x.data(), which ? r.dense_b.data() : r.dense_a.data(),
                           s.xm.data());
            xm = s.xm.data();
          }
          std::vector<double>& acc = which ? s.ds : s.dc;
          for (std::int64_t row = 0; row < rows; ++row)
            for (std::int64_t j = 0; j < rd; ++j)
              acc[j] += double(s.g[row * hd + j]) * xm[row * rd + j];
        }
      }
      if (da || db) {
        for (std::int64_t row = 0; row < rows; ++row)  // xᵀ: rd × rows
          for (std::int64_t i = 0; i < rd; ++i) s.xt[i * rows + row] = s.x[row * rd + i];
        if (da) product(rd, rows, rd, s.xt.data(), rows, s.u.data(), rd, s.pa.data(), rd);
        if (db) product(rd, rows, rd, s.xt.data(), rows, s.v.data(), rd, s.pb.data(), rd);
        pending_rows += rows;
        if (pending_rows >= kMatrixFlushRows) flush_matrix_sums();
      }
    }
    store_table_gradient(bp.dcos, bp.dcos_outer, outer, plan.outer_count, plan.tables.width,
                         s.dc.data(), rd);
    store_table_gradient(bp.dsin, bp.dsin_outer, outer, plan.outer_count, plan.tables.width,
                         s.ds.data(), rd, plan.tables.negate_sin);
  }
  if (pending_rows > 0) flush_matrix_sums();
}

std::vector<float> transposed(const std::vector<float>& m, std::int64_t n) {
  std::vector<float> t(m.size());
  for (std::int64_t i = 0; i < n; ++i)
    for (std::int64_t j = 0; j < n; ++j) t[j * n + i] = m[i * n + j];
  return t;
}

}  // namespace

void rope_backward(const Rotation& rotation, const Tables& tables, const ConstTensorView& grad,
                   const ConstTensorView& x, const Gradients& out, const ExecOptions& options) {
  if (const std::int64_t offset = rotation.lane_offset(); offset > 0) {
    // As rope_forward: the rotated lanes as heads of their own; dx's leading lanes are grad's.
    const std::int64_t hd = rotation.head_dim();
    const ConstTensorView g = detail::narrow_lanes("grad", grad, hd, offset);
    const ConstTensorView xs = x.data ? detail::narrow_lanes("x", x, hd, offset) : x;
    Gradients narrowed = out;
    if (out.dx.data) narrowed.dx = detail::narrow_lanes("dx", out.dx, hd, offset);
    rope_backward(rotation.unshifted(), tables, g, xs, narrowed, options);
    if (out.dx.data) detail::copy_leading_lanes(grad, out.dx, offset);
    return;
  }
  detail::check_environment();
  detail::check_options(options);
  const BackwardPlan bp = detail::plan_backward(rotation, tables, grad, x, out);
  const std::int64_t rd = rotation.rotary_dim();
  const std::int64_t items = bp.forward.outer_total;
  int threads = detail::resolve_threads(options.num_threads);
  threads = detail::threads_for_bytes(options, bp.forward.bytes_moved, threads,
                                      detail::kMinParallelBytesBackward);
  const RotationData& r = rotation.data();
  const bool dense = r.kind == Rotation::Kind::dense;
  std::vector<float> a_t, b_t;
  if (dense) {
    if (!r.a_identity) a_t = transposed(r.dense_a, rd);
    b_t = transposed(r.dense_b, rd);
  }
  auto range = [&](std::int64_t b, std::int64_t e, double* da, double* db) {
    if (dense)
      backward_dense_range(bp, a_t, b_t, b, e, da, db);
    else
      backward_range(bp, b, e, da, db);
  };
  if (!out.da && !out.db) {
    detail::parallel_for(options, items, threads,
                         [&](std::int64_t b, std::int64_t e) { range(b, e, nullptr, nullptr); });
    return;
  }
  // dA/dB: fixed chunks summed in order, so results do not depend on the thread count.
  const std::int64_t matrix = rd * rd;
  const std::int64_t budget = std::max<std::int64_t>(1, (std::int64_t(64) << 20) / (16 * matrix));
  const std::int64_t chunks =
      std::max<std::int64_t>(1, std::min({items, std::int64_t(64), budget}));
  std::vector<double> partial_a(out.da ? chunks * matrix : 0),
      partial_b(out.db ? chunks * matrix : 0);
  detail::parallel_for(options, chunks, int(std::min<std::int64_t>(threads, chunks)),
                       [&](std::int64_t b, std::int64_t e) {
                         for (std::int64_t c = b; c < e; ++c)
                           range(items * c / chunks, items * (c + 1) / chunks,
                                 out.da ? partial_a.data() + c * matrix : nullptr,
                                 out.db ? partial_b.data() + c * matrix : nullptr);
                       });
  for (auto [dst, partial] : {std::pair{out.da, &partial_a}, std::pair{out.db, &partial_b}}) {
    if (!dst) continue;
    for (std::int64_t e = 0; e < matrix; ++e) {
      double sum = 0;
      for (std::int64_t c = 0; c < chunks; ++c) sum += (*partial)[c * matrix + e];
      dst[e] = float(sum);
    }
  }
}

}  // namespace rome
