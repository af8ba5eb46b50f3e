#include "dispatch.hpp"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <utility>

#include "rome/error.hpp"
#include "thread_pool.hpp"

#if defined(__unix__)
#include <unistd.h>
#endif

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#define ROME_X86 1
#endif

namespace rome {
namespace detail {
namespace {

#ifdef ROME_X86
std::uint64_t read_xcr0() {
  std::uint32_t eax, edx;
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return (std::uint64_t(edx) << 32) | eax;
}

// Linux keeps AMX tile data off until a process asks (arch_prctl ARCH_REQ_XCOMP_PERM).
bool request_amx_permission() {
#if defined(__linux__)
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
#else
  return false;
#endif
}
#endif

CpuFeatures detect() {
  CpuFeatures f;
#ifdef ROME_X86
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return f;
  const bool osxsave = c & (1u << 27), avx = c & (1u << 28);
  f.fma = c & (1u << 12);
  f.f16c = c & (1u << 29);
  if (!osxsave || !avx) return f;
  const std::uint64_t xcr0 = read_xcr0();
  const bool ymm_state = (xcr0 & 0x6) == 0x6;
  const bool zmm_state = (xcr0 & 0xe6) == 0xe6;
  const bool tile_state = (xcr0 & 0x60000) == 0x60000;
  if (__get_cpuid_max(0, nullptr) < 7) return f;
  __cpuid_count(7, 0, a, b, c, d);
  f.avx2 = ymm_state && (b & (1u << 5));
  f.avx512f = zmm_state && (b & (1u << 16));
  f.avx512dq = zmm_state && (b & (1u << 17));
  f.avx512bw = zmm_state && (b & (1u << 30));
  f.avx512vl = zmm_state && (b & (1u << 31));
  f.avx512_fp16 = zmm_state && (d & (1u << 23));
  f.amx_bf16 = tile_state && (d & (1u << 22));
  f.amx_tile = tile_state && (d & (1u << 24));
  unsigned a1, b1, c1, d1;
  __cpuid_count(7, 1, a1, b1, c1, d1);
  f.avx512_bf16 = zmm_state && (a1 & (1u << 5));
  unsigned max_leaf = 0, vendor[3] = {};
  __cpuid(0, max_leaf, vendor[0], vendor[2], vendor[1]);  // "AuthenticAMD" in ebx, edx, ecx
  f.fast_bf16_dot = f.avx512_bf16 && std::memcmp(vendor, "AuthenticAMD", 12) == 0;
  if (f.amx_tile && f.amx_bf16) f.amx_permitted = request_amx_permission();
#endif
  return f;
}

Isa isa_from_features(const CpuFeatures& f) {
  Isa isa = Isa::scalar;
  if (f.avx2 && f.fma && f.f16c) isa = Isa::avx2;
  if (isa == Isa::avx2 && f.avx512f && f.avx512bw && f.avx512vl && f.avx512dq) isa = Isa::avx512;
  if (isa == Isa::avx512 && f.amx_tile && f.amx_bf16 && f.amx_permitted) isa = Isa::amx;
  return isa;
}

bool parse_isa(const char* text, Isa& out) {
  for (Isa isa : {Isa::scalar, Isa::avx2, Isa::avx512, Isa::amx})
    if (std::strcmp(text, isa_name(isa)) == 0) {
      out = isa;
      return true;
    }
  return false;
}

Isa highest_compiled(Isa limit) {
  while (limit != Isa::scalar && !isa_compiled(limit)) limit = Isa(int(limit) - 1);
  return limit;
}

// An unknown ROME_MAX_ISA leaves the ISA alone here; check_environment() reports it on the first
// call, where an exception can reach the caller.
Isa initial_isa() {
  Isa isa = highest_compiled(detected_isa());
  if (const char* env = std::getenv("ROME_MAX_ISA"); env && *env) {
    Isa limit;
    if (parse_isa(env, limit) && limit < isa) isa = limit;
  }
  return isa;
}

std::atomic<int>& active_isa_value() {
  static std::atomic<int> value{int(initial_isa())};
  return value;
}

std::atomic<int> configured_threads{0};

}  // namespace

const CpuFeatures& cpu_features() noexcept {
  static const CpuFeatures features = detect();
  return features;
}

namespace {
std::atomic<const kernels::KernelTable*> kernel_override{nullptr};
}

void override_kernels_for_testing(const kernels::KernelTable* table) noexcept {
  kernel_override.store(table);
}

const kernels::KernelTable& active_kernels() noexcept {
  if (const kernels::KernelTable* table = kernel_override.load(std::memory_order_relaxed))
    return *table;
  switch (Isa(active_isa_value().load(std::memory_order_relaxed))) {
#ifdef ROME_HAVE_AMX
    case Isa::amx: return kernels::amx_kernels(cpu_features().avx512_bf16);
#endif
#ifdef ROME_HAVE_AVX512
    case Isa::avx512:
      return kernels::avx512_kernels(cpu_features().avx512_bf16, cpu_features().fast_bf16_dot);
#endif
#ifdef ROME_HAVE_AVX2
    case Isa::avx2: return kernels::avx2_kernels();
#endif
    default: return kernels::scalar_kernels();
  }
}

void check_options(const ExecOptions& options) {
  if (options.num_threads < 0 || options.num_threads > kMaxThreads)
    fail(Status::invalid_argument, "options.num_threads",
         "0 (the default) to " + std::to_string(kMaxThreads), std::to_string(options.num_threads));
  if (options.tile_tokens < 0 || options.tile_tokens > kMaxTileTokens)
    fail(Status::invalid_argument, "options.tile_tokens",
         "0 (sized from the cache) to " + std::to_string(kMaxTileTokens),
         std::to_string(options.tile_tokens));
  if (options.min_parallel_bytes < -1)
    fail(Status::invalid_argument, "options.min_parallel_bytes",
         "-1 (RoME's threshold) or a byte count >= 0", std::to_string(options.min_parallel_bytes));
}

void check_environment() {
  static const bool valid = [] {
    const char* env = std::getenv("ROME_MAX_ISA");
    Isa ignored;
    return !env || !*env || parse_isa(env, ignored);
  }();
  if (!valid)
    fail(Status::invalid_argument, "ROME_MAX_ISA", "one of scalar, avx2, avx512, amx",
         std::string("'") + std::getenv("ROME_MAX_ISA") + "'");
}

// Logical-processor IDs sharing the last-level cache: EAX[25:14] + 1 of the deterministic
// cache parameters (leaf 4 on Intel, 0x8000001D on AMD and Hygon) for the level-3 entry; 1
// where unknown.
int l3_sharing_threads() noexcept {
#ifdef ROME_X86
  unsigned max_leaf = 0, vendor[3] = {};
  __cpuid(0, max_leaf, vendor[0], vendor[2], vendor[1]);
  const bool amd =
      std::memcmp(vendor, "AuthenticAMD", 12) == 0 || std::memcmp(vendor, "HygonGenuine", 12) == 0;
  const unsigned leaf = amd ? 0x8000001Du : 4u;
  if ((amd ? __get_cpuid_max(0x80000000u, nullptr) : max_leaf) < leaf) return 1;
  for (unsigned sub = 0; sub < 8; ++sub) {
    unsigned a, b, c, d;
    __cpuid_count(leaf, sub, a, b, c, d);
    if ((a & 31) == 0) break;  // no more caches
    if (((a >> 5) & 7) == 3) return int((a >> 14) & 0xfff) + 1;
  }
#endif
  return 1;
}

std::int64_t sysfs_cache_bytes(const std::string& size) noexcept {
  char* end = nullptr;
  const long long value = std::strtoll(size.c_str(), &end, 10);
  if (end == size.c_str() || value <= 0 || value > (1LL << 40)) return 0;
  if (*end == 'K') return std::int64_t(value) << 10;
  if (*end == 'M') return std::int64_t(value) << 20;
  return *end == '\0' ? std::int64_t(value) : 0;
}

int cpu_list_count(const std::string& list) noexcept {
  int count = 0;
  const char* p = list.c_str();
  while (*p) {
    char* after = nullptr;
    const long first = std::strtol(p, &after, 10);
    if (after == p || first < 0) return 0;
    long last = first;
    if (*after == '-') {
      const char* from = after + 1;
      last = std::strtol(from, &after, 10);
      if (after == from || last < first) return 0;
    }
    count += int(last - first + 1);
    if (*after == '\0') break;
    if (*after != ',') return 0;
    p = after + 1;
  }
  return count;
}

// Linux's own view of cpu0's level-3 cache (/sys/devices/system/cpu/cpu0/cache/index*: level,
// type, size, shared_cpu_list): its bytes and how many logical processors share it; {0, 0} where
// absent. A VM can pass its host's CPUID through: sysconf (which reads CPUID) gave 320 MiB of L3
// shared by 2 on a 2-vCPU Zen 4 VM whose sysfs lists 32 MiB.
std::pair<std::int64_t, int> sysfs_l3() {
  auto read_line = [](const std::string& path) {
    std::ifstream file(path);
    std::string line;
    std::getline(file, line);
    return line;
  };
  for (int index = 0; index < 16; ++index) {
    const std::string base =
        "/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(index) + "/";
    const std::string level = read_line(base + "level");
    if (level.empty()) break;
    if (level != "3" || read_line(base + "type") == "Instruction") continue;
    return {sysfs_cache_bytes(read_line(base + "size")),
            cpu_list_count(read_line(base + "shared_cpu_list"))};
  }
  return {0, 0};
}
namespace {
std::atomic<const CacheSizes*> cache_sizes_override{nullptr};

}  // namespace

void override_cache_sizes_for_testing(const CacheSizes* sizes) noexcept {
  cache_sizes_override.store(sizes);
}

const CacheSizes& cache_sizes() noexcept {
  if (const CacheSizes* sizes = cache_sizes_override.load(std::memory_order_relaxed)) return *sizes;
  static const CacheSizes sizes = [] {
    CacheSizes s{32 << 10, 1 << 20, 8 << 20, 0};
#if defined(_SC_LEVEL1_DCACHE_SIZE) && defined(_SC_LEVEL2_CACHE_SIZE) && \
    defined(_SC_LEVEL3_CACHE_SIZE)
    auto read = [](int name, std::int64_t& out) {
      const long v = sysconf(name);
      if (v > 0) out = v;
    };
    read(_SC_LEVEL1_DCACHE_SIZE, s.l1d);
    read(_SC_LEVEL2_CACHE_SIZE, s.l2);
    read(_SC_LEVEL3_CACHE_SIZE, s.l3);
#endif
    s.l3_per_thread = s.l3 / l3_sharing_threads();
    // Where sysfs lists a smaller share, it is the one this machine has (see sysfs_l3).
    const auto [sysfs_bytes, sysfs_sharing] = sysfs_l3();
    if (sysfs_bytes > 0 && sysfs_sharing > 0 && sysfs_bytes / sysfs_sharing < s.l3_per_thread) {
      s.l3 = sysfs_bytes;
      s.l3_per_thread = sysfs_bytes / sysfs_sharing;
    }
    return s;
  }();
  return sizes;
}

bool outgrows_cache_share(std::int64_t bytes) noexcept {
  return bytes > cache_sizes().l3_per_thread * 3 / 4;
}

void fence_streamed() noexcept {
#if defined(__SSE2__)
  _mm_sfence();
#endif
}

void stream_copy(void* dst, const void* src, std::size_t n) noexcept {
  if (n == 0) return;
  active_kernels().stream_copy(dst, src, n);
  fence_streamed();
}

int resolve_threads(int requested) noexcept {
  if (requested > 0) return requested;
  const int configured = configured_threads.load(std::memory_order_relaxed);
  return configured > 0 ? configured : default_num_threads();
}

ForwardKernel forward_kernel(const Rotation& rotation, DType dtype) noexcept {
  const kernels::KernelTable& table = active_kernels();
  if (rotation.kind() == Rotation::Kind::dense)
    return {table.forward_dense ? table.forward_dense : kernels::scalar_kernels().forward_dense,
            kernels::TableLayout::natural, false};
  return {table.forward_permute,
          table.permute_table_layout ? table.permute_table_layout(rotation.data(), dtype)
                                     : kernels::TableLayout::natural,
          true};
}

}  // namespace detail

const char* isa_name(Isa isa) noexcept {
  switch (isa) {
    case Isa::scalar: return "scalar";
    case Isa::avx2: return "avx2";
    case Isa::avx512: return "avx512";
    case Isa::amx: return "amx";
  }
  return "unknown";
}

bool isa_compiled(Isa isa) noexcept {
  switch (isa) {
    case Isa::scalar: return true;
#ifdef ROME_HAVE_AVX2
    case Isa::avx2: return true;
#endif
#ifdef ROME_HAVE_AVX512
    case Isa::avx512: return true;
#endif
#ifdef ROME_HAVE_AMX
    case Isa::amx: return true;
#endif
    default: return false;
  }
}

Isa detected_isa() noexcept {
  return detail::isa_from_features(detail::cpu_features());
}

Isa active_isa() noexcept {
  return Isa(detail::active_isa_value().load());
}

Isa set_max_isa(Isa limit) noexcept {
  // Lowering only: never above what the CPU, the build and ROME_MAX_ISA allow.
  const Isa ceiling = detail::initial_isa();
  const Isa isa = detail::highest_compiled(limit < ceiling ? limit : ceiling);
  detail::active_isa_value().store(int(isa));
  return isa;
}

namespace {
// ROME_NUM_THREADS when set to a positive count, else 0; read once.
int env_num_threads() noexcept {
  static const int threads = [] {
    const char* env = std::getenv("ROME_NUM_THREADS");
    const int n = env && *env ? std::atoi(env) : 0;
    return n > 0 ? n : 0;
  }();
  return threads;
}
}  // namespace

int default_num_threads() noexcept {
  // Read once: hardware_concurrency() reads sysfs, far too slow for every decode call.
  static const int threads = env_num_threads() > 0 ? env_num_threads() : detail::hardware_threads();
  return threads;
}

int requested_num_threads() noexcept {
  const int configured = detail::configured_threads.load(std::memory_order_relaxed);
  return configured > 0 ? configured : env_num_threads();
}

void set_num_threads(int threads) {
  if (threads < 0 || threads > detail::kMaxThreads)
    fail(Status::invalid_argument, "threads",
         "0 (the default) to " + std::to_string(detail::kMaxThreads), std::to_string(threads));
  detail::configured_threads.store(threads);
}

const char* dtype_name(DType dtype) noexcept {
  switch (dtype) {
    case DType::f32: return "float32";
    case DType::f16: return "float16";
    case DType::bf16: return "bfloat16";
    case DType::i32: return "int32";
    case DType::i64: return "int64";
  }
  return "unknown";
}

}  // namespace rome
