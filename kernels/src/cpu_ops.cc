#include "kvstash/kernels/cpu_ops.h"

#include <cassert>
#include <cmath>
#include <cstring>

#include "simd.h"

namespace kvstash::kernels {
namespace {

using internal::F32x8;
using internal::Load8;
using internal::Store8;

// MatMul blocking. A panel of w (kPanelRows rows of kTileCols columns, 16 KiB) is copied into a
// contiguous stack buffer and reused by every block of kRowBlock x rows: read in place, a
// column strip of w with a row pitch of a power of two (out = 2048) maps to one L1 set and
// the product ran at 7 instead of 45 GFLOP/s (n=64, in=out=2048). The 6 x 16 tile is 12
// accumulators, enough independent FMAs to cover their latency on two FMA ports, with 16 vector
// registers.
constexpr size_t kTileCols = 16;
constexpr size_t kPanelRows = 256;
constexpr size_t kRowBlock = 6;
// Below this many rows packing costs more than it saves: each w row is streamed once, a few
// at a time, into a kStreamCols-wide strip of every y row (which stays in L1/L2).
constexpr size_t kMinPackedRows = 8;
constexpr size_t kStreamCols = 2048;

// y[r][0:16) (+)= x[r][0:kn) · panel[0:kn)[0:16) for R rows: `first` starts from zero, else
// accumulates onto y (later panels of the same rows).
template <size_t R>
KVSTASH_KERNEL_INLINE void PanelTile(const float* x, size_t x_stride, const float* panel, size_t kn,
                                     float* y, size_t y_stride, bool first) {
  F32x8 acc[R][2];
  for (size_t r = 0; r < R; ++r) {
    acc[r][0] = first ? F32x8{} : Load8(y + r * y_stride);
    acc[r][1] = first ? F32x8{} : Load8(y + r * y_stride + 8);
  }
  for (size_t k = 0; k < kn; ++k) {
    const F32x8 w0 = Load8(panel + k * kTileCols);
    const F32x8 w1 = Load8(panel + k * kTileCols + 8);
    for (size_t r = 0; r < R; ++r) {
      const float xv = x[r * x_stride + k];
      acc[r][0] += xv * w0;
      acc[r][1] += xv * w1;
    }
  }
  for (size_t r = 0; r < R; ++r) {
    Store8(y + r * y_stride, acc[r][0]);
    Store8(y + r * y_stride + 8, acc[r][1]);
  }
}

KVSTASH_KERNEL_INLINE void PackedMatMul(const float* x, const float* w, float* y, size_t n,
                                        size_t in, size_t out, size_t x_stride, size_t y_stride) {
  alignas(64) float panel[kPanelRows * kTileCols];
  for (size_t k0 = 0; k0 < in; k0 += kPanelRows) {
    const size_t kn = in - k0 < kPanelRows ? in - k0 : kPanelRows;
    const bool first = k0 == 0;
    const float* xk = x + k0;
    size_t j = 0;
    for (; j + kTileCols <= out; j += kTileCols) {
      for (size_t k = 0; k < kn; ++k) {
        std::memcpy(panel + k * kTileCols, w + (k0 + k) * out + j, kTileCols * sizeof(float));
      }
      size_t i = 0;
      for (; i + kRowBlock <= n; i += kRowBlock) {
        PanelTile<kRowBlock>(xk + i * x_stride, x_stride, panel, kn, y + i * y_stride + j, y_stride,
                             first);
      }
      const float* xr = xk + i * x_stride;
      float* yr = y + i * y_stride + j;
      switch (n - i) {
        case 5:
          PanelTile<5>(xr, x_stride, panel, kn, yr, y_stride, first);
          break;
        case 4:
          PanelTile<4>(xr, x_stride, panel, kn, yr, y_stride, first);
          break;
        case 3:
          PanelTile<3>(xr, x_stride, panel, kn, yr, y_stride, first);
          break;
        case 2:
          PanelTile<2>(xr, x_stride, panel, kn, yr, y_stride, first);
          break;
        case 1:
          PanelTile<1>(xr, x_stride, panel, kn, yr, y_stride, first);
          break;
        default:
          break;
      }
    }
    // The last out % 16 columns: an axpy per row, the w rows read in place (narrow, so no
    // point packing them).
    if (j < out) {
      const size_t cols = out - j;
      for (size_t i = 0; i < n; ++i) {
        float* __restrict yr = y + i * y_stride + j;
        if (first) std::memset(yr, 0, cols * sizeof(float));
        for (size_t k = 0; k < kn; ++k) {
          const float xv = xk[i * x_stride + k];
          const float* __restrict wr = w + (k0 + k) * out + j;
          for (size_t c = 0; c < cols; ++c) yr[c] += xv * wr[c];
        }
      }
    }
  }
}

// Few rows (decode): w is read once, four rows at a time, in order; each x row adds them onto
// a strip of its y row. Memory-bound on w for a large matrix, so the point is to read w once
// and sequentially.
KVSTASH_KERNEL_INLINE void StreamedMatMul(const float* x, const float* w, float* y, size_t n,
                                          size_t in, size_t out, size_t x_stride, size_t y_stride) {
  for (size_t j0 = 0; j0 < out; j0 += kStreamCols) {
    const size_t cols = out - j0 < kStreamCols ? out - j0 : kStreamCols;
    for (size_t i = 0; i < n; ++i) std::memset(y + i * y_stride + j0, 0, cols * sizeof(float));
    size_t k = 0;
    for (; k + 4 <= in; k += 4) {
      const float* __restrict w0 = w + k * out + j0;
      const float* __restrict w1 = w0 + out;
      const float* __restrict w2 = w1 + out;
      const float* __restrict w3 = w2 + out;
      for (size_t i = 0; i < n; ++i) {
        const float* xr = x + i * x_stride + k;
        const float a0 = xr[0], a1 = xr[1], a2 = xr[2], a3 = xr[3];
        float* __restrict yr = y + i * y_stride + j0;
        // One term at a time, in k order, as the packed path adds them: a row's result must
        // not depend on how many rows share the call (the engine's tokens may not change with
        // the batch or the prefill chunk).
        for (size_t c = 0; c < cols; ++c) {
          float v = yr[c];
          v += a0 * w0[c];
          v += a1 * w1[c];
          v += a2 * w2[c];
          v += a3 * w3[c];
          yr[c] = v;
        }
      }
    }
    for (; k < in; ++k) {
      const float* __restrict w0 = w + k * out + j0;
      for (size_t i = 0; i < n; ++i) {
        const float a0 = x[i * x_stride + k];
        float* __restrict yr = y + i * y_stride + j0;
        for (size_t c = 0; c < cols; ++c) yr[c] += a0 * w0[c];
      }
    }
  }
}

KVSTASH_KERNEL_INLINE F32x8 Silu8(F32x8 g) { return g / (1.0f + internal::Exp8(-g)); }

}  // namespace

KVSTASH_KERNEL_CLONES
void MatMul(const float* x, const float* w, float* y, size_t n, size_t in, size_t out,
            size_t x_stride, size_t y_stride) {
  if (x_stride == 0) x_stride = in;
  if (y_stride == 0) y_stride = out;
  if (n >= kMinPackedRows && in > 0 && internal::HasWideVectors()) {
    PackedMatMul(x, w, y, n, in, out, x_stride, y_stride);
  } else {
    StreamedMatMul(x, w, y, n, in, out, x_stride, y_stride);
  }
}

KVSTASH_KERNEL_CLONES
void RmsNorm(const float* x, const float* weight, float* y, size_t n, size_t dim, float eps) {
  for (size_t i = 0; i < n; ++i) {
    const float* xr = x + i * dim;
    F32x8 acc0{}, acc1{};
    size_t j = 0;
    for (; j + 16 <= dim; j += 16) {
      const F32x8 a = Load8(xr + j), b = Load8(xr + j + 8);
      acc0 += a * a;
      acc1 += b * b;
    }
    float sum = internal::HorizontalSum(acc0 + acc1);
    for (; j < dim; ++j) sum += xr[j] * xr[j];
    const float inv = static_cast<float>(1.0 / std::sqrt(double{sum} / dim + eps));
    // In place, one pointer: the compiler would version a loop over two possibly-overlapping
    // pointers and take its scalar path when they are equal.
    if (y == x) {
      float* __restrict xw = y + i * dim;
      for (j = 0; j < dim; ++j) xw[j] = xw[j] * inv * weight[j];
    } else {
      float* __restrict yr = y + i * dim;
      const float* __restrict xs = xr;
      for (j = 0; j < dim; ++j) yr[j] = xs[j] * inv * weight[j];
    }
  }
}

KVSTASH_KERNEL_CLONES
void ApplyRope(float* x, size_t stride, size_t n, size_t num_heads, size_t head_dim,
               const uint32_t* positions, float theta) {
  assert(head_dim % 2 == 0);
  const size_t half = head_dim / 2;
  // Frequencies are taken kPairs at a time so the tables fit on the stack whatever head_dim.
  // Angles are computed in double: position * frequency in float is off by about
  // position * 6e-8 radians (6e-3 at position 1e5), the whole error budget of a float32 model.
  constexpr size_t kPairs = 64;
  double inv_freq[kPairs];
  float cos_t[kPairs], sin_t[kPairs];
  const double log_theta = std::log(double{theta});
  for (size_t j0 = 0; j0 < half; j0 += kPairs) {
    const size_t pairs = half - j0 < kPairs ? half - j0 : kPairs;
    for (size_t j = 0; j < pairs; ++j) {
      inv_freq[j] = std::exp(-2.0 * static_cast<double>(j0 + j) / head_dim * log_theta);
    }
    for (size_t i = 0; i < n; ++i) {
      const double pos = positions[i];
      for (size_t j = 0; j < pairs; ++j) {
        const double angle = pos * inv_freq[j];
        cos_t[j] = static_cast<float>(std::cos(angle));
        sin_t[j] = static_cast<float>(std::sin(angle));
      }
      for (size_t h = 0; h < num_heads; ++h) {
        float* __restrict lo = x + i * stride + h * head_dim + j0;
        float* __restrict hi = lo + half;
        for (size_t j = 0; j < pairs; ++j) {
          const float a = lo[j], b = hi[j];
          lo[j] = a * cos_t[j] - b * sin_t[j];
          hi[j] = a * sin_t[j] + b * cos_t[j];
        }
      }
    }
  }
}

KVSTASH_KERNEL_CLONES
void SiluMul(const float* gate, const float* up, float* out, size_t count) {
  // Eight at a time, loads before the store: out may be gate or up.
  size_t i = 0;
  for (; i + 8 <= count; i += 8) Store8(out + i, Silu8(Load8(gate + i)) * Load8(up + i));
  if (i < count) {
    float g[8] = {}, u[8] = {}, o[8];
    std::memcpy(g, gate + i, (count - i) * sizeof(float));
    std::memcpy(u, up + i, (count - i) * sizeof(float));
    Store8(o, Silu8(Load8(g)) * Load8(u));
    std::memcpy(out + i, o, (count - i) * sizeof(float));
  }
}

KVSTASH_KERNEL_CLONES
void AddInPlace(float* x, const float* y, size_t count) {
  float* __restrict xr = x;
  const float* __restrict yr = y;
  for (size_t i = 0; i < count; ++i) xr[i] += yr[i];
}

}  // namespace kvstash::kernels
