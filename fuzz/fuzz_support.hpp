// Pieces shared by the fuzz_fused and fuzz_table_free harnesses: the byte reader that decodes an
// input, the abort on a finding, and the outcome counts printed at exit.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

namespace rome::fuzzing {

// A zero byte, or the end of the input, always picks the plainest option.
struct Reader {
  const std::uint8_t* data;
  std::size_t size;
  std::size_t pos = 0;
  unsigned byte() { return pos < size ? data[pos++] : 0; }
  std::int64_t below(std::int64_t n) { return n <= 1 ? 0 : std::int64_t(byte() % unsigned(n)); }
  bool rare(unsigned one_in) { return byte() % one_in == one_in - 1; }
};

[[noreturn]] inline void report_bug(const char* target, const std::string& what) {
  std::fprintf(stderr, "%s: %s\n", target, what.c_str());
  std::abort();
}

// Outcomes by kind, printed at exit with ROME_FUZZ_STATS=1 as "count  outcome" lines (which
// fuzz/build.sh shows): does the fuzzer reach successful calls as well as every error?
struct OutcomeCounts {
  std::vector<std::pair<std::string, long>> counts;
  void add(const std::string& key) {
    for (auto& [k, n] : counts)
      if (k == key) return void(++n);
    counts.push_back({key, 1});
  }
  ~OutcomeCounts() {
    if (!std::getenv("ROME_FUZZ_STATS")) return;
    for (const auto& [k, n] : counts) std::fprintf(stderr, "%10ld  %s\n", n, k.c_str());
  }
};

}  // namespace rome::fuzzing
