// Writes the seed corpus for fuzz/fuzz_rope.cpp into the directory given as argv[1].
//
// fuzz_rope decodes its input byte by byte and a zero byte always picks the plainest option, so a
// seed is: a data seed (4 bytes), the operation (byte 4: 0 forward q, 1 forward q+k, 2 backward),
// the rotation kind (byte 5: 0 half, 1 interleave, 2 quarter, 3 interleave_half, 4 block_diag,
// 5 partial, 6 dense B, 7 dense A and B, 8 dense signed permutation), then a tail in which a
// given share of the bytes is random and the rest zero ("sparse" tails decode to mostly valid
// calls, dense ones reach the error paths). Deterministic: the same corpus on every run.
#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s DIR\n", argv[0]);
    return 2;
  }
  const std::string dir = argv[1];
  std::mt19937_64 rng(20240601);
  int n = 0;
  auto write = [&](const std::vector<std::uint8_t>& bytes) {
    char name[64];
    std::snprintf(name, sizeof name, "/seed-%03d", n++);
    std::FILE* f = std::fopen((dir + name).c_str(), "wb");
    if (!f) return false;
    std::fwrite(bytes.data(), 1, bytes.size(), f);
    std::fclose(f);
    return true;
  };
  auto seed = [&](int op, int kind, int random_percent, std::size_t tail) {
    std::vector<std::uint8_t> b(6 + tail, 0);
    for (int i = 0; i < 4; ++i) b[i] = std::uint8_t(rng());
    b[4] = std::uint8_t(op);
    b[5] = std::uint8_t(kind);
    for (std::size_t i = 6; i < b.size(); ++i)
      if (int(rng() % 100) < random_percent) b[i] = std::uint8_t(rng());
    return write(b);
  };
  // Every operation × rotation kind with a mostly plain tail.
  for (int op = 0; op < 3; ++op)
    for (int kind = 0; kind < 9; ++kind)
      if (!seed(op, kind, 25, 160)) return 1;
  // All-zero tails: the plainest call of each operation.
  for (int op = 0; op < 3; ++op) seed(op, 0, 0, 64);
  // Dense random tails: bad inputs of every kind.
  for (int i = 0; i < 12; ++i) seed(i % 3, int(rng() % 9), 100, 256);
  std::printf("%d seeds\n", n);
  return 0;
}
