// Runs tests once per ISA: every ISA this build carries and this machine (and ROME_MAX_ISA)
// allows. The ones that cannot run are printed once with the reason.
#pragma once

#include <cstdio>
#include <string>
#include <vector>

#include "rome/rope.hpp"

namespace rome::testing {

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

inline std::string isa_param_name(Isa isa) {
  return isa_name(isa);
}

}  // namespace rome::testing
