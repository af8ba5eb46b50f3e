// Runs tests once per ISA: every ISA this build carries and this machine (and ROME_MAX_ISA)
// allows. The ones that cannot run are printed once with the reason.
#pragma once

#include <cstdio>
#include <string>
#include <vector>

#include "core/dispatch.hpp"
#include "core/rotation_data.hpp"
#include "rome/rope.hpp"

namespace rome::testing {

// True in the AddressSanitizer build (make test's second run of the suite, several times slower
// per case). The heaviest value checks then run on smaller inputs or fewer settings: the
// sanitizers look for memory errors on the same code paths, and the Release run checks every
// value at full size.
#if defined(__SANITIZE_ADDRESS__)
inline constexpr bool kSanitized = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
inline constexpr bool kSanitized = true;
#else
inline constexpr bool kSanitized = false;
#endif
#else
inline constexpr bool kSanitized = false;
#endif

inline std::vector<Isa> isas_under_test() {
  static const std::vector<Isa> isas = [] {
    std::vector<Isa> out;
    const Isa ceiling = set_max_isa(Isa::amx);
    for (Isa isa : {Isa::scalar, Isa::avx2, Isa::avx512, Isa::amx}) {
      if (!isa_compiled(isa)) {
        std::printf("[ rome ] skipping ISA %s: not compiled into this build\n", isa_name(isa));
      } else if (isa > detected_isa()) {
        std::printf("[ rome ] skipping ISA %s: this CPU/OS does not support it (detected: %s)\n",
                    isa_name(isa), isa_name(detected_isa()));
      } else if (isa > ceiling) {
        std::printf("[ rome ] skipping ISA %s: lowered by ROME_MAX_ISA\n", isa_name(isa));
      } else {
        out.push_back(isa);
      }
    }
    return out;
  }();
  return isas;
}

// Sets the ISA for a scope and restores the highest allowed one afterwards.
class ScopedIsa {
 public:
  explicit ScopedIsa(Isa isa) { set_max_isa(isa); }
  ~ScopedIsa() { set_max_isa(Isa::amx); }
  ScopedIsa(const ScopedIsa&) = delete;
  ScopedIsa& operator=(const ScopedIsa&) = delete;
};

// Runs every call of a scope on `table` (nullptr: the active ISA's, as normal), e.g. a table the
// core would not pick on this CPU.
class ScopedKernels {
 public:
  explicit ScopedKernels(const kernels::KernelTable* table) {
    detail::override_kernels_for_testing(table);
  }
  ~ScopedKernels() { detail::override_kernels_for_testing(nullptr); }
  ScopedKernels(const ScopedKernels&) = delete;
  ScopedKernels& operator=(const ScopedKernels&) = delete;
};

// Reports `sizes` as this CPU's caches within a scope (the streaming threshold and tile budgets
// follow), so that paths chosen by cache size run on any machine.
class ScopedCacheSizes {
 public:
  explicit ScopedCacheSizes(const detail::CacheSizes& sizes) : sizes_(sizes) {
    detail::override_cache_sizes_for_testing(&sizes_);
  }
  ~ScopedCacheSizes() { detail::override_cache_sizes_for_testing(nullptr); }
  ScopedCacheSizes(const ScopedCacheSizes&) = delete;
  ScopedCacheSizes& operator=(const ScopedCacheSizes&) = delete;

 private:
  const detail::CacheSizes sizes_;
};

// Options for `threads` threads that split even the tests' small calls (RoME keeps calls below
// ExecOptions::min_parallel_bytes on the calling thread).
inline ExecOptions split_across(int threads) {
  ExecOptions options;
  options.num_threads = threads;
  options.min_parallel_bytes = 0;
  return options;
}

// Whether `isa` runs this rotation of `dtype` x as bf16 dot products (avx512 on a CPU whose
// vdpbf16ps the core uses, bf16 x, matrices exact in bf16): summed in the instruction's order and
// held to the dot-product bound (test_dense_bf16_dot.cpp), not to the scalar kernel's bits.
inline bool takes_bf16_dot_path(Isa isa, const Rotation& rotation, DType dtype) {
  return isa == Isa::avx512 && dtype == DType::bf16 && detail::cpu_features().fast_bf16_dot &&
         rotation.data().pair_panel_packs().bf16_exact;
}

inline std::string isa_param_name(Isa isa) {
  return isa_name(isa);
}

}  // namespace rome::testing
