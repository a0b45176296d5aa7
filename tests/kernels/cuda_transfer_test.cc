// CUDA block transfers (label gpu) against the host executor: random bytes on both sides, a
// poisoned destination, random plans of the shapes of docs/semantics.md §12.H, both directions, on
// a stream of our own and on the default stream. Skips itself where no CUDA device is present.

#include "kvstash/kernels/cuda_transfer.h"

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "kvstash/kernels/transfer_plan.h"

namespace kvstash::kernels {
namespace {

#define CUDA_OK(expr) ASSERT_EQ((expr), cudaSuccess) << #expr

class CudaTransferTest : public ::testing::TestWithParam<uint32_t> {
 protected:
  void SetUp() override {
    if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  }
};

TEST_P(CudaTransferTest, MovesWhatTheHostExecutorMovesAndNothingElse) {
  const uint32_t factor = GetParam();
  std::mt19937_64 rng(std::random_device{}());
  const size_t device_blocks = 64, host_blocks = 256;
  // Four tensors of different pages, two groups of two tensors each.
  std::vector<TransferTensor> tensors;
  for (size_t t = 0; t < 4; ++t) {
    const size_t page = 512 * (t % 2 + 1);
    tensors.push_back({page, page, page * factor});
  }
  for (TransferDirection dir :
       {TransferDirection::kDeviceToHost, TransferDirection::kHostToDevice}) {
    for (bool own_stream : {true, false}) {
      SCOPED_TRACE(testing::Message() << "direction " << static_cast<int>(dir) << " own stream "
                                      << own_stream << " factor " << factor);
      // A random sample of 3*factor device blocks per group, the first factor-1 dropped
      // (block_indices = factor-1), as vLLM's GPU test does.
      std::vector<uint32_t> all_device(device_blocks), all_host(host_blocks);
      std::iota(all_device.begin(), all_device.end(), 0u);
      std::iota(all_host.begin(), all_host.end(), 0u);
      std::shuffle(all_device.begin(), all_device.end(), rng);
      std::shuffle(all_host.begin(), all_host.end(), rng);
      TransferSpec spec;
      spec.direction = dir;
      spec.factor = factor;
      const uint32_t size = 3 * factor - (factor - 1);
      spec.group_sizes = {size, 0, size};
      spec.block_indices = {factor - 1, 0, factor - 1};
      spec.refs = {{0, 1}, {}, {2, 3}};
      spec.device_blocks.assign(all_device.begin(), all_device.begin() + 2 * size);
      spec.host_blocks.assign(all_host.begin(), all_host.begin() + 6);
      auto plan = PlanTransfer(spec, tensors);
      ASSERT_TRUE(plan.ok()) << plan.status().ToString();

      std::vector<std::vector<std::byte>> dev_mirror(4), host_mirror(4);
      std::vector<std::byte*> dev(4), host(4), dev_m(4), host_m(4);
      for (size_t t = 0; t < 4; ++t) {
        const size_t dbytes = device_blocks * tensors[t].device_row_stride;
        const size_t hbytes = host_blocks * tensors[t].host_row_stride;
        dev_mirror[t].resize(dbytes);
        host_mirror[t].resize(hbytes);
        for (auto& b : dev_mirror[t]) b = std::byte(rng());  // destination or source: random
        for (auto& b : host_mirror[t]) b = std::byte(rng());
        CUDA_OK(cudaMalloc(reinterpret_cast<void**>(&dev[t]), dbytes));
        CUDA_OK(cudaHostAlloc(reinterpret_cast<void**>(&host[t]), hbytes, cudaHostAllocDefault));
        CUDA_OK(cudaMemcpy(dev[t], dev_mirror[t].data(), dbytes, cudaMemcpyHostToDevice));
        std::memcpy(host[t], host_mirror[t].data(), hbytes);
        dev_m[t] = dev_mirror[t].data();
        host_m[t] = host_mirror[t].data();
      }
      cudaStream_t stream = nullptr;
      if (own_stream) {
        CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
      }
      ASSERT_TRUE(cuda::IssueTransfer(*plan, dev, host, stream).ok());
      ExecuteTransferOnHost(*plan, dev_m, host_m);
      CUDA_OK(cudaStreamSynchronize(stream));
      for (size_t t = 0; t < 4; ++t) {
        std::vector<std::byte> got(dev_mirror[t].size());
        CUDA_OK(cudaMemcpy(got.data(), dev[t], got.size(), cudaMemcpyDeviceToHost));
        EXPECT_TRUE(got == dev_mirror[t]) << "device tensor " << t;
        EXPECT_EQ(std::memcmp(host[t], host_mirror[t].data(), host_mirror[t].size()), 0)
            << "host tensor " << t;
        cudaFree(dev[t]);
        cudaFreeHost(host[t]);
      }
      if (stream != nullptr) cudaStreamDestroy(stream);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Factors, CudaTransferTest, ::testing::Values(1u, 3u));

TEST(CudaTransferApiTest, TensorBasesMissingAreRefusedBeforeAnyCopy) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  TransferPlan plan;
  plan.ops.push_back({3, 0, 0, 64});
  std::vector<std::byte*> one(1, nullptr);
  EXPECT_EQ(cuda::IssueTransfer(plan, one, one, nullptr).code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvstash::kernels
