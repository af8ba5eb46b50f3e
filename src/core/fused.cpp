// Fused passes over token-major heads: QK-norm + RoPE, and RoPE + the paged KV-cache write. Work
// is cut into runs of 16 tokens whose table rows are prepared once. The kernel takes the run's q
// heads in one call and its k heads in another; then each token's rotated keys and its values
// are copied into their cache slot while they are still in L1 or L2.
#include "rome/fused.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "convert.hpp"
#include "dispatch.hpp"
#include "plan.hpp"
#include "rome/error.hpp"
#include "thread_pool.hpp"

namespace rome {
namespace {

using std::int64_t;
using std::to_string;

constexpr int64_t kTokensPerTile = 16;

ConstTensorView cview(const TensorView& v) {
  return as_const(v);
}

void require_rank(const std::string& name, const BasicView<const void*>& v, int rank,
                  const char* expected) {
  if (v.rank != rank)
    fail(Status::invalid_argument, name, expected,
         "rank " + to_string(v.rank) + " " + shape_string(v));
}

// The weight as fp32 values (1 + w for Gemma), checked.
std::vector<float> weight_values(const std::string& name, const ConstTensorView& w,
                                 int64_t head_dim, bool unit_offset) {
  require_rank(name, w, 1, "rank 1 [head_dim]");
  if (w.shape[0] != head_dim)
    fail(Status::invalid_argument, name, "[" + to_string(head_dim) + "] (head_dim)",
         shape_string(w));
  if (!is_floating(w.dtype))
    fail(Status::invalid_argument, name + ".dtype", "float32, float16 or bfloat16",
         dtype_name(w.dtype));
  std::vector<float> out(static_cast<std::size_t>(head_dim));
  if (detail::metadata_only()) return out;  // no values to read
  if (head_dim > 0 && !w.data) fail(Status::invalid_argument, name, "a data pointer", "null");
  if (w.strides[0] == 1) {
    detail::load_row_any(w.data, w.dtype, head_dim, out.data());
  } else {
    for (int64_t j = 0; j < head_dim; ++j)
      out[std::size_t(j)] = detail::load_any(w.data, w.dtype, j * w.strides[0]);
  }
  if (unit_offset)
    for (float& v : out) v = 1.0f + v;
  return out;
}

int64_t load_slot(const ConstTensorView& s, int64_t t) {
  const int64_t off = t * s.strides[0];
  return s.dtype == DType::i32 ? int64_t(static_cast<const std::int32_t*>(s.data)[off])
                               : static_cast<const std::int64_t*>(s.data)[off];
}

// Under detail::MetadataOnly (the _check functions): validation from shapes, dtypes and strides,
// then return; no slot or weight value is read.
void run_fused(const Rotation& rotation, const Tables& tables, const TensorView& q,
               const TensorView& k, const QkNorm* norm, const PagedKvWrite* kv,
               const ExecOptions& options) {
  const bool check_only = detail::metadata_only();
  if (!check_only) {
    detail::check_environment();
    detail::check_options(options);
  }
  if (rotation.kind() != Rotation::Kind::signed_permutation)
    fail(Status::unsupported, "rotation", "a signed permutation (fused passes have no matrix path)",
         "a dense rotation");
  if (rotation.lane_offset() != 0)
    fail(Status::unsupported, "rotation", "no lane offset (the norm covers the whole head)",
         "lane offset " + to_string(rotation.lane_offset()));
  require_rank("q", cview(q), 3, "rank 3 [T, Hq, D]");
  require_rank("k", cview(k), 3, "rank 3 [T, Hk, D]");
  const Operand oq{cview(q), q}, ok{cview(k), k};
  const detail::ForwardPlan plan = detail::plan_forward(rotation, tables, oq, &ok);
  if (plan.outer_axis[1])
    fail(Status::invalid_argument, "tables", "tables that vary only along tokens (axis 0)",
         "tables that vary per head");
  const int64_t tokens = q.shape[0], hd = rotation.head_dim();
  const DType dtype = q.dtype;
  const int64_t es = dtype_size(dtype);

  std::vector<float> q_weight, k_weight;
  kernels::NormParams q_norm{}, k_norm{};
  if (norm) {
    if (!std::isfinite(norm->eps) || norm->eps < 0)
      fail(Status::invalid_argument, "eps", "a finite value >= 0", std::to_string(norm->eps));
    q_weight = weight_values("q_weight", norm->q_weight, hd, norm->unit_offset);
    k_weight = weight_values("k_weight", norm->k_weight, hd, norm->unit_offset);
    for (const auto& [w, name] :
         {std::pair{&norm->q_weight, "q_weight"}, std::pair{&norm->k_weight, "k_weight"}}) {
      detail::require_disjoint_views(q, "q", *w, name);
      detail::require_disjoint_views(k, "k", *w, name);
    }
    q_norm = {q_weight.data(), norm->eps};
    k_norm = {k_weight.data(), norm->eps};
  }

  int64_t slots = 0;
  if (kv) {
    const int64_t heads = k.shape[1];
    detail::check_head_tensor("value", kv->value, hd);
    if (kv->value.rank != 3 || kv->value.shape[0] != tokens || kv->value.shape[1] != heads)
      fail(Status::invalid_argument, "value",
           "[T, Hk, D] = [" + to_string(tokens) + ", " + to_string(heads) + ", " + to_string(hd) +
               "] (k's shape)",
           shape_string(kv->value));
    if (kv->value.dtype != dtype)
      fail(Status::invalid_argument, "value.dtype", std::string(dtype_name(dtype)) + " (k's)",
           dtype_name(kv->value.dtype));
    for (const auto& [c, name] :
         {std::pair{&kv->key_cache, "key_cache"}, std::pair{&kv->value_cache, "value_cache"}}) {
      detail::check_head_tensor(name, cview(*c), hd);
      if (c->rank != 4 || c->shape[2] != heads)
        fail(Status::invalid_argument, name,
             "[num_blocks, block_size, Hk, D] with Hk " + to_string(heads) + ", D " + to_string(hd),
             shape_string(*c));
      if (c->dtype != dtype)
        fail(Status::invalid_argument, std::string(name) + ".dtype",
             std::string(dtype_name(dtype)) + " (k's)", dtype_name(c->dtype));
      detail::require_distinct_elements(name, *c);
    }
    if (kv->value_cache.shape[0] != kv->key_cache.shape[0] ||
        kv->value_cache.shape[1] != kv->key_cache.shape[1])
      fail(Status::invalid_argument, "value_cache",
           "the shape of key_cache " + shape_string(kv->key_cache), shape_string(kv->value_cache));
    slots = kv->key_cache.shape[0] * kv->key_cache.shape[1];
    const ConstTensorView& sm = kv->slot_mapping;
    if (sm.rank != 1 || sm.shape[0] != tokens)
      fail(Status::invalid_argument, "slot_mapping", "[T] = [" + to_string(tokens) + "]",
           "rank " + to_string(sm.rank) + " " + shape_string(sm));
    if (sm.dtype != DType::i32 && sm.dtype != DType::i64)
      fail(Status::invalid_argument, "slot_mapping.dtype", "int32 or int64", dtype_name(sm.dtype));
    if (!check_only && tokens > 0 && !sm.data)
      fail(Status::invalid_argument, "slot_mapping", "a data pointer", "null");
    std::vector<int64_t> used;
    used.reserve(std::size_t(tokens));
    for (int64_t t = 0; !check_only && t < tokens; ++t) {
      const int64_t s = load_slot(sm, t);
      if (s < -1 || s >= slots)
        fail(Status::out_of_range, "slot_mapping[" + to_string(t) + "]",
             "-1 (padding) or a slot in [0, " + to_string(slots) + ") (num_blocks × block_size)",
             to_string(s));
      if (s >= 0) used.push_back(s);
    }
    std::sort(used.begin(), used.end());
    if (const auto d = std::adjacent_find(used.begin(), used.end()); d != used.end())
      fail(Status::invalid_argument, "slot_mapping", "a distinct slot per token (or -1)",
           "slot " + to_string(*d) + " twice");
    // Writes must not land on anything the pass still reads or writes elsewhere.
    const std::pair<const ConstTensorView*, const char*> reads[] = {
        {&kv->value, "value"},
        {&tables.cos, "cos"},
        {&tables.sin, "sin"},
        {&kv->slot_mapping, "slot_mapping"}};
    for (const auto& [c, name] :
         {std::pair{&kv->key_cache, "key_cache"}, std::pair{&kv->value_cache, "value_cache"}}) {
      for (const auto& [r, rname] : reads) detail::require_disjoint_views(*c, name, *r, rname);
      if (tables.is_cache())
        detail::require_disjoint_views(*c, name, tables.positions, "positions");
      detail::require_disjoint_views(*c, name, cview(q), "q");
      detail::require_disjoint_views(*c, name, cview(k), "k");
      if (norm) {
        detail::require_disjoint_views(*c, name, norm->q_weight, "q_weight");
        detail::require_disjoint_views(*c, name, norm->k_weight, "k_weight");
      }
    }
    detail::require_disjoint_views(kv->value_cache, "value_cache", cview(kv->key_cache),
                                   "key_cache");
    if (!check_only && (detail::views_may_overlap(cview(q), kv->value) ||
                        detail::views_may_overlap(cview(k), kv->value)))
      fail(Status::invalid_argument, "value", "memory disjoint from q and k", "an overlap");
  }
  if (check_only) return;
  if (tokens == 0 || plan.outer_total == 0) return;

  const kernels::KernelTable& table = detail::active_kernels();
  const kernels::ForwardFn rotate = table.forward_permute;
  const kernels::NormForwardFn norm_rotate = table.forward_norm_permute
                                                 ? table.forward_norm_permute
                                                 : kernels::scalar_kernels().forward_norm_permute;
  // Each kernel may want its own lane order (the scalar norm kernel has none: natural).
  const kernels::TableLayoutFn layout_of = !norm                        ? table.permute_table_layout
                                           : table.forward_norm_permute ? table.norm_table_layout
                                                                        : nullptr;
  const kernels::TableLayout layout =
      layout_of ? layout_of(rotation.data(), dtype) : kernels::TableLayout::natural;
  const int64_t rd = rotation.rotary_dim();
  const int64_t stride = (rd + 15) / 16 * 16;
  const bool per_token = plan.outer_count > 0;
  const detail::RotationData& r = rotation.data();
  const int64_t kv_row_bytes = hd * es;
  // The norm kernels' table rows are C·w (kernel_api.hpp promises nothing of them).
  const bool table_nans_low_bits_zero = !norm && detail::table_nans_low_bits_zero(plan, layout);

  // Tokens [t, t + n) of v in place, every head of a token on its table row (cos, sin: the run's
  // first row, the next token's a stride on when the tables vary per token).
  auto run_of = [&](const TensorView& v, int64_t t, int64_t n, const float* cos, const float* sin) {
    kernels::ForwardTile run{};
    run.cos = cos;
    run.sin = sin;
    run.table_step = 0;
    run.x = static_cast<const char*>(v.data) + t * v.strides[0] * es;
    run.y = static_cast<char*>(v.data) + t * v.strides[0] * es;
    run.x_step = run.y_step = v.strides[1] * es;
    run.count = v.shape[1];
    run.tokens = n;
    run.x_token_step = run.y_token_step = v.strides[0] * es;
    run.table_token_step = per_token ? stride : 0;
    run.dtype = dtype;
    run.table_nans_low_bits_zero = table_nans_low_bits_zero;
    return run;
  };

  // Cache rows are written once and read by a later attention pass: when all of them outgrow
  // the cache (the executor's rule for streaming outputs) they are stored non-temporally, which
  // spares reading every destination line before writing it (prefill, T = 4096 of Qwen3-8B
  // shapes, 1 and 2 threads: 8-14% less time per call).
  const bool stream_cache =
      kv && detail::outgrows_cache_share(2 * tokens * k.shape[1] * kv_row_bytes);
  auto copy_row = [&](char* d, const char* s, std::size_t n) {
    if (stream_cache)
      table.stream_copy(d, s, n);
    else
      std::memcpy(d, s, n);
  };
  auto run_tokens = [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> rows;
    const std::size_t need = std::size_t(2 * kTokensPerTile * stride + 2 * rd + 32);
    if (rows.size() < need) rows.resize(need);
    // 64-byte aligned table rows (the kernels' contract).
    float* base = reinterpret_cast<float*>((reinterpret_cast<std::uintptr_t>(rows.data()) + 63) &
                                           ~std::uintptr_t(63));
    float* cos = base;
    float* sin = cos + kTokensPerTile * stride;
    float* row_cos = sin + kTokensPerTile * stride;
    float* row_sin = row_cos + rd;
    for (int64_t t0 = begin; t0 < end; t0 += kTokensPerTile) {
      const int64_t n = std::min(kTokensPerTile, end - t0);
      int64_t outer[kMaxRank] = {t0};
      detail::prepare_table_tile(plan, outer, per_token ? n : 1, stride, layout, cos, sin, row_cos,
                                 row_sin);
      // The kernels take every token of the run in one call each for q and k (a call per token
      // and operand cost its setup 2n times: 15-35% of rope + cache write on one thread).
      for (const TensorView* v : {&q, &k}) {
        const kernels::ForwardTile run = run_of(*v, t0, n, cos, sin);
        if (norm)
          norm_rotate(r, run, v == &q ? q_norm : k_norm);
        else
          rotate(r, run);
      }
      if (!kv) continue;
      for (int64_t t = t0; t < t0 + n; ++t) {
        const int64_t slot = load_slot(kv->slot_mapping, t);
        if (slot < 0) continue;
        const int64_t block = slot / kv->key_cache.shape[1], offset = slot % kv->key_cache.shape[1];
        for (int64_t h = 0; h < k.shape[1]; ++h) {
          const TensorView& kc = kv->key_cache;
          const TensorView& vc = kv->value_cache;
          copy_row(static_cast<char*>(kc.data) +
                       (block * kc.strides[0] + offset * kc.strides[1] + h * kc.strides[2]) * es,
                   static_cast<const char*>(k.data) + (t * k.strides[0] + h * k.strides[1]) * es,
                   std::size_t(kv_row_bytes));
          copy_row(static_cast<char*>(vc.data) +
                       (block * vc.strides[0] + offset * vc.strides[1] + h * vc.strides[2]) * es,
                   static_cast<const char*>(kv->value.data) +
                       (t * kv->value.strides[0] + h * kv->value.strides[1]) * es,
                   std::size_t(kv_row_bytes));
        }
      }
    }
    if (stream_cache) detail::fence_streamed();
  };

  int threads = detail::resolve_threads(options.num_threads);
  const int64_t bytes = plan.bytes_moved + (kv ? 3 * tokens * k.shape[1] * kv_row_bytes : 0);
  threads = detail::threads_for_bytes(options, bytes, threads);
  // Chunks of whole table tiles, several per thread.
  const int64_t tiles = (tokens + kTokensPerTile - 1) / kTokensPerTile;
  detail::parallel_for(options, tiles, threads, [&](int64_t b, int64_t e) {
    run_tokens(b * kTokensPerTile, std::min(tokens, e * kTokensPerTile));
  });
}

}  // namespace

void qk_norm_rope_check(const Rotation& rotation, const Tables& tables, const QkNorm& norm,
                        const TensorView& q, const TensorView& k) {
  const detail::MetadataOnly metadata_only;
  run_fused(rotation, tables, q, k, &norm, nullptr, {});
}

void rope_and_cache_kv_check(const Rotation& rotation, const Tables& tables, const TensorView& q,
                             const TensorView& k, const PagedKvWrite& cache, const QkNorm* norm) {
  const detail::MetadataOnly metadata_only;
  run_fused(rotation, tables, q, k, norm, &cache, {});
}

void qk_norm_rope(const Rotation& rotation, const Tables& tables, const QkNorm& norm,
                  const TensorView& q, const TensorView& k, const ExecOptions& options) {
  run_fused(rotation, tables, q, k, &norm, nullptr, options);
}

void rope_and_cache_kv(const Rotation& rotation, const Tables& tables, const TensorView& q,
                       const TensorView& k, const PagedKvWrite& cache, const QkNorm* norm,
                       const ExecOptions& options) {
  run_fused(rotation, tables, q, k, norm, &cache, options);
}

}  // namespace rome
