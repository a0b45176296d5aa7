#pragma once

// The CPU devices of device.h ("cpu", and "cpu-staged" with `staged`). Internal to
// kvstash::kernels; MakeDevice calls it.

#include <memory>

#include "kvstash/kernels/device.h"

namespace kvstash::kernels {

std::unique_ptr<Device> MakeCpuDevice(bool staged);

}  // namespace kvstash::kernels
