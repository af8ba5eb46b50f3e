// The rome:: operators: schemas, CPU kernels (thin calls into the core), Meta kernels (shapes
// only), Autograd (torch::autograd::Function whose backward calls rome::_rope_backward) and
// ADInplaceOrView (version counters of the in-place ops).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/SymInt.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/library.h>

#include <array>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "common.hpp"

namespace rome_torch {

namespace {

template <typename F>
decltype(auto) guarded(F&& f) {
  try {
    return f();
  } catch (const rome::Error& e) {
    rethrow(e);
  }
}

// The core names its operands q, q_out, k, k_out, cos, sin; an op whose arguments are called
// otherwise (x, query, key, cos_sin_cache) or that passes q as its own output (in place) maps
// the names back, so every message names an argument of the op the user called.
using Renames = std::initializer_list<std::pair<const char*, const char*>>;

template <typename F>
decltype(auto) guarded(Renames renames, F&& f) {
  try {
    return f();
  } catch (const rome::Error& e) {
    const std::string& arg = e.argument();
    const std::string base = arg.substr(0, arg.find('.')), suffix = arg.substr(base.size());
    for (const auto& [from, to] : renames) {
      const bool whole = arg == from;  // "tables.frequencies" -> "inv_freq"
      if (!whole && base != from) continue;
      const std::string old_prefix = "rome: " + arg,
                        renamed = std::string(to) + (whole ? std::string() : suffix);
      std::string message = e.what();
      if (message.rfind(old_prefix, 0) == 0)
        message = "rome: " + renamed + message.substr(old_prefix.size());
      rethrow(rome::Error(e.status(), renamed, message));
    }
    rethrow(e);
  }
}

bool has(const OptTensor& t) {
  return t.has_value() && t->defined();
}

std::vector<int64_t> to_vec(c10::IntArrayRef a) {
  return std::vector<int64_t>(a.begin(), a.end());
}

Tensor empty_marker(const Tensor& like) {
  return at::empty({0}, like.options());
}

// Every operand goes through the core with a rank of at least 2; name it in errors first.
int64_t head_dim_of(const Tensor& x, const char* name) {
  if (x.dim() < 2 || x.dim() > rome::kMaxRank)
    rome::fail(rome::Status::invalid_argument, name, "rank 2 to 5 with the head dimension last",
               "rank " + std::to_string(x.dim()) + " " + shape_of(x));
  return x.size(-1);
}

// ----------------------------------------------------------------------------------------------
// Typed handles (for redispatch from Autograd / ADInplaceOrView and for backward).

using RopeSig = std::tuple<Tensor, Tensor>(const Tensor&, const OptTensor&, const Tensor&,
                                           const Tensor&, const OptTensor&, c10::string_view,
                                           c10::IntArrayRef, int64_t, c10::string_view,
                                           c10::IntArrayRef, const OptTensor&, const OptTensor&);
using RopeInplaceSig = void(const Tensor&, const OptTensor&, const Tensor&, const Tensor&,
                            const OptTensor&, c10::string_view, c10::IntArrayRef, int64_t,
                            c10::string_view, c10::IntArrayRef, const OptTensor&, const OptTensor&);
using RopeOutSig = void(const Tensor&, const OptTensor&, const Tensor&, const Tensor&,
                        const Tensor&, const OptTensor&, const OptTensor&, c10::string_view,
                        c10::IntArrayRef, int64_t, c10::string_view, c10::IntArrayRef,
                        const OptTensor&, const OptTensor&);
using RopeMatrixSig = Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&);
using RopeMatrixInplaceSig = void(const Tensor&, const Tensor&, const Tensor&, const Tensor&);
using RotaryEmbeddingSig = void(const Tensor&, const Tensor&, const OptTensor&, int64_t,
                                const Tensor&, bool, int64_t, bool);
using FusedQkNormRopeSig = void(const Tensor&, int64_t, int64_t, int64_t, int64_t, double,
                                const Tensor&, const Tensor&, const Tensor&, bool, const Tensor&,
                                bool);
using RopeWithCacheSig = void(const Tensor&, const Tensor&, const Tensor&, const Tensor&, int64_t,
                              const Tensor&, bool, const Tensor&, const Tensor&, const Tensor&,
                              const OptTensor&, const OptTensor&, double, bool);
using RerotatePagedSig = void(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                              const Tensor&, c10::string_view, int64_t);
using InterleavedSig = Tensor(const Tensor&, const Tensor&);
using FromPositionsSig = std::tuple<Tensor, Tensor>(const Tensor&, const OptTensor&, const Tensor&,
                                                    const Tensor&, c10::string_view,
                                                    c10::IntArrayRef, int64_t, double,
                                                    c10::IntArrayRef, bool);
using FromPositionsInplaceSig = void(const Tensor&, const OptTensor&, const Tensor&, const Tensor&,
                                     c10::string_view, c10::IntArrayRef, int64_t, double,
                                     c10::IntArrayRef, bool);
using BackwardSig = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor>(
    const Tensor&, const OptTensor&, const Tensor&, const OptTensor&, const Tensor&, const Tensor&,
    const OptTensor&, c10::string_view, c10::IntArrayRef, int64_t, c10::string_view,
    c10::IntArrayRef, const OptTensor&, const OptTensor&, std::array<bool, 6>);

template <typename Sig>
c10::TypedOperatorHandle<Sig> handle(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}
#define ROME_OP(var, name, Sig) static const auto var = handle<Sig>(name)

// ----------------------------------------------------------------------------------------------
// CPU kernels

struct Prepared {
  std::optional<rome::Rotation> rotation;
  PreparedTables tables;
};

Prepared prepare(const Tensor& q, const Tensor& cos, const Tensor& sin, const OptTensor& positions,
                 c10::string_view rotation, c10::IntArrayRef blocks, int64_t rotary_dim,
                 c10::string_view table_width, c10::IntArrayRef column_axis, const OptTensor& mat_a,
                 const OptTensor& mat_b, const char* q_name = "q") {
  Prepared p;
  const int64_t hd = head_dim_of(q, q_name);
  p.rotation =
      build_rotation(std::string(rotation), to_vec(blocks), rotary_dim, hd, mat_a, mat_b, "mat_b");
  p.tables =
      prepare_tables(cos, sin, positions, std::string(table_width), to_vec(column_axis), q.sizes());
  return p;
}

// rope_forward of q (and k) into fresh outputs: (q_out, k_out), k_out empty without k.
std::tuple<Tensor, Tensor> forward_out_of_place(const rome::Rotation& rotation,
                                                const rome::Tables& tables, const Tensor& q,
                                                const OptTensor& k) {
  const Tensor qin = readable(q);
  rome::Operand oq{const_view(qin, "q", false), {}};
  const Tensor qout = alloc_like(q);
  oq.out = mutable_view(qout, "q_out");
  Tensor kin, kout;
  rome::Operand ok;
  if (has(k)) {
    head_dim_of(*k, "k");
    kin = readable(*k);
    kout = alloc_like(*k);
    ok = {const_view(kin, "k", false), mutable_view(kout, "k_out")};
  }
  rome::rope_forward(rotation, tables, oq, has(k) ? &ok : nullptr, exec_options());
  return std::make_tuple(qout, has(k) ? kout : empty_marker(q));
}

// rope_forward of q (and k) in place.
void forward_in_place(const rome::Rotation& rotation, const rome::Tables& tables, const Tensor& q,
                      const OptTensor& k) {
  const rome::TensorView qv = mutable_view(q, "q");
  const rome::Operand oq{rome::as_const(qv), qv};
  rome::Operand ok;
  if (has(k)) {
    head_dim_of(*k, "k");
    const rome::TensorView kv = mutable_view(*k, "k");
    ok = {rome::as_const(kv), kv};
  }
  rome::rope_forward(rotation, tables, oq, has(k) ? &ok : nullptr, exec_options());
}

std::tuple<Tensor, Tensor> rope_cpu(const Tensor& q, const OptTensor& k, const Tensor& cos,
                                    const Tensor& sin, const OptTensor& positions,
                                    c10::string_view rotation, c10::IntArrayRef blocks,
                                    int64_t rotary_dim, c10::string_view table_width,
                                    c10::IntArrayRef column_axis, const OptTensor& mat_a,
                                    const OptTensor& mat_b) {
  return guarded({{"dim", "rotary_dim"}, {"head_dim", "q"}}, [&] {
    const Prepared p = prepare(q, cos, sin, positions, rotation, blocks, rotary_dim, table_width,
                               column_axis, mat_a, mat_b);
    return forward_out_of_place(*p.rotation, p.tables.tables, q, k);
  });
}

void rope_inplace_cpu(const Tensor& q, const OptTensor& k, const Tensor& cos, const Tensor& sin,
                      const OptTensor& positions, c10::string_view rotation,
                      c10::IntArrayRef blocks, int64_t rotary_dim, c10::string_view table_width,
                      c10::IntArrayRef column_axis, const OptTensor& mat_a,
                      const OptTensor& mat_b) {
  guarded({{"q_out", "q"}, {"k_out", "k"}, {"dim", "rotary_dim"}, {"head_dim", "q"}}, [&] {
    const Prepared p = prepare(q, cos, sin, positions, rotation, blocks, rotary_dim, table_width,
                               column_axis, mat_a, mat_b);
    forward_in_place(*p.rotation, p.tables.tables, q, k);
  });
}

// Out of place into the caller's tensors: engines keep their buffers, no allocation per call.
void rope_out_cpu(const Tensor& q, const OptTensor& k, const Tensor& cos, const Tensor& sin,
                  const Tensor& q_out, const OptTensor& k_out, const OptTensor& positions,
                  c10::string_view rotation, c10::IntArrayRef blocks, int64_t rotary_dim,
                  c10::string_view table_width, c10::IntArrayRef column_axis,
                  const OptTensor& mat_a, const OptTensor& mat_b) {
  guarded({{"dim", "rotary_dim"}, {"head_dim", "q"}}, [&] {
    const Prepared p = prepare(q, cos, sin, positions, rotation, blocks, rotary_dim, table_width,
                               column_axis, mat_a, mat_b);
    if (has(k) != has(k_out))
      rome::fail(rome::Status::invalid_argument, "k_out",
                 has(k) ? "a tensor (k is given)" : "None (k is None)",
                 has(k_out) ? shape_of(*k_out) : std::string("None"));
    auto require_like = [](const Tensor& out, const Tensor& in, const char* name) {
      if (out.scalar_type() != in.scalar_type())
        rome::fail(rome::Status::invalid_argument, name,
                   std::string("dtype ") + c10::toString(in.scalar_type()) + " (the input's)",
                   c10::toString(out.scalar_type()));
    };
    require_like(q_out, q, "q_out");
    const Tensor qin = readable(q);
    rome::Operand oq{const_view(qin, "q", false), mutable_view(q_out, "q_out")};
    Tensor kin;
    rome::Operand ok;
    if (has(k)) {
      head_dim_of(*k, "k");
      require_like(*k_out, *k, "k_out");
      kin = readable(*k);
      ok = {const_view(kin, "k", false), mutable_view(*k_out, "k_out")};
    }
    rome::rope_forward(*p.rotation, p.tables.tables, oq, has(k) ? &ok : nullptr, exec_options());
  });
}

Prepared prepare_matrix(const Tensor& x, const Tensor& mat, const Tensor& sin, const Tensor& cos) {
  Prepared p;
  const int64_t hd = head_dim_of(x, "x");
  p.rotation = build_rotation("dense", {}, -1, hd, std::nullopt, mat, "mat");
  p.tables = prepare_tables(cos, sin, std::nullopt, "full", {}, x.sizes());
  return p;
}

Tensor rope_matrix_cpu(const Tensor& x, const Tensor& mat, const Tensor& sin, const Tensor& cos) {
  return guarded({{"q", "x"}, {"dim", "x"}, {"head_dim", "x"}}, [&] {
    const Prepared p = prepare_matrix(x, mat, sin, cos);
    const Tensor xin = readable(x);
    rome::Operand op{const_view(xin, "x", false), {}};
    const Tensor out = alloc_like(x);
    op.out = mutable_view(out, "out");
    rome::rope_forward(*p.rotation, p.tables.tables, op, nullptr, exec_options());
    return out;
  });
}

void rope_matrix_inplace_cpu(const Tensor& x, const Tensor& mat, const Tensor& sin,
                             const Tensor& cos) {
  guarded({{"q", "x"}, {"q_out", "x"}, {"dim", "x"}, {"head_dim", "x"}}, [&] {
    const Prepared p = prepare_matrix(x, mat, sin, cos);
    const rome::TensorView v = mutable_view(x, "x");
    rome::rope_forward(*p.rotation, p.tables.tables, rome::Operand{rome::as_const(v), v}, nullptr,
                       exec_options());
  });
}

// vLLM: query/key [T, H*D], [T, H, D] or [B, S, H*D]; the token axes are positions' axes.
rome::TensorView vllm_view(const Tensor& t, const char* name, int64_t token_axes,
                           int64_t head_size) {
  rome::TensorView v = mutable_view(t, name);
  const int64_t extra = t.dim() - token_axes;
  const std::string expected = "[T, H*" + std::to_string(head_size) + "], [T, H, " +
                               std::to_string(head_size) + "] or [B, S, H*" +
                               std::to_string(head_size) + "] matching positions' axes";
  if (extra == 2) {
    if (t.size(-1) != head_size)
      rome::fail(rome::Status::invalid_argument, name, expected, shape_of(t));
    return v;
  }
  if (extra != 1 || token_axes + 2 > rome::kMaxRank)
    rome::fail(rome::Status::invalid_argument, name, expected, shape_of(t));
  const int64_t last = t.size(-1);
  if (last % head_size != 0)
    rome::fail(rome::Status::invalid_argument, name,
               "a last axis that is a multiple of head_size " + std::to_string(head_size),
               shape_of(t));
  const int64_t lane = t.stride(-1);
  v.rank = static_cast<int>(t.dim() + 1);
  v.shape[v.rank - 2] = last / head_size;
  v.strides[v.rank - 2] = head_size * lane;
  v.shape[v.rank - 1] = head_size;
  v.strides[v.rank - 1] = lane;
  return v;
}

// vLLM's cos_sin_cache [max_position, rotary_dim] as half-width cos and sin views (no narrow():
// two tensor allocations per decode step) + positions [T] / [B, S] as [T, 1] / [B, S, 1] (one
// position for every head). rotary_dim must be even and at most max_rotary.
rome::Tables vllm_tables(const Tensor& positions, const Tensor& cos_sin_cache, bool is_neox,
                         int64_t max_rotary, const std::string& max_rotary_what) {
  if (positions.dim() < 1 || positions.dim() > 2)
    rome::fail(rome::Status::invalid_argument, "positions", "[T] or [B, S]", shape_of(positions));
  if (cos_sin_cache.dim() != 2 || cos_sin_cache.size(1) % 2 != 0 || cos_sin_cache.size(1) == 0 ||
      cos_sin_cache.size(1) > max_rotary)
    rome::fail(rome::Status::invalid_argument, "cos_sin_cache",
               "[max_position, rotary_dim] with an even rotary_dim of at most " +
                   std::to_string(max_rotary) + " (" + max_rotary_what + ")",
               shape_of(cos_sin_cache));
  const int64_t rd = cos_sin_cache.size(1), token_axes = positions.dim();
  rome::Tables tables;
  tables.positions = const_view(positions, "positions", true);
  tables.positions.rank = static_cast<int>(token_axes + 1);
  tables.positions.shape[token_axes] = 1;
  tables.positions.strides[token_axes] = 0;
  tables.cos = const_view(cos_sin_cache, "cos_sin_cache", false);
  tables.cos.shape[1] = rd / 2;
  tables.sin = tables.cos;
  tables.sin.data = static_cast<const char*>(tables.cos.data) +
                    (rd / 2) * cos_sin_cache.stride(1) * cos_sin_cache.element_size();
  tables.width = is_neox ? rome::TableWidth::halves : rome::TableWidth::pairs;
  return tables;
}

rome::Rotation vllm_rotation(int64_t rd, int64_t head_size, bool is_neox, int64_t offset = 0) {
  return build_rotation(is_neox ? "half" : "interleave", {}, rd, head_size, std::nullopt,
                        std::nullopt, "mat_b", offset);
}

void rotary_embedding_cpu(const Tensor& positions, const Tensor& query, const OptTensor& key,
                          int64_t head_size, const Tensor& cos_sin_cache, bool is_neox,
                          int64_t rope_dim_offset, bool inverse) {
  guarded({{"q", "query"},
           {"q_out", "query"},
           {"k", "key"},
           {"k_out", "key"},
           {"cos", "cos_sin_cache"},
           {"sin", "cos_sin_cache"},
           {"head_dim", "head_size"}},
          [&] {
            if (head_size <= 0)
              rome::fail(rome::Status::invalid_argument, "head_size", "a positive size",
                         std::to_string(head_size));
            if (rope_dim_offset < 0 || rope_dim_offset > head_size)
              rome::fail(rome::Status::invalid_argument, "rope_dim_offset",
                         "an offset in [0, head_size " + std::to_string(head_size) + "]",
                         std::to_string(rope_dim_offset));
            rome::Tables tables =
                vllm_tables(positions, cos_sin_cache, is_neox, head_size - rope_dim_offset,
                            "head_size - rope_dim_offset");
            tables.inverse = inverse;
            const rome::Rotation rotation =
                vllm_rotation(cos_sin_cache.size(1), head_size, is_neox, rope_dim_offset);
            const int64_t token_axes = positions.dim();
            const rome::TensorView qv = vllm_view(query, "query", token_axes, head_size);
            const rome::Operand oq{rome::as_const(qv), qv};
            rome::Operand ok;
            if (has(key)) {
              const rome::TensorView kv = vllm_view(*key, "key", token_axes, head_size);
              ok = {rome::as_const(kv), kv};
            }
            rome::rope_forward(rotation, tables, oq, has(key) ? &ok : nullptr, exec_options());
          });
}

void fused_qk_norm_rope_cpu(const Tensor& qkv, int64_t num_heads_q, int64_t num_heads_k,
                            int64_t num_heads_v, int64_t head_dim, double eps,
                            const Tensor& q_weight, const Tensor& k_weight,
                            const Tensor& cos_sin_cache, bool is_neox, const Tensor& position_ids,
                            bool gemma_norm) {
  guarded(
      {{"q", "qkv"},
       {"k", "qkv"},
       {"q_out", "qkv"},
       {"k_out", "qkv"},
       {"cos", "cos_sin_cache"},
       {"sin", "cos_sin_cache"},
       {"positions", "position_ids"},
       {"head_dim", "head_dim"}},
      [&] {
        if (head_dim <= 0 || num_heads_q <= 0 || num_heads_k <= 0 || num_heads_v < 0)
          rome::fail(rome::Status::invalid_argument, "head_dim / num_heads",
                     "positive head_dim, num_heads_q, num_heads_k and num_heads_v >= 0",
                     std::to_string(head_dim) + ", " + std::to_string(num_heads_q) + ", " +
                         std::to_string(num_heads_k) + ", " + std::to_string(num_heads_v));
        const int64_t width = (num_heads_q + num_heads_k + num_heads_v) * head_dim;
        if (qkv.dim() != 2 || qkv.size(1) != width)
          rome::fail(rome::Status::invalid_argument, "qkv",
                     "[T, (Hq + Hk + Hv) * head_dim] = [T, " + std::to_string(width) + "]",
                     shape_of(qkv));
        if (position_ids.dim() != 1)
          rome::fail(rome::Status::invalid_argument, "position_ids", "[T]", shape_of(position_ids));
        const rome::Tables tables =
            vllm_tables(position_ids, cos_sin_cache, is_neox, head_dim, "head_dim");
        const rome::Rotation rotation = vllm_rotation(cos_sin_cache.size(1), head_dim, is_neox);
        const rome::TensorView whole = mutable_view(qkv, "qkv");
        auto heads = [&](int64_t first, int64_t count) {
          rome::TensorView v = whole;
          v.data =
              static_cast<char*>(v.data) + first * head_dim * whole.strides[1] * qkv.element_size();
          v.rank = 3;
          v.shape[1] = count;
          v.strides[1] = head_dim * whole.strides[1];
          v.shape[2] = head_dim;
          v.strides[2] = whole.strides[1];
          return v;
        };
        rome::QkNorm norm;
        norm.q_weight = const_view(q_weight, "q_weight", false);
        norm.k_weight = const_view(k_weight, "k_weight", false);
        norm.eps = float(eps);
        norm.unit_offset = gemma_norm;
        rome::qk_norm_rope(rotation, tables, norm, heads(0, num_heads_q),
                           heads(num_heads_q, num_heads_k), exec_options());
      });
}

void rotary_embedding_with_cache_cpu(const Tensor& positions, const Tensor& query,
                                     const Tensor& key, const Tensor& value, int64_t head_size,
                                     const Tensor& cos_sin_cache, bool is_neox,
                                     const Tensor& key_cache, const Tensor& value_cache,
                                     const Tensor& slot_mapping, const OptTensor& q_weight,
                                     const OptTensor& k_weight, double eps, bool gemma_norm) {
  guarded({{"q", "query"},
           {"q_out", "query"},
           {"k", "key"},
           {"k_out", "key"},
           {"cos", "cos_sin_cache"},
           {"sin", "cos_sin_cache"},
           {"head_dim", "head_size"}},
          [&] {
            if (head_size <= 0)
              rome::fail(rome::Status::invalid_argument, "head_size", "a positive size",
                         std::to_string(head_size));
            if (positions.dim() != 1)
              rome::fail(rome::Status::invalid_argument, "positions", "[T]", shape_of(positions));
            const rome::Tables tables =
                vllm_tables(positions, cos_sin_cache, is_neox, head_size, "head_size");
            const rome::Rotation rotation =
                vllm_rotation(cos_sin_cache.size(1), head_size, is_neox);
            const rome::TensorView q = vllm_view(query, "query", 1, head_size);
            const rome::TensorView k = vllm_view(key, "key", 1, head_size);
            const rome::TensorView v = vllm_view(value, "value", 1, head_size);
            if (has(q_weight) != has(k_weight))
              rome::fail(rome::Status::invalid_argument, has(q_weight) ? "k_weight" : "q_weight",
                         "a tensor when the other weight is given (QK-norm)", "None");
            rome::PagedKvWrite write;
            write.value = rome::as_const(v);
            write.key_cache = mutable_view(key_cache, "key_cache");
            write.value_cache = mutable_view(value_cache, "value_cache");
            write.slot_mapping = const_view(slot_mapping, "slot_mapping", true);
            rome::QkNorm norm;
            if (has(q_weight)) {
              norm.q_weight = const_view(*q_weight, "q_weight", false);
              norm.k_weight = const_view(*k_weight, "k_weight", false);
              norm.eps = float(eps);
              norm.unit_offset = gemma_norm;
            }
            rome::rope_and_cache_kv(rotation, tables, q, k, write, has(q_weight) ? &norm : nullptr,
                                    exec_options());
          });
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

// ExecuTorch: x [B, N, C], freqs_cis with N*C elements, (cos, sin) pairs innermost.
std::pair<Tensor, Tensor> interleaved_tables(const Tensor& freqs, c10::SymInt n, c10::SymInt c) {
  const Tensor pairs = freqs.reshape_symint({n, c / 2, 2});
  return {pairs.select(2, 0), pairs.select(2, 1)};
}

void check_interleaved(const Tensor& x, const Tensor& freqs) {
  if (x.dim() != 3)
    rome::fail(rome::Status::invalid_argument, "x", "[B, N, C] (rank 3)",
               "rank " + std::to_string(x.dim()) + " " + shape_of(x));
  if (x.size(2) % 2 != 0)
    rome::fail(rome::Status::invalid_argument, "x", "an even last axis C", shape_of(x));
  if (freqs.numel() != x.size(1) * x.size(2))
    rome::fail(rome::Status::invalid_argument, "freqs_cis",
               std::to_string(x.size(1) * x.size(2)) + " elements (N*C: [N, C/2, 2] cos/sin pairs)",
               shape_of(freqs));
}

Tensor interleaved_cpu(const Tensor& x, const Tensor& freqs_cis) {
  return guarded({{"q", "x"}, {"cos", "freqs_cis"}, {"sin", "freqs_cis"}, {"dim", "x"}}, [&] {
    check_interleaved(x, freqs_cis);
    const rome::Rotation rotation =
        build_rotation("interleave", {}, -1, x.size(2), std::nullopt, std::nullopt, "mat_b");
    const auto [cos, sin] = interleaved_tables(freqs_cis, x.size(1), x.size(2));
    rome::Tables tables;
    tables.cos = const_view(cos, "freqs_cis", false);
    tables.sin = const_view(sin, "freqs_cis", false);
    tables.width = rome::TableWidth::pairs;
    const Tensor xin = readable(x);
    rome::Operand op{const_view(xin, "x", false), {}};
    const Tensor out = alloc_like(x);
    op.out = mutable_view(out, "out");
    rome::rope_forward(rotation, tables, op, nullptr, exec_options());
    return out;
  });
}

// Gradients of the general op for q (and k), summed over both for the shared tables/matrices.
// Outputs not asked for by output_mask are empty [0] tensors.
// ----------------------------------------------------------------------------------------------
// Table-free RoPE: cos/sin from positions × inv_freq inside the kernel's token tiles.

constexpr Renames kFromPositionsNames = {{"tables.frequencies", "inv_freq"},
                                         {"tables.amplitude", "amplitude"},
                                         {"tables.column_axis", "column_axis"},
                                         {"dim", "rotary_dim"},
                                         {"head_dim", "q"}};

struct FromPositions {
  std::optional<rome::Rotation> rotation;
  PreparedTables tables;
};

FromPositions prepare_from_positions(const Tensor& q, const Tensor& positions,
                                     const Tensor& inv_freq, c10::string_view rotation,
                                     c10::IntArrayRef blocks, int64_t rotary_dim, double amplitude,
                                     c10::IntArrayRef column_axis, bool inverse,
                                     const char* q_name = "q") {
  FromPositions p;
  const int64_t hd = head_dim_of(q, q_name);
  p.rotation = build_rotation(std::string(rotation), to_vec(blocks), rotary_dim, hd, std::nullopt,
                              std::nullopt, "mat_b");
  p.tables =
      table_free_tables(positions, inv_freq, amplitude, to_vec(column_axis), q.sizes(), inverse);
  return p;
}

std::tuple<Tensor, Tensor> rope_from_positions_cpu(const Tensor& q, const OptTensor& k,
                                                   const Tensor& positions, const Tensor& inv_freq,
                                                   c10::string_view rotation,
                                                   c10::IntArrayRef blocks, int64_t rotary_dim,
                                                   double amplitude, c10::IntArrayRef column_axis,
                                                   bool inverse) {
  return guarded(kFromPositionsNames, [&] {
    const FromPositions p = prepare_from_positions(q, positions, inv_freq, rotation, blocks,
                                                   rotary_dim, amplitude, column_axis, inverse);
    return forward_out_of_place(*p.rotation, p.tables.tables, q, k);
  });
}

void rope_from_positions_inplace_cpu(const Tensor& q, const OptTensor& k, const Tensor& positions,
                                     const Tensor& inv_freq, c10::string_view rotation,
                                     c10::IntArrayRef blocks, int64_t rotary_dim, double amplitude,
                                     c10::IntArrayRef column_axis, bool inverse) {
  guarded(kFromPositionsNames, [&] {
    const FromPositions p = prepare_from_positions(q, positions, inv_freq, rotation, blocks,
                                                   rotary_dim, amplitude, column_axis, inverse);
    forward_in_place(*p.rotation, p.tables.tables, q, k);
  });
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

// The exact table builder: [*positions.shape, 2·n] fp32 cos and sin (half or pairs layout).
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
    Tensor cos = at::empty(shape, positions.options().dtype(at::kFloat));
    Tensor sin = at::empty(shape, positions.options().dtype(at::kFloat));
    const int64_t* p = pos.data_ptr<int64_t>();
    const std::span<const double> f(frequencies);
    // Validate everything once on this thread, then fill the rows in parallel.
    rome::exact_cos_sin_rows({p, size_t(rows)}, f, amplitude, layout == "pairs", nullptr, nullptr);
    float* c = cos.data_ptr<float>();
    float* s = sin.data_ptr<float>();
    const bool pairs = layout == "pairs";
    at::parallel_for(0, rows, 256, [&](int64_t begin, int64_t end) {
      rome::exact_cos_sin_rows({p + begin, size_t(end - begin)}, f, amplitude, pairs,
                               c + begin * 2 * n, s + begin * 2 * n);
    });
    if (dtype.has_value() && *dtype != at::kFloat)
      return std::make_tuple(cos.to(*dtype), sin.to(*dtype));
    return std::make_tuple(cos, sin);
  });
}

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

// ----------------------------------------------------------------------------------------------
// Meta kernels: fresh outputs with the CPU kernels' shapes, dtypes and strides.
//
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

void require_rope_meta(const Tensor& q, const OptTensor& k, const Tensor& cos, const Tensor& sin,
                       const OptTensor& positions, const OptTensor& mat_a, const OptTensor& mat_b) {
  require_all_meta({{"q", &q},
                    {"k", opt(k)},
                    {"cos", &cos},
                    {"sin", &sin},
                    {"positions", opt(positions)},
                    {"mat_a", opt(mat_a)},
                    {"mat_b", opt(mat_b)}});
}

std::tuple<Tensor, Tensor> rope_meta(const Tensor& q, const OptTensor& k, const Tensor& cos,
                                     const Tensor& sin, const OptTensor& positions,
                                     c10::string_view, c10::IntArrayRef, int64_t, c10::string_view,
                                     c10::IntArrayRef, const OptTensor& mat_a,
                                     const OptTensor& mat_b) {
  require_rope_meta(q, k, cos, sin, positions, mat_a, mat_b);
  return std::make_tuple(alloc_like(q), has(k) ? alloc_like(*k) : empty_marker(q));
}

void rope_inplace_meta(const Tensor& q, const OptTensor& k, const Tensor& cos, const Tensor& sin,
                       const OptTensor& positions, c10::string_view, c10::IntArrayRef, int64_t,
                       c10::string_view, c10::IntArrayRef, const OptTensor& mat_a,
                       const OptTensor& mat_b) {
  require_rope_meta(q, k, cos, sin, positions, mat_a, mat_b);
}

void rope_out_meta(const Tensor& q, const OptTensor& k, const Tensor& cos, const Tensor& sin,
                   const Tensor& q_out, const OptTensor& k_out, const OptTensor& positions,
                   c10::string_view, c10::IntArrayRef, int64_t, c10::string_view, c10::IntArrayRef,
                   const OptTensor& mat_a, const OptTensor& mat_b) {
  require_rope_meta(q, k, cos, sin, positions, mat_a, mat_b);
  require_all_meta({{"q_out", &q_out}, {"k_out", opt(k_out)}});
}

std::tuple<Tensor, Tensor> rope_from_positions_meta(const Tensor& q, const OptTensor& k,
                                                    const Tensor& positions, const Tensor& inv_freq,
                                                    c10::string_view, c10::IntArrayRef, int64_t,
                                                    double, c10::IntArrayRef, bool) {
  require_all_meta({{"q", &q}, {"k", opt(k)}, {"positions", &positions}, {"inv_freq", &inv_freq}});
  return std::make_tuple(alloc_like(q), has(k) ? alloc_like(*k) : empty_marker(q));
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
                                      const Tensor& inv_freq, c10::string_view, c10::IntArrayRef,
                                      int64_t, double, c10::IntArrayRef, bool) {
  require_all_meta({{"q", &q}, {"k", opt(k)}, {"positions", &positions}, {"inv_freq", &inv_freq}});
}

Tensor rope_matrix_meta(const Tensor& x, const Tensor& mat, const Tensor& sin, const Tensor& cos) {
  require_all_meta({{"x", &x}, {"mat", &mat}, {"sin", &sin}, {"cos", &cos}});
  return alloc_like(x);
}

void rope_matrix_inplace_meta(const Tensor& x, const Tensor& mat, const Tensor& sin,
                              const Tensor& cos) {
  require_all_meta({{"x", &x}, {"mat", &mat}, {"sin", &sin}, {"cos", &cos}});
}

void rotary_embedding_meta(const Tensor& positions, const Tensor& query, const OptTensor& key,
                           int64_t, const Tensor& cos_sin_cache, bool, int64_t, bool) {
  require_all_meta({{"positions", &positions},
                    {"query", &query},
                    {"key", opt(key)},
                    {"cos_sin_cache", &cos_sin_cache}});
}

void fused_qk_norm_rope_meta(const Tensor& qkv, int64_t, int64_t, int64_t, int64_t, double,
                             const Tensor& q_weight, const Tensor& k_weight,
                             const Tensor& cos_sin_cache, bool, const Tensor& position_ids, bool) {
  require_all_meta({{"qkv", &qkv},
                    {"q_weight", &q_weight},
                    {"k_weight", &k_weight},
                    {"cos_sin_cache", &cos_sin_cache},
                    {"position_ids", &position_ids}});
}

void rotary_embedding_with_cache_meta(const Tensor& positions, const Tensor& query,
                                      const Tensor& key, const Tensor& value, int64_t,
                                      const Tensor& cos_sin_cache, bool, const Tensor& key_cache,
                                      const Tensor& value_cache, const Tensor& slot_mapping,
                                      const OptTensor& q_weight, const OptTensor& k_weight, double,
                                      bool) {
  require_all_meta({{"positions", &positions},
                    {"query", &query},
                    {"key", &key},
                    {"value", &value},
                    {"cos_sin_cache", &cos_sin_cache},
                    {"key_cache", &key_cache},
                    {"value_cache", &value_cache},
                    {"slot_mapping", &slot_mapping},
                    {"q_weight", opt(q_weight)},
                    {"k_weight", opt(k_weight)}});
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
  require_all_meta({{"x", &x}, {"freqs_cis", &freqs_cis}});
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

// ----------------------------------------------------------------------------------------------
// Autograd

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

// In-place ops are inference only: autograd cannot record a kernel that overwrites its input.
void inference_only(const char* op,
                    std::initializer_list<std::pair<const char*, OptTensor>> inputs) {
  if (!at::GradMode::is_enabled()) return;
  guarded([&] {
    for (const auto& [name, t] : inputs)
      if (requires_grad(t))
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

void rotary_embedding_autograd(const Tensor& positions, const Tensor& query, const OptTensor& key,
                               int64_t head_size, const Tensor& cos_sin_cache, bool is_neox,
                               int64_t rope_dim_offset, bool inverse) {
  ROME_OP(op, "rome::rotary_embedding", RotaryEmbeddingSig);
  inference_only("rotary_embedding",
                 {{"query", query}, {"key", key}, {"cos_sin_cache", cos_sin_cache}});
  at::AutoDispatchBelowAutograd guard;
  op.call(positions, query, key, head_size, cos_sin_cache, is_neox, rope_dim_offset, inverse);
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

TORCH_LIBRARY(rome, m) {
  m.def("rope_matrix(Tensor x, Tensor mat, Tensor sin, Tensor cos) -> Tensor");
  // Returns nothing (not Tensor(a!)): functionalization (torch.compile, export) rejects custom
  // ops whose outputs alias an input. rome.ops.rope_matrix_ returns x.
  m.def("rope_matrix_(Tensor(a!) x, Tensor mat, Tensor sin, Tensor cos) -> ()");
  m.def(
      "rope(Tensor q, Tensor? k, Tensor cos, Tensor sin, Tensor? positions=None, "
      "str rotation=\"half\", int[] blocks=[], int rotary_dim=-1, str table_width=\"full\", "
      "int[] column_axis=[], Tensor? mat_a=None, Tensor? mat_b=None) -> (Tensor, Tensor)");
  m.def(
      "rope_(Tensor(a!) q, Tensor(b!)? k, Tensor cos, Tensor sin, Tensor? positions=None, "
      "str rotation=\"half\", int[] blocks=[], int rotary_dim=-1, str table_width=\"full\", "
      "int[] column_axis=[], Tensor? mat_a=None, Tensor? mat_b=None) -> ()");
  // Out of place into preallocated outputs (q_out, k_out: q's and k's shapes and dtypes).
  m.def(
      "rope_out(Tensor q, Tensor? k, Tensor cos, Tensor sin, Tensor(c!) q_out, Tensor(d!)? k_out, "
      "Tensor? positions=None, str rotation=\"half\", int[] blocks=[], int rotary_dim=-1, "
      "str table_width=\"full\", int[] column_axis=[], Tensor? mat_a=None, Tensor? mat_b=None) "
      "-> ()");
  m.def(
      "rotary_embedding(Tensor positions, Tensor(a!) query, Tensor(b!)? key, int head_size, "
      "Tensor cos_sin_cache, bool is_neox, int rope_dim_offset=0, bool inverse=False) -> ()");
  // Re-rotates the keys of a paged cache [num_blocks, block_size, heads, head_dim] in place:
  // sequence b's slots [0, seq_lens[b]) of its blocks block_table[b] by cos/sin row b
  // ([num_seqs, rotary_dim/2]: the angles of its position shift).
  // vLLM's fused_qk_norm_rope schema (+ Gemma's (1 + w) norm): per-head RMSNorm and RoPE of the
  // q and k heads of a packed qkv [T, (Hq+Hk+Hv)·D] in place, v untouched.
  m.def(
      "fused_qk_norm_rope(Tensor(a!) qkv, int num_heads_q, int num_heads_k, int num_heads_v, "
      "int head_dim, float eps, Tensor q_weight, Tensor k_weight, Tensor cos_sin_cache, "
      "bool is_neox, Tensor position_ids, bool gemma_norm=False) -> ()");
  // RoPE of query and key in place and the rotated key + value written to a paged cache
  // [num_blocks, block_size, Hk, D] at slot_mapping[t] (-1: not stored); optional QK-norm.
  m.def(
      "rotary_embedding_with_cache(Tensor positions, Tensor(a!) query, Tensor(b!) key, "
      "Tensor value, int head_size, Tensor cos_sin_cache, bool is_neox, Tensor(c!) key_cache, "
      "Tensor(d!) value_cache, Tensor slot_mapping, Tensor? q_weight=None, "
      "Tensor? k_weight=None, float eps=1e-6, bool gemma_norm=False) -> ()");
  m.def(
      "rerotate_paged_(Tensor(a!) key_cache, Tensor cos, Tensor sin, Tensor block_table, "
      "Tensor seq_lens, str rotation=\"half\", int rope_dim_offset=0) -> ()");
  m.def("apply_rotary_emb_interleaved(Tensor x, Tensor freqs_cis) -> Tensor");
  // Table-free RoPE: cos/sin of positions × inv_freq (one frequency per lane pair, pairs
  // numbered by their lower lane, block by block), exact at any position; no table is built.
  m.def(
      "rope_from_positions(Tensor q, Tensor? k, Tensor positions, Tensor inv_freq, "
      "str rotation=\"half\", int[] blocks=[], int rotary_dim=-1, float amplitude=1.0, "
      "int[] column_axis=[], bool inverse=False) -> (Tensor, Tensor)");
  m.def(
      "rope_from_positions_(Tensor(a!) q, Tensor(b!)? k, Tensor positions, Tensor inv_freq, "
      "str rotation=\"half\", int[] blocks=[], int rotary_dim=-1, float amplitude=1.0, "
      "int[] column_axis=[], bool inverse=False) -> ()");
  m.def(
      "cos_sin(Tensor positions, Tensor inv_freq, str layout=\"half\", float amplitude=1.0, "
      "ScalarType? dtype=None) -> (Tensor, Tensor)");
  m.def(
      "_rope_from_positions_backward(Tensor grad_q, Tensor? grad_k, Tensor positions, "
      "Tensor inv_freq, str rotation, int[] blocks, int rotary_dim, float amplitude, "
      "int[] column_axis, bool inverse) -> (Tensor, Tensor)");
  // Backward of every op above (internal): grads of (q, k, cos, sin, mat_a, mat_b); outputs not
  // in output_mask are empty [0] tensors.
  m.def(
      "_rope_backward(Tensor grad_q, Tensor? grad_k, Tensor q, Tensor? k, Tensor cos, Tensor sin, "
      "Tensor? positions, str rotation, int[] blocks, int rotary_dim, str table_width, "
      "int[] column_axis, Tensor? mat_a, Tensor? mat_b, bool[6] output_mask) -> "
      "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
}

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
  m.impl("_rope_from_positions_backward", rope_from_positions_meta);
}

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
