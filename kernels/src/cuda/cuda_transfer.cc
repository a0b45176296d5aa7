#include "kvstash/kernels/cuda_transfer.h"

#if KVSTASH_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

#include <vector>

namespace kvstash::kernels::cuda {

#if KVSTASH_HAVE_CUDA

bool Built() { return true; }

int DeviceCount() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no device" / "no driver" error
    return 0;
  }
  return n;
}

Status IssueTransfer(const TransferPlan& plan, std::span<std::byte* const> device,
                     std::span<std::byte* const> host, void* stream_ptr) {
  if (plan.ops.empty()) return Status::OK();
  std::vector<void*> dsts;
  std::vector<const void*> srcs;
  std::vector<size_t> sizes;
  dsts.reserve(plan.ops.size());
  srcs.reserve(plan.ops.size());
  sizes.reserve(plan.ops.size());
  const bool to_host = plan.direction == TransferDirection::kDeviceToHost;
  for (const CopyOp& op : plan.ops) {
    if (op.tensor >= device.size() || op.tensor >= host.size()) {
      return InvalidArgumentError("transfer: tensor {} but {} device and {} host bases given",
                                  op.tensor, device.size(), host.size());
    }
    std::byte* d = device[op.tensor] + op.device_offset;
    std::byte* h = host[op.tensor] + op.host_offset;
    dsts.push_back(to_host ? h : d);
    srcs.push_back(to_host ? d : h);
    sizes.push_back(op.bytes);
  }
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  auto one_by_one = [&] {
    cudaError_t e = cudaSuccess;
    for (size_t i = 0; i < sizes.size() && e == cudaSuccess; ++i) {
      e = cudaMemcpyAsync(dsts[i], srcs[i], sizes[i], cudaMemcpyDefault, stream);
    }
    return e;
  };
  cudaError_t err = cudaSuccess;
#if CUDART_VERSION >= 12080
  if (stream == nullptr) {
    err = one_by_one();  // batched copies refuse the legacy default stream
  } else {
    // One batched copy. A device source is read in stream order (the compute before it wrote
    // it); a pinned host source is not written while a transfer is queued, so any order will
    // do.
    cudaMemcpyAttributes attrs{};
    attrs.srcAccessOrder = to_host ? cudaMemcpySrcAccessOrderStream : cudaMemcpySrcAccessOrderAny;
    size_t attrs_index = 0;
#if CUDART_VERSION >= 13000
    err = cudaMemcpyBatchAsync(dsts.data(), srcs.data(), sizes.data(), sizes.size(), &attrs,
                               &attrs_index, 1, stream);
#else
    size_t fail_index = 0;
    err = cudaMemcpyBatchAsync(dsts.data(), const_cast<void**>(srcs.data()), sizes.data(),
                               sizes.size(), &attrs, &attrs_index, 1, &fail_index, stream);
#endif
    if (err == cudaErrorNotSupported) {  // a driver older than the runtime
      cudaGetLastError();
      err = one_by_one();
    }
  }
#else
  err = one_by_one();
#endif
  if (err != cudaSuccess) {
    return InternalError("transfer of {} blocks ({} bytes): {}", plan.ops.size(),
                         plan.transfer_bytes, cudaGetErrorString(err));
  }
  return Status::OK();
}

#else  // built without the CUDA toolkit

bool Built() { return false; }
int DeviceCount() { return 0; }
Status IssueTransfer(const TransferPlan&, std::span<std::byte* const>, std::span<std::byte* const>,
                     void*) {
  return UnimplementedError("kvstash was built without CUDA (KVSTASH_WITH_CUDA)");
}

#endif

}  // namespace kvstash::kernels::cuda
