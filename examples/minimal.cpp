// Minimal use of RoME from C++: NeoX (half) RoPE on q [1, 4, 8, 64] in place, with fp32 tables
// [8, 64] broadcast over batch and heads. Built and run by the test suite.
#include <cmath>
#include <cstdio>
#include <vector>

#include "rome/rome.hpp"

int main() {
  const std::int64_t heads = 4, seq = 8, dim = 64;
  std::vector<float> q(heads * seq * dim, 1.0f), cos(seq * dim), sin(seq * dim);
  for (std::int64_t s = 0; s < seq; ++s)
    for (std::int64_t j = 0; j < dim; ++j) {
      const double inv_freq = std::pow(10000.0, -2.0 * double(j % (dim / 2)) / double(dim));
      cos[s * dim + j] = float(std::cos(double(s) * inv_freq));
      sin[s * dim + j] = float(std::sin(double(s) * inv_freq));
    }

  const rome::Rotation rotation = rome::Rotation::half(dim);
  rome::Tables tables;
  tables.cos = rome::make_view<const void*>(cos.data(), rome::DType::f32, {seq, dim});
  tables.sin = rome::make_view<const void*>(sin.data(), rome::DType::f32, {seq, dim});
  const auto view = rome::make_view<void*>(q.data(), rome::DType::f32, {1, heads, seq, dim});
  rome::rope_forward(rotation, tables, rome::Operand{rome::as_const(view), view});

  // Position 1, lane 0 of a head of ones: cos(1) - sin(1).
  const double expected = std::cos(1.0) - std::sin(1.0);
  std::printf("q[0, 0, 1, 0] = %.6f (expected %.6f) on %s\n", q[dim], expected,
              rome::isa_name(rome::active_isa()));
  return std::abs(q[dim] - expected) < 1e-6 ? 0 : 1;
}
