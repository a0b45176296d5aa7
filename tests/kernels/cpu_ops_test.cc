#include "kvstash/kernels/cpu_ops.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "kernel_test_util.h"

namespace kvstash::kernels {
namespace {

struct MatMulShape {
  size_t n, in, out;
};

TEST(MatMulTest, MatchesDoubleReferenceOnOddShapesAndStrides) {
  std::mt19937 rng(1);
  // Row counts on both sides of the packed path's threshold and every remainder of its 6-row
  // blocks; in across the 256-row panels; out with and without a whole number of 16-column
  // tiles, and a power-of-two row pitch.
  const MatMulShape shapes[] = {{1, 1, 1},       {1, 7, 13},     {3, 100, 77},  {7, 33, 300},
                                {8, 16, 16},     {9, 40, 50},    {12, 64, 48},  {13, 257, 35},
                                {17, 300, 2048}, {64, 256, 768}, {6, 513, 129}, {1, 2048, 5},
                                {2, 5, 4099},    {11, 1, 31}};
  for (const auto& [n, in, out] : shapes) {
    for (bool strided : {false, true}) {
      SCOPED_TRACE(testing::Message()
                   << "n=" << n << " in=" << in << " out=" << out << " strided=" << strided);
      const size_t x_stride = strided ? in + 3 : in;
      const size_t y_stride = strided ? out + 5 : out;
      const std::vector<float> x = RandomFloats(n * x_stride, rng);
      const std::vector<float> w = RandomFloats(in * out, rng);
      std::vector<float> y(n * y_stride, kSentinel);
      MatMul(x.data(), w.data(), y.data(), n, in, out, strided ? x_stride : 0,
             strided ? y_stride : 0);

      std::vector<double> want(n * out, 0.0);
      std::vector<float> got(n * out);
      for (size_t i = 0; i < n; ++i) {
        for (size_t j = 0; j < out; ++j) {
          double sum = 0.0;
          for (size_t k = 0; k < in; ++k) sum += double{x[i * x_stride + k]} * w[k * out + j];
          want[i * out + j] = sum;
          got[i * out + j] = y[i * y_stride + j];
        }
        for (size_t j = out; j < y_stride; ++j) {
          ASSERT_EQ(y[i * y_stride + j], kSentinel) << "wrote past row " << i;
        }
      }
      EXPECT_LT(MaxRelativeError(got, want), 1e-5);
    }
  }
}

// A row's result must not depend on how many rows share the call (the packed path for 8 rows
// or more, the streamed one below): the engine computes a token alone in decode, in a prefill
// chunk of any size, or as part of another request's prefix, and greedy tokens must not move.
TEST(MatMulTest, RowResultsAreBitwiseIndependentOfTheBatch) {
  std::mt19937 rng(77);
  for (size_t in : {64, 192, 300, 600}) {
    for (size_t out : {17, 64, 192, 256}) {
      const size_t n = 64;
      const std::vector<float> x = RandomFloats(n * in, rng);
      const std::vector<float> w = RandomFloats(in * out, rng);
      std::vector<float> all(n * out);
      MatMul(x.data(), w.data(), all.data(), n, in, out);
      for (size_t first : {0, 5, 40}) {
        for (size_t m : {1, 3, 7, 8, 13, 24}) {
          if (first + m > n) continue;
          std::vector<float> part(m * out);
          MatMul(x.data() + first * in, w.data(), part.data(), m, in, out);
          ASSERT_TRUE(std::equal(part.begin(), part.end(), all.begin() + first * out))
              << "in " << in << " out " << out << " rows " << first << "+" << m;
        }
      }
    }
  }
}

TEST(MatMulTest, EmptyInnerDimensionGivesZeros) {
  std::vector<float> y(3 * 5, kSentinel);
  for (size_t n : {3, 10}) {
    y.assign(n * 5, kSentinel);
    MatMul(nullptr, nullptr, y.data(), n, 0, 5);
    for (float v : y) EXPECT_EQ(v, 0.0f);
  }
}

TEST(RmsNormTest, MatchesReferenceOutOfPlaceAndInPlace) {
  std::mt19937 rng(2);
  for (size_t dim : {1, 7, 16, 64, 100, 4099}) {
    SCOPED_TRACE(testing::Message() << "dim=" << dim);
    const size_t n = 3;
    const float eps = 1e-5f;
    const std::vector<float> x = RandomFloats(n * dim, rng, -3.0f, 3.0f);
    const std::vector<float> weight = RandomFloats(dim, rng, 0.5f, 1.5f);
    std::vector<double> want(n * dim);
    for (size_t i = 0; i < n; ++i) {
      double ss = 0.0;
      for (size_t j = 0; j < dim; ++j) ss += double{x[i * dim + j]} * x[i * dim + j];
      const double inv = 1.0 / std::sqrt(ss / dim + eps);
      for (size_t j = 0; j < dim; ++j) want[i * dim + j] = x[i * dim + j] * inv * weight[j];
    }
    std::vector<float> y(n * dim);
    RmsNorm(x.data(), weight.data(), y.data(), n, dim, eps);
    EXPECT_LT(MaxRelativeError(y, want), 1e-6);

    std::vector<float> in_place = x;
    RmsNorm(in_place.data(), weight.data(), in_place.data(), n, dim, eps);
    EXPECT_EQ(in_place, y);
  }
}

TEST(ApplyRopeTest, RotatesHalvesByPositionTimesFrequency) {
  std::mt19937 rng(3);
  const float theta = 10000.0f;
  // head_dim 160 has 80 pairs, more than the kernel takes at once.
  for (size_t head_dim : {2, 8, 16, 64, 160}) {
    SCOPED_TRACE(testing::Message() << "head_dim=" << head_dim);
    const size_t num_heads = 3, n = 6;
    const size_t stride = num_heads * head_dim + 5;
    const std::vector<uint32_t> positions = {0, 1, 17, 4095, 100000, 3};
    std::vector<float> x = RandomFloats(n * stride, rng);
    for (size_t i = 0; i < n; ++i) {
      for (size_t j = num_heads * head_dim; j < stride; ++j) x[i * stride + j] = kSentinel;
    }
    const std::vector<float> before = x;
    ApplyRope(x.data(), stride, n, num_heads, head_dim, positions.data(), theta);

    const size_t half = head_dim / 2;
    std::vector<double> want;
    std::vector<float> got;
    for (size_t i = 0; i < n; ++i) {
      for (size_t h = 0; h < num_heads; ++h) {
        const float* row = before.data() + i * stride + h * head_dim;
        for (size_t j = 0; j < half; ++j) {
          const double angle =
              positions[i] * std::pow(double{theta}, -2.0 * static_cast<double>(j) / head_dim);
          want.push_back(row[j] * std::cos(angle) - row[j + half] * std::sin(angle));
          want.push_back(row[j] * std::sin(angle) + row[j + half] * std::cos(angle));
          got.push_back(x[i * stride + h * head_dim + j]);
          got.push_back(x[i * stride + h * head_dim + j + half]);
        }
      }
      for (size_t j = num_heads * head_dim; j < stride; ++j) {
        EXPECT_EQ(x[i * stride + j], kSentinel);
      }
    }
    EXPECT_LT(MaxRelativeError(got, want), 1e-6);
    // Position 0 is the identity.
    for (size_t j = 0; j < num_heads * head_dim; ++j) EXPECT_EQ(x[j], before[j]);
  }
}

TEST(SiluMulTest, MatchesReferenceIncludingInPlace) {
  std::mt19937 rng(4);
  for (size_t count : {1, 7, 8, 9, 1000, 1003}) {
    SCOPED_TRACE(testing::Message() << "count=" << count);
    const std::vector<float> gate = RandomFloats(count, rng, -20.0f, 20.0f);
    const std::vector<float> up = RandomFloats(count, rng, -2.0f, 2.0f);
    std::vector<float> out(count);
    SiluMul(gate.data(), up.data(), out.data(), count);
    for (size_t i = 0; i < count; ++i) {
      const double g = gate[i];
      const double want = g / (1.0 + std::exp(-g)) * up[i];
      EXPECT_NEAR(out[i], want, 2e-6 * std::abs(want) + 1e-30) << "gate " << g;
    }
    std::vector<float> into_gate = gate, into_up = up;
    SiluMul(into_gate.data(), up.data(), into_gate.data(), count);
    SiluMul(gate.data(), into_up.data(), into_up.data(), count);
    EXPECT_EQ(into_gate, out);
    EXPECT_EQ(into_up, out);
  }
}

TEST(SiluMulTest, SaturatesAtLargeGates) {
  const std::vector<float> gate = {-1000.0f, -100.0f, -80.0f, 0.0f,  80.0f,
                                   100.0f,   1000.0f, 1e30f,  -1e30f};
  const std::vector<float> up(gate.size(), 1.0f);
  std::vector<float> out(gate.size());
  SiluMul(gate.data(), up.data(), out.data(), gate.size());
  for (size_t i = 0; i < gate.size(); ++i) {
    ASSERT_TRUE(std::isfinite(out[i])) << gate[i];
    if (gate[i] > 0) {
      EXPECT_FLOAT_EQ(out[i], gate[i]);
    } else {
      EXPECT_NEAR(out[i], 0.0f, 1e-30f) << gate[i];
    }
  }
}

TEST(AddInPlaceTest, AddsElementwise) {
  std::mt19937 rng(5);
  for (size_t count : {0, 1, 15, 1001}) {
    std::vector<float> x = RandomFloats(count, rng);
    const std::vector<float> y = RandomFloats(count, rng);
    const std::vector<float> before = x;
    AddInPlace(x.data(), y.data(), count);
    for (size_t i = 0; i < count; ++i) EXPECT_EQ(x[i], before[i] + y[i]);
  }
}

}  // namespace
}  // namespace kvstash::kernels
