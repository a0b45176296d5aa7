#pragma once

// What the kernel tests share: random inputs, a sentinel for outputs a kernel must not touch,
// and the error measure their float32 results are judged by.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <random>
#include <vector>

namespace kvstash::kernels {

inline constexpr float kSentinel = -12345.0f;

inline std::vector<float> RandomFloats(size_t count, std::mt19937& rng, float lo = -1.0f,
                                       float hi = 1.0f) {
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(count);
  for (float& f : v) f = dist(rng);
  return v;
}

// Largest |got - want| over the largest |want| (infinity if anything is not finite): float32
// results of sums of many terms are judged against the size of what they sum to, not element
// by element (an element near zero is a cancellation whose relative error says nothing about
// the kernel; attention outputs are averages of value rows, so their scale is the values').
inline double MaxRelativeError(const std::vector<float>& got, const std::vector<double>& want) {
  double err = 0.0, scale = 0.0;
  for (size_t i = 0; i < want.size(); ++i) {
    if (!std::isfinite(got[i])) return std::numeric_limits<double>::infinity();
    err = std::max(err, std::abs(double{got[i]} - want[i]));
    scale = std::max(scale, std::abs(want[i]));
  }
  return scale == 0.0 ? err : err / scale;
}

}  // namespace kvstash::kernels
