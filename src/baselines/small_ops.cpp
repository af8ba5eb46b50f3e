#include "small_ops.hpp"

#include <vector>

#include "core/convert.hpp"

namespace rome::baselines {
namespace {

// A dense 2-D temporary in float holding values already rounded to the working dtype, as a
// framework tensor of that dtype would.
struct Temp {
  std::int64_t rows, cols;
  std::vector<float> v;
  Temp(std::int64_t r, std::int64_t c) : rows(r), cols(c), v(r * c) {}
  float& at(std::int64_t r, std::int64_t c) { return v[r * cols + c]; }
};

float round_to(DType d, float f) {
  if (d == DType::bf16) return detail::bf16_to_float(detail::float_to_bf16(f));
  if (d == DType::f16) return detail::fp16_to_float(detail::float_to_fp16(f));
  return f;
}

Temp slice(DType d, const Temp& t, std::int64_t begin, std::int64_t end, std::int64_t step = 1) {
  Temp out(t.rows, (end - begin + step - 1) / step);
  for (std::int64_t r = 0; r < t.rows; ++r)
    for (std::int64_t c = 0; c < out.cols; ++c) out.at(r, c) = t.v[r * t.cols + begin + c * step];
  return out;
}

Temp negate(const Temp& t) {
  Temp out = t;
  for (float& f : out.v) f = -f;
  return out;
}

Temp concat(const Temp& a, const Temp& b) {
  Temp out(a.rows, a.cols + b.cols);
  for (std::int64_t r = 0; r < a.rows; ++r) {
    for (std::int64_t c = 0; c < a.cols; ++c) out.at(r, c) = a.v[r * a.cols + c];
    for (std::int64_t c = 0; c < b.cols; ++c) out.at(r, a.cols + c) = b.v[r * b.cols + c];
  }
  return out;
}

// Elementwise with a table broadcast over rows (row r uses table row r % table.rows).
template <typename Op>
Temp broadcast(DType d, const Temp& a, const Temp& b, Op op) {
  Temp out(a.rows, a.cols);
  for (std::int64_t r = 0; r < a.rows; ++r) {
    const float* br = b.v.data() + (r % b.rows) * b.cols;
    for (std::int64_t c = 0; c < a.cols; ++c) out.at(r, c) = round_to(d, op(a.v[r * a.cols + c], br[c]));
  }
  return out;
}

Temp load(DType d, const void* p, std::int64_t rows, std::int64_t cols) {
  Temp t(rows, cols);
  for (std::int64_t i = 0; i < rows * cols; ++i) t.v[i] = detail::load_any(p, d, i);
  return t;
}

}  // namespace

void small_ops_rope(Mode mode, DType dtype, const void* x, void* y, std::int64_t rows,
                    std::int64_t dim, const void* cos, const void* sin, std::int64_t tokens,
                    std::span<const std::int64_t> sections) {
  const Temp xt = load(dtype, x, rows, dim), ct = load(dtype, cos, tokens, dim),
             st = load(dtype, sin, tokens, dim);
  std::vector<std::int64_t> cuts(sections.begin(), sections.end());
  if (cuts.empty()) cuts.push_back(dim);
  Temp result(rows, 0);
  std::int64_t begin = 0;
  for (std::int64_t width : cuts) {
    const Temp xs = slice(dtype, xt, begin, begin + width);
    const Temp cs = slice(dtype, ct, begin, begin + width), ss = slice(dtype, st, begin, begin + width);
    Temp rotated(rows, width);
    if (mode == Mode::half) {
      rotated = concat(negate(slice(dtype, xs, width / 2, width)), slice(dtype, xs, 0, width / 2));
    } else {
      // rotate_every_two: stack((-x[1::2], x[0::2]), -1).flatten(-2)
      const Temp odd = negate(slice(dtype, xs, 1, width, 2)), even = slice(dtype, xs, 0, width, 2);
      for (std::int64_t r = 0; r < rows; ++r)
        for (std::int64_t i = 0; i < width / 2; ++i) {
          rotated.at(r, 2 * i) = odd.v[r * odd.cols + i];
          rotated.at(r, 2 * i + 1) = even.v[r * even.cols + i];
        }
    }
    const Temp a = broadcast(dtype, xs, cs, [](float p, float q) { return p * q; });
    const Temp b = broadcast(dtype, rotated, ss, [](float p, float q) { return p * q; });
    result = concat(result, broadcast(dtype, a, b, [](float p, float q) { return p + q; }));
    begin += width;
  }
  for (std::int64_t i = 0; i < rows * dim; ++i) detail::store_any(y, dtype, i, result.v[i]);
}

}  // namespace rome::baselines
