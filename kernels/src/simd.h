#pragma once

// Private to kvstash_kernels: the multi-versioning attribute of the hot entry points and the few
// vector helpers the kernels share.
//
// Loops with a loop-carried sum (dot products, squared norms, a register tile of a matrix
// product) are written with GCC/Clang vector types: without -ffast-math the compiler may not
// reorder a float sum, so a plain loop stays scalar there. Element-wise loops stay plain and
// are vectorised by the compiler.

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>

// The library is built for the baseline x86-64 ISA (no -march=native: the binary runs on other
// machines), so each hot entry point is compiled twice, for AVX2+FMA (x86-64-v3) and the
// baseline, and the loader picks one (ifunc). GCC only: Clang 14 does not take arch= levels.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(__AVX2__)
#define KVSTASH_KERNEL_MULTIVERSIONED 1
#define KVSTASH_KERNEL_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define KVSTASH_KERNEL_MULTIVERSIONED 0
#define KVSTASH_KERNEL_CLONES
#endif

// Helpers are forced inline so that each clone of a caller gets its own ISA's copy (a call
// would reach the baseline version).
#define KVSTASH_KERNEL_INLINE inline __attribute__((always_inline))

namespace kvstash::kernels::internal {

// Whether the x86-64-v3 clones run (the test the ifunc resolvers make), or the library is not
// multi-versioned. The baseline clone has half the vector registers and no FMA, so the packed
// matrix product's 6 x 16 register tile spills there: 1.9 against 22 GFLOP/s for the streamed
// loop at n=64, in=256, out=768.
inline bool HasWideVectors() {
#if KVSTASH_KERNEL_MULTIVERSIONED
  return __builtin_cpu_supports("x86-64-v3");
#else
  return true;
#endif
}

using F32x8 = float __attribute__((vector_size(32)));
using I32x8 = int32_t __attribute__((vector_size(32)));

KVSTASH_KERNEL_INLINE F32x8 Load8(const float* p) {
  F32x8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

KVSTASH_KERNEL_INLINE void Store8(float* p, F32x8 v) { std::memcpy(p, &v, sizeof(v)); }

KVSTASH_KERNEL_INLINE float HorizontalSum(F32x8 v) {
  return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

// sum a[i] * b[i] over n floats, eight partial sums wide.
KVSTASH_KERNEL_INLINE float Dot(const float* a, const float* b, size_t n) {
  F32x8 acc0{}, acc1{};
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    acc0 += Load8(a + i) * Load8(b + i);
    acc1 += Load8(a + i + 8) * Load8(b + i + 8);
  }
  if (i + 8 <= n) {
    acc0 += Load8(a + i) * Load8(b + i);
    i += 8;
  }
  float sum = HorizontalSum(acc0 + acc1);
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// exp(x) of eight floats, within about 2 ulp for x in [-87, 88.3]; below, exp(-87); above,
// +inf (float overflows at 88.72), so that silu(g) = g / (1 + exp(-g)) is exactly -0 for a
// very negative g. Written on vectors because std::exp is a libm call the compiler cannot
// vectorise without -ffast-math, and GCC 12 does not if-convert a loop over a scalar version
// of this (two clamps then arithmetic). Cephes' expf: x = n ln2 + r with |r| <= ln2 / 2,
// exp(r) by a degree-7 polynomial, 2^n built in the exponent bits (n = 128 makes them +inf).
KVSTASH_KERNEL_INLINE F32x8 Exp8(F32x8 x) {
  const F32x8 lo = F32x8{} - 87.0f, hi = F32x8{} + 89.0f;
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  // Adding 1.5 * 2^23 rounds x / ln2 to an integer held in the low mantissa bits of t, so n
  // comes out of the bits without a float-to-int conversion.
  constexpr float kRound = 12582912.0f;
  const F32x8 t = x * 1.44269504088896341f + kRound;
  const F32x8 n = t - kRound;
  F32x8 r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  const F32x8 r2 = r * r;
  F32x8 p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r2 + r + 1.0f;
  const I32x8 exponent = (std::bit_cast<I32x8>(t) - std::bit_cast<int32_t>(kRound) + 127) << 23;
  return p * std::bit_cast<F32x8>(exponent);
}

}  // namespace kvstash::kernels::internal
