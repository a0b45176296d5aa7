#pragma once

// The "cuda" Device (kvstash/kernels/device.h): the engine's kernels on the first visible CUDA
// device, on a stream of its own. Internal to kvstash::kernels; MakeDevice("cuda") calls it.

#include <memory>

#include "kvstash/common/status.h"
#include "kvstash/kernels/device.h"

namespace kvstash::kernels::cuda {

// Unimplemented in a build without CUDA; FailedPrecondition naming the reason when no device
// can be used (no driver, no device, a driver older than the runtime).
Result<std::unique_ptr<Device>> MakeCudaDevice();

}  // namespace kvstash::kernels::cuda
