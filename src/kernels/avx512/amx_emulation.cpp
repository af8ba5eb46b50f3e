// A software model of the AMX tile instructions the matrix-unit kernel uses (tile loads and
// stores, zero, TDPBF16PS), so its tiling, packing and epilogue are tested on every AVX-512 CPU,
// not only on CPUs with AMX. Used by the tests; never chosen by dispatch.
#include <cstring>

#include "../../core/convert.hpp"
#include "../amx/amx_dense.hpp"
#include "../dense_kernels.hpp"

namespace rome::kernels {
namespace {

struct EmulatedTiles {
  struct alignas(64) Tile {
    unsigned char bytes[16][64];
  };
  static Tile* registers() {
    thread_local Tile tiles[8];
    return tiles;
  }
  static void configure() {}
  static void release() {}
  template <int T>
  static void zero() {
    std::memset(&registers()[T], 0, sizeof(Tile));
  }
  template <int T>
  static void load(const void* p, std::size_t stride) {
    for (int r = 0; r < 16; ++r)
      std::memcpy(registers()[T].bytes[r], static_cast<const char*>(p) + r * stride, 64);
  }
  template <int T>
  static void store(void* p, std::size_t stride) {
    for (int r = 0; r < 16; ++r)
      std::memcpy(static_cast<char*>(p) + r * stride, registers()[T].bytes[r], 64);
  }
  // TDPBF16PS: c[m][n] += Σ_k a[m][2k]·b[k][2n] + a[m][2k+1]·b[k][2n+1] (bf16 products are exact
  // in fp32; the sums round in fp32).
  template <int C, int A, int B>
  static void dot() {
    Tile& c = registers()[C];
    const Tile& a = registers()[A];
    const Tile& b = registers()[B];
    for (int m = 0; m < 16; ++m)
      for (int n = 0; n < 16; ++n) {
        float acc;
        std::memcpy(&acc, &c.bytes[m][4 * n], 4);
        for (int k = 0; k < 16; ++k) {
          std::uint16_t a0, a1, b0, b1;
          std::memcpy(&a0, &a.bytes[m][4 * k], 2);
          std::memcpy(&a1, &a.bytes[m][4 * k + 2], 2);
          std::memcpy(&b0, &b.bytes[k][4 * n], 2);
          std::memcpy(&b1, &b.bytes[k][4 * n + 2], 2);
          acc += detail::bf16_to_float(a0) * detail::bf16_to_float(b0);
          acc += detail::bf16_to_float(a1) * detail::bf16_to_float(b1);
        }
        std::memcpy(&c.bytes[m][4 * n], &acc, 4);
      }
  }
};

void forward_dense(const detail::RotationData& r, const ForwardTile& tile) {
  amx::forward_dense_any<EmulatedTiles, avx512::NarrowExact>(r, tile, avx512_forward_dense);
}

}  // namespace

const KernelTable& amx_emulated_kernels() {
  // The permute kernels narrow bf16 in integer arithmetic (the same bits as with AVX512-BF16):
  // this table exists for the dense tile model.
  static const KernelTable table{"amx-emulated",
                                 avx512_kernels(false).forward_permute,
                                 forward_dense,
                                 avx512_accumulate_product,
                                 avx512_kernels(false).permute_table_layout,
                                 avx512_kernels(false).forward_norm_permute,
                                 avx512_kernels(false).norm_table_layout,
                                 avx512_kernels(false).cos_sin,
                                 avx512_kernels(false).cos_sin_rows,
                                 avx512_kernels(false).narrow_bf16,
                                 avx512_kernels(false).spread_even_odd_16,
                                 avx512_kernels(false).stream_copy};
  return table;
}

}  // namespace rome::kernels
