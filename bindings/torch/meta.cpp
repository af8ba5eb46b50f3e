// Meta kernels of the rome:: operators: fresh outputs with the CPU kernels' shapes, dtypes and
// strides. The rope family, the matrix ops, rotary_embedding, the interleaved op, the fused
// passes and table-free RoPE also check their arguments as the CPU kernels do (calls.hpp,
// Mode::check), so torch.compile refuses while tracing what the CPU kernel would refuse, with the
// same message; with symbolic shapes (dynamic=True) that check is left to the CPU kernel at run
// time.
#include "calls.hpp"
#include "dispatch.hpp"

namespace rome_torch {

namespace {

// The dispatcher picks Meta when ANY tensor argument is on meta: CPU q with a meta table lands
// here too. Computing nothing and returning an uninitialised CPU tensor (or leaving q untouched
// in place) would be a silent wrong answer, so every argument must be on meta.
using NamedTensors = std::initializer_list<std::pair<const char*, const Tensor*>>;

void require_all_meta(NamedTensors tensors) {
  guarded([&] {
    const std::pair<const char*, const Tensor*>* other = nullptr;  // a tensor not on meta
    for (const auto& t : tensors)
      if (t.second && t.second->defined() && !t.second->is_meta()) other = &t;
    if (!other) return;
    for (const auto& t : tensors)
      if (t.second && t.second->defined() && t.second->is_meta())
        rome::fail(rome::Status::invalid_argument, std::string(t.first) + ".device",
                   other->second->device().str() + " (the device of " + other->first +
                       "; every tensor on one device)",
                   "meta");
  });
}

const Tensor* opt(const OptTensor& t) {
  return t.has_value() ? &*t : nullptr;
}

// Whether every tensor has concrete sizes and strides (rope_check needs numbers).
bool concrete(NamedTensors tensors) {
  for (const auto& t : tensors)
    if (t.second && t.second->defined() &&
        t.second->unsafeGetTensorImpl()->has_symbolic_sizes_strides())
      return false;
  return true;
}

// Every argument on meta (else the error); then whether the shapes are concrete, so the
// arguments can be checked like the CPU kernel's.
bool checkable_on_meta(NamedTensors tensors) {
  require_all_meta(tensors);
  return concrete(tensors);
}

bool require_rope_meta(const Tensor& q, const OptTensor& k, const Tensor& cos, const Tensor& sin,
                       const OptTensor& positions, const OptTensor& mat_a, const OptTensor& mat_b) {
  return checkable_on_meta({{"q", &q},
                            {"k", opt(k)},
                            {"cos", &cos},
                            {"sin", &sin},
                            {"positions", opt(positions)},
                            {"mat_a", opt(mat_a)},
                            {"mat_b", opt(mat_b)}});
}

std::tuple<Tensor, Tensor> rope_meta(const Tensor& q, const OptTensor& k, const Tensor& cos,
                                     const Tensor& sin, const OptTensor& positions,
                                     c10::string_view rotation, c10::IntArrayRef blocks,
                                     int64_t rotary_dim, c10::string_view table_width,
                                     c10::IntArrayRef column_axis, const OptTensor& mat_a,
                                     const OptTensor& mat_b) {
  if (require_rope_meta(q, k, cos, sin, positions, mat_a, mat_b))
    return rope_call(Mode::check, q, k, cos, sin, positions, rotation, blocks, rotary_dim,
                     table_width, column_axis, mat_a, mat_b);
  return std::make_tuple(alloc_like(q), has(k) ? alloc_like(*k) : empty_marker(q));
}

void rope_inplace_meta(const Tensor& q, const OptTensor& k, const Tensor& cos, const Tensor& sin,
                       const OptTensor& positions, c10::string_view rotation,
                       c10::IntArrayRef blocks, int64_t rotary_dim, c10::string_view table_width,
                       c10::IntArrayRef column_axis, const OptTensor& mat_a,
                       const OptTensor& mat_b) {
  if (require_rope_meta(q, k, cos, sin, positions, mat_a, mat_b))
    rope_inplace_call(Mode::check, q, k, cos, sin, positions, rotation, blocks, rotary_dim,
                      table_width, column_axis, mat_a, mat_b);
}

void rope_out_meta(const Tensor& q, const OptTensor& k, const Tensor& cos, const Tensor& sin,
                   const Tensor& q_out, const OptTensor& k_out, const OptTensor& positions,
                   c10::string_view rotation, c10::IntArrayRef blocks, int64_t rotary_dim,
                   c10::string_view table_width, c10::IntArrayRef column_axis,
                   const OptTensor& mat_a, const OptTensor& mat_b) {
  const bool inputs_checkable = require_rope_meta(q, k, cos, sin, positions, mat_a, mat_b);
  if (checkable_on_meta({{"q_out", &q_out}, {"k_out", opt(k_out)}}) && inputs_checkable)
    rope_out_call(Mode::check, q, k, cos, sin, q_out, k_out, positions, rotation, blocks,
                  rotary_dim, table_width, column_axis, mat_a, mat_b);
}

std::tuple<Tensor, Tensor> rope_from_positions_meta(const Tensor& q, const OptTensor& k,
                                                    const Tensor& positions, const Tensor& inv_freq,
                                                    c10::string_view rotation,
                                                    c10::IntArrayRef blocks, int64_t rotary_dim,
                                                    double amplitude, c10::IntArrayRef column_axis,
                                                    bool inverse) {
  if (checkable_on_meta(
          {{"q", &q}, {"k", opt(k)}, {"positions", &positions}, {"inv_freq", &inv_freq}}))
    return rope_from_positions_call(Mode::check, q, k, positions, inv_freq, rotation, blocks,
                                    rotary_dim, amplitude, column_axis, inverse);
  return std::make_tuple(alloc_like(q), has(k) ? alloc_like(*k) : empty_marker(q));
}

// The backward's gradients take the shapes of grad_q and grad_k (not checked here).
std::tuple<Tensor, Tensor> rope_from_positions_backward_meta(
    const Tensor& grad_q, const OptTensor& grad_k, const Tensor& positions, const Tensor& inv_freq,
    c10::string_view, c10::IntArrayRef, int64_t, double, c10::IntArrayRef, bool) {
  require_all_meta({{"grad_q", &grad_q},
                    {"grad_k", opt(grad_k)},
                    {"positions", &positions},
                    {"inv_freq", &inv_freq}});
  return std::make_tuple(alloc_like(grad_q),
                         has(grad_k) ? alloc_like(*grad_k) : empty_marker(grad_q));
}

std::tuple<Tensor, Tensor> cos_sin_meta(const Tensor& positions, const Tensor& inv_freq,
                                        c10::string_view, double,
                                        std::optional<at::ScalarType> dtype) {
  require_all_meta({{"positions", &positions}, {"inv_freq", &inv_freq}});
  std::vector<c10::SymInt> shape(positions.sym_sizes().begin(), positions.sym_sizes().end());
  shape.push_back(inv_freq.sym_size(0) * 2);
  const auto options = positions.options().dtype(dtype.value_or(at::kFloat));
  return std::make_tuple(at::empty_symint(shape, options), at::empty_symint(shape, options));
}

void rope_from_positions_inplace_meta(const Tensor& q, const OptTensor& k, const Tensor& positions,
                                      const Tensor& inv_freq, c10::string_view rotation,
                                      c10::IntArrayRef blocks, int64_t rotary_dim, double amplitude,
                                      c10::IntArrayRef column_axis, bool inverse) {
  if (checkable_on_meta(
          {{"q", &q}, {"k", opt(k)}, {"positions", &positions}, {"inv_freq", &inv_freq}}))
    rope_from_positions_inplace_call(Mode::check, q, k, positions, inv_freq, rotation, blocks,
                                     rotary_dim, amplitude, column_axis, inverse);
}

Tensor rope_matrix_meta(const Tensor& x, const Tensor& mat, const Tensor& sin, const Tensor& cos) {
  if (checkable_on_meta({{"x", &x}, {"mat", &mat}, {"sin", &sin}, {"cos", &cos}}))
    return rope_matrix_call(Mode::check, x, mat, sin, cos);
  return alloc_like(x);
}

void rope_matrix_inplace_meta(const Tensor& x, const Tensor& mat, const Tensor& sin,
                              const Tensor& cos) {
  if (checkable_on_meta({{"x", &x}, {"mat", &mat}, {"sin", &sin}, {"cos", &cos}}))
    rope_matrix_inplace_call(Mode::check, x, mat, sin, cos);
}

void rotary_embedding_meta(const Tensor& positions, const Tensor& query, const OptTensor& key,
                           int64_t head_size, const Tensor& cos_sin_cache, bool is_neox,
                           int64_t rope_dim_offset, bool inverse) {
  if (checkable_on_meta({{"positions", &positions},
                         {"query", &query},
                         {"key", opt(key)},
                         {"cos_sin_cache", &cos_sin_cache}}))
    rotary_embedding_call(Mode::check, positions, query, key, head_size, cos_sin_cache, is_neox,
                          rope_dim_offset, inverse);
}

void fused_qk_norm_rope_meta(const Tensor& qkv, int64_t num_heads_q, int64_t num_heads_k,
                             int64_t num_heads_v, int64_t head_dim, double eps,
                             const Tensor& q_weight, const Tensor& k_weight,
                             const Tensor& cos_sin_cache, bool is_neox, const Tensor& position_ids,
                             bool gemma_norm) {
  if (checkable_on_meta({{"qkv", &qkv},
                         {"q_weight", &q_weight},
                         {"k_weight", &k_weight},
                         {"cos_sin_cache", &cos_sin_cache},
                         {"position_ids", &position_ids}}))
    fused_qk_norm_rope_call(Mode::check, qkv, num_heads_q, num_heads_k, num_heads_v, head_dim, eps,
                            q_weight, k_weight, cos_sin_cache, is_neox, position_ids, gemma_norm);
}

void rotary_embedding_with_cache_meta(const Tensor& positions, const Tensor& query,
                                      const Tensor& key, const Tensor& value, int64_t head_size,
                                      const Tensor& cos_sin_cache, bool is_neox,
                                      const Tensor& key_cache, const Tensor& value_cache,
                                      const Tensor& slot_mapping, const OptTensor& q_weight,
                                      const OptTensor& k_weight, double eps, bool gemma_norm) {
  if (checkable_on_meta({{"positions", &positions},
                         {"query", &query},
                         {"key", &key},
                         {"value", &value},
                         {"cos_sin_cache", &cos_sin_cache},
                         {"key_cache", &key_cache},
                         {"value_cache", &value_cache},
                         {"slot_mapping", &slot_mapping},
                         {"q_weight", opt(q_weight)},
                         {"k_weight", opt(k_weight)}}))
    rotary_embedding_with_cache_call(Mode::check, positions, query, key, value, head_size,
                                     cos_sin_cache, is_neox, key_cache, value_cache, slot_mapping,
                                     q_weight, k_weight, eps, gemma_norm);
}

void rerotate_paged_meta(const Tensor& key_cache, const Tensor& cos, const Tensor& sin,
                         const Tensor& block_table, const Tensor& seq_lens, c10::string_view,
                         int64_t) {
  require_all_meta({{"key_cache", &key_cache},
                    {"cos", &cos},
                    {"sin", &sin},
                    {"block_table", &block_table},
                    {"seq_lens", &seq_lens}});
}

Tensor interleaved_meta(const Tensor& x, const Tensor& freqs_cis) {
  if (checkable_on_meta({{"x", &x}, {"freqs_cis", &freqs_cis}}))
    return interleaved_call(Mode::check, x, freqs_cis);
  return alloc_like(x);
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> rope_backward_meta(
    const Tensor& grad_q, const OptTensor& grad_k, const Tensor& q, const OptTensor& k,
    const Tensor& cos, const Tensor& sin, const OptTensor& positions, c10::string_view,
    c10::IntArrayRef, int64_t, c10::string_view, c10::IntArrayRef, const OptTensor& mat_a,
    const OptTensor& mat_b, std::array<bool, 6> mask) {
  require_all_meta({{"grad_q", &grad_q},
                    {"grad_k", opt(grad_k)},
                    {"q", &q},
                    {"k", opt(k)},
                    {"cos", &cos},
                    {"sin", &sin},
                    {"positions", opt(positions)},
                    {"mat_a", opt(mat_a)},
                    {"mat_b", opt(mat_b)}});
  auto table = [](const Tensor& t) { return at::empty_symint(t.sym_sizes(), t.options()); };
  return std::make_tuple(mask[0] ? alloc_like(grad_q) : empty_marker(q),
                         mask[1] && has(k) ? alloc_like(*grad_k) : empty_marker(q),
                         mask[2] ? table(cos) : empty_marker(q),
                         mask[3] ? table(sin) : empty_marker(q),
                         mask[4] && has(mat_a) ? table(*mat_a) : empty_marker(q),
                         mask[5] && has(mat_b) ? table(*mat_b) : empty_marker(q));
}

}  // namespace

TORCH_LIBRARY_IMPL(rome, Meta, m) {
  m.impl("rope_matrix", rope_matrix_meta);
  m.impl("rope_matrix_", rope_matrix_inplace_meta);
  m.impl("rope", rope_meta);
  m.impl("rope_", rope_inplace_meta);
  m.impl("rope_out", rope_out_meta);
  m.impl("rotary_embedding", rotary_embedding_meta);
  m.impl("rerotate_paged_", rerotate_paged_meta);
  m.impl("fused_qk_norm_rope", fused_qk_norm_rope_meta);
  m.impl("rotary_embedding_with_cache", rotary_embedding_with_cache_meta);
  m.impl("apply_rotary_emb_interleaved", interleaved_meta);
  m.impl("_rope_backward", rope_backward_meta);
  m.impl("rope_from_positions", rope_from_positions_meta);
  m.impl("cos_sin", cos_sin_meta);
  m.impl("rope_from_positions_", rope_from_positions_inplace_meta);
  m.impl("_rope_from_positions_backward", rope_from_positions_backward_meta);
}

}  // namespace rome_torch
