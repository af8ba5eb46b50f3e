// Tests for rome::tables: closed forms computed here in double, literal values produced by
// HuggingFace transformers 5.23.0 (torch 2.13.0, CPU), layouts, grids, MRoPE, scaling, bf16/fp16
// conversion and the error of every bad argument.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <numbers>
#include <random>
#include <string>
#include <vector>

#include "rome/error.hpp"
#include "rome/tables.hpp"

namespace rt = rome::tables;
using rt::Layout;
using rt::Mrope;
using rt::Scaling;

namespace {

double closed_inv_freq(int64_t i, int64_t dim, double theta) {
  return std::pow(theta, -2.0 * static_cast<double>(i) / static_cast<double>(dim));
}

// Relative comparison for values transformers computed in float32.
void expect_close_rel(const std::vector<double>& got, const std::vector<double>& want, double rel) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_NEAR(got[i], want[i], rel * std::abs(want[i])) << "index " << i;
  }
}

void expect_invalid(const std::function<void()>& call, const std::string& argument) {
  try {
    call();
    ADD_FAILURE() << "expected rome::Error naming " << argument;
  } catch (const rome::Error& e) {
    EXPECT_EQ(e.status(), rome::Status::invalid_argument);
    EXPECT_EQ(e.argument(), argument);
    EXPECT_NE(std::string(e.what()).find(argument), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("expected"), std::string::npos) << e.what();
  }
}

float at(const std::vector<float>& v, int64_t row, int64_t width, int64_t lane) {
  return v[static_cast<size_t>(row * width + lane)];
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Inverse frequencies

TEST(InverseFrequencies, MatchClosedForm) {
  const std::vector<double> f = rt::inverse_frequencies(128, 10000.0);
  ASSERT_EQ(f.size(), 64u);
  EXPECT_EQ(f[0], 1.0);
  for (int64_t i : {1, 17, 32, 63}) {
    EXPECT_NEAR(f[static_cast<size_t>(i)], closed_inv_freq(i, 128, 10000.0),
                1e-15 * closed_inv_freq(i, 128, 10000.0));
  }
  EXPECT_EQ(rt::inverse_frequencies(2, 500000.0), std::vector<double>{1.0});
}

// ---------------------------------------------------------------------------------------------
// Scaling: literal values from transformers' ROPE_INIT_FUNCTIONS[rope_type](LlamaConfig(...)),
// printed with "%.9g" (transformers computes them in float32, hence the 1e-6 relative tolerance).

TEST(Scaling, NoneIsPlainFrequencies) {
  const rt::Frequencies f = rt::scaled_frequencies(64, 10000.0, Scaling{});
  EXPECT_EQ(f.inv_freq, rt::inverse_frequencies(64, 10000.0));
  EXPECT_EQ(f.amplitude, 1.0);
}

TEST(Scaling, LinearMatchesTransformers) {
  // rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}, head_dim=32
  const rt::Frequencies f = rt::scaled_frequencies(32, 10000.0, Scaling::linear(4.0));
  expect_close_rel(f.inv_freq,
                   {0.25, 0.140585333, 0.079056941, 0.0444569848, 0.0250000004, 0.0140585322,
                    0.00790569466, 0.00444569858, 0.00249999994, 0.00140585331, 0.000790569466,
                    0.000444569858, 0.000250000012, 0.000140585325, 7.90569466e-05, 4.44569851e-05},
                   1e-6);
  EXPECT_EQ(f.amplitude, 1.0);
}

TEST(Scaling, DynamicNtkMatchesTransformers) {
  // rope_type "dynamic", rope_theta 10000, factor 2, head_dim 32, max_position_embeddings 4096,
  // called with seq_len=10000.
  const rt::Frequencies f =
      rt::scaled_frequencies(32, 10000.0, Scaling::dynamic_ntk(2.0, 4096, 10000));
  expect_close_rel(f.inv_freq,
                   {1, 0.513716578, 0.263904721, 0.135572225, 0.0696456954, 0.0357781462,
                    0.018379828, 0.00944202114, 0.00485052308, 0.00249179406, 0.00128007587,
                    0.000657596218, 0.000337818055, 0.000173542736, 8.91517775e-05, 4.57987444e-05},
                   1e-6);
  EXPECT_EQ(f.amplitude, 1.0);
  // Same with seq_len=100 (< 4096): no scaling.
  const rt::Frequencies short_seq =
      rt::scaled_frequencies(32, 10000.0, Scaling::dynamic_ntk(2.0, 4096, 100));
  expect_close_rel(short_seq.inv_freq, rt::inverse_frequencies(32, 10000.0), 1e-15);
}

TEST(Scaling, StaticNtkClosedForm) {
  const rt::Frequencies f = rt::scaled_frequencies(64, 10000.0, Scaling::ntk(8.0));
  const double base = 10000.0 * std::pow(8.0, 64.0 / 62.0);
  for (int64_t i : {0, 1, 20, 31}) {
    EXPECT_NEAR(f.inv_freq[static_cast<size_t>(i)], closed_inv_freq(i, 64, base),
                1e-14 * closed_inv_freq(i, 64, base));
  }
  EXPECT_EQ(f.amplitude, 1.0);
}

TEST(Scaling, YarnMatchesTransformers) {
  // rope_type "yarn", rope_theta 10000, factor 4, original_max_position_embeddings 4096,
  // head_dim 32 (beta_fast 32, beta_slow 1, truncate default True). attention_factor printed
  // with repr(): 1.138629436111989.
  const rt::Frequencies f = rt::scaled_frequencies(32, 10000.0, Scaling::yarn(4.0, 4096));
  expect_close_rel(f.inv_freq,
                   {1, 0.562341332, 0.316227764, 0.177827939, 0.100000001, 0.0562341288,
                    0.0282346234, 0.0139721958, 0.00678571407, 0.00321337907, 0.00146820047,
                    0.00063509983, 0.000250000012, 0.000140585325, 7.90569466e-05, 4.44569851e-05},
                   1e-6);
  EXPECT_NEAR(f.amplitude, 1.138629436111989, 1e-15);
  EXPECT_NEAR(f.amplitude, 0.1 * std::log(4.0) + 1.0, 1e-15);
}

TEST(Scaling, YarnWithDeepSeekMscaleMatchesTransformers) {
  // rope_type "yarn", rope_theta 10000, factor 40, original_max_position_embeddings 4096,
  // mscale 1.0, mscale_all_dim 0.707, head_dim 64. attention_factor 1.0857263992561355.
  Scaling s = Scaling::yarn(40.0, 4096);
  s.mscale = 1.0;
  s.mscale_all_dim = 0.707;
  const rt::Frequencies f = rt::scaled_frequencies(64, 10000.0, s);
  expect_close_rel(f.inv_freq,
                   {1,
                    0.749894202,
                    0.562341332,
                    0.421696514,
                    0.316227764,
                    0.237137362,
                    0.177827939,
                    0.133352146,
                    0.100000001,
                    0.0749894157,
                    0.0562341288,
                    0.0390069261,
                    0.0268793609,
                    0.0183781441,
                    0.012447956,
                    0.0083345091,
                    0.00550000044,
                    0.00356199732,
                    0.00224936521,
                    0.00137051346,
                    0.000790569407,
                    0.000414990413,
                    0.00017782794,
                    3.3338034e-05,
                    2.49999994e-05,
                    1.87473543e-05,
                    1.40585325e-05,
                    1.05424124e-05,
                    7.90569447e-06,
                    5.92843435e-06,
                    4.44569832e-06,
                    3.33380353e-06},
                   1e-6);
  EXPECT_NEAR(f.amplitude, 1.0857263992561355, 1e-15);
}

TEST(Scaling, YarnWithoutTruncateMatchesTransformers) {
  // rope_type "yarn", rope_theta 1e6, factor 4, original_max_position_embeddings 32768,
  // truncate False, head_dim 128 (Qwen-style). Every 8th frequency and the last are checked.
  Scaling s = Scaling::yarn(4.0, 32768);
  s.truncate = false;
  const rt::Frequencies f = rt::scaled_frequencies(128, 1e6, s);
  ASSERT_EQ(f.inv_freq.size(), 64u);
  const std::vector<std::pair<size_t, double>> want = {{0, 1},
                                                       {8, 0.177827939},
                                                       {16, 0.0316227786},
                                                       {23, 0.00697830599},
                                                       {24, 0.00551727042},
                                                       {25, 0.0042343582},
                                                       {32, 0.000607408001},
                                                       {39, 6.18780759e-05},
                                                       {40, 4.44569851e-05},
                                                       {48, 7.90569356e-06},
                                                       {56, 1.40585337e-06},
                                                       {63, 3.10234441e-07}};
  for (const auto& [i, value] : want) EXPECT_NEAR(f.inv_freq[i], value, 1e-6 * value) << i;
}

TEST(Scaling, YarnExplicitAttentionFactorWins) {
  Scaling s = Scaling::yarn(4.0, 4096);
  s.attention_factor = 0.5;
  s.mscale = 1.0;
  s.mscale_all_dim = 1.0;
  EXPECT_EQ(rt::scaled_frequencies(32, 10000.0, s).amplitude, 0.5);
  s.attention_factor.reset();  // mscale == mscale_all_dim: the ratio is 1 (DeepSeek-V3)
  EXPECT_NEAR(rt::scaled_frequencies(32, 10000.0, s).amplitude, 1.0, 1e-15);
}

TEST(Scaling, Llama3MatchesTransformers) {
  // rope_type "llama3", rope_theta 500000, factor 8, low_freq_factor 1, high_freq_factor 4,
  // original_max_position_embeddings 8192, head_dim 128 (Llama-3.1-8B). Frequencies 0..28 are
  // high (unchanged), 29..35 smoothed, 36..63 divided by 8.
  const rt::Frequencies f = rt::scaled_frequencies(128, 500000.0, Scaling::llama3(8.0));
  ASSERT_EQ(f.inv_freq.size(), 64u);
  const std::vector<std::pair<size_t, double>> want = {{0, 1},
                                                       {1, 0.814617217},
                                                       {28, 0.00321144611},
                                                       {29, 0.00216657063},
                                                       {30, 0.00137189368},
                                                       {31, 0.00085675146},
                                                       {32, 0.000524846022},
                                                       {33, 0.00031269365},
                                                       {34, 0.000178507791},
                                                       {35, 9.55621217e-05},
                                                       {36, 7.78465546e-05},
                                                       {50, 4.41153452e-06},
                                                       {63, 3.06892588e-07}};
  for (const auto& [i, value] : want) EXPECT_NEAR(f.inv_freq[i], value, 1e-6 * value) << i;
  EXPECT_EQ(f.amplitude, 1.0);
}

TEST(Scaling, YarnTableMatchesTransformersRotaryEmbedding) {
  // LlamaRotaryEmbedding(LlamaConfig(head_dim=16, rope_parameters={"rope_type": "yarn",
  // "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 4096}))
  // called with position_ids [[0, 1, 7, 100]]: the amplitude multiplies cos AND sin.
  const rt::Frequencies f = rt::scaled_frequencies(16, 10000.0, Scaling::yarn(4.0, 4096));
  const std::vector<int64_t> positions = {0, 1, 7, 100};
  const rt::Table t = rt::rope_table(positions, f.inv_freq, Layout::half, f.amplitude);
  ASSERT_EQ(t.rows, 4);
  ASSERT_EQ(t.width, 16);
  const std::vector<std::vector<double>> want_cos = {
      {1.13862944, 1.13862944, 1.13862944, 1.13862944, 1.13862944, 1.13862944, 1.13862944,
       1.13862944},
      {0.615204155, 1.08217084, 1.13294101, 1.13825357, 1.13860714, 1.13862836, 1.13862944,
       1.13862944},
      {0.858415306, -0.682537138, 0.870871842, 1.12026298, 1.13753986, 1.13857603, 1.13862765,
       1.13862932},
      {0.981861651, 1.11435711, -0.955391526, -0.95723331, 0.923386514, 1.1277498, 1.1382736,
       1.13859391}};
  const std::vector<std::vector<double>> want_sin = {
      {0, 0, 0, 0, 0, 0, 0, 0},
      {0.958123624, 0.354095072, 0.11367327, 0.0292521622, 0.0071163876, 0.00157528941,
       0.000284657377, 9.00165687e-05},
      {0.74806428, 0.911383569, 0.733525217, 0.203685388, 0.0497991443, 0.0110268565, 0.0019926005,
       0.000630115974},
      {-0.576562822, 0.233848959, -0.619438469, 0.616588533, 0.666208982, 0.157026932, 0.0284627713,
       0.0090015633}};
  for (int64_t r = 0; r < 4; ++r) {
    for (int64_t k = 0; k < 8; ++k) {
      // transformers' float32 angle at position 100 is off by up to ~1e-5.
      for (int64_t lane : {k, k + 8}) {
        EXPECT_NEAR(at(t.cos, r, 16, lane), want_cos[r][k], 2e-5) << r << "," << lane;
        EXPECT_NEAR(at(t.sin, r, 16, lane), want_sin[r][k], 2e-5) << r << "," << lane;
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// 1D tables and layouts

TEST(RopeTable, HalfLayoutClosedForm) {
  const std::vector<double> inv = rt::inverse_frequencies(128, 10000.0);
  const std::vector<int64_t> positions = {0, 3, 1000, 123456};
  const rt::Table t = rt::rope_table(positions, inv, Layout::half, 1.0);
  ASSERT_EQ(t.rows, 4);
  ASSERT_EQ(t.width, 128);
  ASSERT_EQ(t.cos.size(), 4u * 128u);
  for (size_t r = 0; r < positions.size(); ++r) {
    for (int64_t k : {0, 1, 31, 63}) {
      const double angle = static_cast<double>(positions[r]) * closed_inv_freq(k, 128, 10000.0);
      for (int64_t lane : {k, k + 64}) {
        EXPECT_EQ(at(t.cos, static_cast<int64_t>(r), 128, lane),
                  static_cast<float>(std::cos(angle)));
        EXPECT_EQ(at(t.sin, static_cast<int64_t>(r), 128, lane),
                  static_cast<float>(std::sin(angle)));
      }
    }
  }
}

TEST(RopeTable, PairsLayoutClosedForm) {
  const std::vector<double> inv = rt::inverse_frequencies(8, 100.0);
  const rt::Table t = rt::rope_table(5, inv, Layout::pairs, 2.0);
  ASSERT_EQ(t.rows, 5);
  ASSERT_EQ(t.width, 8);
  for (int64_t r = 0; r < 5; ++r) {
    for (int64_t k = 0; k < 4; ++k) {
      const double angle = static_cast<double>(r) * closed_inv_freq(k, 8, 100.0);
      for (int64_t lane : {2 * k, 2 * k + 1}) {
        EXPECT_FLOAT_EQ(at(t.cos, r, 8, lane), static_cast<float>(2.0 * std::cos(angle)));
        EXPECT_FLOAT_EQ(at(t.sin, r, 8, lane), static_cast<float>(2.0 * std::sin(angle)));
      }
    }
  }
}

TEST(RopeTable, CountEqualsExplicitRange) {
  const std::vector<double> inv = rt::inverse_frequencies(16, 10000.0);
  const rt::Table a = rt::rope_table(7, inv, Layout::half);
  const rt::Table b = rt::rope_table(std::vector<int64_t>{0, 1, 2, 3, 4, 5, 6}, inv, Layout::half);
  EXPECT_EQ(a.cos, b.cos);
  EXPECT_EQ(a.sin, b.sin);
  const rt::Table empty = rt::rope_table(0, inv, Layout::half);
  EXPECT_EQ(empty.rows, 0);
  EXPECT_EQ(empty.width, 16);
  EXPECT_TRUE(empty.cos.empty());
}

TEST(RopeTable, LongContextAngleInDouble) {
  // A float32 angle at position 1e6 would be off by ~0.06 rad; the double angle is exact to
  // float rounding.
  const std::vector<double> inv = rt::inverse_frequencies(128, 500000.0);
  const std::vector<int64_t> positions = {1000000, -5};
  const rt::Table t = rt::rope_table(positions, inv, Layout::half);
  for (int64_t k : {0, 5, 40}) {
    const double angle = 1e6 * closed_inv_freq(k, 128, 500000.0);
    EXPECT_NEAR(at(t.cos, 0, 128, k), std::cos(angle), 1e-7);
    EXPECT_NEAR(at(t.sin, 0, 128, k), std::sin(angle), 1e-7);
    EXPECT_NEAR(at(t.sin, 1, 128, k), std::sin(-5.0 * closed_inv_freq(k, 128, 500000.0)), 1e-7);
  }
}

TEST(HalfWidth, FrequencyTableAndCosSinCache) {
  const std::vector<double> inv = rt::inverse_frequencies(8, 10000.0);
  const rt::Table half = rt::frequency_table(3, inv, 1.5);
  ASSERT_EQ(half.rows, 3);
  ASSERT_EQ(half.width, 4);
  const rt::CosSinCache cache = rt::cos_sin_cache(3, inv, 1.5);
  ASSERT_EQ(cache.rows, 3);
  ASSERT_EQ(cache.width, 8);
  ASSERT_EQ(cache.data.size(), 24u);
  for (int64_t p = 0; p < 3; ++p) {
    for (int64_t k = 0; k < 4; ++k) {
      const double angle = static_cast<double>(p) * closed_inv_freq(k, 8, 10000.0);
      const auto c = static_cast<float>(1.5 * std::cos(angle));
      const auto s = static_cast<float>(1.5 * std::sin(angle));
      EXPECT_EQ(at(half.cos, p, 4, k), c);
      EXPECT_EQ(at(half.sin, p, 4, k), s);
      EXPECT_EQ(at(cache.data, p, 8, k), c);      // cos first ...
      EXPECT_EQ(at(cache.data, p, 8, k + 4), s);  // ... then sin, no duplication
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Multi-axis grids

TEST(Grid, TwoDimHalfBlocksRowMajor) {
  // FLUX-like 2D: 64 + 64 lanes, h = 3, w = 5.
  const rt::Axes axes{{64, 64}, {10000.0}};
  const std::vector<int64_t> sizes = {3, 5};
  const rt::Table t = rt::grid_table(axes, sizes, Layout::half);
  ASSERT_EQ(t.rows, 15);
  ASSERT_EQ(t.width, 128);
  for (int64_t h = 0; h < 3; ++h) {
    for (int64_t w = 0; w < 5; ++w) {
      const int64_t row = h * 5 + w;  // w fastest
      for (int64_t k : {0, 1, 31}) {
        const double fh = static_cast<double>(h) * closed_inv_freq(k, 64, 10000.0);
        const double fw = static_cast<double>(w) * closed_inv_freq(k, 64, 10000.0);
        // Axis h owns lanes [0, 64): half layout k and k + 32; axis w owns [64, 128).
        EXPECT_EQ(at(t.cos, row, 128, k), static_cast<float>(std::cos(fh)));
        EXPECT_EQ(at(t.cos, row, 128, k + 32), static_cast<float>(std::cos(fh)));
        EXPECT_EQ(at(t.sin, row, 128, 64 + k), static_cast<float>(std::sin(fw)));
        EXPECT_EQ(at(t.sin, row, 128, 96 + k), static_cast<float>(std::sin(fw)));
      }
    }
  }
}

TEST(Grid, ThreeDimSeedBenchmarkHalfBlocks) {
  // 44 / 44 / 40 half blocks, t = 2, h = 3, w = 4, shared theta.
  const rt::Axes axes{{44, 44, 40}, {10000.0}};
  const std::vector<int64_t> sizes = {2, 3, 4};
  const rt::Table t = rt::grid_table(axes, sizes, Layout::half);
  ASSERT_EQ(t.rows, 24);
  ASSERT_EQ(t.width, 128);
  const int64_t row = 1 * 12 + 2 * 4 + 3;  // t = 1, h = 2, w = 3
  const int64_t k = 5;
  EXPECT_EQ(at(t.cos, row, 128, k),
            static_cast<float>(std::cos(1.0 * closed_inv_freq(k, 44, 1e4))));
  EXPECT_EQ(at(t.cos, row, 128, 22 + k),
            static_cast<float>(std::cos(1.0 * closed_inv_freq(k, 44, 1e4))));
  EXPECT_EQ(at(t.cos, row, 128, 44 + k),
            static_cast<float>(std::cos(2.0 * closed_inv_freq(k, 44, 1e4))));
  EXPECT_EQ(at(t.cos, row, 128, 66 + k),
            static_cast<float>(std::cos(2.0 * closed_inv_freq(k, 44, 1e4))));
  EXPECT_EQ(at(t.sin, row, 128, 88 + k),
            static_cast<float>(std::sin(3.0 * closed_inv_freq(k, 40, 1e4))));
  EXPECT_EQ(at(t.sin, row, 128, 108 + k),
            static_cast<float>(std::sin(3.0 * closed_inv_freq(k, 40, 1e4))));
}

TEST(Grid, WanPairsPerAxisThetaAndStarts) {
  // Wan: 44 / 42 / 42 interleaved pairs; one theta per axis and start offsets.
  const rt::Axes axes{{44, 42, 42}, {10000.0, 20000.0, 30000.0}};
  const std::vector<int64_t> sizes = {2, 2, 3};
  const std::vector<int64_t> starts = {10, 0, 7};
  const rt::Table t = rt::grid_table(axes, sizes, Layout::pairs, starts);
  ASSERT_EQ(t.rows, 12);
  ASSERT_EQ(t.width, 128);
  const int64_t row = 1 * 6 + 0 * 3 + 2;  // positions t = 11, h = 0, w = 9
  for (int64_t k : {0, 3, 20}) {
    const double at_t = 11.0 * closed_inv_freq(k, 44, 10000.0);
    const double at_w = 9.0 * closed_inv_freq(k, 42, 30000.0);
    EXPECT_EQ(at(t.cos, row, 128, 2 * k), static_cast<float>(std::cos(at_t)));
    EXPECT_EQ(at(t.cos, row, 128, 2 * k + 1), static_cast<float>(std::cos(at_t)));
    EXPECT_EQ(at(t.sin, row, 128, 44 + 2 * k), 0.0f);  // h = 0
    EXPECT_EQ(at(t.cos, row, 128, 44 + 2 * k + 1), 1.0f);
    EXPECT_EQ(at(t.sin, row, 128, 86 + 2 * k), static_cast<float>(std::sin(at_w)));
    EXPECT_EQ(at(t.sin, row, 128, 86 + 2 * k + 1), static_cast<float>(std::sin(at_w)));
  }
}

TEST(Grid, AxesTableMatchesGrid) {
  // HunyuanVideo / Flux: 16 / 56 / 56. Explicit [n_tokens][3] positions equal the grid.
  const rt::Axes axes{{16, 56, 56}, {256.0}};
  const std::vector<int64_t> sizes = {2, 2, 2};
  const std::vector<int64_t> starts = {0, 4, 8};
  std::vector<int64_t> positions;
  for (int64_t t = 0; t < 2; ++t) {
    for (int64_t h = 0; h < 2; ++h) {
      for (int64_t w = 0; w < 2; ++w) positions.insert(positions.end(), {t, 4 + h, 8 + w});
    }
  }
  for (Layout layout : {Layout::half, Layout::pairs}) {
    const rt::Table grid = rt::grid_table(axes, sizes, layout, starts);
    const rt::Table tokens = rt::axes_table(axes, positions, layout);
    EXPECT_EQ(grid.rows, tokens.rows);
    EXPECT_EQ(grid.cos, tokens.cos);
    EXPECT_EQ(grid.sin, tokens.sin);
  }
}

TEST(Grid, OneAxisEqualsRopeTable) {
  const rt::Axes axes{{32}, {10000.0}};
  const std::vector<int64_t> sizes = {9};
  const rt::Table grid = rt::grid_table(axes, sizes, Layout::pairs);
  const rt::Table plain = rt::rope_table(9, rt::inverse_frequencies(32, 10000.0), Layout::pairs);
  EXPECT_EQ(grid.cos, plain.cos);
  EXPECT_EQ(grid.sin, plain.sin);
}

// ---------------------------------------------------------------------------------------------
// MRoPE. Axis strings come from Qwen2VLRotaryEmbedding / Qwen3VLTextRotaryEmbedding
// (head_dim 128, rope_theta 10000) called with t, h, w positions 3, 50, 700: the axis of each
// output lane is the one whose cos(pos * inv_freq) matches transformers' cos.

std::string axis_string(const std::vector<int>& axis) {
  std::string s;
  for (int a : axis) s += static_cast<char>('0' + a);
  return s;
}

TEST(Mrope, SectionedAxesMatchQwen2VL) {
  const std::vector<int64_t> sections = {16, 24, 24};
  EXPECT_EQ(axis_string(rt::mrope_column_axis(sections, Mrope::sectioned)),
            "0000000000000000111111111111111111111111222222222222222222222222"
            "0000000000000000111111111111111111111111222222222222222222222222");
  EXPECT_EQ(rt::mrope_frequency_axis(sections, Mrope::sectioned).size(), 64u);
}

TEST(Mrope, InterleavedAxesMatchQwen3VL) {
  const std::vector<int64_t> sections = {24, 20, 20};
  EXPECT_EQ(axis_string(rt::mrope_column_axis(sections, Mrope::interleaved)),
            "0120120120120120120120120120120120120120120120120120120120120000"
            "0120120120120120120120120120120120120120120120120120120120120000");
  EXPECT_EQ(
      axis_string(rt::mrope_frequency_axis(std::vector<int64_t>{3, 3, 2}, Mrope::interleaved)),
      "01201201");
}

TEST(Mrope, TablesMatchTransformers) {
  // head_dim 16, rope_theta 10000, positions t = 3, h = 50, w = 700 (one token); cos/sin from
  // Qwen2VLRotaryEmbedding with mrope_section [2, 3, 3] and Qwen3VLTextRotaryEmbedding with
  // [3, 3, 2]. Tolerance covers transformers' float32 angle at position 700.
  const std::vector<double> inv = rt::inverse_frequencies(16, 10000.0);
  const std::vector<int64_t> positions = {3, 50, 700};  // [3][T = 1]
  struct Case {
    std::vector<int64_t> sections;
    Mrope mode;
    std::vector<double> cos, sin;
  };
  const std::vector<Case> cases = {{{2, 3, 3},
                                    Mrope::sectioned,
                                    {-0.989992499, 0.582753658, 0.2836622, -0.0103424573,
                                     0.87758255, -0.599437475, 0.764842153, 0.975599885},
                                    {0.141120002, 0.812648892, -0.958924294, 0.999946535,
                                     0.47942555, 0.800421596, 0.64421773, 0.219556108}},
                                   {{3, 3, 2},
                                    Mrope::interleaved,
                                    {-0.989992499, -0.994656444, 0.633319199, 0.995503366,
                                     0.87758255, -0.599437475, 0.99999553, 0.999875009},
                                    {0.141120002, -0.10324046, 0.773890674, 0.0947260931,
                                     0.47942555, 0.800421596, 0.0029999956, 0.0158107299}}};
  for (const Case& c : cases) {
    const rt::Table t = rt::mrope_table(positions, inv, c.sections, c.mode);
    ASSERT_EQ(t.rows, 1);
    ASSERT_EQ(t.width, 16);
    for (int64_t k = 0; k < 8; ++k) {
      for (int64_t lane : {k, k + 8}) {
        EXPECT_NEAR(t.cos[static_cast<size_t>(lane)], c.cos[static_cast<size_t>(k)], 1e-5);
        EXPECT_NEAR(t.sin[static_cast<size_t>(lane)], c.sin[static_cast<size_t>(k)], 1e-5);
      }
    }
  }
}

TEST(Mrope, SamePositionOnEveryAxisIsPlainRope) {
  // Text tokens carry t = h = w; MRoPE then reduces to 1D half RoPE.
  const std::vector<double> inv = rt::inverse_frequencies(128, 1e6);
  const std::vector<int64_t> positions = {0, 5, 9, 0, 5, 9, 0, 5, 9};  // [3][3]
  const std::vector<int64_t> sections = {24, 20, 20};
  const rt::Table plain = rt::rope_table(std::vector<int64_t>{0, 5, 9}, inv, Layout::half, 1.25);
  for (Mrope mode : {Mrope::sectioned, Mrope::interleaved}) {
    const rt::Table m = rt::mrope_table(positions, inv, sections, mode, 1.25);
    EXPECT_EQ(m.cos, plain.cos);
    EXPECT_EQ(m.sin, plain.sin);
  }
}

TEST(Mrope, PositionsAreAxisMajor) {
  // [3][T]: token 1 has t = 2, h = 20, w = 200.
  const std::vector<double> inv = rt::inverse_frequencies(16, 10000.0);
  const std::vector<int64_t> positions = {1, 2, 10, 20, 100, 200};
  const std::vector<int64_t> sections = {2, 3, 3};
  const rt::Table t = rt::mrope_table(positions, inv, sections, Mrope::sectioned);
  ASSERT_EQ(t.rows, 2);
  EXPECT_EQ(at(t.cos, 1, 16, 1), static_cast<float>(std::cos(2.0 * inv[1])));
  EXPECT_EQ(at(t.cos, 1, 16, 2), static_cast<float>(std::cos(20.0 * inv[2])));
  EXPECT_EQ(at(t.cos, 1, 16, 8 + 7), static_cast<float>(std::cos(200.0 * inv[7])));
}

// ---------------------------------------------------------------------------------------------
// bf16 / fp16 bits

// Independent reference: nearest representable of the two neighbours by exact double distance,
// ties to the even one.
uint16_t reference_bf16(float value) {
  const auto bits = std::bit_cast<uint32_t>(value);
  const auto down = static_cast<uint16_t>(bits >> 16);
  const auto up = static_cast<uint16_t>(down + 1);
  const double v = value;
  const double dd = std::abs(v - static_cast<double>(rt::float_from_bf16_bits(down)));
  const double du = std::abs(v - static_cast<double>(rt::float_from_bf16_bits(up)));
  if (dd < du) return down;
  if (du < dd) return up;
  return (down & 1u) == 0 ? down : up;
}

TEST(Bf16, RoundToNearestEven) {
  EXPECT_EQ(rt::bf16_bits(1.0f), 0x3f80);
  EXPECT_EQ(rt::bf16_bits(-2.0f), 0xc000);
  // Ties: 1 + 2^-8 sits halfway between 1 and 1 + 2^-7 -> even (1.0); 1 + 3 * 2^-8 -> up.
  EXPECT_EQ(rt::bf16_bits(1.0f + 0x1p-8f), 0x3f80);
  EXPECT_EQ(rt::bf16_bits(1.0f + 3 * 0x1p-8f), 0x3f82);
  EXPECT_EQ(rt::bf16_bits(std::bit_cast<float>(0x3f808001u)), 0x3f81);  // just above the tie
  EXPECT_EQ(rt::bf16_bits(0.0f), 0x0000);
  EXPECT_EQ(rt::bf16_bits(-0.0f), 0x8000);
}

TEST(Bf16, SpecialValues) {
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(rt::bf16_bits(inf), 0x7f80);
  EXPECT_EQ(rt::bf16_bits(-inf), 0xff80);
  EXPECT_EQ(rt::bf16_bits(std::numeric_limits<float>::max()), 0x7f80);  // rounds up to inf
  const uint16_t nan = rt::bf16_bits(std::numeric_limits<float>::quiet_NaN());
  EXPECT_TRUE(std::isnan(rt::float_from_bf16_bits(nan)));
  // A NaN whose payload lives only in the low 16 bits must not become inf.
  const uint16_t low_payload = rt::bf16_bits(std::bit_cast<float>(0xff800001u));
  EXPECT_TRUE(std::isnan(rt::float_from_bf16_bits(low_payload)));
  EXPECT_EQ(low_payload & 0x8000, 0x8000);
  // Float subnormals round like any other value.
  EXPECT_EQ(rt::bf16_bits(std::bit_cast<float>(0x00008000u)), 0x0000);  // tie -> even
  EXPECT_EQ(rt::bf16_bits(std::bit_cast<float>(0x00018000u)), 0x0002);  // tie -> even
  EXPECT_EQ(rt::bf16_bits(std::numeric_limits<float>::denorm_min()), 0x0000);
}

TEST(Bf16, MatchesReferenceOnRandomFloats) {
  std::mt19937 rng(7);
  std::vector<float> values;
  for (int i = 0; i < 200000; ++i) {
    const float v = std::bit_cast<float>(static_cast<uint32_t>(rng()));
    if (std::isfinite(v) && std::abs(v) < 3.0e38f) values.push_back(v);
  }
  const std::vector<uint16_t> bits = rt::to_bf16_bits(values);
  ASSERT_EQ(bits.size(), values.size());
  for (size_t i = 0; i < values.size(); ++i) {
    ASSERT_EQ(bits[i], reference_bf16(values[i])) << std::hexfloat << values[i];
  }
}

TEST(Fp16, RoundToNearestEvenAndOverflow) {
  EXPECT_EQ(rt::fp16_bits(1.0f), 0x3c00);
  EXPECT_EQ(rt::fp16_bits(-2.0f), 0xc000);
  EXPECT_EQ(rt::fp16_bits(1.0f + 0x1p-11f), 0x3c00);      // tie -> even
  EXPECT_EQ(rt::fp16_bits(1.0f + 3 * 0x1p-11f), 0x3c02);  // tie -> even (up)
  EXPECT_EQ(rt::fp16_bits(65504.0f), 0x7bff);
  EXPECT_EQ(rt::fp16_bits(65519.0f), 0x7bff);  // below the tie
  EXPECT_EQ(rt::fp16_bits(65520.0f), 0x7c00);  // tie -> inf
  EXPECT_EQ(rt::fp16_bits(-1e6f), 0xfc00);
  EXPECT_EQ(rt::fp16_bits(std::numeric_limits<float>::infinity()), 0x7c00);
  EXPECT_EQ(rt::fp16_bits(-0.0f), 0x8000);
}

TEST(Fp16, Subnormals) {
  EXPECT_EQ(rt::fp16_bits(0x1p-24f), 0x0001);         // smallest subnormal
  EXPECT_EQ(rt::fp16_bits(0x1p-25f), 0x0000);         // tie with 0 -> even (0)
  EXPECT_EQ(rt::fp16_bits(0x1.8p-24f), 0x0002);       // 1.5 steps: tie -> even (2)
  EXPECT_EQ(rt::fp16_bits(0x1.000002p-25f), 0x0001);  // just above the tie
  EXPECT_EQ(rt::fp16_bits(-0x3p-24f), 0x8003);
  EXPECT_EQ(rt::fp16_bits(0x3ffp-24f), 0x03ff);    // largest subnormal
  EXPECT_EQ(rt::fp16_bits(0x3ff.8p-24f), 0x0400);  // tie -> smallest normal
  EXPECT_EQ(rt::fp16_bits(0x1p-14f), 0x0400);
  EXPECT_EQ(rt::fp16_bits(1e-10f), 0x0000);
}

TEST(Fp16, NaNIsPreserved) {
  const uint16_t nan = rt::fp16_bits(std::numeric_limits<float>::quiet_NaN());
  EXPECT_TRUE(std::isnan(rt::float_from_fp16_bits(nan)));
  const uint16_t low_payload = rt::fp16_bits(std::bit_cast<float>(0xff800001u));
  EXPECT_EQ(low_payload & 0xfe00, 0xfe00);  // sign kept, quiet NaN
  EXPECT_TRUE(std::isnan(rt::float_from_fp16_bits(low_payload)));
}

TEST(Fp16, EveryHalfRoundTrips) {
  for (uint32_t h = 0; h <= 0xffff; ++h) {
    const auto bits = static_cast<uint16_t>(h);
    const float f = rt::float_from_fp16_bits(bits);
    if (std::isnan(f)) continue;
    ASSERT_EQ(rt::fp16_bits(f), bits) << std::hex << h;
  }
  EXPECT_EQ(rt::float_from_fp16_bits(0x0001), 0x1p-24f);
  EXPECT_EQ(rt::float_from_fp16_bits(0x7bff), 65504.0f);
  EXPECT_EQ(rt::float_from_fp16_bits(0xfc00), -std::numeric_limits<float>::infinity());
}

#if defined(__FLT16_MAX__)
TEST(Fp16, MatchesCompilerConversionOnRandomFloats) {
  // The compiler's float -> _Float16 conversion rounds to nearest even.
  std::mt19937 rng(11);
  std::vector<float> values;
  for (int i = 0; i < 200000; ++i) {
    const float v = std::bit_cast<float>(static_cast<uint32_t>(rng()));
    if (!std::isnan(v)) values.push_back(v);
    values.push_back(std::ldexp(static_cast<float>(rng() % 4096), -static_cast<int>(rng() % 40)));
  }
  const std::vector<uint16_t> bits = rt::to_fp16_bits(values);
  for (size_t i = 0; i < values.size(); ++i) {
    ASSERT_EQ(bits[i], std::bit_cast<uint16_t>(static_cast<_Float16>(values[i])))
        << std::hexfloat << values[i];
  }
}
#endif

// ---------------------------------------------------------------------------------------------
// Errors: every bad argument throws rome::Error naming it.

TEST(Errors, Dim) {
  expect_invalid([] { rt::inverse_frequencies(7, 10000.0); }, "dim");
  expect_invalid([] { rt::inverse_frequencies(0, 10000.0); }, "dim");
  expect_invalid([] { rt::inverse_frequencies(-4, 10000.0); }, "dim");
  expect_invalid([] { rt::scaled_frequencies(2, 10000.0, Scaling::ntk(2.0)); }, "dim");
}

TEST(Errors, Theta) {
  expect_invalid([] { rt::inverse_frequencies(8, 0.0); }, "theta");
  expect_invalid([] { rt::inverse_frequencies(8, -1.0); }, "theta");
  expect_invalid([] { rt::inverse_frequencies(8, std::nan("")); }, "theta");
  expect_invalid([] { rt::scaled_frequencies(8, 1.0, Scaling::yarn(2.0, 4096)); }, "theta");
}

TEST(Errors, Factor) {
  expect_invalid([] { rt::scaled_frequencies(8, 1e4, Scaling::linear(0.0)); }, "scaling.factor");
  expect_invalid([] { rt::scaled_frequencies(8, 1e4, Scaling::yarn(-2.0, 4096)); },
                 "scaling.factor");
  expect_invalid([] { rt::scaled_frequencies(8, 1e4, Scaling::llama3(std::nan(""))); },
                 "scaling.factor");
}

TEST(Errors, ScalingLengthsAndYarnParameters) {
  expect_invalid([] { rt::scaled_frequencies(8, 1e4, Scaling::yarn(2.0, 0)); },
                 "scaling.original_max_position_embeddings");
  expect_invalid([] { rt::scaled_frequencies(8, 1e4, Scaling::dynamic_ntk(2.0, 4096, -1)); },
                 "scaling.seq_len");
  Scaling s = Scaling::yarn(2.0, 4096);
  s.beta_fast = 0.0;
  expect_invalid([&] { rt::scaled_frequencies(8, 1e4, s); }, "scaling.beta_fast");
  s = Scaling::yarn(2.0, 4096);
  s.attention_factor = 0.0;
  expect_invalid([&] { rt::scaled_frequencies(8, 1e4, s); }, "scaling.attention_factor");
}

TEST(Errors, Llama3FreqFactors) {
  expect_invalid([] { rt::scaled_frequencies(8, 1e4, Scaling::llama3(8.0, 8192, 4.0, 4.0)); },
                 "scaling.high_freq_factor");
  expect_invalid([] { rt::scaled_frequencies(8, 1e4, Scaling::llama3(8.0, 8192, 0.0, 4.0)); },
                 "scaling.low_freq_factor");
}

TEST(Errors, RopeTableArguments) {
  const std::vector<double> inv = rt::inverse_frequencies(8, 1e4);
  expect_invalid([&] { rt::rope_table(-1, inv, Layout::half); }, "num_positions");
  expect_invalid([] { rt::rope_table(4, std::vector<double>{}, Layout::half); }, "inv_freq");
  expect_invalid([&] { rt::rope_table(4, inv, Layout::half, std::nan("")); }, "amplitude");
  expect_invalid([&] { rt::frequency_table(-3, inv); }, "num_positions");
  expect_invalid([&] { rt::cos_sin_cache(-3, inv); }, "max_positions");
}

TEST(Errors, SizeOverflow) {
  const std::vector<double> inv = rt::inverse_frequencies(8, 1e4);
  const int64_t huge = std::numeric_limits<int64_t>::max() / 2;
  expect_invalid([&] { rt::rope_table(huge, inv, Layout::half); }, "table size");
  expect_invalid([&] { rt::cos_sin_cache(huge, inv); }, "table size");
  const rt::Axes axes{{8, 8}, {1e4}};
  expect_invalid(
      [&] {
        rt::grid_table(axes, std::vector<int64_t>{huge, 4}, Layout::half);
      },
      "grid size");
  expect_invalid(
      [&] {
        rt::grid_table(axes, std::vector<int64_t>{1LL << 40, 1LL << 20}, Layout::half);
      },
      "table size");
}

TEST(Errors, GridArguments) {
  const rt::Axes axes{{8, 8}, {1e4}};
  expect_invalid([&] { rt::grid_table(axes, std::vector<int64_t>{4, 0}, Layout::half); }, "sizes");
  expect_invalid([&] { rt::grid_table(axes, std::vector<int64_t>{4, -2}, Layout::half); }, "sizes");
  expect_invalid([&] { rt::grid_table(axes, std::vector<int64_t>{}, Layout::half); }, "sizes");
  expect_invalid([&] { rt::grid_table(axes, std::vector<int64_t>{4}, Layout::half); }, "sizes");
  expect_invalid(
      [&] {
        rt::grid_table(axes, std::vector<int64_t>{2, 2}, Layout::half, std::vector<int64_t>{1});
      },
      "starts");
  expect_invalid(
      [] {
        rt::grid_table({{}, {1e4}}, std::vector<int64_t>{}, Layout::half);
      },
      "axes.dims");
  expect_invalid(
      [] {
        rt::grid_table({{8, 7}, {1e4}}, std::vector<int64_t>{2, 2}, Layout::half);
      },
      "axes.dims[1]");
  expect_invalid(
      [] {
        rt::grid_table({{8, 8, 8}, {1e4, 1e4}}, std::vector<int64_t>{2, 2, 2}, Layout::half);
      },
      "axes.thetas");
  expect_invalid(
      [] {
        rt::grid_table({{8, 8}, {1e4, 0.0}}, std::vector<int64_t>{2, 2}, Layout::half);
      },
      "axes.thetas[1]");
  expect_invalid(
      [&] {
        rt::axes_table(axes, std::vector<int64_t>{1, 2, 3}, Layout::half);
      },
      "positions");
}

TEST(Errors, MropeArguments) {
  const std::vector<double> inv = rt::inverse_frequencies(16, 1e4);
  const std::vector<int64_t> positions = {0, 0, 0};
  expect_invalid(
      [&] {
        rt::mrope_table(positions, inv, std::vector<int64_t>{2, 3, 2}, Mrope::sectioned);
      },
      "sections");
  expect_invalid(
      [&] {
        rt::mrope_table(positions, inv, std::vector<int64_t>{4, 4}, Mrope::interleaved);
      },
      "sections");
  expect_invalid(
      [] {
        rt::mrope_frequency_axis(std::vector<int64_t>{4, -1, 5}, Mrope::sectioned);
      },
      "sections");
  expect_invalid([] { rt::mrope_column_axis(std::vector<int64_t>{}, Mrope::sectioned); },
                 "sections");
  expect_invalid(
      [&] {
        rt::mrope_table(std::vector<int64_t>{0, 0}, inv, std::vector<int64_t>{2, 3, 3},
                        Mrope::sectioned);
      },
      "positions");
}
