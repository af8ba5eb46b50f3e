// The rome:: ops' argument handling (calls.hpp): everything the CPU kernels did before the core
// call, ending in rome::rope_forward (Mode::run) or rome::rope_check (Mode::check).
#include "calls.hpp"

namespace rome_torch {

static void forward(Mode mode, const rome::Rotation& rotation, const rome::Tables& tables,
                    const rome::Operand& q, const rome::Operand* k) {
  if (mode == Mode::run)
    rome::rope_forward(rotation, tables, q, k, exec_options());
  else
    rome::rope_check(rotation, tables, q, k);
}

Prepared prepare(const Tensor& q, const Tensor& cos, const Tensor& sin, const OptTensor& positions,
                 c10::string_view rotation, c10::IntArrayRef blocks, int64_t rotary_dim,
                 c10::string_view table_width, c10::IntArrayRef column_axis, const OptTensor& mat_a,
                 const OptTensor& mat_b, const char* q_name) {
  Prepared p;
  const int64_t hd = head_dim_of(q, q_name);
  p.rotation =
      build_rotation(std::string(rotation), to_vec(blocks), rotary_dim, hd, mat_a, mat_b, "mat_b");
  p.tables =
      prepare_tables(cos, sin, positions, std::string(table_width), to_vec(column_axis), q.sizes());
  return p;
}

std::tuple<Tensor, Tensor> forward_out_of_place(Mode mode, const rome::Rotation& rotation,
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
  forward(mode, rotation, tables, oq, has(k) ? &ok : nullptr);
  return std::make_tuple(qout, has(k) ? kout : empty_marker(q));
}

void forward_in_place(Mode mode, const rome::Rotation& rotation, const rome::Tables& tables,
                      const Tensor& q, const OptTensor& k) {
  const rome::TensorView qv = mutable_view(q, "q");
  const rome::Operand oq{rome::as_const(qv), qv};
  rome::Operand ok;
  if (has(k)) {
    head_dim_of(*k, "k");
    const rome::TensorView kv = mutable_view(*k, "k");
    ok = {rome::as_const(kv), kv};
  }
  forward(mode, rotation, tables, oq, has(k) ? &ok : nullptr);
}

std::tuple<Tensor, Tensor> rope_call(Mode mode, const Tensor& q, const OptTensor& k,
                                     const Tensor& cos, const Tensor& sin,
                                     const OptTensor& positions, c10::string_view rotation,
                                     c10::IntArrayRef blocks, int64_t rotary_dim,
                                     c10::string_view table_width, c10::IntArrayRef column_axis,
                                     const OptTensor& mat_a, const OptTensor& mat_b) {
  return guarded({{"dim", "rotary_dim"}, {"head_dim", "q"}}, [&] {
    const Prepared p = prepare(q, cos, sin, positions, rotation, blocks, rotary_dim, table_width,
                               column_axis, mat_a, mat_b);
    return forward_out_of_place(mode, *p.rotation, p.tables.tables, q, k);
  });
}

void rope_inplace_call(Mode mode, const Tensor& q, const OptTensor& k, const Tensor& cos,
                       const Tensor& sin, const OptTensor& positions, c10::string_view rotation,
                       c10::IntArrayRef blocks, int64_t rotary_dim, c10::string_view table_width,
                       c10::IntArrayRef column_axis, const OptTensor& mat_a,
                       const OptTensor& mat_b) {
  guarded({{"q_out", "q"}, {"k_out", "k"}, {"dim", "rotary_dim"}, {"head_dim", "q"}}, [&] {
    const Prepared p = prepare(q, cos, sin, positions, rotation, blocks, rotary_dim, table_width,
                               column_axis, mat_a, mat_b);
    forward_in_place(mode, *p.rotation, p.tables.tables, q, k);
  });
}

// Out of place into the caller's tensors: engines keep their buffers, no allocation per call.
void rope_out_call(Mode mode, const Tensor& q, const OptTensor& k, const Tensor& cos,
                   const Tensor& sin, const Tensor& q_out, const OptTensor& k_out,
                   const OptTensor& positions, c10::string_view rotation, c10::IntArrayRef blocks,
                   int64_t rotary_dim, c10::string_view table_width, c10::IntArrayRef column_axis,
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
    forward(mode, *p.rotation, p.tables.tables, oq, has(k) ? &ok : nullptr);
  });
}

static Prepared prepare_matrix(const Tensor& x, const Tensor& mat, const Tensor& sin,
                               const Tensor& cos) {
  Prepared p;
  const int64_t hd = head_dim_of(x, "x");
  p.rotation = build_rotation("dense", {}, -1, hd, std::nullopt, mat, "mat");
  p.tables = prepare_tables(cos, sin, std::nullopt, "full", {}, x.sizes());
  return p;
}

Tensor rope_matrix_call(Mode mode, const Tensor& x, const Tensor& mat, const Tensor& sin,
                        const Tensor& cos) {
  return guarded({{"q", "x"}, {"dim", "x"}, {"head_dim", "x"}}, [&] {
    const Prepared p = prepare_matrix(x, mat, sin, cos);
    const Tensor xin = readable(x);
    rome::Operand op{const_view(xin, "x", false), {}};
    const Tensor out = alloc_like(x);
    op.out = mutable_view(out, "out");
    forward(mode, *p.rotation, p.tables.tables, op, nullptr);
    return out;
  });
}

void rope_matrix_inplace_call(Mode mode, const Tensor& x, const Tensor& mat, const Tensor& sin,
                              const Tensor& cos) {
  guarded({{"q", "x"}, {"q_out", "x"}, {"dim", "x"}, {"head_dim", "x"}}, [&] {
    const Prepared p = prepare_matrix(x, mat, sin, cos);
    const rome::TensorView v = mutable_view(x, "x");
    const rome::Operand op{rome::as_const(v), v};
    forward(mode, *p.rotation, p.tables.tables, op, nullptr);
  });
}

// vLLM: query/key [T, H*D], [T, H, D] or [B, S, H*D]; the token axes are positions' axes.
rome::TensorView vllm_view(const Tensor& t, const char* name, int64_t token_axes,
                           int64_t head_size) {
  rome::TensorView v = mutable_view(t, name);
  const int64_t extra = t.dim() - token_axes;
  // Built only on failure: a decode step calls this twice.
  auto fail_shape = [&] {
    const std::string h = std::to_string(head_size);
    rome::fail(
        rome::Status::invalid_argument, name,
        "[T, H*" + h + "], [T, H, " + h + "] or [B, S, H*" + h + "] matching positions' axes",
        shape_of(t));
  };
  if (extra == 2) {
    if (t.size(-1) != head_size) fail_shape();
    return v;
  }
  if (extra != 1 || token_axes + 2 > rome::kMaxRank) fail_shape();
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
                         int64_t max_rotary, const char* max_rotary_what) {
  if (positions.dim() < 1 || positions.dim() > 2)
    rome::fail(rome::Status::invalid_argument, "positions", "[T] or [B, S]", shape_of(positions));
  if (cos_sin_cache.dim() != 2 || cos_sin_cache.size(1) % 2 != 0 || cos_sin_cache.size(1) == 0 ||
      cos_sin_cache.size(1) > max_rotary)
    rome::fail(rome::Status::invalid_argument, "cos_sin_cache",
               "[max_position, rotary_dim] with an even rotary_dim of at most " +
                   std::to_string(max_rotary) + " (" + std::string(max_rotary_what) + ")",
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
  if (tables.cos.data)  // null for meta tensors
    tables.sin.data = static_cast<const char*>(tables.cos.data) +
                      (rd / 2) * cos_sin_cache.stride(1) * cos_sin_cache.element_size();
  tables.width = is_neox ? rome::TableWidth::halves : rome::TableWidth::pairs;
  return tables;
}

// The rotation of this thread's last call with the same arguments is reused as is: a decode step
// otherwise paid build_rotation's locked cache lookup (strings, vectors) for the same rotation.
rome::Rotation vllm_rotation(int64_t rd, int64_t head_size, bool is_neox, int64_t offset) {
  struct Last {
    int64_t rd = -1, head_size = -1, offset = -1;
    bool is_neox = false;
    std::optional<rome::Rotation> rotation;
  };
  thread_local Last last;
  if (last.rotation && last.rd == rd && last.head_size == head_size && last.offset == offset &&
      last.is_neox == is_neox)
    return *last.rotation;
  rome::Rotation rotation = build_rotation(is_neox ? "half" : "interleave", {}, rd, head_size,
                                           std::nullopt, std::nullopt, "mat_b", offset);
  last.rotation = rotation;
  last.rd = rd;
  last.head_size = head_size;
  last.offset = offset;
  last.is_neox = is_neox;
  return rotation;
}

// vLLM's ops name q, k and the tables query, key and cos_sin_cache, and the head size head_size.
constexpr Renames kVllmNames = {
    {"q", "query"},           {"q_out", "query"},       {"k", "key"},
    {"k_out", "key"},         {"cos", "cos_sin_cache"}, {"sin", "cos_sin_cache"},
    {"head_dim", "head_size"}};

static void require_positive_head_size(int64_t head_size) {
  if (head_size <= 0)
    rome::fail(rome::Status::invalid_argument, "head_size", "a positive size",
               std::to_string(head_size));
}

void rotary_embedding_call(Mode mode, const Tensor& positions, const Tensor& query,
                           const OptTensor& key, int64_t head_size, const Tensor& cos_sin_cache,
                           bool is_neox, int64_t rope_dim_offset, bool inverse) {
  guarded(kVllmNames, [&] {
    require_positive_head_size(head_size);
    if (rope_dim_offset < 0 || rope_dim_offset > head_size)
      rome::fail(rome::Status::invalid_argument, "rope_dim_offset",
                 "an offset in [0, head_size " + std::to_string(head_size) + "]",
                 std::to_string(rope_dim_offset));
    rome::Tables tables = vllm_tables(positions, cos_sin_cache, is_neox,
                                      head_size - rope_dim_offset, "head_size - rope_dim_offset");
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
    forward(mode, rotation, tables, oq, has(key) ? &ok : nullptr);
  });
}

// ExecuTorch: x [B, N, C], freqs_cis with N*C elements (see interleaved_tables).
static void check_interleaved(const Tensor& x, const Tensor& freqs) {
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

Tensor interleaved_call(Mode mode, const Tensor& x, const Tensor& freqs_cis) {
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
    forward(mode, rotation, tables, op, nullptr);
    return out;
  });
}

void fused_qk_norm_rope_call(Mode mode, const Tensor& qkv, int64_t num_heads_q, int64_t num_heads_k,
                             int64_t num_heads_v, int64_t head_dim, double eps,
                             const Tensor& q_weight, const Tensor& k_weight,
                             const Tensor& cos_sin_cache, bool is_neox, const Tensor& position_ids,
                             bool gemma_norm) {
  guarded({{"q", "qkv"},
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
              rome::fail(rome::Status::invalid_argument, "position_ids", "[T]",
                         shape_of(position_ids));
            const rome::Tables tables =
                vllm_tables(position_ids, cos_sin_cache, is_neox, head_dim, "head_dim");
            const rome::Rotation rotation = vllm_rotation(cos_sin_cache.size(1), head_dim, is_neox);
            const rome::TensorView whole = mutable_view(qkv, "qkv");
            auto heads = [&](int64_t first, int64_t count) {
              rome::TensorView v = whole;
              if (v.data)  // null for meta tensors
                v.data = static_cast<char*>(v.data) +
                         first * head_dim * whole.strides[1] * qkv.element_size();
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
            const rome::TensorView q = heads(0, num_heads_q), k = heads(num_heads_q, num_heads_k);
            if (mode == Mode::run)
              rome::qk_norm_rope(rotation, tables, norm, q, k, exec_options());
            else
              rome::qk_norm_rope_check(rotation, tables, norm, q, k);
          });
}

void rotary_embedding_with_cache_call(Mode mode, const Tensor& positions, const Tensor& query,
                                      const Tensor& key, const Tensor& value, int64_t head_size,
                                      const Tensor& cos_sin_cache, bool is_neox,
                                      const Tensor& key_cache, const Tensor& value_cache,
                                      const Tensor& slot_mapping, const OptTensor& q_weight,
                                      const OptTensor& k_weight, double eps, bool gemma_norm) {
  guarded(kVllmNames, [&] {
    require_positive_head_size(head_size);
    if (positions.dim() != 1)
      rome::fail(rome::Status::invalid_argument, "positions", "[T]", shape_of(positions));
    const rome::Tables tables =
        vllm_tables(positions, cos_sin_cache, is_neox, head_size, "head_size");
    const rome::Rotation rotation = vllm_rotation(cos_sin_cache.size(1), head_size, is_neox);
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
    if (mode == Mode::run)
      rome::rope_and_cache_kv(rotation, tables, q, k, write, has(q_weight) ? &norm : nullptr,
                              exec_options());
    else
      rome::rope_and_cache_kv_check(rotation, tables, q, k, write, has(q_weight) ? &norm : nullptr);
  });
}

FromPositions prepare_from_positions(const Tensor& q, const Tensor& positions,
                                     const Tensor& inv_freq, c10::string_view rotation,
                                     c10::IntArrayRef blocks, int64_t rotary_dim, double amplitude,
                                     c10::IntArrayRef column_axis, bool inverse,
                                     const char* q_name) {
  FromPositions p;
  const int64_t hd = head_dim_of(q, q_name);
  p.rotation = build_rotation(std::string(rotation), to_vec(blocks), rotary_dim, hd, std::nullopt,
                              std::nullopt, "mat_b");
  p.tables =
      table_free_tables(positions, inv_freq, amplitude, to_vec(column_axis), q.sizes(), inverse);
  return p;
}

std::tuple<Tensor, Tensor> rope_from_positions_call(Mode mode, const Tensor& q, const OptTensor& k,
                                                    const Tensor& positions, const Tensor& inv_freq,
                                                    c10::string_view rotation,
                                                    c10::IntArrayRef blocks, int64_t rotary_dim,
                                                    double amplitude, c10::IntArrayRef column_axis,
                                                    bool inverse) {
  return guarded(kFromPositionsNames, [&] {
    const FromPositions p = prepare_from_positions(q, positions, inv_freq, rotation, blocks,
                                                   rotary_dim, amplitude, column_axis, inverse);
    return forward_out_of_place(mode, *p.rotation, p.tables.tables, q, k);
  });
}

void rope_from_positions_inplace_call(Mode mode, const Tensor& q, const OptTensor& k,
                                      const Tensor& positions, const Tensor& inv_freq,
                                      c10::string_view rotation, c10::IntArrayRef blocks,
                                      int64_t rotary_dim, double amplitude,
                                      c10::IntArrayRef column_axis, bool inverse) {
  guarded(kFromPositionsNames, [&] {
    const FromPositions p = prepare_from_positions(q, positions, inv_freq, rotation, blocks,
                                                   rotary_dim, amplitude, column_axis, inverse);
    forward_in_place(mode, *p.rotation, p.tables.tables, q, k);
  });
}

}  // namespace rome_torch
