// The contract between the core and the per-ISA kernels. The core validates, plans, splits work
// into tiles and prepares their table rows; a kernel rotates the rows of one tile.
#pragma once

#include <cstddef>
#include <cstdint>

#include "../core/rotation_data.hpp"
#include "rome/tensor.hpp"

namespace rome::kernels {

// A tile: `count` rows of one operand, handed over by the core's executor. Row n reads
// x + n·x_step and writes y + n·y_step (bytes; y may equal x: in place, never a partial
// overlap) with the table rows cos + n·table_step and sin + n·table_step (floats; 0: one table
// row for every row of the tile). Table rows are fp32, 64-byte aligned, padded with zeros to a
// multiple of 16 floats. For signed permutations the signs of A and B are already folded into
// them (cos·sign_A, sin·sign_B lane by lane), so the kernel only moves lanes.
struct ForwardTile {
  const float* cos;
  const float* sin;
  std::int64_t table_step;
  const char* x;
  char* y;
  std::int64_t x_step, y_step;
  std::int64_t count;
  // Permute and QK-norm kernels take a run of tokens per call: `tokens` runs of `count` rows, run t
  // at x + t·x_token_step (y and the table rows likewise). One call instead of one per token keeps
  // the kernel's per-call setup off token-major tiles and off the groups of heads of head-major
  // ones (rope_forward.cpp: kHeadsPerGroup). Dense kernels are handed one token
  // (detail::ForwardKernel::token_runs says which). A token-major call of one token still sets
  // x_token_step: the kernel prefetches the next tokens' rows by it (0: along the rows).
  std::int64_t tokens = 1;
  std::int64_t x_token_step = 0, y_token_step = 0, table_token_step = 0;
  DType dtype;            // of x and y
  bool copy_passthrough;  // out of place: copy lanes [rotary_dim, head_dim) from x to y
  bool stream;            // non-temporal stores where rows are aligned (never set in place)
  // Every NaN of the table rows has 16 zero low bits: rows read from bf16 tables, or rows the core
  // prepared in TableLayout::even_odd_16 order (SpreadEvenOdd16Fn quietens their NaNs and clears
  // those bits; table-free rows have none). A value-initialised tile promises nothing.
  bool table_nans_low_bits_zero;

  const void* x_row(std::int64_t n) const { return x + n * x_step; }
  void* y_row(std::int64_t n) const { return y + n * y_step; }
  const float* cos_row(std::int64_t n) const { return cos + n * table_step; }
  const float* sin_row(std::int64_t n) const { return sin + n * table_step; }
  // Token t's run of rows, as a one-token tile.
  ForwardTile token(std::int64_t t) const {
    ForwardTile one = *this;
    one.tokens = 1;
    one.x += t * x_token_step;
    one.y += t * y_token_step;
    one.cos += t * table_token_step;
    one.sin += t * table_token_step;
    return one;
  }
};

// Forward epilogues (permute, dense, QK-norm) on 16-bit x: one fma (combine_lane_one_fma) instead
// of the compensated combine_lane. With 16-bit tables x·c is exact in fp32 (at most 11 + 11
// significant bits) and the fma is the correctly rounded sum. With fp32 tables it leaves out the
// rounding error of x·c, at most 2^-24·|x·c|: 2^13 (fp16) to 2^16 (bf16) times below the output's
// own 16-bit rounding unless the two products cancel that far, and the 16-bit input carries a
// relative error as much larger. The compensated sum cost the seed's bf16 tensor with fp32 tables
// 1.13-1.28x the time, and QK-norm + RoPE 1.08-1.11x (AVX2, from DRAM, 1 and 2 threads). fp32 x
// keeps it. One rule for every path, so a signed permutation run as a matrix gives the permute
// path's bits.
constexpr bool single_fma_epilogue(DType x) {
  return x == DType::bf16 || x == DType::f16;
}

// bf16 x and table rows whose NaNs have 16 zero low bits: so has every NaN the one-fma epilogue
// returns (an input's payload, quietened, or the default NaN). Rounding such a NaN to bf16 leaves
// its high half unchanged, so a kernel may narrow without a NaN case.
inline bool nan_results_low_bits_zero(const ForwardTile& tile) {
  return tile.dtype == DType::bf16 && tile.table_nans_low_bits_zero;
}

// y = (x·A) ⊙ cos + (x·B) ⊙ sin for every row of the tile; math in fp32, one rounding.
using ForwardFn = void (*)(const detail::RotationData& rotation, const ForwardTile& tile);

// The lane order a permute kernel wants its table rows in. even_odd_16: within every 16 lanes
// the 8 even lanes come first, then the 8 odd ones (a kernel that splits 16 bf16 values into
// their even and odd halves by shifts and masks, with no permute, reads them that way).
enum class TableLayout : std::uint8_t { natural, even_odd_16 };
using TableLayoutFn = TableLayout (*)(const detail::RotationData& rotation, DType dtype);

// c[r·ldc + j] += Σ_{i<k} a[r·lda + i] · b[i·ldb + j] for r < rows, j < n, in fp32: per
// element one fma per i in ascending i, starting from c's value. Every ISA performs exactly this
// sequence, so results agree bit for bit across ISAs (and do not depend on how rows are split).
// The dense backward's products (dx through Mᵀ, x·M for the table gradients, dM = xᵀ·(g ⊙ S)).
using AccumulateProductFn = void (*)(std::int64_t rows, std::int64_t k, std::int64_t n,
                                     const float* a, std::int64_t lda, const float* b,
                                     std::int64_t ldb, float* c, std::int64_t ldc);

// Per-head RMSNorm fused with a signed-permutation rotation (QK-norm + RoPE). Each row of head_dim
// lanes is normalised in fp32: ss = Σ x² in a fixed order (lane j into partial sum j % 8 by fma;
// for bf16, each whole 16-lane chunk's even lanes 16c + 2k into partial sum k, then its odd lanes;
// then ((s0+s4)+(s2+s6)) + ((s1+s5)+(s3+s7))), r = 1 / sqrt(ss / head_dim + eps). The weight goes
// into the table row (common/norm_fold-inl.hpp: C'_j = C_j·w_a(j), S'_j = S_j·w_b(j), once per
// row of tables, not per head). Rotated lane j (j < rotary_dim; table rows in norm_table_layout's
// order, signs folded) is y_j = r · (x_a(j)·C'_j + x_b(j)·S'_j): the sum of the raw lanes'
// products, formed as ForwardFn's epilogue forms it (single_fma_epilogue: combine_lane_one_fma,
// else combine_lane), then scaled once. Where that is not finite (r is 0 or infinite, a product
// overflows, an input is inf or NaN) the lane is the normalised form instead, combine_lane(x_a·r,
// C'_j, x_b·r, S'_j), so no overflow of an unnormalised product reaches the output. Lanes past
// rotary_dim are (x·r)·w. Each lane is rounded once. Every ISA gives the same bits (where two NaNs
// meet in one operation, which payload survives follows the compiler's operand order). In place
// (y == x) or out of place.
struct NormParams {
  const float* weight;  // head_dim fp32 values (Gemma's 1 + w already added)
  float eps;  // finite and >= 0 (the core checks): the SIMD kernels' overflow bounds need it
};
using NormForwardFn = void (*)(const detail::RotationData& rotation, const ForwardTile& tile,
                               const NormParams& norm);

// cos[i] = fp32(amplitude·cos(position[i]·frequency[i])) and sin likewise, for i < n: the
// angle formed without rounding error and reduced by π/2 in double, cos/sin evaluated in fp32 on
// the reduced argument: within 2 fp32 ulp of the true value (|error| < 1e-7), amplitude one more
// fp32 rounding (cos_sin-inl.hpp). Requires |position[i]·frequency[i]| < 2^51 (the core
// checks). Every ISA gives the same bits.
using CosSinFn = void (*)(std::int64_t n, const double* position, const double* frequency,
                          double amplitude, float* cos, float* sin);

// Whole rows of the same values: for r < rows and i < n, θ = position[r]·frequency[i]:
// cos[r·stride + i] = CosSinFn's cos of θ, sin likewise, and with repeat_halves the same values
// again at r·stride + n + i (the half layout's second half). Same bits as CosSinFn, except that
// each written lane l of a row has its bits xor-ed with cos_signs[l] / sin_signs[l] (l < n, or
// 2n with repeat_halves); a null array xors nothing.
using CosSinRowsFn = void (*)(std::int64_t rows, const double* position, std::int64_t n,
                              const double* frequency, double amplitude, bool repeat_halves,
                              const std::uint32_t* cos_signs, const std::uint32_t* sin_signs,
                              std::int64_t stride, float* cos, float* sin);

// out[i] = the bf16 bits of in[i], for i < n: round to nearest even, NaN quietened, subnormals
// kept (core/convert.hpp's float_to_bf16). Every ISA gives the same bits.
using NarrowBf16Fn = void (*)(std::int64_t n, const float* in, std::uint16_t* out);

// One table row into TableLayout::even_odd_16 order, for the tiles the core prepares. Lane j of
// the rd lanes (a multiple of 16) reads column j of `row`, or column j - period past the first
// `period` lanes: period is rd (full rows) or rd / 2 (half-width rows, a multiple of 16). `row` is
// fp32, or bf16 (dtype), whose value is the upper half of its fp32 bits. out[k + i] for 16-lane
// chunk k gets chunk lane 2i (i < 8) or 2(i - 8) + 1 (i >= 8), with its bits xor-ed with signs[k +
// i] (null: none) and with flip (each 0 or the sign bit 0x80000000), and every NaN given the quiet
// bit and 16 zero low bits. Such rows let the bf16 kernels narrow without a NaN case
// (nan_results_low_bits_zero; the case cost 5-10% of a bf16 call): the one-fma epilogue returns
// such an input quietened, and rounding it to bf16 keeps its high half, which is the NaN case's
// result for the original value. Without the quiet bit a signalling NaN with only low payload bits
// would become an infinity. Pure bit movement: every ISA gives the same bits. out may be the row
// itself (fp32, full width): each chunk is read before it is written.
using SpreadEvenOdd16Fn = void (*)(const void* row, DType dtype, std::int64_t period,
                                   const std::uint32_t* signs, std::uint32_t flip, std::int64_t rd,
                                   float* out);

// n bytes from src to dst (disjoint): from dst's first 64-byte boundary on (16-byte in the scalar
// kernels) whole vectors with non-temporal stores, the bytes before it and the last partial vector
// plain. No fence: the caller orders the stores (an sfence) before publishing them.
using StreamCopyFn = void (*)(void* dst, const void* src, std::size_t n);

struct KernelTable {
  const char* name;
  ForwardFn forward_permute;  // rotation.kind == signed_permutation
  ForwardFn forward_dense;    // rotation.kind == dense; nullptr: use the scalar kernel
  AccumulateProductFn accumulate_product;
  TableLayoutFn permute_table_layout;    // nullptr: natural
  NormForwardFn forward_norm_permute;    // nullptr: use the scalar kernel
  TableLayoutFn norm_table_layout;       // of forward_norm_permute's tiles; nullptr: natural
  CosSinFn cos_sin;                      // table-free RoPE's angles
  CosSinRowsFn cos_sin_rows;             // the same, a row of frequencies per position
  NarrowBf16Fn narrow_bf16;              // tables::to_bf16_bits (16-bit tables built in bulk)
  SpreadEvenOdd16Fn spread_even_odd_16;  // the core's even/odd table rows
  StreamCopyFn stream_copy;              // outputs written once and read much later
};

// One per ISA, each defined in its own object library compiled with that ISA's flags. Feature bits
// beyond the ISA come in as arguments (the core reads CPUID; kernels never ask):
// avx512_bf16 = the CPU has AVX512-BF16, whose vcvtne(2)ps2bf16 narrows bf16 rows;
// bf16_dot = its vdpbf16ps issues as often as an fma, so bf16 x times a bf16-exact dense matrix
// runs as dot products (needs avx512_bf16).
const KernelTable& scalar_kernels();
const KernelTable& avx2_kernels();
const KernelTable& avx512_kernels(bool avx512_bf16, bool bf16_dot = false);
const KernelTable& amx_kernels(bool avx512_bf16);
// For tests: which permutation compiled into the AVX-512 kernels runs `rotation` (0: none; 1, 2:
// 3D 44/44/40, 44/42/42 in half blocks; 3, 4: interleave_half 64, 128).
int avx512_compiled_plan(const detail::RotationData& rotation);

void scalar_spread_even_odd_16(const void* row, DType dtype, std::int64_t period,
                               const std::uint32_t* signs, std::uint32_t flip, std::int64_t rd,
                               float* out);
void scalar_cos_sin(std::int64_t n, const double* position, const double* frequency,
                    double amplitude, float* cos, float* sin);
void avx2_cos_sin(std::int64_t n, const double* position, const double* frequency, double amplitude,
                  float* cos, float* sin);
void avx512_cos_sin(std::int64_t n, const double* position, const double* frequency,
                    double amplitude, float* cos, float* sin);
void scalar_cos_sin_rows(std::int64_t rows, const double* position, std::int64_t n,
                         const double* frequency, double amplitude, bool repeat_halves,
                         const std::uint32_t* cos_signs, const std::uint32_t* sin_signs,
                         std::int64_t stride, float* cos, float* sin);
void avx2_cos_sin_rows(std::int64_t rows, const double* position, std::int64_t n,
                       const double* frequency, double amplitude, bool repeat_halves,
                       const std::uint32_t* cos_signs, const std::uint32_t* sin_signs,
                       std::int64_t stride, float* cos, float* sin);
void avx512_cos_sin_rows(std::int64_t rows, const double* position, std::int64_t n,
                         const double* frequency, double amplitude, bool repeat_halves,
                         const std::uint32_t* cos_signs, const std::uint32_t* sin_signs,
                         std::int64_t stride, float* cos, float* sin);

void avx2_forward_norm_permute(const detail::RotationData& rotation, const ForwardTile& tile,
                               const NormParams& norm);
TableLayout avx2_norm_table_layout(const detail::RotationData& rotation, DType dtype);
// Natural table rows. The second narrows bf16 rows with AVX512-BF16's vcvtneps2bf16.
void avx512_forward_norm_permute(const detail::RotationData& rotation, const ForwardTile& tile,
                                 const NormParams& norm);
void avx512_bf16_forward_norm_permute(const detail::RotationData& rotation, const ForwardTile& tile,
                                      const NormParams& norm);

}  // namespace rome::kernels
