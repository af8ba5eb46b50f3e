// The rome:: ops' handling of their arguments, up to the core call, shared by the CPU kernels
// (which run the call) and the Meta kernels (which check it with rome::rope_check): one set of
// rules for what an op accepts, and the same error for the same bad argument on either device.
#pragma once

#include <optional>
#include <string>
#include <tuple>

#include "dispatch.hpp"

namespace rome_torch {

enum class Mode {
  run,    // CPU: rome::rope_forward
  check,  // Meta: rome::rope_check and the fused passes' checks (shapes, dtypes, strides; nothing
          // read or written)
};

struct Prepared {
  std::optional<rome::Rotation> rotation;
  PreparedTables tables;
};

// Rotation and tables of the general op (rope, rope_, rope_out, _rope_backward).
Prepared prepare(const Tensor& q, const Tensor& cos, const Tensor& sin, const OptTensor& positions,
                 c10::string_view rotation, c10::IntArrayRef blocks, int64_t rotary_dim,
                 c10::string_view table_width, c10::IntArrayRef column_axis, const OptTensor& mat_a,
                 const OptTensor& mat_b, const char* q_name = "q");

// q (and k) into fresh outputs: (q_out, k_out), k_out empty without k.
std::tuple<Tensor, Tensor> forward_out_of_place(Mode mode, const rome::Rotation& rotation,
                                                const rome::Tables& tables, const Tensor& q,
                                                const OptTensor& k);
// q (and k) in place.
void forward_in_place(Mode mode, const rome::Rotation& rotation, const rome::Tables& tables,
                      const Tensor& q, const OptTensor& k);

std::tuple<Tensor, Tensor> rope_call(Mode mode, const Tensor& q, const OptTensor& k,
                                     const Tensor& cos, const Tensor& sin,
                                     const OptTensor& positions, c10::string_view rotation,
                                     c10::IntArrayRef blocks, int64_t rotary_dim,
                                     c10::string_view table_width, c10::IntArrayRef column_axis,
                                     const OptTensor& mat_a, const OptTensor& mat_b);
void rope_inplace_call(Mode mode, const Tensor& q, const OptTensor& k, const Tensor& cos,
                       const Tensor& sin, const OptTensor& positions, c10::string_view rotation,
                       c10::IntArrayRef blocks, int64_t rotary_dim, c10::string_view table_width,
                       c10::IntArrayRef column_axis, const OptTensor& mat_a,
                       const OptTensor& mat_b);
void rope_out_call(Mode mode, const Tensor& q, const OptTensor& k, const Tensor& cos,
                   const Tensor& sin, const Tensor& q_out, const OptTensor& k_out,
                   const OptTensor& positions, c10::string_view rotation, c10::IntArrayRef blocks,
                   int64_t rotary_dim, c10::string_view table_width, c10::IntArrayRef column_axis,
                   const OptTensor& mat_a, const OptTensor& mat_b);
Tensor rope_matrix_call(Mode mode, const Tensor& x, const Tensor& mat, const Tensor& sin,
                        const Tensor& cos);
void rope_matrix_inplace_call(Mode mode, const Tensor& x, const Tensor& mat, const Tensor& sin,
                              const Tensor& cos);
void rotary_embedding_call(Mode mode, const Tensor& positions, const Tensor& query,
                           const OptTensor& key, int64_t head_size, const Tensor& cos_sin_cache,
                           bool is_neox, int64_t rope_dim_offset, bool inverse);
Tensor interleaved_call(Mode mode, const Tensor& x, const Tensor& freqs_cis);
void fused_qk_norm_rope_call(Mode mode, const Tensor& qkv, int64_t num_heads_q, int64_t num_heads_k,
                             int64_t num_heads_v, int64_t head_dim, double eps,
                             const Tensor& q_weight, const Tensor& k_weight,
                             const Tensor& cos_sin_cache, bool is_neox, const Tensor& position_ids,
                             bool gemma_norm);
void rotary_embedding_with_cache_call(Mode mode, const Tensor& positions, const Tensor& query,
                                      const Tensor& key, const Tensor& value, int64_t head_size,
                                      const Tensor& cos_sin_cache, bool is_neox,
                                      const Tensor& key_cache, const Tensor& value_cache,
                                      const Tensor& slot_mapping, const OptTensor& q_weight,
                                      const OptTensor& k_weight, double eps, bool gemma_norm);

// Table-free RoPE (rope_from_positions and its backward).
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
                                     const char* q_name = "q");
std::tuple<Tensor, Tensor> rope_from_positions_call(Mode mode, const Tensor& q, const OptTensor& k,
                                                    const Tensor& positions, const Tensor& inv_freq,
                                                    c10::string_view rotation,
                                                    c10::IntArrayRef blocks, int64_t rotary_dim,
                                                    double amplitude, c10::IntArrayRef column_axis,
                                                    bool inverse);
void rope_from_positions_inplace_call(Mode mode, const Tensor& q, const OptTensor& k,
                                      const Tensor& positions, const Tensor& inv_freq,
                                      c10::string_view rotation, c10::IntArrayRef blocks,
                                      int64_t rotary_dim, double amplitude,
                                      c10::IntArrayRef column_axis, bool inverse);

// vLLM's layouts, also used by the fused ops.
rome::TensorView vllm_view(const Tensor& t, const char* name, int64_t token_axes,
                           int64_t head_size);
rome::Tables vllm_tables(const Tensor& positions, const Tensor& cos_sin_cache, bool is_neox,
                         int64_t max_rotary, const char* max_rotary_what);
rome::Rotation vllm_rotation(int64_t rd, int64_t head_size, bool is_neox, int64_t offset = 0);

}  // namespace rome_torch
