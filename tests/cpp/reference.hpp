// Double-precision reference of y = (x·A) ⊙ C + (x·B) ⊙ S, written from the definition with
// dense matrices and plain index loops: independent of the planner and the kernels.
#pragma once

#include <functional>
#include <vector>

#include "rome/rope.hpp"
#include "test_tensor.hpp"

namespace rome::testing {

// Tables as the test built them: direct tensors broadcast to x, or a cache with positions.
struct TestTables {
  TestTensor cos, sin;
  TestTensor positions;  // empty shape: direct tables
  std::vector<int> column_axis;
  TableWidth width = TableWidth::full;

  bool is_cache() const { return !positions.shape.empty(); }
  Tables view() const {
    Tables t;
    t.cos = cos.cview();
    t.sin = sin.cview();
    if (is_cache()) t.positions = positions.cview();
    t.column_axis = column_axis;
    t.width = width;
    return t;
  }
  std::int64_t column(std::int64_t lane) const {
    const std::int64_t w = cos.shape.back();
    return width == TableWidth::full ? lane : width == TableWidth::halves ? lane % w : lane / 2;
  }
  // C or S for lane j of the x row at `row` (x's indices without the head axis).
  double value(bool want_sin, const std::vector<std::int64_t>& row, std::int64_t lane) const {
    const TestTensor& t = want_sin ? sin : cos;
    const std::int64_t c = column(lane);
    // Reused: this runs once per reference element.
    thread_local std::vector<std::int64_t> idx, pidx;
    if (!is_cache()) {
      idx.resize(t.shape.size());
      const std::size_t lead = row.size() - (t.shape.size() - 1);
      for (std::size_t i = 0; i + 1 < t.shape.size(); ++i)
        idx[i] = t.shape[i] == 1 ? 0 : row[lead + i];
      idx.back() = c;
      return t.get(idx);
    }
    pidx.assign(positions.shape.size(), 0);
    for (std::size_t i = 0; i < row.size(); ++i) pidx[i] = positions.shape[i] == 1 ? 0 : row[i];
    if (!column_axis.empty()) pidx.back() = column_axis[c];
    const auto p = std::int64_t(positions.get(pidx));
    idx.assign({p, c});
    return t.get(idx);
  }
};

// The rotation's matrices in double, kept as the nonzero entries of each column (a D = 4094
// rotation has 16.7M entries and a few thousand nonzeros: the dense copy is not kept).
struct DenseRotation {
  std::int64_t head_dim, rotary_dim;
  bool dense;  // Rotation::Kind::dense: the reference also gives the dot-product error bound
  std::vector<std::vector<std::pair<std::int64_t, double>>> a_cols, b_cols;
  explicit DenseRotation(const Rotation& r)
      : head_dim(r.head_dim()),
        rotary_dim(r.rotary_dim()),
        dense(r.kind() == Rotation::Kind::dense) {
    a_cols = nonzero_columns(r.to_dense_a());
    b_cols = nonzero_columns(r.to_dense_b());
  }

 private:
  std::vector<std::vector<std::pair<std::int64_t, double>>> nonzero_columns(
      const std::vector<float>& m) const {
    std::vector<std::vector<std::pair<std::int64_t, double>>> cols(rotary_dim);
    for (std::int64_t i = 0; i < rotary_dim; ++i) {
      const float* row = m.data() + i * rotary_dim;
      for (std::int64_t j = 0; j < rotary_dim; ++j)
        if (row[j] != 0) cols[j].push_back({i, row[j]});
    }
    return cols;
  }
};

struct Reference {
  std::vector<double> y;  // x's logical elements, row-major
  // Per element, where the kernels' result may be further than 1 ulp (fp32: 2) from the rounded
  // reference: dense rotations (fp32 dot products) and the one-fma epilogue of 16-bit x with fp32
  // tables. Empty elsewhere.
  std::vector<double> bound;
};

// (v·M)[j] over structural nonzeros only, so non-finite lanes reach only their partners.
inline double column_dot(const std::vector<std::pair<std::int64_t, double>>& col, const double* v,
                         double* magnitude) {
  double s = 0;
  for (const auto& [i, m] : col) {
    s += v[i] * m;
    *magnitude += std::abs(v[i] * m);
  }
  return s;
}

// matrix_unit: the AMX kernel's bound (bf16 hi/lo split products, see src/kernels/amx).
// Takes the rotation's columns, which a table-driven test can build once per rotation.
inline Reference reference(const DenseRotation& m, const TestTables& tables, const TestTensor& x,
                           bool matrix_unit = false) {
  const bool dense = m.dense;
  const std::int64_t d = m.head_dim, rd = m.rotary_dim, rows = d ? x.numel() / d : 0;
  const double out_ulp = x.dtype == DType::f32 ? 0x1p-23 : x.dtype == DType::f16 ? 0x1p-10 : 0x1p-7;
  // 16-bit x with fp32 cosines: the one-fma epilogue (kernel_api.hpp: single_fma_epilogue) leaves
  // out the rounding of x_a·c, at most 2^-24·|x_a·c|; then the fma's own fp32 rounding and the
  // output's (`tiny`: its subnormal spacing). Dense rotations' bound already covers it.
  const bool one_fma = !dense && x.dtype != DType::f32 && tables.cos.dtype == DType::f32;
  const double tiny = x.dtype == DType::f16 ? 0x1p-24 : 0x1p-133;
  Reference ref;
  ref.y.resize(x.numel());
  if (dense || one_fma) ref.bound.resize(x.numel());
  std::vector<double> v(d), c(rd), s(rd);
  std::vector<std::int64_t> row(x.shape.size() - 1);
  for (std::int64_t r = 0; r < rows; ++r) {
    std::int64_t rest = r;
    for (int i = int(row.size()) - 1; i >= 0; --i) {
      row[i] = rest % x.shape[i];
      rest /= x.shape[i];
    }
    std::vector<std::int64_t> idx(row);
    idx.push_back(0);
    for (std::int64_t j = 0; j < d; ++j) {
      idx.back() = j;
      v[j] = x.get(idx);
    }
    for (std::int64_t j = 0; j < rd; ++j) {
      c[j] = tables.value(false, row, j);
      s[j] = tables.value(true, row, j);
    }
    for (std::int64_t j = 0; j < d; ++j) {
      if (j >= rd) {
        ref.y[r * d + j] = v[j];
        continue;
      }
      double ma = 0, mb = 0;
      const double xa = column_dot(m.a_cols[j], v.data(), &ma);
      const double xb = column_dot(m.b_cols[j], v.data(), &mb);
      ref.y[r * d + j] = xa * c[j] + xb * s[j];
      // fp32 dot products of rd terms: |error| <= (rd + 3)·2^-24·Σ|terms| (+ 3·2^-16·Σ|terms|
      // for split bf16 tile products), plus the output rounding.
      const double unit = double(rd + 3) * 0x1p-24 + (matrix_unit ? 3 * 0x1p-16 : 0.0);
      if (dense)
        ref.bound[r * d + j] = unit * (ma * std::abs(c[j]) + mb * std::abs(s[j])) +
                               out_ulp * std::abs(ref.y[r * d + j]);
      if (one_fma)  // the 2^-24 terms doubled: slack between the fma's value and ref
        ref.bound[r * d + j] = 0x1p-23 * ma * std::abs(c[j]) +
                               (0x1p-23 + out_ulp / 2) * std::abs(ref.y[r * d + j]) + tiny / 2;
    }
  }
  return ref;
}

inline Reference reference(const Rotation& rotation, const TestTables& tables, const TestTensor& x,
                           bool matrix_unit = false) {
  return reference(DenseRotation(rotation), tables, x, matrix_unit);
}

inline std::vector<double> reference_forward(const Rotation& rotation, const TestTables& tables,
                                             const TestTensor& x) {
  return reference(rotation, tables, x).y;
}

// Compares `out` with the reference: bf16/fp16 within 1 ulp of the reference rounded to the
// dtype, fp32 within 2 ulp; or within the bound (Reference::bound), where there is one.
struct Comparison {
  bool ok = true;
  std::string first_failure;
  std::int64_t worst_ulp = 0;
};

inline Comparison compare(const TestTensor& out, const std::vector<double>& ref,
                          const std::vector<double>& dense_bound = {}) {
  Comparison c;
  const std::int64_t allowed = out.dtype == DType::f32 ? 2 : 1;
  std::vector<std::int64_t> idx(out.shape.size(), 0);
  for (std::int64_t e = 0; e < out.numel(); ++e, out.next_index(idx)) {
    const double got = out.get(idx);
    const std::int64_t ulp = ulp_distance(out.dtype, got, ref[e]);
    const bool within_bound = !dense_bound.empty() && std::abs(got - ref[e]) <= dense_bound[e];
    if (ulp > allowed && !within_bound) {
      if (c.ok) {
        std::string at;
        for (auto i : idx) at += std::to_string(i) + ",";
        c.first_failure = "at [" + at + "] got " + std::to_string(got) + " expected " +
                          std::to_string(ref[e]) + " (" + std::to_string(ulp) + " ulp)";
      }
      c.ok = false;
    }
    if (!within_bound && ulp > c.worst_ulp) c.worst_ulp = ulp;
  }
  return c;
}

}  // namespace rome::testing
