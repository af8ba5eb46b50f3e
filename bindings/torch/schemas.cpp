// The schemas of the rome:: operators.
#include <torch/library.h>

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
