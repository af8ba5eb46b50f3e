// Fused passes over token-major heads: per-head RMSNorm + RoPE (QK-norm models: Qwen3, Gemma 3,
// OLMo 2, ...) and RoPE + the paged KV-cache write, each in one pass over q, k (and v).
#pragma once

#include <cstdint>

#include "rome/rope.hpp"

namespace rome {

// RMSNorm of every head of q and k before the rotation: n = x / sqrt(mean(x²) + eps) · w in
// fp32 (the mean over head_dim lanes, summed in a fixed order), rotated in fp32, rounded once:
// no round trip through x's dtype between the norm and the rotation.
struct QkNorm {
  ConstTensorView q_weight;  // [head_dim], any float dtype
  ConstTensorView k_weight;  // [head_dim]
  float eps = 1e-6f;
  bool unit_offset = false;  // Gemma: the weight is (1 + w)
};

// q [T, Hq, D] and k [T, Hk, D] (any strides but a contiguous last axis, e.g. slices of a packed
// qkv buffer) normalised per head and rotated, in place. Tables as for rope_forward with T as
// the only axis they vary along (a cache with positions [T, 1], or direct [T, 1, width]). The
// rotation must be a signed permutation without a lane offset; lanes past rotary_dim are
// normalised, not rotated.
void qk_norm_rope(const Rotation& rotation, const Tables& tables, const QkNorm& norm,
                  const TensorView& q, const TensorView& k, const ExecOptions& options = {});

// A paged KV cache and where each token goes: caches [num_blocks, block_size, Hk, D] in k's
// dtype (any strides but a contiguous last axis), value [T, Hk, D], slot_mapping int32/int64 [T]
// (slot = block · block_size + offset; -1: a padding token, rotated but not stored). No two
// tokens may name the same slot.
struct PagedKvWrite {
  ConstTensorView value;
  TensorView key_cache;
  TensorView value_cache;
  ConstTensorView slot_mapping;
};

// Rotates q [T, Hq, D] and k [T, Hk, D] in place (optionally QK-normalised first) and writes the
// rotated keys and the values into the cache slots, one pass over each token. Everything is
// validated before anything is written.
void rope_and_cache_kv(const Rotation& rotation, const Tables& tables, const TensorView& q,
                       const TensorView& k, const PagedKvWrite& cache, const QkNorm* norm = nullptr,
                       const ExecOptions& options = {});

// The checks of qk_norm_rope and rope_and_cache_kv from shapes, dtypes and strides alone, as
// rope_check does for rope_forward: data pointers may be null and nothing is read, so weight and
// slot values, null pointers and aliasing are left to the call.
void qk_norm_rope_check(const Rotation& rotation, const Tables& tables, const QkNorm& norm,
                        const TensorView& q, const TensorView& k);
void rope_and_cache_kv_check(const Rotation& rotation, const Tables& tables, const TensorView& q,
                             const TensorView& k, const PagedKvWrite& cache,
                             const QkNorm* norm = nullptr);

}  // namespace rome
