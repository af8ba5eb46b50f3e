// Cosine and sine tables for RoME: y = x ⊙ C + (x · M) ⊙ S.
//
// Builders for C and S (one value per output lane) for every RoPE flavour the library supports:
// 1D positions, multi-axis grids (2D h×w, 3D t×h×w), MRoPE (Qwen2-VL sections, Qwen3-VL
// interleaved) and frequency scaling (linear, NTK, YaRN, Llama-3.1) as HuggingFace transformers
// computes it. All math runs in double; tables are stored as float and can be converted to bf16 or
// fp16 bits. Every bad argument throws rome::Error (Status::invalid_argument).
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <vector>

namespace rome::tables {

// How the frequencies of one rotation are laid out across lanes, to match the rotate matrix.
enum class Layout {
  half,   // NeoX rotate_half: [f0 .. f(n-1), f0 .. f(n-1)]
  pairs,  // GPT-J interleave: [f0, f0, f1, f1, ...]
};

// Row-major [rows, width] tables: cos[r * width + lane], sin[r * width + lane].
struct Table {
  int64_t rows = 0;
  int64_t width = 0;
  std::vector<float> cos;
  std::vector<float> sin;
};

// ---------------------------------------------------------------------------------------------
// Inverse frequencies and scaling

// inv_freq[i] = theta^(-2i/dim) for i in [0, dim/2). dim must be even and > 0, theta > 0.
std::vector<double> inverse_frequencies(int64_t dim, double theta);

// Frequency scaling, with the formulas of transformers' ROPE_INIT_FUNCTIONS
// (modeling_rope_utils.py). A default Scaling is no scaling; build the others with the named
// constructors below and adjust the optional fields.
struct Scaling {
  enum class Kind {
    none,
    linear,       // inv_freq / factor (= positions / factor)
    dynamic_ntk,  // transformers "dynamic": base grows with seq_len beyond the original length
    ntk,          // static NTK-aware: base * factor^(dim / (dim - 2))
    yarn,         // transformers "yarn": ramp between interpolation and extrapolation + amplitude
    llama3,       // transformers "llama3" (Llama-3.1): smooth interpolation by wavelength
  };
  Kind kind = Kind::none;
  double factor = 1.0;

  // dynamic_ntk: the model's max_position_embeddings; yarn, llama3: the pretraining length.
  int64_t original_max_position_embeddings = 8192;
  // dynamic_ntk: the current sequence length (max position + 1); shorter than the original
  // length means no scaling.
  int64_t seq_len = 0;

  // yarn. mscale / mscale_all_dim of 0 mean "not set" (as in transformers, where 0 is falsy).
  double beta_fast = 32.0;
  double beta_slow = 1.0;
  double mscale = 0.0;
  double mscale_all_dim = 0.0;
  std::optional<double> attention_factor;  // overrides the amplitude computed from factor
  bool truncate = true;                    // floor/ceil the correction range

  // llama3
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;

  static Scaling linear(double factor);
  static Scaling dynamic_ntk(double factor, int64_t max_position_embeddings, int64_t seq_len);
  static Scaling ntk(double factor);
  static Scaling yarn(double factor, int64_t original_max_position_embeddings);
  static Scaling llama3(double factor, int64_t original_max_position_embeddings = 8192,
                        double low_freq_factor = 1.0, double high_freq_factor = 4.0);
};

// Scaled inverse frequencies plus the amplitude (transformers' attention_factor /
// attention_scaling) that multiplies BOTH cos and sin. amplitude is 1 except for YaRN.
struct Frequencies {
  std::vector<double> inv_freq;
  double amplitude = 1.0;
};

Frequencies scaled_frequencies(int64_t dim, double theta, const Scaling& scaling);

// ---------------------------------------------------------------------------------------------
// 1D tables

// Row r holds cos/sin(positions[r] * inv_freq[k]) * amplitude laid out by `layout`;
// width = 2 * inv_freq.size().
Table rope_table(std::span<const int64_t> positions, std::span<const double> inv_freq,
                 Layout layout, double amplitude = 1.0);
// Positions 0 .. num_positions - 1.
Table rope_table(int64_t num_positions, std::span<const double> inv_freq, Layout layout,
                 double amplitude = 1.0);

// One value per frequency, no duplication: [num_positions, inv_freq.size()]. This is the
// half-width cos_cache / sin_cache pair of ONNX RotaryEmbedding.
Table frequency_table(int64_t num_positions, std::span<const double> inv_freq,
                      double amplitude = 1.0);

// vLLM's cos_sin_cache: [max_positions, rotary_dim] = cat(cos, sin) per row, where
// rotary_dim = 2 * inv_freq.size().
struct CosSinCache {
  int64_t rows = 0;
  int64_t width = 0;
  std::vector<float> data;
};
CosSinCache cos_sin_cache(int64_t max_positions, std::span<const double> inv_freq,
                          double amplitude = 1.0);

// ---------------------------------------------------------------------------------------------
// Multi-axis tables (2D h×w, 3D t×h×w, ...)

// Axis a owns a contiguous block of dims[a] lanes, axis 0 first. Inside its block it uses its own
// inv_freq over dims[a] (theta_a^(-2i/dims[a])) laid out by the table's layout.
struct Axes {
  std::vector<int64_t> dims;   // each even and > 0; the table width is their sum
  std::vector<double> thetas;  // one base per axis, or a single base shared by all axes
};

// Rows enumerate the grid sizes[0] × sizes[1] × ... in row-major order (axis 0 slowest, the last
// axis fastest). starts[a] is the first position along axis a (empty = all 0).
Table grid_table(const Axes& axes, std::span<const int64_t> sizes, Layout layout,
                 std::span<const int64_t> starts = {});

// Explicit per-token positions, row-major [n_tokens][n_axes] with n_axes = axes.dims.size().
Table axes_table(const Axes& axes, std::span<const int64_t> positions, Layout layout);

// ---------------------------------------------------------------------------------------------
// MRoPE (Qwen2-VL, Qwen3-VL): one inv_freq over head_dim, each frequency driven by one of the
// three position axes (t, h, w); layout half.

enum class Mrope {
  sectioned,    // Qwen2-VL: consecutive sections; section i uses axis i % 3
  interleaved,  // Qwen3-VL: t everywhere, then h at 1, 4, 7, ... < 3*sections[1],
                //           w at 2, 5, 8, ... < 3*sections[2]
};

// Axis (0 = t, 1 = h, 2 = w) of each frequency; size = sum(sections) = head_dim / 2.
std::vector<int> mrope_frequency_axis(std::span<const int64_t> sections, Mrope mode);
// Axis of each output lane (column) of the half layout: the frequency axes twice; size = head_dim.
std::vector<int> mrope_column_axis(std::span<const int64_t> sections, Mrope mode);

// positions: row-major [3][T] (t, h, w positions of each token). sum(sections) must equal
// inv_freq.size(). Width = 2 * inv_freq.size().
Table mrope_table(std::span<const int64_t> positions, std::span<const double> inv_freq,
                  std::span<const int64_t> sections, Mrope mode, double amplitude = 1.0);

// ---------------------------------------------------------------------------------------------
// Storage dtypes: round to nearest even, NaN kept (quieted, sign kept), fp16 overflow -> inf,
// fp16 subnormals rounded correctly.

uint16_t bf16_bits(float value) noexcept;
uint16_t fp16_bits(float value) noexcept;
float float_from_bf16_bits(uint16_t bits) noexcept;
float float_from_fp16_bits(uint16_t bits) noexcept;

std::vector<uint16_t> to_bf16_bits(std::span<const float> values);
std::vector<uint16_t> to_fp16_bits(std::span<const float> values);
// The same into `out` (values.size() elements): one call per row, not one per element.
void to_bf16_bits(std::span<const float> values, uint16_t* out) noexcept;
void to_fp16_bits(std::span<const float> values, uint16_t* out) noexcept;

}  // namespace rome::tables
