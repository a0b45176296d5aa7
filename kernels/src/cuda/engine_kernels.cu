// The CUDA kernels of the "cuda" Device. Each mirrors its CPU kernel (cpu_ops.cc,
// paged_attention.cc) in meaning and, where it matters for the engine's determinism, in the
// order of its sums: a MatMul output is one fmaf chain in ascending k whatever the number of
// rows, so a row's result does not depend on the batch it came in.

#include <cmath>

#include "engine_kernels.h"

namespace kvstash::kernels::cuda {
namespace {

constexpr int kThreads = 256;  // elementwise kernels
constexpr unsigned kMaxGrid = 1u << 20;
// The most blocks along x, for kernels with a block per row.
constexpr size_t kMaxRows = 0x7fffffff;

unsigned GridFor(size_t count, int threads = kThreads) {
  const size_t blocks = (count + threads - 1) / threads;
  return blocks < kMaxGrid ? static_cast<unsigned>(blocks) : kMaxGrid;
}

__device__ __forceinline__ size_t GlobalThread() {
  return blockIdx.x * size_t{blockDim.x} + threadIdx.x;
}
__device__ __forceinline__ size_t GridThreads() { return size_t{gridDim.x} * blockDim.x; }

__device__ __forceinline__ float WarpSum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// The sum of v over the block (blockDim.x a multiple of 32), the same value in every thread.
__device__ float BlockSum(float v) {
  __shared__ float partial[32];
  v = WarpSum(v);
  if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = v;
  __syncthreads();
  float total = 0.0f;
  for (unsigned w = 0; w < blockDim.x / 32; ++w) total += partial[w];
  __syncthreads();  // partial is free for the next call
  return total;
}

__global__ void FillKernel(float* x, size_t count, float value) {
  for (size_t i = GlobalThread(); i < count; i += GridThreads()) x[i] = value;
}

// MatMul, many rows: a 64 x 64 tile of y per block of 256 threads, each thread 4 x 4 outputs
// (rows ty + 16 i, columns tx + 16 j), k in steps of 16 through shared memory. Padding past n,
// in or out is zero, and a zero step leaves a sum unchanged, so the chain is the plain one.
constexpr int kTileM = 64;
constexpr int kTileN = 64;
constexpr int kTileK = 16;
constexpr int kTileThreads = 256;

__global__ void __launch_bounds__(kTileThreads)
    MatMulTiledKernel(const float* __restrict__ x, const float* __restrict__ w,
                      float* __restrict__ y, size_t n, size_t in, size_t out, size_t x_stride,
                      size_t y_stride) {
  __shared__ float x_tile[kTileK][kTileM + 1];  // transposed: [k][row]
  __shared__ float w_tile[kTileK][kTileN];
  const int tx = threadIdx.x % 16;
  const int ty = threadIdx.x / 16;
  const size_t row0 = blockIdx.y * size_t{kTileM};
  const size_t col0 = blockIdx.x * size_t{kTileN};
  float acc[4][4] = {};
  for (size_t k0 = 0; k0 < in; k0 += kTileK) {
    for (int e = threadIdx.x; e < kTileM * kTileK; e += kTileThreads) {
      const int r = e / kTileK, kk = e % kTileK;
      const size_t gr = row0 + r, gk = k0 + kk;
      x_tile[kk][r] = gr < n && gk < in ? x[gr * x_stride + gk] : 0.0f;
    }
    for (int e = threadIdx.x; e < kTileK * kTileN; e += kTileThreads) {
      const int kk = e / kTileN, c = e % kTileN;
      const size_t gk = k0 + kk, gc = col0 + c;
      w_tile[kk][c] = gk < in && gc < out ? w[gk * out + gc] : 0.0f;
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < kTileK; ++kk) {
      float a[4], b[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) a[i] = x_tile[kk][ty + 16 * i];
#pragma unroll
      for (int j = 0; j < 4; ++j) b[j] = w_tile[kk][tx + 16 * j];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
      }
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const size_t r = row0 + ty + 16 * i;
    if (r >= n) continue;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const size_t c = col0 + tx + 16 * j;
      if (c < out) y[r * y_stride + c] = acc[i][j];
    }
  }
}

// MatMul, few rows (decode): one column per thread for up to kSkinnyRows rows, w read once in
// order (coalesced along the row), x broadcast.
constexpr int kSkinnyRows = 8;
constexpr int kSkinnyThreads = 64;
constexpr size_t kMaxSkinnyN = 16;

__global__ void __launch_bounds__(kSkinnyThreads)
    MatMulSkinnyKernel(const float* __restrict__ x, const float* __restrict__ w,
                       float* __restrict__ y, size_t n, size_t in, size_t out, size_t x_stride,
                       size_t y_stride) {
  const size_t c = GlobalThread();
  if (c >= out) return;
  const size_t row0 = blockIdx.y * size_t{kSkinnyRows};
  const int rows = n - row0 < size_t{kSkinnyRows} ? static_cast<int>(n - row0) : kSkinnyRows;
  const float* xr = x + row0 * x_stride;
  float acc[kSkinnyRows] = {};
#pragma unroll 4
  for (size_t k = 0; k < in; ++k) {
    const float wv = w[k * out + c];
#pragma unroll
    for (int i = 0; i < kSkinnyRows; ++i) {
      if (i < rows) acc[i] = fmaf(xr[i * x_stride + k], wv, acc[i]);
    }
  }
#pragma unroll
  for (int i = 0; i < kSkinnyRows; ++i) {
    if (i < rows) y[(row0 + i) * y_stride + c] = acc[i];
  }
}

// One block per row; x and y may be the same row (every read of the row is before the barrier
// of the sum, and the second pass reads and writes the same element in one thread).
__global__ void RmsNormKernel(const float* x, const float* __restrict__ weight, float* y,
                              size_t dim, float eps) {
  const float* xr = x + blockIdx.x * dim;
  float* yr = y + blockIdx.x * dim;
  float sum = 0.0f;
  for (size_t j = threadIdx.x; j < dim; j += blockDim.x) sum = fmaf(xr[j], xr[j], sum);
  sum = BlockSum(sum);
  // In double, as on the CPU.
  const float inv = static_cast<float>(1.0 / sqrt(static_cast<double>(sum) / dim + eps));
  for (size_t j = threadIdx.x; j < dim; j += blockDim.x) yr[j] = xr[j] * inv * weight[j];
}

// One block per row; a thread per pair (j, j + half), its angle in double (as on the CPU: in
// float the angle at position 1e5 is off by 6e-3 radians), applied to every head of the row.
__global__ void ApplyRopeKernel(float* x, size_t stride, size_t num_heads, size_t head_dim,
                                const uint32_t* __restrict__ positions, double log_theta) {
  const size_t half = head_dim / 2;
  const double pos = positions[blockIdx.x];
  float* row = x + blockIdx.x * stride;
  for (size_t j = threadIdx.x; j < half; j += blockDim.x) {
    const double inv_freq = exp(-2.0 * static_cast<double>(j) / head_dim * log_theta);
    double s, c;
    sincos(pos * inv_freq, &s, &c);
    const float sin_a = static_cast<float>(s), cos_a = static_cast<float>(c);
    for (size_t h = 0; h < num_heads; ++h) {
      float* lo = row + h * head_dim + j;
      const float a = lo[0], b = lo[half];
      lo[0] = a * cos_a - b * sin_a;
      lo[half] = a * sin_a + b * cos_a;
    }
  }
}

__global__ void SiluMulKernel(const float* gate, const float* up, float* out, size_t count) {
  for (size_t i = GlobalThread(); i < count; i += GridThreads()) {
    const float g = gate[i], u = up[i];
    out[i] = g / (1.0f + expf(-g)) * u;
  }
}

__global__ void AddInPlaceKernel(float* __restrict__ x, const float* __restrict__ y, size_t count) {
  for (size_t i = GlobalThread(); i < count; i += GridThreads()) x[i] += y[i];
}

__global__ void AddConstantKernel(float* x, size_t stride, size_t rows, size_t cols, float value) {
  const size_t count = rows * cols;
  for (size_t e = GlobalThread(); e < count; e += GridThreads()) {
    x[e / cols * stride + e % cols] += value;
  }
}

__global__ void EmbedKernel(const float* __restrict__ table, size_t vocab, size_t dim,
                            const uint32_t* __restrict__ tokens, size_t n,
                            float* __restrict__ out) {
  const size_t count = n * dim;
  for (size_t e = GlobalThread(); e < count; e += GridThreads()) {
    const size_t i = e / dim, d = e % dim;
    const size_t token = tokens[i] < vocab ? tokens[i] : vocab - 1;
    out[e] = table[token * dim + d];
  }
}

// One block per position.
__global__ void WriteKvKernel(KvLayout layer, const uint32_t* __restrict__ table, size_t table_len,
                              size_t start_pos, const float* __restrict__ k,
                              const float* __restrict__ v, size_t stride) {
  const size_t pos = start_pos + blockIdx.x;
  const size_t block = pos / layer.block_size;
  if (block >= table_len) return;
  const uint32_t page = table[block];
  if (page == 0) return;  // the null page is never written
  const size_t row = size_t{layer.num_kv_heads} * layer.head_dim;
  float* keys =
      layer.pool + page * layer.page_floats + layer.layer_offset + pos % layer.block_size * row;
  float* values = keys + size_t{layer.block_size} * row;
  const float* kr = k + blockIdx.x * stride;
  const float* vr = v + blockIdx.x * stride;
  for (size_t e = threadIdx.x; e < row; e += blockDim.x) {
    keys[e] = kr[e];
    values[e] = vr[e];
  }
}

__device__ __forceinline__ size_t FirstKey(const MaskSpec& mask, size_t p) {
  switch (mask.kind) {
    case MaskSpec::kSlidingWindow:
      return p + 1 >= mask.window ? p + 1 - mask.window : 0;
    case MaskSpec::kChunkedLocal:
      return p / mask.chunk * mask.chunk;
    default:
      return 0;
  }
}

// Attention: one block per (query, head). Keys go kKeyTile at a time: a warp per key for the
// scores (lanes along head_dim), then one online-softmax rescale per tile, then a thread per
// output dimension sums the tile's values. Only the table entries and pages of keys
// [FirstKey(p), p] are read.
constexpr int kAttnThreads = 128;
constexpr int kAttnWarps = kAttnThreads / 32;
constexpr int kKeyTile = 64;
constexpr int kDimsPerThread = kMaxHeadDim / kAttnThreads;
static_assert(kMaxHeadDim % kAttnThreads == 0, "each thread owns whole output dimensions");

__global__ void __launch_bounds__(kAttnThreads)
    PagedAttentionKernel(KvLayout layer, const uint32_t* __restrict__ table, const float* q,
                         size_t q_stride, size_t start_pos, uint32_t group, MaskSpec mask,
                         float scale, float* out, size_t out_stride) {
  __shared__ float q_s[kMaxHeadDim];
  __shared__ float scores[kKeyTile];
  __shared__ float probs[kKeyTile];
  __shared__ size_t key_offset[kKeyTile];  // floats from the pool's start to the key
  const size_t i = blockIdx.x;
  const uint32_t h = blockIdx.y;
  const uint32_t hd = layer.head_dim;
  const int tid = threadIdx.x;
  const size_t pos = start_pos + i;
  const size_t first = FirstKey(mask, pos);
  float* o = out + i * out_stride + size_t{h} * hd;
  if (first > pos) {  // a zero window: no key at all
    for (uint32_t d = tid; d < hd; d += kAttnThreads) o[d] = 0.0f;
    return;
  }
  const float* qh = q + i * q_stride + size_t{h} * hd;
  for (uint32_t d = tid; d < hd; d += kAttnThreads) q_s[d] = qh[d] * scale;
  const size_t row = size_t{layer.num_kv_heads} * hd;
  const size_t head_offset = size_t{h / group} * hd;
  const size_t value_offset = size_t{layer.block_size} * row;
  const int lane = tid % 32, warp = tid / 32;
  float running_max = -INFINITY, running_sum = 0.0f;
  float acc[kDimsPerThread] = {};
  __syncthreads();  // q_s

  for (size_t t0 = first; t0 <= pos; t0 += kKeyTile) {
    const int len = pos + 1 - t0 < kKeyTile ? static_cast<int>(pos + 1 - t0) : kKeyTile;
    for (int j = warp; j < len; j += kAttnWarps) {
      const size_t t = t0 + j;
      const uint32_t page = table[t / layer.block_size];
      const size_t offset =
          page * layer.page_floats + layer.layer_offset + t % layer.block_size * row + head_offset;
      const float* key = layer.pool + offset;
      float s = 0.0f;
      for (uint32_t d = lane; d < hd; d += 32) s = fmaf(q_s[d], key[d], s);
      s = WarpSum(s);
      if (lane == 0) {
        scores[j] = s;
        key_offset[j] = offset;
      }
    }
    __syncthreads();  // scores, key_offset

    float tile_max = scores[0];
    for (int j = 1; j < len; ++j) tile_max = fmaxf(tile_max, scores[j]);
    const float new_max = fmaxf(running_max, tile_max);
    const float correction = expf(running_max - new_max);  // exp(-inf) = 0 on the first tile
    for (int j = tid; j < len; j += kAttnThreads) probs[j] = expf(scores[j] - new_max);
    __syncthreads();  // probs

    float tile_sum = 0.0f;
    for (int j = 0; j < len; ++j) tile_sum += probs[j];
    running_sum = running_sum * correction + tile_sum;
    running_max = new_max;
#pragma unroll
    for (int e = 0; e < kDimsPerThread; ++e) {
      const uint32_t d = tid + e * kAttnThreads;
      if (d >= hd) break;
      float a = acc[e] * correction;
      for (int j = 0; j < len; ++j)
        a = fmaf(probs[j], layer.pool[key_offset[j] + value_offset + d], a);
      acc[e] = a;
    }
    __syncthreads();  // the next tile rewrites scores, probs and key_offset
  }

  const float inv = 1.0f / running_sum;
#pragma unroll
  for (int e = 0; e < kDimsPerThread; ++e) {
    const uint32_t d = tid + e * kAttnThreads;
    if (d < hd) o[d] = acc[e] * inv;
  }
}

// The state recurrence: a thread per column b of a head's S (value dimension), blocks along
// (head, column tile). Column b of S depends on nothing but itself and the token's k, v, q, so
// the threads never meet; each walks the tokens in order.
constexpr int kScanThreads = 128;

__global__ void __launch_bounds__(kScanThreads)
    StateScanKernel(float* state, const float* q, const float* k, const float* v, size_t stride,
                    const float* gate, size_t gate_stride, size_t n, uint32_t head_dim, float* out,
                    size_t out_stride) {
  const size_t h = blockIdx.x;
  const size_t hd = head_dim;
  const size_t b = blockIdx.y * size_t{kScanThreads} + threadIdx.x;
  if (b >= hd) return;
  float* s = state + h * hd * hd + b;  // column b, rows hd apart
  for (size_t i = 0; i < n; ++i) {
    const float* qh = q + i * stride + h * hd;
    const float* kh = k + i * stride + h * hd;
    const float g = 1.0f / (1.0f + expf(-gate[i * gate_stride + h]));
    const float vb = v[i * stride + h * hd + b];
    float o = 0.0f;
#pragma unroll 4
    for (size_t a = 0; a < hd; ++a) {
      const float updated = g * s[a * hd] + kh[a] * vb;
      s[a * hd] = updated;
      o = fmaf(qh[a], updated, o);
    }
    out[i * out_stride + h * hd + b] = o;
  }
}

}  // namespace

cudaError_t LaunchFill(float* x, size_t count, float value, cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  FillKernel<<<GridFor(count), kThreads, 0, stream>>>(x, count, value);
  return cudaGetLastError();
}

cudaError_t LaunchMatMul(const float* x, const float* w, float* y, size_t n, size_t in, size_t out,
                         size_t x_stride, size_t y_stride, cudaStream_t stream) {
  if (n == 0 || out == 0) return cudaSuccess;
  if (x_stride == 0) x_stride = in;
  if (y_stride == 0) y_stride = out;
  if (n <= kMaxSkinnyN) {
    const dim3 grid((out + kSkinnyThreads - 1) / kSkinnyThreads,
                    (n + kSkinnyRows - 1) / kSkinnyRows);
    MatMulSkinnyKernel<<<grid, kSkinnyThreads, 0, stream>>>(x, w, y, n, in, out, x_stride,
                                                            y_stride);
  } else {
    const size_t row_tiles = (n + kTileM - 1) / kTileM;
    if (row_tiles > 65535) return cudaErrorInvalidValue;
    const dim3 grid((out + kTileN - 1) / kTileN, static_cast<unsigned>(row_tiles));
    MatMulTiledKernel<<<grid, kTileThreads, 0, stream>>>(x, w, y, n, in, out, x_stride, y_stride);
  }
  return cudaGetLastError();
}

cudaError_t LaunchRmsNorm(const float* x, const float* weight, float* y, size_t n, size_t dim,
                          float eps, cudaStream_t stream) {
  if (n == 0 || dim == 0) return cudaSuccess;
  if (n > kMaxRows) return cudaErrorInvalidValue;
  RmsNormKernel<<<static_cast<unsigned>(n), kThreads, 0, stream>>>(x, weight, y, dim, eps);
  return cudaGetLastError();
}

cudaError_t LaunchApplyRope(float* x, size_t stride, size_t n, size_t num_heads, size_t head_dim,
                            const uint32_t* positions, float theta, cudaStream_t stream) {
  if (n == 0 || num_heads == 0 || head_dim < 2) return cudaSuccess;
  if (head_dim % 2 != 0 || n > kMaxRows) return cudaErrorInvalidValue;
  ApplyRopeKernel<<<static_cast<unsigned>(n), 128, 0, stream>>>(
      x, stride, num_heads, head_dim, positions, std::log(static_cast<double>(theta)));
  return cudaGetLastError();
}

cudaError_t LaunchSiluMul(const float* gate, const float* up, float* out, size_t count,
                          cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  SiluMulKernel<<<GridFor(count), kThreads, 0, stream>>>(gate, up, out, count);
  return cudaGetLastError();
}

cudaError_t LaunchAddInPlace(float* x, const float* y, size_t count, cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  AddInPlaceKernel<<<GridFor(count), kThreads, 0, stream>>>(x, y, count);
  return cudaGetLastError();
}

cudaError_t LaunchAddConstant(float* x, size_t stride, size_t rows, size_t cols, float value,
                              cudaStream_t stream) {
  if (rows == 0 || cols == 0) return cudaSuccess;
  AddConstantKernel<<<GridFor(rows * cols), kThreads, 0, stream>>>(x, stride, rows, cols, value);
  return cudaGetLastError();
}

cudaError_t LaunchEmbed(const float* table, size_t vocab, size_t dim, const uint32_t* tokens,
                        size_t n, float* out, cudaStream_t stream) {
  if (n == 0 || dim == 0) return cudaSuccess;
  if (vocab == 0) return cudaErrorInvalidValue;
  EmbedKernel<<<GridFor(n * dim), kThreads, 0, stream>>>(table, vocab, dim, tokens, n, out);
  return cudaGetLastError();
}

cudaError_t LaunchWriteKv(const KvLayout& layer, const uint32_t* block_table, size_t table_len,
                          size_t start_pos, size_t n, const float* k, const float* v, size_t stride,
                          cudaStream_t stream) {
  if (n == 0 || layer.num_kv_heads == 0 || layer.head_dim == 0) return cudaSuccess;
  if (layer.block_size == 0 || n > kMaxRows) return cudaErrorInvalidValue;
  WriteKvKernel<<<static_cast<unsigned>(n), 128, 0, stream>>>(layer, block_table, table_len,
                                                              start_pos, k, v, stride);
  return cudaGetLastError();
}

cudaError_t LaunchPagedAttention(const KvLayout& layer, const uint32_t* block_table, const float* q,
                                 size_t q_stride, size_t n, size_t start_pos, uint32_t num_heads,
                                 const MaskSpec& mask, float scale, float* out, size_t out_stride,
                                 cudaStream_t stream) {
  if (n == 0 || layer.head_dim == 0 || num_heads == 0) return cudaSuccess;
  if (layer.head_dim > kMaxHeadDim || layer.num_kv_heads == 0 ||
      num_heads % layer.num_kv_heads != 0 || num_heads > 65535 || n > kMaxRows ||
      layer.block_size == 0 || (mask.kind == MaskSpec::kChunkedLocal && mask.chunk == 0)) {
    return cudaErrorInvalidValue;
  }
  const dim3 grid(static_cast<unsigned>(n), num_heads);
  PagedAttentionKernel<<<grid, kAttnThreads, 0, stream>>>(layer, block_table, q, q_stride,
                                                          start_pos, num_heads / layer.num_kv_heads,
                                                          mask, scale, out, out_stride);
  return cudaGetLastError();
}

cudaError_t LaunchStateScan(float* state, const float* q, const float* k, const float* v,
                            size_t stride, const float* gate, size_t gate_stride, size_t n,
                            uint32_t num_heads, uint32_t head_dim, float* out, size_t out_stride,
                            cudaStream_t stream) {
  if (n == 0 || num_heads == 0 || head_dim == 0) return cudaSuccess;
  if (head_dim > kMaxHeadDim) return cudaErrorInvalidValue;
  const dim3 grid(num_heads, (head_dim + kScanThreads - 1) / kScanThreads);
  StateScanKernel<<<grid, kScanThreads, 0, stream>>>(state, q, k, v, stride, gate, gate_stride, n,
                                                     head_dim, out, out_stride);
  return cudaGetLastError();
}

}  // namespace kvstash::kernels::cuda
