// The one dispatch point: picks the kernel table of the active ISA.
#pragma once

#include <cstdint>
#include <string>
#include <utility>

#include "../kernels/kernel_api.hpp"
#include "rome/rope.hpp"

namespace rome::detail {

struct CpuFeatures {
  bool avx2 = false, fma = false, f16c = false;
  bool avx512f = false, avx512bw = false, avx512vl = false, avx512dq = false;
  bool avx512_bf16 = false, avx512_fp16 = false;
  // vdpbf16ps issues about as often as an fma (AMD Zen 4 and later). On an Intel Xeon it measured
  // a quarter of the fma rate, so the dense bf16 dot-product kernel lost to the fma one there.
  bool fast_bf16_dot = false;
  bool amx_tile = false, amx_bf16 = false, amx_permitted = false;
};
const CpuFeatures& cpu_features() noexcept;

const kernels::KernelTable& active_kernels() noexcept;

// The active ISA's forward kernel for a rotation (dense: its matrix kernel, else the scalar one)
// and the table-row layout it wants for x's dtype.
struct ForwardKernel {
  kernels::ForwardFn fn;
  kernels::TableLayout layout;
  bool token_runs;  // takes tiles of several tokens (ForwardTile::tokens): the permute kernels
};
ForwardKernel forward_kernel(const Rotation& rotation, DType dtype) noexcept;

// Data cache sizes in bytes (sysconf, which reads CPUID; typical values where it reports none).
// l3_per_thread: l3 over the logical-processor IDs CPUID says share it (l3 where it says
// nothing; on bare metal a power of two at least the thread count), or Linux sysfs's L3 over the
// CPUs of its shared_cpu_list where that share is smaller (then l3 is sysfs's too).
struct CacheSizes {
  std::int64_t l1d, l2, l3, l3_per_thread;
};
const CacheSizes& cache_sizes() noexcept;
// sysfs's cache "size" ("32768K", "32M", "512") in bytes, and the number of CPUs of a
// "shared_cpu_list" ("0-1,4"); 0 for anything else.
std::int64_t sysfs_cache_bytes(const std::string& size) noexcept;
int cpu_list_count(const std::string& list) noexcept;
// cpu0's level-3 cache as Linux's sysfs lists it: {bytes, CPUs sharing it}; {0, 0} where absent.
std::pair<std::int64_t, int> sysfs_l3();
// Whether `bytes` written once cannot stay in the last-level cache, so non-temporal stores pay:
// glibc 2.26-2.37's rule for memmove (3/4 of one thread's share of the L3). The share is the
// smaller of CPUID's and sysfs's (cache_sizes): on a VM whose CPUID reports its host's L3, outputs
// of 12-120 MB were not streamed and paid the read-for-ownership of every line (BENCHMARKS.md,
// twenty-seventh session).
bool outgrows_cache_share(std::int64_t bytes) noexcept;
// Orders non-temporal stores (KernelTable::stream_copy) before whatever publishes them (a pool's
// join).
void fence_streamed() noexcept;
// The active kernels' stream_copy, fenced: the benchmarks' streaming copy floor
// (bench/common/copy_floor.hpp says why memcpy alone is not one).
void stream_copy(void* dst, const void* src, std::size_t n) noexcept;
// Tests only: report `sizes` instead of this CPU's (nullptr: back to normal), so that cache-size
// decisions (streaming stores, tile budgets) are exercised on any machine.
void override_cache_sizes_for_testing(const CacheSizes* sizes) noexcept;
int resolve_threads(int requested) noexcept;

// Tests only: run every call on `table` instead of the active ISA's (nullptr: back to normal).
// Lets the matrix-unit kernel run on its software tile model where the CPU has no AMX.
void override_kernels_for_testing(const kernels::KernelTable* table) noexcept;
// Throws when the environment asks for something invalid (an unknown ROME_MAX_ISA).
void check_environment();
constexpr int kMaxThreads = 4096;
constexpr std::int64_t kMaxTileTokens = 1 << 20;
void check_options(const ExecOptions& options);

}  // namespace rome::detail
