// Matrices for the dense-path benchmarks, shared by rome_bench and rome_timer.
#pragma once

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "rome/rotation.hpp"

namespace rome::bench {

// A random orthogonal n×n matrix (Gram-Schmidt on uniform columns, in double): a learned
// rotation with no structure for the dense paths.
inline std::vector<float> random_orthogonal(std::int64_t n, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  std::vector<double> q(n * n);
  for (auto& v : q) v = u(rng);
  for (std::int64_t j = 0; j < n; ++j) {
    for (std::int64_t k = 0; k < j; ++k) {
      double dot = 0;
      for (std::int64_t i = 0; i < n; ++i) dot += q[i * n + j] * q[i * n + k];
      for (std::int64_t i = 0; i < n; ++i) q[i * n + j] -= dot * q[i * n + k];
    }
    double norm = 0;
    for (std::int64_t i = 0; i < n; ++i) norm += q[i * n + j] * q[i * n + j];
    for (std::int64_t i = 0; i < n; ++i) q[i * n + j] /= std::sqrt(norm);
  }
  return std::vector<float>(q.begin(), q.end());
}

// Dense orthogonal blocks on the diagonal (e.g. 44+44+40: a learned 3D rotation per axis).
inline Rotation random_orthogonal_blocks(const std::vector<std::int64_t>& sizes) {
  std::vector<Rotation> blocks;
  std::uint32_t seed = 1;
  for (auto s : sizes) blocks.push_back(Rotation::dense(random_orthogonal(s, seed++), s));
  return Rotation::block_diag(blocks);
}

}  // namespace rome::bench
