// The AMX ISA: signed permutations stay on the AVX-512 permute kernel (pure vector work at
// memory speed); dense rotations run on the tile unit (amx_dense.hpp).
#include <immintrin.h>

#include "../dense_kernels.hpp"
#include "amx_dense.hpp"

namespace rome::kernels {
namespace {

// Palette 1 with every tile 16 rows × 64 bytes: accumulators 16×16 fp32, operands 16×32 bf16.
struct alignas(64) TileConfig {
  std::uint8_t palette = 1, start_row = 0, reserved[14] = {};
  std::uint16_t column_bytes[16] = {};
  std::uint8_t rows[16] = {};
};

struct HardwareTiles {
  static void configure() {
    TileConfig config;
    for (int t = 0; t < 8; ++t) {
      config.column_bytes[t] = 64;
      config.rows[t] = 16;
    }
    _tile_loadconfig(&config);
  }
  static void release() { _tile_release(); }
  // GCC's tile intrinsics paste their register arguments into the instruction text, so they
  // take literals only; "%c" prints a template constant the same way.
  template <int T>
  static void zero() {
    __asm__ volatile("tilezero %%tmm%c0" ::"i"(T));
  }
  template <int T>
  static void load(const void* p, std::size_t stride) {
    __asm__ volatile("tileloadd (%0,%1,1), %%tmm%c2" ::"r"(p), "r"(stride), "i"(T) : "memory");
  }
  template <int T>
  static void store(void* p, std::size_t stride) {
    __asm__ volatile("tilestored %%tmm%c2, (%0,%1,1)" ::"r"(p), "r"(stride), "i"(T) : "memory");
  }
  template <int C, int A, int B>
  static void dot() {
    __asm__ volatile("tdpbf16ps %%tmm%c2, %%tmm%c1, %%tmm%c0" ::"i"(C), "i"(A), "i"(B));
  }
};

template <class N>
void forward_dense(const detail::RotationData& r, const ForwardTile& tile) {
  amx::forward_dense_any<HardwareTiles, N>(r, tile, avx512_forward_dense);
}

}  // namespace

const KernelTable& amx_kernels(bool avx512_bf16) {
  auto make = [](const KernelTable& avx512, ForwardFn dense) {
    return KernelTable{"amx",
                       avx512.forward_permute,
                       dense,
                       avx512_accumulate_product,
                       avx512.permute_table_layout,
                       avx512.forward_norm_permute,
                       avx512.norm_table_layout,
                       avx512.cos_sin,
                       avx512.cos_sin_rows,
                       avx512.narrow_bf16,
                       avx512.spread_even_odd_16,
                       avx512.stream_copy};
  };
  static const KernelTable table = make(avx512_kernels(false), forward_dense<avx512::NarrowExact>);
  static const KernelTable table_bf16 =
      make(avx512_kernels(true), forward_dense<avx512::NarrowBf16Insn>);
  return avx512_bf16 ? table_bf16 : table;
}

}  // namespace rome::kernels
