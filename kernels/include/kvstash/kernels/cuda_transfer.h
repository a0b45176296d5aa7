#pragma once

// Device<->host block transfers on a CUDA device: a TransferPlan (transfer_plan.h) issued as one
// batched copy on a stream (cudaMemcpyBatchAsync; on a runtime older than 12.8, one
// cudaMemcpyAsync per operation on that stream). This header needs no CUDA headers: a stream
// is passed as void* (a cudaStream_t; null is the default stream). Built without the CUDA
// toolkit (KVSTASH_WITH_CUDA=OFF, or AUTO where none is found), DeviceCount() is 0 and
// IssueTransfer answers Unimplemented.

#include <cstddef>
#include <span>

#include "kvstash/common/status.h"
#include "kvstash/kernels/transfer_plan.h"

namespace kvstash::kernels::cuda {

// Whether this build has the CUDA kernels.
bool Built();
// CUDA devices usable by this process (0 without a driver, a device, or CUDA in this build).
int DeviceCount();

// Issues the plan on `stream`: device[t] is tensor t's base in device memory, host[t] its base
// in host memory (pinned for the copies to run at the bus's speed and asynchronously). Returns
// once the copies are queued; they run in stream order after the work queued before them (a
// device-to-host copy therefore waits for the compute that wrote its blocks when both are on
// the stream, or when the stream waits on the compute's event). Within the batch the copies
// have no order. InvalidArgument for tensor bases missing from the spans; Internal naming the
// CUDA error when the runtime refuses the copies.
Status IssueTransfer(const TransferPlan& plan, std::span<std::byte* const> device,
                     std::span<std::byte* const> host, void* stream);

}  // namespace kvstash::kernels::cuda
