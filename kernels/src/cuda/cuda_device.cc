#include "cuda_device.h"

#if KVSTASH_HAVE_CUDA
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "engine_kernels.h"
#include "kvstash/kernels/cuda_transfer.h"
#include "kvstash/kernels/transfer_plan.h"
#endif

namespace kvstash::kernels::cuda {

#if KVSTASH_HAVE_CUDA

namespace {

// Move-only owners of the CUDA handles.
struct StreamDeleter {
  void operator()(cudaStream_t stream) const { cudaStreamDestroy(stream); }
};
using StreamHandle = std::unique_ptr<std::remove_pointer_t<cudaStream_t>, StreamDeleter>;
struct EventDeleter {
  void operator()(cudaEvent_t event) const { cudaEventDestroy(event); }
};
using EventHandle = std::unique_ptr<std::remove_pointer_t<cudaEvent_t>, EventDeleter>;
struct DeviceMemoryDeleter {
  void operator()(std::byte* p) const { cudaFree(p); }
};
using DeviceMemory = std::unique_ptr<std::byte, DeviceMemoryDeleter>;
struct PinnedMemoryDeleter {
  void operator()(std::byte* p) const { cudaFreeHost(p); }
};
using PinnedMemory = std::unique_ptr<std::byte, PinnedMemoryDeleter>;

// The one translation of CUDA's codes. `code` is what the caller's context makes of a failure
// (FailedPrecondition while opening the device, Internal once it runs).
Status FromCuda(cudaError_t err, StatusCode code, std::string_view what) {
  return Status(code, fmt::format("CUDA device: {}: {} ({})", what, cudaGetErrorString(err),
                                  cudaGetErrorName(err)));
}

// Staged arrays are placed at this alignment (cudaMalloc's), so any element type is aligned.
constexpr size_t kStageAlignment = 256;
// The first staging chunk, and the least a new one gets.
constexpr size_t kStageChunkBytes = size_t{1} << 20;
// Uploads up to this size go through the staging chunks (queued, the caller's buffer free at
// once); larger ones, or past kMaxStagedUploadBytesPerStep in one step, are copied directly and
// waited for, so that uploading weights does not grow the chunks.
constexpr size_t kMaxStagedUploadBytes = size_t{64} << 10;
constexpr size_t kMaxStagedUploadBytesPerStep = size_t{4} << 20;

KvLayout ToLayout(const PagedLayer& layer) {
  return {.pool = layer.pool,
          .page_floats = layer.page_floats,
          .layer_offset = layer.layer_offset,
          .block_size = layer.block_size,
          .num_kv_heads = layer.num_kv_heads,
          .head_dim = layer.head_dim};
}

MaskSpec ToMask(const AttentionMask& mask) {
  MaskSpec spec;
  switch (mask.kind) {
    case AttentionMask::Kind::kCausal:
      spec.kind = MaskSpec::kCausal;
      break;
    case AttentionMask::Kind::kSlidingWindow:
      spec.kind = MaskSpec::kSlidingWindow;
      break;
    case AttentionMask::Kind::kChunkedLocal:
      spec.kind = MaskSpec::kChunkedLocal;
      break;
  }
  spec.window = mask.window;
  spec.chunk = mask.chunk;
  return spec;
}

// The copies of whole pages between a pool and its host mirror (same layout, one tensor): one
// operation per run of consecutive pages.
TransferPlan PagePlan(TransferDirection direction, size_t page_floats,
                      std::span<const uint32_t> pages) {
  TransferPlan plan;
  plan.direction = direction;
  const uint64_t page_bytes = uint64_t{page_floats} * sizeof(float);
  for (uint32_t page : pages) {
    const uint64_t offset = uint64_t{page} * page_bytes;
    if (!plan.ops.empty()) {
      CopyOp& last = plan.ops.back();
      if (last.device_offset + last.bytes == offset) {
        last.bytes += page_bytes;
        continue;
      }
    }
    plan.ops.push_back(
        {.tensor = 0, .device_offset = offset, .host_offset = offset, .bytes = page_bytes});
  }
  plan.transfer_bytes = pages.size() * page_bytes;
  return plan;
}

// The engine's kernels on CUDA device 0, queued on a non-blocking stream of its own; page
// copies for a connector run on a second stream, ordered against the first by events. The first
// CUDA error is kept and reported by every later Synchronize (and by the page copies): a kernel
// that failed has left its outputs undefined. Owns its streams, events and staging memory; the
// memory Allocate gives is the caller's to Free. Not thread-safe: one thread drives it.
class CudaDevice final : public Device {
 public:
  // FailedPrecondition when device 0 cannot run the kernels (no kernel image for its
  // architecture, a driver older than the runtime).
  static Result<std::unique_ptr<Device>> Create() {
    cudaError_t err = cudaSetDevice(0);
    cudaDeviceProp prop{};
    if (err == cudaSuccess) err = cudaGetDeviceProperties(&prop, 0);
    if (err != cudaSuccess) {
      cudaGetLastError();
      return FromCuda(err, StatusCode::kFailedPrecondition, "opening device 0");
    }
    const std::string what =
        fmt::format("device 0 ({}, compute capability {}.{})", prop.name, prop.major, prop.minor);
    cudaStream_t stream = nullptr, copy_stream = nullptr;
    cudaEvent_t computed = nullptr, loaded = nullptr;
    err = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
    StreamHandle stream_handle(stream);
    if (err == cudaSuccess) err = cudaStreamCreateWithFlags(&copy_stream, cudaStreamNonBlocking);
    StreamHandle copy_handle(copy_stream);
    if (err == cudaSuccess) err = cudaEventCreateWithFlags(&computed, cudaEventDisableTiming);
    EventHandle computed_handle(computed);
    if (err == cudaSuccess) err = cudaEventCreateWithFlags(&loaded, cudaEventDisableTiming);
    EventHandle loaded_handle(loaded);
    if (err != cudaSuccess) {
      cudaGetLastError();
      return FromCuda(err, StatusCode::kFailedPrecondition,
                      fmt::format("creating streams and events on {}", what));
    }
    auto device = std::unique_ptr<CudaDevice>(
        new CudaDevice(std::move(stream_handle), std::move(copy_handle), std::move(computed_handle),
                       std::move(loaded_handle)));
    // One kernel, run: a build without code for this architecture fails here, with its reason,
    // rather than at the engine's first step.
    void* probe = nullptr;
    err = cudaMalloc(&probe, sizeof(float));
    if (err == cudaSuccess) {
      err = LaunchFill(static_cast<float*>(probe), 1, 0.0f, device->stream());
      if (err == cudaSuccess) err = cudaStreamSynchronize(device->stream());
      cudaFree(probe);
    }
    if (err != cudaSuccess) {
      cudaGetLastError();
      return FromCuda(err, StatusCode::kFailedPrecondition,
                      fmt::format("running a kernel on {}", what));
    }
    return std::unique_ptr<Device>(std::move(device));
  }

  ~CudaDevice() override {
    // The staging chunks are freed below; nothing queued may still read them.
    cudaStreamSynchronize(copy_stream_.get());
    cudaStreamSynchronize(stream_.get());
  }

  std::string_view name() const override { return "cuda"; }
  bool HostAccessible() const override { return false; }

  Result<float*> Allocate(size_t floats) override {
    if (floats == 0) return static_cast<float*>(nullptr);
    void* p = nullptr;
    if (floats > SIZE_MAX / sizeof(float) ||
        cudaMalloc(&p, floats * sizeof(float)) != cudaSuccess) {
      cudaGetLastError();  // out of memory is not sticky: clear it for the next launch check
      return ResourceExhaustedError("{} floats of device memory refused", floats);
    }
    return static_cast<float*>(p);
  }
  void Free(float* p) override {
    if (p != nullptr) Check(cudaFree(p), "free");
  }
  // Pinned: page copies to and from it run at the bus's speed.
  Result<float*> AllocateHost(size_t floats) override {
    if (floats == 0) return static_cast<float*>(nullptr);
    void* p = nullptr;
    if (floats > SIZE_MAX / sizeof(float) ||
        cudaHostAlloc(&p, floats * sizeof(float), cudaHostAllocDefault) != cudaSuccess) {
      cudaGetLastError();
      return ResourceExhaustedError("{} floats of pinned host memory refused", floats);
    }
    return static_cast<float*>(p);
  }
  void FreeHost(float* p) override {
    if (p != nullptr) Check(cudaFreeHost(p), "free host");
  }
  void Copy(float* dst, const float* src, size_t floats) override {
    if (floats == 0 || !error_.ok()) return;
    Check(cudaMemcpyAsync(dst, src, floats * sizeof(float), cudaMemcpyDeviceToDevice, stream()),
          "copy");
  }
  void Fill(float* x, size_t floats, float value) override {
    if (!error_.ok()) return;  // a failed device runs nothing more
    Check(LaunchFill(x, floats, value, stream()), "fill");
  }
  void Upload(float* dst, const float* host, size_t floats) override {
    if (floats == 0) return;
    const size_t bytes = floats * sizeof(float);
    if (bytes <= kMaxStagedUploadBytes &&
        staged_upload_bytes_ + bytes <= kMaxStagedUploadBytesPerStep) {
      // Through pinned staging memory, which nothing reuses before BeginStep has waited for the
      // stream: queued, and the caller's buffer is free at once.
      staged_upload_bytes_ += bytes;
      std::byte* pinned = Reserve(bytes).host;
      if (pinned == nullptr) return;  // refused: the device has failed (Synchronize says so)
      std::memcpy(pinned, host, bytes);
      Check(cudaMemcpyAsync(dst, pinned, bytes, cudaMemcpyHostToDevice, stream()), "upload");
    } else {
      // `host` may be pinned (then the copy would read it after we return): wait for it.
      Check(cudaMemcpyAsync(dst, host, bytes, cudaMemcpyHostToDevice, stream()), "upload");
      Check(cudaStreamSynchronize(stream()), "upload");
    }
  }
  void Download(float* host, const float* src, size_t floats) override {
    if (floats == 0) return;
    Check(cudaMemcpyAsync(host, src, floats * sizeof(float), cudaMemcpyDeviceToHost, stream()),
          "download");
    Check(cudaStreamSynchronize(stream()), "download");
  }
  const uint32_t* Stage(std::span<const uint32_t> host) override {
    const size_t bytes = host.size_bytes();
    const Slot slot = Reserve(bytes);
    if (slot.host == nullptr) return nullptr;  // refused: the device has failed
    if (bytes > 0) {
      std::memcpy(slot.host, host.data(), bytes);
      Check(cudaMemcpyAsync(slot.device, slot.host, bytes, cudaMemcpyHostToDevice, stream()),
            "stage");
    }
    return reinterpret_cast<const uint32_t*>(slot.device);
  }
  void BeginStep() override {
    Check(cudaStreamSynchronize(stream()), "begin step");
    // Nothing queued reads the chunks any more. Several chunks (the last step outgrew the
    // first) become one of their total size, so that a steady state stages into one.
    if (chunks_.size() > 1) {
      size_t total = 0;
      for (const Chunk& chunk : chunks_) total += chunk.bytes;
      // Refused: the chunks of the last step serve this one too.
      if (Result<Chunk> merged = NewChunk(total); merged.ok()) {
        chunks_.clear();
        chunks_.push_back(std::move(merged).value());
      }
    }
    chunk_ = 0;
    chunk_used_ = 0;
    staged_upload_bytes_ = 0;
  }
  Status Synchronize() override {
    Check(cudaStreamSynchronize(stream()), "synchronize");
    return error_;
  }

  void MatMul(const float* x, const float* w, float* y, size_t n, size_t in, size_t out,
              size_t x_stride, size_t y_stride) override {
    if (!error_.ok()) return;  // a failed device runs nothing more
    Check(LaunchMatMul(x, w, y, n, in, out, x_stride, y_stride, stream()), "MatMul");
  }
  void RmsNorm(const float* x, const float* weight, float* y, size_t n, size_t dim,
               float eps) override {
    if (!error_.ok()) return;  // a failed device runs nothing more
    Check(LaunchRmsNorm(x, weight, y, n, dim, eps, stream()), "RmsNorm");
  }
  void ApplyRope(float* x, size_t stride, size_t n, size_t num_heads, size_t head_dim,
                 const uint32_t* positions, float theta) override {
    if (!error_.ok()) return;  // a failed device runs nothing more
    Check(LaunchApplyRope(x, stride, n, num_heads, head_dim, positions, theta, stream()),
          "ApplyRope");
  }
  void SiluMul(const float* gate, const float* up, float* out, size_t count) override {
    if (!error_.ok()) return;  // a failed device runs nothing more
    Check(LaunchSiluMul(gate, up, out, count, stream()), "SiluMul");
  }
  void AddInPlace(float* x, const float* y, size_t count) override {
    if (!error_.ok()) return;  // a failed device runs nothing more
    Check(LaunchAddInPlace(x, y, count, stream()), "AddInPlace");
  }
  void AddConstant(float* x, size_t stride, size_t rows, size_t cols, float value) override {
    if (!error_.ok()) return;  // a failed device runs nothing more
    Check(LaunchAddConstant(x, stride, rows, cols, value, stream()), "AddConstant");
  }
  void Embed(const float* table, size_t vocab, size_t dim, const uint32_t* tokens, size_t n,
             float* out) override {
    if (!error_.ok()) return;  // a failed device runs nothing more
    Check(LaunchEmbed(table, vocab, dim, tokens, n, out, stream()), "Embed");
  }
  void WriteKv(const PagedLayer& layer, const uint32_t* block_table, size_t table_len,
               size_t start_pos, size_t n, const float* k, const float* v, size_t stride) override {
    if (!error_.ok()) return;  // a failed device runs nothing more
    Check(LaunchWriteKv(ToLayout(layer), block_table, table_len, start_pos, n, k, v, stride,
                        stream()),
          "WriteKv");
  }
  void PagedAttention(const PagedLayer& layer, const uint32_t* block_table, size_t table_len,
                      const float* q, size_t q_stride, size_t n, size_t start_pos,
                      uint32_t num_heads, const AttentionMask& mask, float scale, float* out,
                      size_t out_stride) override {
    if (!error_.ok()) return;  // a failed device runs nothing more
    Check(LaunchPagedAttention(ToLayout(layer), block_table, q, q_stride, n, start_pos, num_heads,
                               ToMask(mask), scale, out, out_stride, stream()),
          "PagedAttention");
  }
  void StateScan(float* state, const float* q, const float* k, const float* v, size_t stride,
                 const float* gate, size_t gate_stride, size_t n, uint32_t num_heads,
                 uint32_t head_dim, float* out, size_t out_stride) override {
    if (!error_.ok()) return;  // a failed device runs nothing more
    Check(LaunchStateScan(state, q, k, v, stride, gate, gate_stride, n, num_heads, head_dim, out,
                          out_stride, stream()),
          "StateScan");
  }

  Status PagesToHost(const float* pool, float* host_pool, size_t page_floats,
                     std::span<const uint32_t> pages) override {
    if (!error_.ok()) return error_;
    if (pages.empty() || page_floats == 0) return Status::OK();
    // After the compute queued so far, which wrote the pages.
    cudaError_t err = CopiesAfterCompute();
    if (err != cudaSuccess) return Fail(err, "ordering page copies after the compute");
    std::byte* device_base = reinterpret_cast<std::byte*>(const_cast<float*>(pool));
    std::byte* host_base = reinterpret_cast<std::byte*>(host_pool);
    const Status issued =
        IssueTransfer(PagePlan(TransferDirection::kDeviceToHost, page_floats, pages),
                      {&device_base, 1}, {&host_base, 1}, copy_stream());
    // Whatever was queued lands before we return: the caller reads or reuses the host pages.
    err = cudaStreamSynchronize(copy_stream());
    if (!issued.ok()) {
      cudaGetLastError();  // a refused copy: not the next kernel's error
      return issued;
    }
    if (err != cudaSuccess) return Fail(err, "copying pages to the host");
    return Status::OK();
  }
  Status PagesToDevice(float* pool, const float* host_pool, size_t page_floats,
                       std::span<const uint32_t> pages) override {
    if (!error_.ok()) return error_;
    if (pages.empty() || page_floats == 0) return Status::OK();
    // After the compute queued so far too: a kernel queued before may still read or write the
    // pages (a page given back and taken again in one step, a pool still being filled). The
    // engine loads pages between steps, when the stream is idle, so this costs it nothing.
    cudaError_t err = CopiesAfterCompute();
    if (err != cudaSuccess) return Fail(err, "ordering page copies after the compute");
    std::byte* device_base = reinterpret_cast<std::byte*>(pool);
    std::byte* host_base = reinterpret_cast<std::byte*>(const_cast<float*>(host_pool));
    const Status issued =
        IssueTransfer(PagePlan(TransferDirection::kHostToDevice, page_floats, pages),
                      {&device_base, 1}, {&host_base, 1}, copy_stream());
    // The compute queued from now on waits for the copies.
    err = cudaEventRecord(loaded_.get(), copy_stream());
    if (err == cudaSuccess) err = cudaStreamWaitEvent(stream(), loaded_.get(), 0);
    // Whatever was queued has read the host pages before we return: the caller may reuse them.
    const cudaError_t synced = cudaStreamSynchronize(copy_stream());
    if (!issued.ok()) {
      cudaGetLastError();
      return issued;
    }
    if (err != cudaSuccess) return Fail(err, "ordering the compute after page copies");
    if (synced != cudaSuccess) return Fail(synced, "copying pages to the device");
    return Status::OK();
  }

 private:
  // Pinned host memory and device memory of the same size: a staged array is written to the
  // host side and copied on the stream to the same offset of the device side.
  struct Chunk {
    PinnedMemory host;
    DeviceMemory device;
    size_t bytes = 0;
  };
  struct Slot {
    std::byte* host = nullptr;
    std::byte* device = nullptr;
  };

  CudaDevice(StreamHandle stream, StreamHandle copy_stream, EventHandle computed,
             EventHandle loaded)
      : stream_(std::move(stream)),
        copy_stream_(std::move(copy_stream)),
        computed_(std::move(computed)),
        loaded_(std::move(loaded)) {}

  cudaStream_t stream() const { return stream_.get(); }
  cudaStream_t copy_stream() const { return copy_stream_.get(); }

  // The copy stream waits for what the compute stream has queued so far.
  cudaError_t CopiesAfterCompute() {
    cudaError_t err = cudaEventRecord(computed_.get(), stream());
    if (err == cudaSuccess) err = cudaStreamWaitEvent(copy_stream(), computed_.get(), 0);
    return err;
  }

  // Keeps the first error; the device is failed from then on.
  void Check(cudaError_t err, std::string_view what) {
    if (err != cudaSuccess && error_.ok()) {
      error_ = FromCuda(err, StatusCode::kInternal, what);
    }
  }
  // A page copy's failure: kept like a kernel's, and returned.
  Status Fail(cudaError_t err, std::string_view what) {
    Check(err, what);
    return FromCuda(err, StatusCode::kInternal, what);
  }

  // ResourceExhausted when the memory is refused.
  static Result<Chunk> NewChunk(size_t bytes) {
    Chunk chunk;
    chunk.bytes = bytes;
    void* host = nullptr;
    void* device = nullptr;
    if (cudaHostAlloc(&host, bytes, cudaHostAllocDefault) != cudaSuccess) {
      cudaGetLastError();
      return ResourceExhaustedError("{} bytes of pinned staging memory refused", bytes);
    }
    chunk.host.reset(static_cast<std::byte*>(host));
    if (cudaMalloc(&device, bytes) != cudaSuccess) {
      cudaGetLastError();
      return ResourceExhaustedError("{} bytes of device staging memory refused", bytes);
    }
    chunk.device.reset(static_cast<std::byte*>(device));
    return chunk;
  }

  // `bytes` of staging memory, unused since the last BeginStep. Chunks are added, never moved,
  // so what earlier calls of the step gave stays valid. A null slot when memory is refused.
  Slot Reserve(size_t bytes) {
    const size_t size =
        (std::max<size_t>(bytes, 1) + kStageAlignment - 1) / kStageAlignment * kStageAlignment;
    while (chunk_ < chunks_.size() && chunk_used_ + size > chunks_[chunk_].bytes) {
      ++chunk_;
      chunk_used_ = 0;
    }
    if (chunk_ == chunks_.size()) {
      size_t grown = chunks_.empty() ? kStageChunkBytes : chunks_.back().bytes * 2;
      Result<Chunk> chunk = NewChunk(std::max(grown, size));
      if (!chunk.ok()) {
        // The step cannot be staged: the device fails as on a kernel error, and nothing more
        // of the step runs.
        if (error_.ok()) error_ = chunk.status();
        return Slot{nullptr, nullptr};
      }
      chunks_.push_back(std::move(chunk).value());
      chunk_used_ = 0;
    }
    Chunk& chunk = chunks_[chunk_];
    const Slot slot{chunk.host.get() + chunk_used_, chunk.device.get() + chunk_used_};
    chunk_used_ += size;
    return slot;
  }

  StreamHandle stream_;
  StreamHandle copy_stream_;
  EventHandle computed_;  // on stream_, before page copies
  EventHandle loaded_;    // on copy_stream_, after pages came to the device
  std::vector<Chunk> chunks_;
  size_t chunk_ = 0;       // the chunk Reserve takes from
  size_t chunk_used_ = 0;  // bytes of it given out this step
  size_t staged_upload_bytes_ = 0;
  Status error_;
};

}  // namespace

Result<std::unique_ptr<Device>> MakeCudaDevice() {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no device" / "no driver" error
    return FromCuda(err, StatusCode::kFailedPrecondition, "no CUDA device can be used");
  }
  if (count == 0) {
    const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
    return FailedPreconditionError("CUDA device: none visible (CUDA_VISIBLE_DEVICES={})",
                                   visible != nullptr ? visible : "unset");
  }
  return CudaDevice::Create();
}

#else  // built without the CUDA toolkit

Result<std::unique_ptr<Device>> MakeCudaDevice() {
  return UnimplementedError("kvstash was built without CUDA (KVSTASH_WITH_CUDA)");
}

#endif

}  // namespace kvstash::kernels::cuda
