// CPU kernels of the rome:: operators: thin calls into the core.
#include <algorithm>

#include "calls.hpp"
#include "dispatch.hpp"

namespace rome_torch {

namespace {

std::tuple<Tensor, Tensor> rope_cpu(const Tensor& q, const OptTensor& k, const Tensor& cos,
                                    const Tensor& sin, const OptTensor& positions,
                                    c10::string_view rotation, c10::IntArrayRef blocks,
                                    int64_t rotary_dim, c10::string_view table_width,
                                    c10::IntArrayRef column_axis, const OptTensor& mat_a,
                                    const OptTensor& mat_b) {
  return rope_call(Mode::run, q, k, cos, sin, positions, rotation, blocks, rotary_dim, table_width,
                   column_axis, mat_a, mat_b);
}

void rope_inplace_cpu(const Tensor& q, const OptTensor& k, const Tensor& cos, const Tensor& sin,
                      const OptTensor& positions, c10::string_view rotation,
                      c10::IntArrayRef blocks, int64_t rotary_dim, c10::string_view table_width,
                      c10::IntArrayRef column_axis, const OptTensor& mat_a,
                      const OptTensor& mat_b) {
  rope_inplace_call(Mode::run, q, k, cos, sin, positions, rotation, blocks, rotary_dim, table_width,
                    column_axis, mat_a, mat_b);
}

// Out of place into the caller's tensors: engines keep their buffers, no allocation per call.
void rope_out_cpu(const Tensor& q, const OptTensor& k, const Tensor& cos, const Tensor& sin,
                  const Tensor& q_out, const OptTensor& k_out, const OptTensor& positions,
                  c10::string_view rotation, c10::IntArrayRef blocks, int64_t rotary_dim,
                  c10::string_view table_width, c10::IntArrayRef column_axis,
                  const OptTensor& mat_a, const OptTensor& mat_b) {
  rope_out_call(Mode::run, q, k, cos, sin, q_out, k_out, positions, rotation, blocks, rotary_dim,
                table_width, column_axis, mat_a, mat_b);
}

Tensor rope_matrix_cpu(const Tensor& x, const Tensor& mat, const Tensor& sin, const Tensor& cos) {
  return rope_matrix_call(Mode::run, x, mat, sin, cos);
}

void rope_matrix_inplace_cpu(const Tensor& x, const Tensor& mat, const Tensor& sin,
                             const Tensor& cos) {
  rope_matrix_inplace_call(Mode::run, x, mat, sin, cos);
}

void rotary_embedding_cpu(const Tensor& positions, const Tensor& query, const OptTensor& key,
                          int64_t head_size, const Tensor& cos_sin_cache, bool is_neox,
                          int64_t rope_dim_offset, bool inverse) {
  rotary_embedding_call(Mode::run, positions, query, key, head_size, cos_sin_cache, is_neox,
                        rope_dim_offset, inverse);
}

Tensor interleaved_cpu(const Tensor& x, const Tensor& freqs_cis) {
  return interleaved_call(Mode::run, x, freqs_cis);
}

void fused_qk_norm_rope_cpu(const Tensor& qkv, int64_t num_heads_q, int64_t num_heads_k,
                            int64_t num_heads_v, int64_t head_dim, double eps,
                            const Tensor& q_weight, const Tensor& k_weight,
                            const Tensor& cos_sin_cache, bool is_neox, const Tensor& position_ids,
                            bool gemma_norm) {
  fused_qk_norm_rope_call(Mode::run, qkv, num_heads_q, num_heads_k, num_heads_v, head_dim, eps,
                          q_weight, k_weight, cos_sin_cache, is_neox, position_ids, gemma_norm);
}

void rotary_embedding_with_cache_cpu(const Tensor& positions, const Tensor& query,
                                     const Tensor& key, const Tensor& value, int64_t head_size,
                                     const Tensor& cos_sin_cache, bool is_neox,
                                     const Tensor& key_cache, const Tensor& value_cache,
                                     const Tensor& slot_mapping, const OptTensor& q_weight,
                                     const OptTensor& k_weight, double eps, bool gemma_norm) {
  rotary_embedding_with_cache_call(Mode::run, positions, query, key, value, head_size,
                                   cos_sin_cache, is_neox, key_cache, value_cache, slot_mapping,
                                   q_weight, k_weight, eps, gemma_norm);
}

void rerotate_paged_cpu(const Tensor& key_cache, const Tensor& cos, const Tensor& sin,
                        const Tensor& block_table, const Tensor& seq_lens,
                        c10::string_view rotation, int64_t rope_dim_offset) {
  guarded({{"cache", "key_cache"}, {"q", "key_cache"}, {"head_dim", "key_cache"}}, [&] {
    if (key_cache.dim() != 4)
      rome::fail(rome::Status::invalid_argument, "key_cache",
                 "rank 4 [num_blocks, block_size, heads, head_dim]", shape_of(key_cache));
    if (cos.dim() != 2 || cos.size(1) == 0)
      rome::fail(rome::Status::invalid_argument, "cos", "[num_seqs, rotary_dim/2]", shape_of(cos));
    const std::string kind(rotation);
    if (kind != "half" && kind != "interleave")
      rome::fail(rome::Status::invalid_argument, "rotation", "'half' or 'interleave'",
                 "'" + kind + "'");
    const int64_t hd = key_cache.size(-1), rd = 2 * cos.size(1);
    if (rope_dim_offset < 0 || rd + rope_dim_offset > hd)
      rome::fail(rome::Status::invalid_argument, "rope_dim_offset",
                 "an offset in [0, head_dim - rotary_dim] = [0, " + std::to_string(hd - rd) + "]",
                 std::to_string(rope_dim_offset));
    const rome::Rotation r =
        build_rotation(kind, {}, rd, hd, std::nullopt, std::nullopt, "mat_b", rope_dim_offset);
    rome::Tables tables;
    tables.cos = const_view(cos, "cos", false);
    tables.sin = const_view(sin, "sin", false);
    tables.width = kind == "half" ? rome::TableWidth::halves : rome::TableWidth::pairs;
    rome::PagedKeys keys;
    keys.cache = mutable_view(key_cache, "key_cache");
    keys.block_table = const_view(block_table, "block_table", true);
    keys.seq_lens = const_view(seq_lens, "seq_lens", true);
    rome::rerotate_paged(r, tables, keys, exec_options());
  });
}

// Table-free RoPE: cos/sin from positions × inv_freq inside the kernel's token tiles.

std::tuple<Tensor, Tensor> rope_from_positions_cpu(const Tensor& q, const OptTensor& k,
                                                   const Tensor& positions, const Tensor& inv_freq,
                                                   c10::string_view rotation,
                                                   c10::IntArrayRef blocks, int64_t rotary_dim,
                                                   double amplitude, c10::IntArrayRef column_axis,
                                                   bool inverse) {
  return rope_from_positions_call(Mode::run, q, k, positions, inv_freq, rotation, blocks,
                                  rotary_dim, amplitude, column_axis, inverse);
}

void rope_from_positions_inplace_cpu(const Tensor& q, const OptTensor& k, const Tensor& positions,
                                     const Tensor& inv_freq, c10::string_view rotation,
                                     c10::IntArrayRef blocks, int64_t rotary_dim, double amplitude,
                                     c10::IntArrayRef column_axis, bool inverse) {
  rope_from_positions_inplace_call(Mode::run, q, k, positions, inv_freq, rotation, blocks,
                                   rotary_dim, amplitude, column_axis, inverse);
}

// dq, dk: the transposed rotation of the gradients (rotation by −θ for every standard RoPE).
std::tuple<Tensor, Tensor> rope_from_positions_backward_cpu(
    const Tensor& grad_q, const OptTensor& grad_k, const Tensor& positions, const Tensor& inv_freq,
    c10::string_view rotation, c10::IntArrayRef blocks, int64_t rotary_dim, double amplitude,
    c10::IntArrayRef column_axis, bool inverse) {
  return guarded(kFromPositionsNames, [&] {
    const FromPositions p =
        prepare_from_positions(grad_q, positions, inv_freq, rotation, blocks, rotary_dim, amplitude,
                               column_axis, inverse, "grad");
    auto run = [&](const Tensor& g) {
      const Tensor gin = readable(g);
      const Tensor dx = alloc_like(g);
      rome::Gradients out;
      out.dx = mutable_view(dx, "dx");
      const rome::ConstTensorView gv = const_view(gin, "grad", false);
      rome::rope_backward(*p.rotation, p.tables.tables, gv, gv, out, exec_options());
      return dx;
    };
    const Tensor dq = run(grad_q);
    return std::make_tuple(dq, has(grad_k) ? run(*grad_k) : empty_marker(grad_q));
  });
}

// The exact table builder: [*positions.shape, 2·n] cos and sin (half or pairs layout) in dtype
// (default fp32).
std::tuple<Tensor, Tensor> cos_sin_cpu(const Tensor& positions, const Tensor& inv_freq,
                                       c10::string_view layout, double amplitude,
                                       std::optional<at::ScalarType> dtype) {
  return guarded({{"frequencies", "inv_freq"}}, [&] {
    if (layout != "half" && layout != "pairs")
      rome::fail(rome::Status::invalid_argument, "layout", "'half' or 'pairs'",
                 "'" + std::string(layout) + "'");
    if (positions.scalar_type() != at::kInt && positions.scalar_type() != at::kLong)
      rome::fail(rome::Status::invalid_argument, "positions.dtype", "int32 or int64",
                 c10::toString(positions.scalar_type()));
    const_view(positions, "positions", true);  // device and dtype checks
    const std::vector<double> frequencies = frequencies_of(inv_freq, positions);
    const Tensor pos = positions.to(at::kLong).contiguous();
    const int64_t n = int64_t(frequencies.size()), rows = pos.numel();
    std::vector<int64_t> shape = to_vec(positions.sizes());
    shape.push_back(2 * n);
    const at::ScalarType out_dtype = dtype.value_or(at::kFloat);
    // 16-bit outputs are written directly (rounded to nearest even, as Tensor.to rounds), not
    // through fp32 tensors and two more dispatched copies: a decode step builds one row.
    // Any other dtype (float64, ...) is the fp32 result converted by Tensor.to.
    const bool narrow = out_dtype == at::kBFloat16 || out_dtype == at::kHalf;
    const at::ScalarType fill_dtype = narrow ? out_dtype : at::kFloat;
    Tensor cos = at::empty(shape, positions.options().dtype(fill_dtype));
    Tensor sin = at::empty(shape, positions.options().dtype(fill_dtype));
    const int64_t* p = pos.data_ptr<int64_t>();
    const std::span<const double> f(frequencies);
    // Validate everything once on this thread, then fill the rows in parallel.
    rome::exact_cos_sin_rows({p, size_t(rows)}, f, amplitude, layout == "pairs", nullptr, nullptr);
    const bool pairs = layout == "pairs";
    const int64_t width = 2 * n;
    at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
      if (!narrow) {
        rome::exact_cos_sin_rows({p + begin, size_t(end - begin)}, f, amplitude, pairs,
                                 cos.data_ptr<float>() + begin * width,
                                 sin.data_ptr<float>() + begin * width);
        return;
      }
      // fp32 rows a block at a time, narrowed while still in cache (a whole chunk of rows went
      // out to memory and back, at S = 32768 most of the time). Per thread, reused.
      constexpr int64_t kBlock = 64;
      thread_local std::vector<float> buffer;
      if (buffer.size() < std::size_t(2 * kBlock * width)) buffer.resize(2 * kBlock * width);
      float* const c = buffer.data();
      float* const s = c + kBlock * width;
      auto* const cos16 = static_cast<uint16_t*>(cos.data_ptr());
      auto* const sin16 = static_cast<uint16_t*>(sin.data_ptr());
      const auto to16 =
          out_dtype == at::kBFloat16
              ? static_cast<void (*)(std::span<const float>, uint16_t*)>(rome::tables::to_bf16_bits)
              : static_cast<void (*)(std::span<const float>, uint16_t*)>(
                    rome::tables::to_fp16_bits);
      for (int64_t r0 = begin; r0 < end; r0 += kBlock) {
        const int64_t m = std::min(kBlock, end - r0);
        rome::exact_cos_sin_rows({p + r0, size_t(m)}, f, amplitude, pairs, c, s);
        to16({c, size_t(m * width)}, cos16 + r0 * width);
        to16({s, size_t(m * width)}, sin16 + r0 * width);
      }
    });
    if (fill_dtype != out_dtype) return std::make_tuple(cos.to(out_dtype), sin.to(out_dtype));
    return std::make_tuple(cos, sin);
  });
}

// Gradients of the general op for q (and k), summed over both for the shared tables/matrices.
// Outputs not asked for by output_mask are empty [0] tensors.
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> rope_backward_cpu(
    const Tensor& grad_q, const OptTensor& grad_k, const Tensor& q, const OptTensor& k,
    const Tensor& cos, const Tensor& sin, const OptTensor& positions, c10::string_view rotation,
    c10::IntArrayRef blocks, int64_t rotary_dim, c10::string_view table_width,
    c10::IntArrayRef column_axis, const OptTensor& mat_a, const OptTensor& mat_b,
    std::array<bool, 6> mask) {
  return guarded([&] {
    const Prepared p = prepare(grad_q, cos, sin, positions, rotation, blocks, rotary_dim,
                               table_width, column_axis, mat_a, mat_b, "grad");
    const int64_t rd = p.rotation->rotary_dim();
    const auto f32 = q.options().dtype(at::kFloat);
    const bool want_tables = mask[2] || mask[3];
    const bool want_mats = mask[4] || mask[5];
    Tensor dq = mask[0] ? alloc_like(grad_q) : empty_marker(q);
    Tensor dk = mask[1] && has(k) ? alloc_like(*grad_k) : empty_marker(q);
    // fp32 accumulators in the shape the core sees (effective tables), reduced afterwards.
    Tensor dcos, dsin, da, db;
    if (mask[2]) dcos = at::zeros(p.tables.cos.sizes(), f32);
    if (mask[3]) dsin = at::zeros(p.tables.sin.sizes(), f32);
    if (mask[4]) da = at::zeros({rd, rd}, f32);
    if (mask[5]) db = at::zeros({rd, rd}, f32);

    auto run = [&](const Tensor& g, const Tensor& x, const Tensor& dx, bool accumulate) {
      const Tensor gin = readable(g), xin = readable(x);
      rome::Gradients out;
      if (dx.defined() && dx.numel() > 0) out.dx = mutable_view(dx, "dx");
      Tensor c, s, a, b;
      if (want_tables || want_mats) {
        if (dcos.defined()) c = accumulate ? at::zeros_like(dcos) : dcos;
        if (dsin.defined()) s = accumulate ? at::zeros_like(dsin) : dsin;
        if (da.defined()) a = accumulate ? at::zeros_like(da) : da;
        if (db.defined()) b = accumulate ? at::zeros_like(db) : db;
        if (c.defined()) out.dcos = mutable_view(c, "dcos");
        if (s.defined()) out.dsin = mutable_view(s, "dsin");
        if (a.defined()) out.da = a.data_ptr<float>();
        if (b.defined()) out.db = b.data_ptr<float>();
      }
      if (!out.dx.data && !out.dcos.data && !out.dsin.data && !out.da && !out.db) return;
      rome::rope_backward(*p.rotation, p.tables.tables, const_view(gin, "grad", false),
                          const_view(xin, "x", false), out, exec_options());
      if (accumulate) {
        if (c.defined()) dcos.add_(c);
        if (s.defined()) dsin.add_(s);
        if (a.defined()) da.add_(a);
        if (b.defined()) db.add_(b);
      }
    };
    const bool need_q_pass = mask[0] || want_tables || want_mats;
    if (need_q_pass)
      run(grad_q, want_tables || want_mats ? q : grad_q, mask[0] ? dq : Tensor(), false);
    if (has(k) && has(grad_k) && (mask[1] || want_tables || want_mats)) {
      // Tables/matrices: a second pass whose gradients are added to the first one's.
      const bool with_x = want_tables || want_mats;
      run(*grad_k, with_x ? *k : *grad_k, mask[1] ? dk : Tensor(), with_x);
    }

    // Back to the caller's shapes and dtypes.
    auto to_table = [&](Tensor d, const Tensor& like) {
      if (d.sizes() != like.sizes()) {
        if (d.dim() < like.dim()) {
          std::vector<int64_t> shape(like.dim() - d.dim(), 1);
          for (int64_t s : d.sizes()) shape.push_back(s);
          d = d.view(shape);
        }
        d = at::sum_to(d, like.sizes());
      }
      return d.to(like.scalar_type()).contiguous();
    };
    Tensor rcos = mask[2] ? to_table(dcos, cos) : empty_marker(q);
    Tensor rsin = mask[3] ? to_table(dsin, sin) : empty_marker(q);
    Tensor rda = mask[4] && has(mat_a) ? da.to(mat_a->scalar_type()) : empty_marker(q);
    Tensor rdb = mask[5] && has(mat_b) ? db.to(mat_b->scalar_type()) : empty_marker(q);
    return std::make_tuple(dq, dk, rcos, rsin, rda, rdb);
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(rome, CPU, m) {
  m.impl("rope_matrix", rope_matrix_cpu);
  m.impl("rope_matrix_", rope_matrix_inplace_cpu);
  m.impl("rope", rope_cpu);
  m.impl("rope_", rope_inplace_cpu);
  m.impl("rope_out", rope_out_cpu);
  m.impl("rotary_embedding", rotary_embedding_cpu);
  m.impl("rerotate_paged_", rerotate_paged_cpu);
  m.impl("fused_qk_norm_rope", fused_qk_norm_rope_cpu);
  m.impl("rotary_embedding_with_cache", rotary_embedding_with_cache_cpu);
  m.impl("apply_rotary_emb_interleaved", interleaved_cpu);
  m.impl("_rope_backward", rope_backward_cpu);
  m.impl("rope_from_positions", rope_from_positions_cpu);
  m.impl("cos_sin", cos_sin_cpu);
  m.impl("rope_from_positions_", rope_from_positions_inplace_cpu);
  m.impl("_rope_from_positions_backward", rope_from_positions_backward_cpu);
}

}  // namespace rome_torch
