// The RoME operation: y = (x·A) ⊙ C + (x·B) ⊙ S over strided views.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "rome/rotation.hpp"
#include "rome/tensor.hpp"

namespace rome {

// How a table's columns map onto the rotary_dim lanes of a head.
enum class TableWidth : std::uint8_t {
  full,    // one column per lane (width == rotary_dim)
  halves,  // width == rotary_dim/2, lane j reads column j % width (NeoX caches: vLLM, ONNX)
  pairs,   // width == rotary_dim/2, lane j reads column j / 2 (GPT-J caches, ExecuTorch)
};

// The cos (C) and sin (S) tables, given one of three ways:
//  - direct: cos and sin share one shape, broadcastable to x's shape with the last axis being
//    the table width (e.g. [1, 1, S, D], [B, 1, S, D], [S, D], [1, S, 1, D]);
//  - cache: cos and sin are [P, width] and `positions` (int32 or int64) picks a row per token.
//    positions has rank x.rank - 1, broadcastable to x's shape without its last axis; with
//    `column_axis` set it has one more trailing axis (one position per axis: t, h, w, ...) and
//    column c reads the position of axis column_axis[c] (MRoPE, multi-axis grids).
//  - table-free: no cos/sin tensors; `positions` as for the cache form, and `frequencies` (one
//    per lane pair of the rotation, pairs numbered by their lower lane: j and j + rot/2 for
//    half, 2i and 2i + 1 for interleave, block by block for block diagonals). C and S of lane j
//    in pair i are amplitude·cos/sin(position × frequencies[i]), computed per token as the rows
//    are needed: the angle without rounding error, reduced by π/2 in double, cos/sin in fp32 on
//    the reduced argument — within 2 fp32 ulp at any position (|position × frequency| < 2^50).
//    `column_axis` then has one entry per frequency. Needs a rotation that turns lane pairs
//    (every signed-permutation RoPE; not a dense one). Nothing of size max_position is built.
// Tables may be any floating dtype, independent of x, and any stride (including the last axis).
struct Tables {
  ConstTensorView cos;
  ConstTensorView sin;
  ConstTensorView positions;  // empty (rank 0, data == nullptr) for direct tables
  std::vector<int> column_axis;
  TableWidth width = TableWidth::full;
  // Rotate by −θ: the sine is read negated (vLLM's `inverse`). For unit tables this undoes the
  // rotation when A = I and B is antisymmetric (half, interleave, quarter, their blocks; not
  // interleave_half, whose A reorders lanes). No table is rebuilt.
  bool inverse = false;
  // Table-free form (cos and sin left empty).
  std::vector<double> frequencies;
  double amplitude = 1.0;

  bool is_cache() const noexcept { return positions.data != nullptr || positions.rank > 0; }
  bool is_table_free() const noexcept { return !frequencies.empty(); }
};

// One tensor to rotate: `in` is read, `out` is written. out.data == in.data with equal strides
// is in place; any other overlap is an error.
struct Operand {
  ConstTensorView in;
  TensorView out;
};

// Runs body(context, begin, end) over disjoint ranges covering [0, items), on at most `threads`
// threads, and returns when every range is done. Lets a host run RoME on its own thread pool
// (the torch front uses at::parallel_for, so RoME follows torch's thread count).
using RangeBody = void (*)(void* context, std::int64_t begin, std::int64_t end);
using ParallelFor = void (*)(std::int64_t items, int threads, RangeBody body, void* context);

struct ExecOptions {
  int num_threads = 0;                 // 0: rome::default_num_threads()
  ParallelFor parallel_for = nullptr;  // nullptr: RoME's own pool
  // Tokens per tile of the forward executor (a tile is a run of tokens × every head of q and
  // k; its table rows are prepared once). 0: sized from the CPU's L2 cache.
  std::int64_t tile_tokens = 0;
  // Calls that move fewer bytes (reads + writes) run on the calling thread: waking a worker costs
  // more than it saves (a decode step). -1: RoME's threshold (256 KiB, for every ISA and for
  // rope_backward; measured, README); 0: every call with work for several threads splits it
  // (tests run the threaded paths on small tensors).
  std::int64_t min_parallel_bytes = -1;
};

// Rotates q (and k, when given) with one table read per token: each worker loads a token's
// table row once and applies it to every head of q and k. k may have fewer heads than q
// (GQA/MQA): its shape must equal q's on every axis the tables vary along.
void rope_forward(const Rotation& rotation, const Tables& tables, const Operand& q,
                  const Operand* k = nullptr, const ExecOptions& options = {});

// Checks the arguments of rope_forward as it does before its first write, from shapes, dtypes
// and strides alone: data pointers may be null and nothing is read, so what needs memory (null or
// misaligned pointers, aliasing between q, k, their outputs and the tables, position values) is
// left to rope_forward. For hosts that must refuse a call without running it: the torch front's
// Meta kernels, so that torch.compile refuses while tracing what the CPU kernel refuses.
void rope_check(const Rotation& rotation, const Tables& tables, const Operand& q,
                const Operand* k = nullptr);

// A paged key cache and the sequences whose keys to re-rotate (context shift, prefix reuse).
// cache: [num_blocks, block_size, heads, head_dim], any strides but a contiguous last axis (a
// [num_blocks, heads, block_size, head_dim] cache is passed as its permuted view).
// block_table: int32/int64 [num_seqs, max_blocks]; seq_lens: int32/int64 [num_seqs]. Sequence b
// owns slots [0, seq_lens[b]) of the blocks block_table[b][0 .. ceil(seq_lens[b]/block_size)):
// only those slots are read and written, and no block may belong to two sequences.
struct PagedKeys {
  TensorView cache;
  ConstTensorView block_table;
  ConstTensorView seq_lens;
};

// Rotates the cached keys of every sequence in place by its own table row: tables are direct,
// cos/sin [num_seqs, width] (row b: the angles delta_b·inv_freq of that sequence's position
// shift, built by the caller in any precision; Tables::inverse rotates back). Rotations compose,
// R(p + delta) = R(delta)·R(p), so keys rotated at p end as if rotated at p + delta. One pass over
// the touched slots; no table of the sequence length. Everything is validated before a write.
void rerotate_paged(const Rotation& rotation, const Tables& tables, const PagedKeys& keys,
                    const ExecOptions& options = {});

// Table-free RoPE's cos and sin as table rows, for callers that must hand tables on: row r of
// the [positions.size(), 2·frequencies.size()] row-major outputs holds amplitude·cos/sin(
// positions[r] · frequencies[i]) at columns i and i + n (half layout) or 2i and 2i + 1 (pairs),
// the same fp32 values the table-free executor computes. Validated first (finite frequencies
// and amplitude, |position × frequency| < 2^50): on error nothing is written. Null outputs:
// validation only.
void exact_cos_sin_rows(std::span<const std::int64_t> positions,
                        std::span<const double> frequencies, double amplitude, bool pairs_layout,
                        float* cos, float* sin);

// How many distinct threads ran the calling thread's last rope_forward (0 when it had no work):
// a diagnostic that shows which thread setting took effect.
int last_call_threads() noexcept;

// Gradients of y = (x·A) ⊙ C + (x·B) ⊙ S given g = dL/dy (general formulas, no sin-negation):
//   dx = (g ⊙ C)·Aᵀ + (g ⊙ S)·Bᵀ
//   dC = Σ g ⊙ (x·A),  dS = Σ g ⊙ (x·B)   (summed over the axes the table broadcasts on)
//   dA = xᵀ·(g ⊙ C),   dB = xᵀ·(g ⊙ S)     (summed over all rows)
// Any output left empty (data == nullptr) is skipped. dcos/dsin take the shape of the direct
// tables (cache tables have no table gradient). da/db are rotary_dim × rotary_dim fp32.
struct Gradients {
  TensorView dx;
  TensorView dcos;
  TensorView dsin;
  float* da = nullptr;
  float* db = nullptr;
};
void rope_backward(const Rotation& rotation, const Tables& tables, const ConstTensorView& grad,
                   const ConstTensorView& x, const Gradients& out, const ExecOptions& options = {});

// Instruction sets, ordered: a machine that runs one runs every lower one.
enum class Isa : std::uint8_t { scalar = 0, avx2 = 1, avx512 = 2, amx = 3 };
const char* isa_name(Isa isa) noexcept;

// What the CPU and OS support (CPUID + XCR0 + the Linux AMX permission request), read once.
Isa detected_isa() noexcept;
// The ISA in use: detected_isa() lowered by ROME_MAX_ISA and by set_max_isa().
Isa active_isa() noexcept;
// Lowers (never raises) the ISA for later calls; returns the ISA now active. Meant for tests
// and benchmarks that run every path in one process.
Isa set_max_isa(Isa limit) noexcept;
bool isa_compiled(Isa isa) noexcept;  // this build carries kernels for `isa`

// Threads: ROME_NUM_THREADS, else every core. set_num_threads(0) returns to that default.
int default_num_threads() noexcept;
void set_num_threads(int threads);
// The thread count the user asked RoME for: set_num_threads(), else ROME_NUM_THREADS, else 0
// (nothing asked: a host such as the torch front then applies its own setting).
int requested_num_threads() noexcept;

}  // namespace rome
