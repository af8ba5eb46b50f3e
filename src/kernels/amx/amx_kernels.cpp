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
    for (int t = 0; t < 6; ++t) {
      config.column_bytes[t] = 64;
      config.rows[t] = 16;
    }
    _tile_loadconfig(&config);
  }
  static void release() { _tile_release(); }
  // GCC's tile intrinsics paste the register number into the instruction text, so each use
  // names a literal register.
  template <int T>
  static void zero() {
    static_assert(T == 0);
    _tile_zero(0);
  }
  template <int T>
  static void load(const void* p, std::size_t stride) {
    static_assert(T >= 2 && T <= 5);
    if constexpr (T == 2) _tile_loadd(2, p, stride);
    if constexpr (T == 3) _tile_loadd(3, p, stride);
    if constexpr (T == 4) _tile_loadd(4, p, stride);
    if constexpr (T == 5) _tile_loadd(5, p, stride);
  }
  template <int T>
  static void store(void* p, std::size_t stride) {
    static_assert(T == 0);
    _tile_stored(0, p, stride);
  }
  template <int C, int A, int B>
  static void dot() {
    static_assert(C == 0 && (A == 2 || A == 3) && (B == 4 || B == 5) && !(A == 3 && B == 5));
    if constexpr (A == 2 && B == 4) _tile_dpbf16ps(0, 2, 4);
    if constexpr (A == 2 && B == 5) _tile_dpbf16ps(0, 2, 5);
    if constexpr (A == 3 && B == 4) _tile_dpbf16ps(0, 3, 4);
  }
};

}  // namespace

const KernelTable& amx_kernels(bool avx512_bf16) {
  auto make = [](const KernelTable& avx512) {
    return KernelTable{"amx",
                       avx512.forward_permute,
                       amx::forward_dense_any<HardwareTiles>,
                       avx512_accumulate_product,
                       avx512.permute_table_layout,
                       avx512.forward_norm_permute,
                       avx512.norm_table_layout,
                       avx512.cos_sin};
  };
  static const KernelTable table = make(avx512_kernels(false));
  static const KernelTable table_bf16 = make(avx512_kernels(true));
  return avx512_bf16 ? table_bf16 : table;
}

}  // namespace rome::kernels
