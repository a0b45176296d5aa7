#pragma once

// Where the engine computes: a Device owns memory and runs the engine's kernels on it, in the
// order they are called (one queue: a CUDA stream, or the calling thread on the CPU). The
// operations are those of cpu_ops.h and paged_attention.h with the same meaning and argument
// order; every pointer they take is device memory (Allocate, or Stage for index arrays) except
// where a name says host.
//
//   - "cpu": the CPU kernels on host memory; everything runs before the call returns.
//   - "cpu-staged": the same kernels, but the engine's pool is kept apart from the host copy a
//     connector reads (HostAccessible() is false), so the engine takes the path it takes on a
//     GPU: pages are copied to and from a host mirror. For testing that path without a GPU.
//   - "cuda" (cuda_device.h): the CUDA kernels on device 0 (or CUDA_VISIBLE_DEVICES' first) on
//     a stream of the device's own; calls return once queued.
//
// Not thread-safe: one thread drives a device.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "kvstash/common/status.h"
#include "kvstash/kernels/paged_attention.h"

namespace kvstash::kernels {

class Device {
 public:
  virtual ~Device() = default;

  virtual std::string_view name() const = 0;
  // Whether device memory is host memory (the CPU devices but "cpu-staged").
  virtual bool HostAccessible() const = 0;

  // Memory. Allocate gives `floats` floats (nullptr for 0), never initialised; Free takes
  // what Allocate gave. ResourceExhausted, naming the size, when the memory is refused. Copy
  // and Fill are queued like the kernels.
  virtual Result<float*> Allocate(size_t floats) = 0;
  virtual void Free(float* p) = 0;
  // Host memory the device copies to and from at full speed (pinned on a GPU), for host
  // mirrors of device memory. The base class gives plain host memory. ResourceExhausted when
  // refused.
  virtual Result<float*> AllocateHost(size_t floats);
  virtual void FreeHost(float* p);
  virtual void Copy(float* dst, const float* src, size_t floats) = 0;
  virtual void Fill(float* x, size_t floats, float value) = 0;
  // Host -> device, queued; `host` may be reused once the call returns.
  virtual void Upload(float* dst, const float* host, size_t floats) = 0;
  // Device -> host, after everything queued before; returns when the floats are there.
  virtual void Download(float* host, const float* src, size_t floats) = 0;
  // A device copy of a small host array (block tables, token ids, positions), valid until the
  // next BeginStep. On a host-accessible device it is the host array itself, which the caller
  // keeps alive and unchanged until then. When staging memory is refused the device fails
  // (Synchronize answers ResourceExhausted) and later work of the step is not run.
  virtual const uint32_t* Stage(std::span<const uint32_t> host) = 0;
  // A new step: what Stage gave before is given back. Waits for the work queued before.
  virtual void BeginStep() = 0;
  // Returns once everything queued has run. Internal naming the error when the device failed.
  virtual Status Synchronize() = 0;

  // The engine's kernels (cpu_ops.h, paged_attention.h). Tables, positions and tokens are
  // staged (device) arrays.
  virtual void MatMul(const float* x, const float* w, float* y, size_t n, size_t in, size_t out,
                      size_t x_stride = 0, size_t y_stride = 0) = 0;
  virtual void RmsNorm(const float* x, const float* weight, float* y, size_t n, size_t dim,
                       float eps) = 0;
  virtual void ApplyRope(float* x, size_t stride, size_t n, size_t num_heads, size_t head_dim,
                         const uint32_t* positions, float theta) = 0;
  virtual void SiluMul(const float* gate, const float* up, float* out, size_t count) = 0;
  virtual void AddInPlace(float* x, const float* y, size_t count) = 0;
  // x[r * stride + c] += value for r < rows, c < cols.
  virtual void AddConstant(float* x, size_t stride, size_t rows, size_t cols, float value) = 0;
  // out[i] = table[min(tokens[i], vocab - 1)], rows of `dim` floats.
  virtual void Embed(const float* table, size_t vocab, size_t dim, const uint32_t* tokens, size_t n,
                     float* out) = 0;
  virtual void WriteKv(const PagedLayer& layer, const uint32_t* block_table, size_t table_len,
                       size_t start_pos, size_t n, const float* k, const float* v,
                       size_t stride) = 0;
  virtual void PagedAttention(const PagedLayer& layer, const uint32_t* block_table,
                              size_t table_len, const float* q, size_t q_stride, size_t n,
                              size_t start_pos, uint32_t num_heads, const AttentionMask& mask,
                              float scale, float* out, size_t out_stride) = 0;
  virtual void StateScan(float* state, const float* q, const float* k, const float* v,
                         size_t stride, const float* gate, size_t gate_stride, size_t n,
                         uint32_t num_heads, uint32_t head_dim, float* out, size_t out_stride) = 0;

  // Pages of a paged pool (`page_floats` floats each) between the device and a host mirror of
  // the same layout, for a connector: ToHost after the work queued so far (the compute that
  // wrote them), returning once they are on the host; ToDevice queued so that work queued
  // after it reads them, the host pages free for reuse on return. On a CUDA device they run
  // on a copy stream of their own, as one batched copy.
  virtual Status PagesToHost(const float* pool, float* host_pool, size_t page_floats,
                             std::span<const uint32_t> pages) = 0;
  virtual Status PagesToDevice(float* pool, const float* host_pool, size_t page_floats,
                               std::span<const uint32_t> pages) = 0;
};

// The device called `name`: "cpu", "cpu-staged" or "cuda". InvalidArgument for another name
// (the message lists the names); Unimplemented for "cuda" in a build without CUDA;
// FailedPrecondition naming the reason when no CUDA device can be used.
Result<std::unique_ptr<Device>> MakeDevice(std::string_view name);

// A buffer of floats on a device, grown on demand.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(Device* device) : device_(device) {}
  DeviceBuffer(DeviceBuffer&& other) noexcept { *this = std::move(other); }
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer();

  // At least `floats` floats, the old ones kept and the new ones set to `fill`.
  // ResourceExhausted, the buffer unchanged, when the device refuses the memory.
  [[nodiscard]] Status Grow(size_t floats, float fill = 0.0f);
  float* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  Device* device_ = nullptr;
  float* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace kvstash::kernels
