// Rotations: the matrices A and B of y = (x·A) ⊙ C + (x·B) ⊙ S.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

namespace rome {

namespace detail {
struct RotationData;
}

// A rotation is analysed once on construction: when A and B are signed permutations (one ±1, or
// nothing, per column) it is stored as a source lane and sign per output lane and runs as
// in-register permutes; otherwise it is stored dense and runs as a matrix product.
//
// head_dim() is the size of the head (D); rotary_dim() is how many lanes the matrices cover,
// starting at lane_offset() (0 unless set by partial()). The other lanes pass through unchanged
// (partial rotary, [nope | rope] heads) and tables only cover rotary_dim() lanes.
class Rotation {
 public:
  enum class Kind { signed_permutation, dense };

  // NeoX rotate_half: (x·B)[j] = -x[j+D/2] for j < D/2, +x[j-D/2] otherwise.
  static Rotation half(std::int64_t dim);
  // GPT-J rotate_every_two: (x·B)[2i] = -x[2i+1], (x·B)[2i+1] = x[2i].
  static Rotation interleave(std::int64_t dim);
  // Half rotation inside each half: cat(-x2, x1, -x4, x3) over four D/4 chunks.
  static Rotation quarter(std::int64_t dim);
  // DeepSeek MLA: de-interleave (A), then rotate half (B); output in de-interleaved order.
  static Rotation interleave_half(std::int64_t dim);
  // Any matrices, row-major dim×dim: (x·B)[j] = Σ_i x[i]·B[i·dim + j]. A defaults to I.
  static Rotation dense(std::span<const float> b, std::int64_t dim);
  static Rotation dense(std::span<const float> a, std::span<const float> b, std::int64_t dim);
  // Blocks side by side on the diagonal, e.g. half(44) ⊕ half(44) ⊕ half(40).
  static Rotation block_diag(std::span<const Rotation> blocks);
  static Rotation block_diag(std::initializer_list<Rotation> blocks);

  // This rotation on lanes [lane_offset, lane_offset + rotary_dim()) of a head of head_dim lanes
  // (lane_offset: vLLM's rope_dim_offset, e.g. the rope part after the nope part of an MLA head).
  Rotation partial(std::int64_t head_dim, std::int64_t lane_offset = 0) const;
  // A rotation with a lane offset seen from that offset: a head of head_dim() - lane_offset()
  // lanes, offset 0 (what runs on the narrowed views). Itself when lane_offset() is 0.
  Rotation unshifted() const;
  // The same matrices kept dense: runs as a matrix product (AMX or FMA) even when it is a
  // signed permutation. For benchmarks and tests that compare the two paths.
  Rotation as_dense() const;

  std::int64_t head_dim() const noexcept;
  std::int64_t rotary_dim() const noexcept;
  std::int64_t lane_offset() const noexcept;
  Kind kind() const noexcept;
  bool a_is_identity() const noexcept;

  // rotary_dim × rotary_dim row-major matrices, for tests and for the dense path.
  std::vector<float> to_dense_a() const;
  std::vector<float> to_dense_b() const;

  const detail::RotationData& data() const noexcept { return *data_; }

 private:
  explicit Rotation(std::shared_ptr<const detail::RotationData> data) : data_(std::move(data)) {}
  static std::shared_ptr<detail::RotationData> dense_rotation(std::span<const float> a,
                                                              std::span<const float> b,
                                                              std::int64_t dim);
  std::shared_ptr<const detail::RotationData> data_;
};

}  // namespace rome
