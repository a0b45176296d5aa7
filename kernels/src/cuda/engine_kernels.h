#pragma once

// The CUDA kernels of the "cuda" Device (cuda_device.cc): the operations of cpu_ops.h and
// paged_attention.h, with the same meaning and argument order, on device memory. Each launcher
// queues its kernel on `stream` and returns what cudaGetLastError says after the launch
// (cudaSuccess for an empty operation, which launches nothing). Every pointer is device memory,
// the block tables, positions and tokens included. Internal to kvstash::kernels; built by nvcc,
// so this header takes no other kvstash header (no C++20).
//
// Thread-safe: the launchers keep no state.

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace kvstash::kernels::cuda {

// A layer's view of a paged pool (PagedLayer of paged_attention.h).
struct KvLayout {
  float* pool = nullptr;
  size_t page_floats = 0;
  size_t layer_offset = 0;
  uint32_t block_size = 0;
  uint32_t num_kv_heads = 0;
  uint32_t head_dim = 0;
};

// AttentionMask of paged_attention.h: the keys of a query at p are [FirstKey(p), p].
struct MaskSpec {
  enum Kind : uint32_t { kCausal = 0, kSlidingWindow = 1, kChunkedLocal = 2 };
  uint32_t kind = kCausal;
  uint32_t window = 0;
  uint32_t chunk = 0;
};

// The largest head_dim of LaunchPagedAttention and LaunchStateScan (kMaxHeadDim).
inline constexpr uint32_t kMaxHeadDim = 256;

cudaError_t LaunchFill(float* x, size_t count, float value, cudaStream_t stream);
// y[n][out] = x[n][in] · w[in][out], each output one fmaf chain in ascending k (the CPU's
// order, whatever the number of rows); strides of 0 mean in / out.
cudaError_t LaunchMatMul(const float* x, const float* w, float* y, size_t n, size_t in, size_t out,
                         size_t x_stride, size_t y_stride, cudaStream_t stream);
// y may equal x.
cudaError_t LaunchRmsNorm(const float* x, const float* weight, float* y, size_t n, size_t dim,
                          float eps, cudaStream_t stream);
cudaError_t LaunchApplyRope(float* x, size_t stride, size_t n, size_t num_heads, size_t head_dim,
                            const uint32_t* positions, float theta, cudaStream_t stream);
// out may equal gate or up.
cudaError_t LaunchSiluMul(const float* gate, const float* up, float* out, size_t count,
                          cudaStream_t stream);
cudaError_t LaunchAddInPlace(float* x, const float* y, size_t count, cudaStream_t stream);
cudaError_t LaunchAddConstant(float* x, size_t stride, size_t rows, size_t cols, float value,
                              cudaStream_t stream);
cudaError_t LaunchEmbed(const float* table, size_t vocab, size_t dim, const uint32_t* tokens,
                        size_t n, float* out, cudaStream_t stream);
// Positions whose table entry is 0 (or past table_len) are not written.
cudaError_t LaunchWriteKv(const KvLayout& layer, const uint32_t* block_table, size_t table_len,
                          size_t start_pos, size_t n, const float* k, const float* v, size_t stride,
                          cudaStream_t stream);
// Reads only the table entries and pages of keys [FirstKey(p), p] of each query position p.
// cudaErrorInvalidValue for a head_dim past kMaxHeadDim or num_heads not a multiple of
// num_kv_heads.
cudaError_t LaunchPagedAttention(const KvLayout& layer, const uint32_t* block_table, const float* q,
                                 size_t q_stride, size_t n, size_t start_pos, uint32_t num_heads,
                                 const MaskSpec& mask, float scale, float* out, size_t out_stride,
                                 cudaStream_t stream);
// cudaErrorInvalidValue for a head_dim past kMaxHeadDim.
cudaError_t LaunchStateScan(float* state, const float* q, const float* k, const float* v,
                            size_t stride, const float* gate, size_t gate_stride, size_t n,
                            uint32_t num_heads, uint32_t head_dim, float* out, size_t out_stride,
                            cudaStream_t stream);

}  // namespace kvstash::kernels::cuda
