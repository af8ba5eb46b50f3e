// Autograd of the rome:: operators (torch::autograd::Function whose backward calls
// rome::_rope_backward) and ADInplaceOrView (version counters of the in-place ops).
#include "dispatch.hpp"

namespace rome_torch {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Edge index of each forward argument that is a defined tensor (-1 otherwise), for
// ctx->needs_input_grad.
struct Edges {
  std::vector<int64_t> index;
  int64_t next = 0;
  void add(bool is_tensor) { index.push_back(is_tensor ? next++ : -1); }
};

bool needs(AutogradContext* ctx, int64_t argument) {
  const auto edges = ctx->saved_data["edges"].toIntVector();
  return edges[argument] >= 0 && ctx->needs_input_grad(edges[argument]);
}

bool requires_grad(const OptTensor& t) {
  return has(t) && t->requires_grad();
}

Tensor or_undefined(const OptTensor& t) {
  return has(t) ? *t : Tensor();
}
OptTensor optional(const Tensor& t) {
  return t.defined() ? OptTensor(t) : std::nullopt;
}
Tensor grad_or_none(bool wanted, const Tensor& t) {
  return wanted ? t : Tensor();
}

// Inference calls (grad mode off, or nothing requiring grad) skip the autograd node entirely.
bool grad_needed(std::initializer_list<OptTensor> inputs) {
  if (!at::GradMode::is_enabled()) return false;
  for (const OptTensor& t : inputs)
    if (requires_grad(t)) return true;
  return false;
}

void no_cache_gradient(const OptTensor& positions, const Tensor& cos, const Tensor& sin) {
  if (has(positions) && at::GradMode::is_enabled() && (cos.requires_grad() || sin.requires_grad()))
    TORCH_CHECK_NOT_IMPLEMENTED(false,
                                "rome: cos: expected direct tables (or tables that do not require "
                                "grad) for a table gradient, got a cache gathered by positions "
                                "(a cache has no table gradient)");
}

struct RopeFunction : torch::autograd::Function<RopeFunction> {
  static variable_list forward(AutogradContext* ctx, const Tensor& q, const OptTensor& k,
                               const Tensor& cos, const Tensor& sin, const OptTensor& positions,
                               std::string rotation, std::vector<int64_t> blocks,
                               int64_t rotary_dim, std::string table_width,
                               std::vector<int64_t> column_axis, const OptTensor& mat_a,
                               const OptTensor& mat_b) {
    ROME_OP(op, "rome::rope", RopeSig);
    Edges e;
    for (bool t : {true, has(k), true, true, has(positions), false, false, false, false, false,
                   has(mat_a), has(mat_b)})
      e.add(t);
    ctx->saved_data["edges"] = e.index;
    ctx->saved_data["rotation"] = rotation;
    ctx->saved_data["blocks"] = blocks;
    ctx->saved_data["rotary_dim"] = rotary_dim;
    ctx->saved_data["table_width"] = table_width;
    ctx->saved_data["column_axis"] = column_axis;
    ctx->saved_data["has_k"] = has(k);
    const bool keep_x =
        cos.requires_grad() || sin.requires_grad() || requires_grad(mat_a) || requires_grad(mat_b);
    ctx->save_for_backward({keep_x ? q : Tensor(), keep_x ? or_undefined(k) : Tensor(), cos, sin,
                            or_undefined(positions), or_undefined(mat_a), or_undefined(mat_b)});
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [yq, yk] = op.call(q, k, cos, sin, positions, rotation, blocks, rotary_dim, table_width,
                            column_axis, mat_a, mat_b);
    if (!has(k)) ctx->mark_non_differentiable({yk});
    return {yq, yk};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    ROME_OP(op, "rome::_rope_backward", BackwardSig);
    const auto saved = ctx->get_saved_variables();
    const bool has_k = ctx->saved_data["has_k"].toBool();
    std::array<bool, 6> mask = {needs(ctx, 0), has_k && needs(ctx, 1), needs(ctx, 2),
                                needs(ctx, 3), needs(ctx, 10),         needs(ctx, 11)};
    const Tensor& gq = grads[0];
    const OptTensor gk = has_k ? OptTensor(grads[1]) : std::nullopt;
    const bool keep_x = mask[2] || mask[3] || mask[4] || mask[5];
    const Tensor q = keep_x ? saved[0] : gq;
    const OptTensor k = has_k ? OptTensor(keep_x ? saved[1] : grads[1]) : std::nullopt;
    const auto blocks = ctx->saved_data["blocks"].toIntVector();
    const auto column_axis = ctx->saved_data["column_axis"].toIntVector();
    const std::string rotation = ctx->saved_data["rotation"].toStringRef();
    const std::string width = ctx->saved_data["table_width"].toStringRef();
    auto [dq, dk, dcos, dsin, da, db] =
        op.call(gq, gk, q, k, saved[2], saved[3], optional(saved[4]), rotation, blocks,
                ctx->saved_data["rotary_dim"].toInt(), width, column_axis, optional(saved[5]),
                optional(saved[6]), mask);
    return {grad_or_none(mask[0], dq),
            grad_or_none(mask[1], dk),
            grad_or_none(mask[2], dcos),
            grad_or_none(mask[3], dsin),
            Tensor(),
            Tensor(),
            Tensor(),
            Tensor(),
            Tensor(),
            Tensor(),
            grad_or_none(mask[4], da),
            grad_or_none(mask[5], db)};
  }
};

std::tuple<Tensor, Tensor> rope_autograd(const Tensor& q, const OptTensor& k, const Tensor& cos,
                                         const Tensor& sin, const OptTensor& positions,
                                         c10::string_view rotation, c10::IntArrayRef blocks,
                                         int64_t rotary_dim, c10::string_view table_width,
                                         c10::IntArrayRef column_axis, const OptTensor& mat_a,
                                         const OptTensor& mat_b) {
  no_cache_gradient(positions, cos, sin);
  if (!grad_needed({q, k, cos, sin, mat_a, mat_b})) {
    ROME_OP(op, "rome::rope", RopeSig);
    at::AutoDispatchBelowADInplaceOrView guard;
    return op.call(q, k, cos, sin, positions, rotation, blocks, rotary_dim, table_width,
                   column_axis, mat_a, mat_b);
  }
  auto out =
      RopeFunction::apply(q, k, cos, sin, positions, std::string(rotation), to_vec(blocks),
                          rotary_dim, std::string(table_width), to_vec(column_axis), mat_a, mat_b);
  return std::make_tuple(out[0], out[1]);
}

struct FromPositionsFunction : torch::autograd::Function<FromPositionsFunction> {
  static variable_list forward(AutogradContext* ctx, const Tensor& q, const OptTensor& k,
                               const Tensor& positions, const Tensor& inv_freq,
                               std::string rotation, std::vector<int64_t> blocks,
                               int64_t rotary_dim, double amplitude,
                               std::vector<int64_t> column_axis, bool inverse) {
    ROME_OP(op, "rome::rope_from_positions", FromPositionsSig);
    ctx->saved_data["rotation"] = rotation;
    ctx->saved_data["blocks"] = blocks;
    ctx->saved_data["rotary_dim"] = rotary_dim;
    ctx->saved_data["amplitude"] = amplitude;
    ctx->saved_data["column_axis"] = column_axis;
    ctx->saved_data["inverse"] = inverse;
    ctx->saved_data["has_k"] = has(k);
    ctx->save_for_backward({positions, inv_freq});
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [yq, yk] = op.call(q, k, positions, inv_freq, rotation, blocks, rotary_dim, amplitude,
                            column_axis, inverse);
    if (!has(k)) ctx->mark_non_differentiable({yk});
    return {yq, yk};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    ROME_OP(op, "rome::_rope_from_positions_backward", FromPositionsSig);
    const auto saved = ctx->get_saved_variables();
    const bool has_k = ctx->saved_data["has_k"].toBool();
    const OptTensor gk = has_k ? OptTensor(grads[1]) : std::nullopt;
    auto [dq, dk] =
        op.call(grads[0], gk, saved[0], saved[1], ctx->saved_data["rotation"].toStringRef(),
                ctx->saved_data["blocks"].toIntVector(), ctx->saved_data["rotary_dim"].toInt(),
                ctx->saved_data["amplitude"].toDouble(),
                ctx->saved_data["column_axis"].toIntVector(), ctx->saved_data["inverse"].toBool());
    return {dq,       has_k ? dk : Tensor(),
            Tensor(), Tensor(),
            Tensor(), Tensor(),
            Tensor(), Tensor(),
            Tensor(), Tensor()};
  }
};

std::tuple<Tensor, Tensor> rope_from_positions_autograd(
    const Tensor& q, const OptTensor& k, const Tensor& positions, const Tensor& inv_freq,
    c10::string_view rotation, c10::IntArrayRef blocks, int64_t rotary_dim, double amplitude,
    c10::IntArrayRef column_axis, bool inverse) {
  if (requires_grad(inv_freq))
    guarded([&] {
      rome::fail(rome::Status::unsupported, "inv_freq",
                 "a tensor that does not require grad (no gradient flows to the frequencies)",
                 "requires_grad=True");
    });
  if (!grad_needed({q, k})) {
    ROME_OP(op, "rome::rope_from_positions", FromPositionsSig);
    at::AutoDispatchBelowADInplaceOrView guard;
    return op.call(q, k, positions, inv_freq, rotation, blocks, rotary_dim, amplitude, column_axis,
                   inverse);
  }
  auto out =
      FromPositionsFunction::apply(q, k, positions, inv_freq, std::string(rotation), to_vec(blocks),
                                   rotary_dim, amplitude, to_vec(column_axis), inverse);
  return std::make_tuple(out[0], out[1]);
}

struct RopeMatrixFunction : torch::autograd::Function<RopeMatrixFunction> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const Tensor& mat, const Tensor& sin,
                        const Tensor& cos) {
    ROME_OP(op, "rome::rope_matrix", RopeMatrixSig);
    const bool keep_x = mat.requires_grad() || sin.requires_grad() || cos.requires_grad();
    ctx->save_for_backward({keep_x ? x : Tensor(), mat, sin, cos});
    at::AutoDispatchBelowADInplaceOrView guard;
    return op.call(x, mat, sin, cos);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    ROME_OP(op, "rome::_rope_backward", BackwardSig);
    const auto s = ctx->get_saved_variables();
    // Edges: x 0, mat 1, sin 2, cos 3.
    std::array<bool, 6> mask = {ctx->needs_input_grad(0), false, ctx->needs_input_grad(3),
                                ctx->needs_input_grad(2), false, ctx->needs_input_grad(1)};
    const bool keep_x = mask[2] || mask[3] || mask[5];
    auto [dx, dk, dcos, dsin, da, db] =
        op.call(grads[0], std::nullopt, keep_x ? s[0] : grads[0], std::nullopt, s[3], s[2],
                std::nullopt, "dense", {}, -1, "full", {}, std::nullopt, s[1], mask);
    return {grad_or_none(mask[0], dx), grad_or_none(mask[5], db), grad_or_none(mask[3], dsin),
            grad_or_none(mask[2], dcos)};
  }
};

Tensor rope_matrix_autograd(const Tensor& x, const Tensor& mat, const Tensor& sin,
                            const Tensor& cos) {
  if (!grad_needed({x, mat, sin, cos})) {
    ROME_OP(op, "rome::rope_matrix", RopeMatrixSig);
    at::AutoDispatchBelowADInplaceOrView guard;
    return op.call(x, mat, sin, cos);
  }
  return RopeMatrixFunction::apply(x, mat, sin, cos);
}

struct InterleavedFunction : torch::autograd::Function<InterleavedFunction> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const Tensor& freqs) {
    ROME_OP(op, "rome::apply_rotary_emb_interleaved", InterleavedSig);
    ctx->save_for_backward({freqs.requires_grad() ? x : Tensor(), freqs});
    at::AutoDispatchBelowADInplaceOrView guard;
    return op.call(x, freqs);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    ROME_OP(op, "rome::_rope_backward", BackwardSig);
    const auto s = ctx->get_saved_variables();
    const Tensor& g = grads[0];
    const Tensor& freqs = s[1];
    const bool want_freqs = ctx->needs_input_grad(1);
    std::array<bool, 6> mask = {
        ctx->needs_input_grad(0), false, want_freqs, want_freqs, false, false};
    const auto [cos, sin] = interleaved_tables(freqs, g.sym_size(1), g.sym_size(2));
    auto [dx, dk, dcos, dsin, da, db] =
        op.call(g, std::nullopt, want_freqs ? s[0] : g, std::nullopt, cos, sin, std::nullopt,
                "interleave", {}, -1, "pairs", {}, std::nullopt, std::nullopt, mask);
    Tensor dfreqs;
    if (want_freqs) dfreqs = at::stack({dcos, dsin}, -1).reshape_symint(freqs.sym_sizes());
    return {grad_or_none(mask[0], dx), dfreqs};
  }
};

Tensor interleaved_autograd(const Tensor& x, const Tensor& freqs_cis) {
  if (!grad_needed({x, freqs_cis})) {
    ROME_OP(op, "rome::apply_rotary_emb_interleaved", InterleavedSig);
    at::AutoDispatchBelowADInplaceOrView guard;
    return op.call(x, freqs_cis);
  }
  return InterleavedFunction::apply(x, freqs_cis);
}

// An argument of inference_only, by reference: copying each tensor into an optional cost a
// reference count increment and decrement per argument and call.
struct NamedInput {
  NamedInput(const char* n, const Tensor& t) : name(n), tensor(t.defined() ? &t : nullptr) {}
  NamedInput(const char* n, const OptTensor& t) : name(n), tensor(has(t) ? &*t : nullptr) {}
  const char* name;
  const Tensor* tensor;
};

// In-place ops are inference only: autograd cannot record a kernel that overwrites its input.
void inference_only(const char* op, std::initializer_list<NamedInput> inputs) {
  if (!at::GradMode::is_enabled()) return;
  guarded([&] {
    for (const auto& [name, t] : inputs)
      if (t && t->requires_grad())
        rome::fail(rome::Status::unsupported, name,
                   std::string("a tensor that does not require grad (rome::") + op +
                       " is in place and inference only: use the out-of-place op for training, "
                       "or call it under torch.no_grad() / torch.inference_mode())",
                   "requires_grad=True");
  });
}

void rope_from_positions_inplace_autograd(const Tensor& q, const OptTensor& k,
                                          const Tensor& positions, const Tensor& inv_freq,
                                          c10::string_view rotation, c10::IntArrayRef blocks,
                                          int64_t rotary_dim, double amplitude,
                                          c10::IntArrayRef column_axis, bool inverse) {
  ROME_OP(op, "rome::rope_from_positions_", FromPositionsInplaceSig);
  inference_only("rope_from_positions_", {{"q", q}, {"k", k}, {"inv_freq", inv_freq}});
  at::AutoDispatchBelowAutograd guard;
  op.call(q, k, positions, inv_freq, rotation, blocks, rotary_dim, amplitude, column_axis, inverse);
}

void rope_inplace_autograd(const Tensor& q, const OptTensor& k, const Tensor& cos,
                           const Tensor& sin, const OptTensor& positions, c10::string_view rotation,
                           c10::IntArrayRef blocks, int64_t rotary_dim,
                           c10::string_view table_width, c10::IntArrayRef column_axis,
                           const OptTensor& mat_a, const OptTensor& mat_b) {
  ROME_OP(op, "rome::rope_", RopeInplaceSig);
  inference_only(
      "rope_",
      {{"q", q}, {"k", k}, {"cos", cos}, {"sin", sin}, {"mat_a", mat_a}, {"mat_b", mat_b}});
  at::AutoDispatchBelowAutograd guard;
  op.call(q, k, cos, sin, positions, rotation, blocks, rotary_dim, table_width, column_axis, mat_a,
          mat_b);
}

void rope_out_autograd(const Tensor& q, const OptTensor& k, const Tensor& cos, const Tensor& sin,
                       const Tensor& q_out, const OptTensor& k_out, const OptTensor& positions,
                       c10::string_view rotation, c10::IntArrayRef blocks, int64_t rotary_dim,
                       c10::string_view table_width, c10::IntArrayRef column_axis,
                       const OptTensor& mat_a, const OptTensor& mat_b) {
  ROME_OP(op, "rome::rope_out", RopeOutSig);
  inference_only("rope_out", {{"q", q},
                              {"k", k},
                              {"cos", cos},
                              {"sin", sin},
                              {"q_out", q_out},
                              {"k_out", k_out},
                              {"mat_a", mat_a},
                              {"mat_b", mat_b}});
  at::AutoDispatchBelowAutograd guard;
  op.call(q, k, cos, sin, q_out, k_out, positions, rotation, blocks, rotary_dim, table_width,
          column_axis, mat_a, mat_b);
}

void rope_matrix_inplace_autograd(const Tensor& x, const Tensor& mat, const Tensor& sin,
                                  const Tensor& cos) {
  ROME_OP(op, "rome::rope_matrix_", RopeMatrixInplaceSig);
  inference_only("rope_matrix_", {{"x", x}, {"mat", mat}, {"sin", sin}, {"cos", cos}});
  at::AutoDispatchBelowAutograd guard;
  op.call(x, mat, sin, cos);
}

void bump(const OptTensor& t);

// vLLM's op runs once per layer and decode step: the backend kernel is reached in one hop
// (redispatch past ADInplaceOrView) and the version counters are bumped here, as
// rotary_embedding_view does, rather than through a second dispatch.
void rotary_embedding_autograd(c10::DispatchKeySet keys, const Tensor& positions,
                               const Tensor& query, const OptTensor& key, int64_t head_size,
                               const Tensor& cos_sin_cache, bool is_neox, int64_t rope_dim_offset,
                               bool inverse) {
  ROME_OP(op, "rome::rotary_embedding", RotaryEmbeddingSig);
  inference_only("rotary_embedding",
                 {{"query", query}, {"key", key}, {"cos_sin_cache", cos_sin_cache}});
  op.redispatch(keys & c10::after_ADInplaceOrView_keyset, positions, query, key, head_size,
                cos_sin_cache, is_neox, rope_dim_offset, inverse);
  bump(query);
  bump(key);
}

void fused_qk_norm_rope_autograd(const Tensor& qkv, int64_t hq, int64_t hk, int64_t hv,
                                 int64_t head_dim, double eps, const Tensor& q_weight,
                                 const Tensor& k_weight, const Tensor& cos_sin_cache, bool is_neox,
                                 const Tensor& position_ids, bool gemma_norm) {
  ROME_OP(op, "rome::fused_qk_norm_rope", FusedQkNormRopeSig);
  inference_only("fused_qk_norm_rope", {{"qkv", qkv},
                                        {"q_weight", q_weight},
                                        {"k_weight", k_weight},
                                        {"cos_sin_cache", cos_sin_cache}});
  at::AutoDispatchBelowAutograd guard;
  op.call(qkv, hq, hk, hv, head_dim, eps, q_weight, k_weight, cos_sin_cache, is_neox, position_ids,
          gemma_norm);
}

void rotary_embedding_with_cache_autograd(const Tensor& positions, const Tensor& query,
                                          const Tensor& key, const Tensor& value, int64_t head_size,
                                          const Tensor& cos_sin_cache, bool is_neox,
                                          const Tensor& key_cache, const Tensor& value_cache,
                                          const Tensor& slot_mapping, const OptTensor& q_weight,
                                          const OptTensor& k_weight, double eps, bool gemma_norm) {
  ROME_OP(op, "rome::rotary_embedding_with_cache", RopeWithCacheSig);
  inference_only("rotary_embedding_with_cache", {{"query", query},
                                                 {"key", key},
                                                 {"value", value},
                                                 {"cos_sin_cache", cos_sin_cache},
                                                 {"q_weight", q_weight},
                                                 {"k_weight", k_weight}});
  at::AutoDispatchBelowAutograd guard;
  op.call(positions, query, key, value, head_size, cos_sin_cache, is_neox, key_cache, value_cache,
          slot_mapping, q_weight, k_weight, eps, gemma_norm);
}

void rerotate_paged_autograd(const Tensor& key_cache, const Tensor& cos, const Tensor& sin,
                             const Tensor& block_table, const Tensor& seq_lens,
                             c10::string_view rotation, int64_t rope_dim_offset) {
  ROME_OP(op, "rome::rerotate_paged_", RerotatePagedSig);
  inference_only("rerotate_paged_", {{"key_cache", key_cache}, {"cos", cos}, {"sin", sin}});
  at::AutoDispatchBelowAutograd guard;
  op.call(key_cache, cos, sin, block_table, seq_lens, rotation, rope_dim_offset);
}

// ADInplaceOrView: bump the version counters of mutated tensors.
void bump(const OptTensor& t) {
  if (has(t)) torch::autograd::impl::bump_version(*t);
}

void rope_inplace_view(const Tensor& q, const OptTensor& k, const Tensor& cos, const Tensor& sin,
                       const OptTensor& positions, c10::string_view rotation,
                       c10::IntArrayRef blocks, int64_t rotary_dim, c10::string_view table_width,
                       c10::IntArrayRef column_axis, const OptTensor& mat_a,
                       const OptTensor& mat_b) {
  ROME_OP(op, "rome::rope_", RopeInplaceSig);
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    op.call(q, k, cos, sin, positions, rotation, blocks, rotary_dim, table_width, column_axis,
            mat_a, mat_b);
  }
  bump(q);
  bump(k);
}

void rope_out_view(const Tensor& q, const OptTensor& k, const Tensor& cos, const Tensor& sin,
                   const Tensor& q_out, const OptTensor& k_out, const OptTensor& positions,
                   c10::string_view rotation, c10::IntArrayRef blocks, int64_t rotary_dim,
                   c10::string_view table_width, c10::IntArrayRef column_axis,
                   const OptTensor& mat_a, const OptTensor& mat_b) {
  ROME_OP(op, "rome::rope_out", RopeOutSig);
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    op.call(q, k, cos, sin, q_out, k_out, positions, rotation, blocks, rotary_dim, table_width,
            column_axis, mat_a, mat_b);
  }
  bump(q_out);
  bump(k_out);
}

void rope_matrix_inplace_view(const Tensor& x, const Tensor& mat, const Tensor& sin,
                              const Tensor& cos) {
  ROME_OP(op, "rome::rope_matrix_", RopeMatrixInplaceSig);
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    op.call(x, mat, sin, cos);
  }
  bump(x);
}

void rotary_embedding_view(const Tensor& positions, const Tensor& query, const OptTensor& key,
                           int64_t head_size, const Tensor& cos_sin_cache, bool is_neox,
                           int64_t rope_dim_offset, bool inverse) {
  ROME_OP(op, "rome::rotary_embedding", RotaryEmbeddingSig);
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    op.call(positions, query, key, head_size, cos_sin_cache, is_neox, rope_dim_offset, inverse);
  }
  bump(query);
  bump(key);
}

void fused_qk_norm_rope_view(const Tensor& qkv, int64_t hq, int64_t hk, int64_t hv,
                             int64_t head_dim, double eps, const Tensor& q_weight,
                             const Tensor& k_weight, const Tensor& cos_sin_cache, bool is_neox,
                             const Tensor& position_ids, bool gemma_norm) {
  ROME_OP(op, "rome::fused_qk_norm_rope", FusedQkNormRopeSig);
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    op.call(qkv, hq, hk, hv, head_dim, eps, q_weight, k_weight, cos_sin_cache, is_neox,
            position_ids, gemma_norm);
  }
  bump(qkv);
}

void rotary_embedding_with_cache_view(const Tensor& positions, const Tensor& query,
                                      const Tensor& key, const Tensor& value, int64_t head_size,
                                      const Tensor& cos_sin_cache, bool is_neox,
                                      const Tensor& key_cache, const Tensor& value_cache,
                                      const Tensor& slot_mapping, const OptTensor& q_weight,
                                      const OptTensor& k_weight, double eps, bool gemma_norm) {
  ROME_OP(op, "rome::rotary_embedding_with_cache", RopeWithCacheSig);
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    op.call(positions, query, key, value, head_size, cos_sin_cache, is_neox, key_cache, value_cache,
            slot_mapping, q_weight, k_weight, eps, gemma_norm);
  }
  bump(query);
  bump(key);
  bump(key_cache);
  bump(value_cache);
}

void rope_from_positions_inplace_view(const Tensor& q, const OptTensor& k, const Tensor& positions,
                                      const Tensor& inv_freq, c10::string_view rotation,
                                      c10::IntArrayRef blocks, int64_t rotary_dim, double amplitude,
                                      c10::IntArrayRef column_axis, bool inverse) {
  ROME_OP(op, "rome::rope_from_positions_", FromPositionsInplaceSig);
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    op.call(q, k, positions, inv_freq, rotation, blocks, rotary_dim, amplitude, column_axis,
            inverse);
  }
  bump(q);
  bump(k);
}

void rerotate_paged_view(const Tensor& key_cache, const Tensor& cos, const Tensor& sin,
                         const Tensor& block_table, const Tensor& seq_lens,
                         c10::string_view rotation, int64_t rope_dim_offset) {
  ROME_OP(op, "rome::rerotate_paged_", RerotatePagedSig);
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    op.call(key_cache, cos, sin, block_table, seq_lens, rotation, rope_dim_offset);
  }
  bump(key_cache);
}

}  // namespace

TORCH_LIBRARY_IMPL(rome, Autograd, m) {
  m.impl("rope_matrix", rope_matrix_autograd);
  m.impl("rope_matrix_", rope_matrix_inplace_autograd);
  m.impl("rope", rope_autograd);
  m.impl("rope_", rope_inplace_autograd);
  m.impl("rope_out", rope_out_autograd);
  m.impl("rotary_embedding", rotary_embedding_autograd);
  m.impl("rerotate_paged_", rerotate_paged_autograd);
  m.impl("fused_qk_norm_rope", fused_qk_norm_rope_autograd);
  m.impl("rotary_embedding_with_cache", rotary_embedding_with_cache_autograd);
  m.impl("apply_rotary_emb_interleaved", interleaved_autograd);
  m.impl("rope_from_positions", rope_from_positions_autograd);
  m.impl("rope_from_positions_", rope_from_positions_inplace_autograd);
}

TORCH_LIBRARY_IMPL(rome, ADInplaceOrView, m) {
  m.impl("rope_matrix_", rope_matrix_inplace_view);
  m.impl("rope_", rope_inplace_view);
  m.impl("rope_out", rope_out_view);
  m.impl("rotary_embedding", rotary_embedding_view);
  m.impl("rope_from_positions_", rope_from_positions_inplace_view);
  m.impl("rerotate_paged_", rerotate_paged_view);
  m.impl("fused_qk_norm_rope", fused_qk_norm_rope_view);
  m.impl("rotary_embedding_with_cache", rotary_embedding_with_cache_view);
}

}  // namespace rome_torch
