// The engine on a CUDA device (label gpu): for every built-in model its tokens equal the CPU
// engine's, one request at a time with prefix-cache hits, batched, under chunked prefill, in
// the pool and the ring layouts; and blocks cross between a GPU engine and a CPU engine through
// the connector (in-memory nodes) both ways with those tokens. Skips itself where no CUDA
// device is present.

#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "builtin_models.h"
#include "fake_node_store.h"
#include "generate_util.h"
#include "kvstash/common/hash.h"
#include "kvstash/engine/engine.h"
#include "kvstash/engine/node_offload.h"
#include "kvstash/kernels/cuda_transfer.h"

namespace kvstash::engine {
namespace {

using fakes::FakeNodeStore;
using fakes::FakeStoreClient;

std::vector<uint32_t> Tokens(size_t n, uint64_t seed) {
  std::vector<uint32_t> t(n);
  for (size_t i = 0; i < n; ++i) t[i] = static_cast<uint32_t>(Mix64(seed * 7919 + i) % 256);
  return t;
}

std::unique_ptr<Engine> Make(const std::string& model, EngineOptions o,
                             FakeNodeStore* store = nullptr) {
  auto config = ModelConfig::Load("builtin:" + model);
  EXPECT_TRUE(config.ok());
  if (store != nullptr) {
    o.offload = NodeOffload([store](const OffloadContext& c) -> Result<ConnectorParts> {
      store->set_block_bytes(connector::OffloadedBlockBytes(1, c.layout->page_bytes()));
      ConnectorParts parts;
      parts.client = std::make_unique<FakeStoreClient>(store);
      return parts;
    });
  }
  auto engine = Engine::Create(*config, std::move(o));
  EXPECT_TRUE(engine.ok()) << engine.status().ToString();
  return engine.ok() ? std::move(engine).value() : nullptr;
}

// Prompts sharing prefixes of several lengths, and one long enough for many blocks.
std::vector<std::vector<uint32_t>> Prompts() {
  const std::vector<uint32_t> base = Tokens(300, 5);
  std::vector<std::vector<uint32_t>> prompts;
  for (size_t cut : {300, 200, 47, 16, 3}) {
    std::vector<uint32_t> p(base.begin(), base.begin() + cut);
    const std::vector<uint32_t> tail = Tokens(cut % 13 + 2, cut);
    p.insert(p.end(), tail.begin(), tail.end());
    prompts.push_back(p);
  }
  return prompts;
}

class EngineGpuTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (kernels::cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  }
};

TEST_P(EngineGpuTest, CudaGivesTheCpuTokens) {
  const auto prompts = Prompts();
  for (bool ring : {false, true}) {
    for (size_t budget : {size_t{4096}, size_t{37}}) {
      SCOPED_TRACE(testing::Message() << (ring ? "ring" : "pool") << " budget " << budget);
      EngineOptions o;
      o.swa_ring = ring;
      o.scheduler.max_num_batched_tokens = budget;
      auto cpu = Make(GetParam(), o);
      o.device = "cuda";
      auto gpu = Make(GetParam(), o);
      ASSERT_NE(gpu, nullptr);
      EXPECT_EQ(gpu->runner().device().name(), "cuda");
      // One at a time (later ones hit what earlier ones cached), then all at once.
      size_t hits = 0;
      for (const auto& p : prompts) {
        auto r = gpu->Generate({p}, 16);
        ASSERT_TRUE(r.ok()) << r.status().ToString();
        hits += (*r)[0]->num_cached_tokens;
        EXPECT_EQ(std::vector<uint32_t>((*r)[0]->output().begin(), (*r)[0]->output().end()),
                  GenerateAll(*cpu, {p}, 16)[0]);
      }
      EXPECT_GT(hits, 0u);
      EXPECT_EQ(GenerateAll(*gpu, prompts, 16), GenerateAll(*cpu, prompts, 16));
    }
  }
}

// A GPU prefill worker's blocks serve a CPU decode worker and the other way round: the pages
// reach the host mirror after the compute that wrote them, and loaded pages reach the GPU
// before the request computes.
TEST_P(EngineGpuTest, BlocksCrossBetweenGpuAndCpuEngines) {
  const std::vector<uint32_t> prompt = Tokens(250, 9);
  EngineOptions cpu_options, gpu_options;
  gpu_options.device = "cuda";
  const std::vector<uint32_t> want = GenerateAll(*Make(GetParam(), cpu_options), {prompt}, 8)[0];
  for (bool gpu_pushes : {true, false}) {
    SCOPED_TRACE(gpu_pushes ? "gpu pushes, cpu pulls" : "cpu pushes, gpu pulls");
    FakeNodeStore store;
    {
      auto pusher = Make(GetParam(), gpu_pushes ? gpu_options : cpu_options, &store);
      ASSERT_NE(pusher, nullptr);
      GenerateAll(*pusher, {prompt}, 1);
      pusher->DrainOffload();
    }
    auto puller = Make(GetParam(), gpu_pushes ? cpu_options : gpu_options, &store);
    ASSERT_NE(puller, nullptr);
    auto r = puller->Generate({prompt}, 8);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_EQ(std::vector<uint32_t>((*r)[0]->output().begin(), (*r)[0]->output().end()), want);
    EXPECT_GT((*r)[0]->num_external_tokens, 0u);
    EXPECT_EQ(puller->counters().load_failures, 0u);
  }
}

INSTANTIATE_TEST_SUITE_P(Builtins, EngineGpuTest, BuiltinModels(), BuiltinModelName);

}  // namespace
}  // namespace kvstash::engine
