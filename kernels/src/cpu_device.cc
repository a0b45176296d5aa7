#include "cpu_device.h"

#include <algorithm>
#include <cstring>
#include <new>

#include "kvstash/kernels/cpu_ops.h"

namespace kvstash::kernels {
namespace {

constexpr std::align_val_t kAlignment{64};

// The CPU kernels on host memory, run on the calling thread.
class CpuDevice final : public Device {
 public:
  explicit CpuDevice(bool staged) : staged_(staged) {}

  std::string_view name() const override { return staged_ ? "cpu-staged" : "cpu"; }
  bool HostAccessible() const override { return !staged_; }

  Result<float*> Allocate(size_t floats) override {
    if (floats == 0) return static_cast<float*>(nullptr);
    void* p = floats > SIZE_MAX / sizeof(float)
                  ? nullptr
                  : ::operator new(floats * sizeof(float), kAlignment, std::nothrow);
    if (p == nullptr) return ResourceExhaustedError("{} floats of memory refused", floats);
    return static_cast<float*>(p);
  }
  void Free(float* p) override { ::operator delete(p, kAlignment); }
  void Copy(float* dst, const float* src, size_t floats) override {
    if (floats > 0) std::memmove(dst, src, floats * sizeof(float));
  }
  void Fill(float* x, size_t floats, float value) override { std::fill(x, x + floats, value); }
  void Upload(float* dst, const float* host, size_t floats) override { Copy(dst, host, floats); }
  void Download(float* host, const float* src, size_t floats) override { Copy(host, src, floats); }
  const uint32_t* Stage(std::span<const uint32_t> host) override { return host.data(); }
  void BeginStep() override {}
  Status Synchronize() override { return Status::OK(); }

  void MatMul(const float* x, const float* w, float* y, size_t n, size_t in, size_t out,
              size_t x_stride, size_t y_stride) override {
    kernels::MatMul(x, w, y, n, in, out, x_stride, y_stride);
  }
  void RmsNorm(const float* x, const float* weight, float* y, size_t n, size_t dim,
               float eps) override {
    kernels::RmsNorm(x, weight, y, n, dim, eps);
  }
  void ApplyRope(float* x, size_t stride, size_t n, size_t num_heads, size_t head_dim,
                 const uint32_t* positions, float theta) override {
    kernels::ApplyRope(x, stride, n, num_heads, head_dim, positions, theta);
  }
  void SiluMul(const float* gate, const float* up, float* out, size_t count) override {
    kernels::SiluMul(gate, up, out, count);
  }
  void AddInPlace(float* x, const float* y, size_t count) override {
    kernels::AddInPlace(x, y, count);
  }
  void AddConstant(float* x, size_t stride, size_t rows, size_t cols, float value) override {
    for (size_t r = 0; r < rows; ++r) {
      for (size_t c = 0; c < cols; ++c) x[r * stride + c] += value;
    }
  }
  void Embed(const float* table, size_t vocab, size_t dim, const uint32_t* tokens, size_t n,
             float* out) override {
    for (size_t i = 0; i < n; ++i) {
      const size_t token = std::min<size_t>(tokens[i], vocab - 1);
      std::memcpy(out + i * dim, table + token * dim, dim * sizeof(float));
    }
  }
  void WriteKv(const PagedLayer& layer, const uint32_t* block_table, size_t table_len,
               size_t start_pos, size_t n, const float* k, const float* v, size_t stride) override {
    kernels::WriteKv(layer, {block_table, table_len}, start_pos, n, k, v, stride);
  }
  void PagedAttention(const PagedLayer& layer, const uint32_t* block_table, size_t table_len,
                      const float* q, size_t q_stride, size_t n, size_t start_pos,
                      uint32_t num_heads, const AttentionMask& mask, float scale, float* out,
                      size_t out_stride) override {
    kernels::PagedAttention(layer, {block_table, table_len}, q, q_stride, n, start_pos, num_heads,
                            mask, scale, out, out_stride);
  }
  void StateScan(float* state, const float* q, const float* k, const float* v, size_t stride,
                 const float* gate, size_t gate_stride, size_t n, uint32_t num_heads,
                 uint32_t head_dim, float* out, size_t out_stride) override {
    kernels::StateScan(state, q, k, v, stride, gate, gate_stride, n, num_heads, head_dim, out,
                       out_stride);
  }

  Status PagesToHost(const float* pool, float* host_pool, size_t page_floats,
                     std::span<const uint32_t> pages) override {
    for (uint32_t p : pages) Copy(host_pool + p * page_floats, pool + p * page_floats, page_floats);
    return Status::OK();
  }
  Status PagesToDevice(float* pool, const float* host_pool, size_t page_floats,
                       std::span<const uint32_t> pages) override {
    for (uint32_t p : pages) Copy(pool + p * page_floats, host_pool + p * page_floats, page_floats);
    return Status::OK();
  }

 private:
  bool staged_;
};

}  // namespace

std::unique_ptr<Device> MakeCpuDevice(bool staged) { return std::make_unique<CpuDevice>(staged); }

}  // namespace kvstash::kernels
