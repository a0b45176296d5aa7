#include "cuda_device.h"

namespace kvstash::kernels::cuda {

Result<std::unique_ptr<Device>> MakeCudaDevice() {
  return UnimplementedError("the CUDA device is not written yet");
}

}  // namespace kvstash::kernels::cuda
