#include "kvstash/kernels/device.h"

#include <algorithm>
#include <cstdint>
#include <new>
#include <utility>

#include "cpu_device.h"
#include "cuda/cuda_device.h"

namespace kvstash::kernels {

Result<std::unique_ptr<Device>> MakeDevice(std::string_view name) {
  if (name == "cpu") return MakeCpuDevice(/*staged=*/false);
  if (name == "cpu-staged") return MakeCpuDevice(/*staged=*/true);
  if (name == "cuda") return cuda::MakeCudaDevice();
  return InvalidArgumentError("unknown device '{}': cpu, cpu-staged or cuda", name);
}

Result<float*> Device::AllocateHost(size_t floats) {
  if (floats == 0) return static_cast<float*>(nullptr);
  void* p = floats > SIZE_MAX / sizeof(float)
                ? nullptr
                : ::operator new (floats * sizeof(float), std::align_val_t{64}, std::nothrow);
  if (p == nullptr) return ResourceExhaustedError("{} floats of host memory refused", floats);
  return static_cast<float*>(p);
}

void Device::FreeHost(float* p) { ::operator delete (p, std::align_val_t{64}); }

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  if (this != &other) {
    if (data_ != nullptr) device_->Free(data_);
    device_ = std::exchange(other.device_, nullptr);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

DeviceBuffer::~DeviceBuffer() {
  if (data_ != nullptr) device_->Free(data_);
}

Status DeviceBuffer::Grow(size_t floats, float fill) {
  if (floats <= size_) return Status::OK();
  // Geometric growth: a buffer that grows step by step moves O(final size) floats in all.
  const size_t size = std::max(floats, size_ + size_ / 2);
  KVSTASH_ASSIGN_OR_RETURN(float* data, device_->Allocate(size));
  if (size_ > 0) device_->Copy(data, data_, size_);
  device_->Fill(data + size_, size - size_, fill);
  if (data_ != nullptr) device_->Free(data_);
  data_ = data;
  size_ = size;
  return Status::OK();
}

}  // namespace kvstash::kernels
