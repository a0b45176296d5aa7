// The engine's side of offloading, against a fake KvOffload in process: KV that arrives is
// used (same tokens, fewer computed), KV that does not (a bad block, a failed start) is
// recomputed and never enters the prefix cache, and "ask again" cannot stall a request.

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "builtin_models.h"
#include "kvstash/common/hash.h"
#include "kvstash/engine/engine.h"

namespace kvstash::engine {
namespace {

std::vector<uint32_t> Tokens(size_t n, uint64_t seed) {
  std::vector<uint32_t> t(n);
  for (size_t i = 0; i < n; ++i) t[i] = static_cast<uint32_t>(Mix64(seed * 7919 + i) % 256);
  return t;
}

// Serves KV from a donor engine's pool: a block is found by its hash in the donor's prefix
// cache, as a node finds it by key.
class FakeOffload : public KvOffload {
 public:
  enum class Mode { kServe, kBadBlocks, kRefuseStart, kAskAgainForever };
  FakeOffload(Mode mode, Engine* donor, const OffloadContext& context, size_t matched)
      : mode_(mode), donor_(donor), context_(context), matched_(matched) {}

  std::optional<size_t> MatchedTokens(const Request& r, size_t num_computed) override {
    ++asked_;
    if (mode_ == Mode::kAskAgainForever) return std::nullopt;
    return matched_ > num_computed ? matched_ - num_computed : 0;
  }
  Status StartLoad(const Request& r, const std::vector<std::vector<BlockId>>& tables,
                   size_t num_external) override {
    if (mode_ == Mode::kRefuseStart) return UnavailableError("no node");
    Job job{r.id, {}};
    const auto& hashes = r.hasher->hashes();
    const uint32_t h = context_.kv_cache->hash_block_size();
    for (size_t g = 0; g < tables.size(); ++g) {
      const uint32_t bs = context_.layout->groups[g].block_size, f = bs / h;
      const size_t end = (r.num_computed_tokens + num_external + bs - 1) / bs;
      for (size_t i = r.num_computed_tokens / bs; i < end && i < tables[g].size(); ++i) {
        if (tables[g][i] == kNullBlock) continue;
        const uint32_t group = static_cast<uint32_t>(g);
        auto src = donor_->kv_cache().pool().GetCachedBlock(hashes[i * f + f - 1], {&group, 1});
        if (!src) return NotFoundError("donor lacks group {} block {}", g, i);
        job.copies.push_back({(*src)[0], tables[g][i]});
      }
    }
    queued_.push_back(std::move(job));
    return Status::OK();
  }
  std::vector<std::pair<RequestId, JobId>> BeginStep(const SchedulerOutput&,
                                                     std::span<const RequestId>) override {
    std::vector<std::pair<RequestId, JobId>> out;
    const size_t page = context_.layout->page_floats;
    for (Job& job : queued_) {
      const JobId id = ++next_job_;
      for (auto [from, to] : job.copies) {
        float* dst = context_.pool.data() + size_t{to} * page;
        if (mode_ == Mode::kBadBlocks) {
          std::fill(dst, dst + page, std::nanf(""));  // what a torn transfer could leave
        } else {
          std::memcpy(dst, donor_->runner().host_pool().data() + size_t{from} * page,
                      page * sizeof(float));
        }
      }
      out.emplace_back(job.request, id);
      ++loads_;
    }
    queued_.clear();
    return out;
  }
  void EndStep() override {}
  std::unordered_map<JobId, bool> FinishLoads(std::span<const JobId> jobs) override {
    std::unordered_map<JobId, bool> out;
    for (JobId id : jobs) out[id] = mode_ == Mode::kServe;
    return out;
  }
  void RequestFinished(RequestId) override {}
  void Drain() override {}
  OffloadStats stats() const override { return {}; }

  size_t loads_ = 0, asked_ = 0;

 private:
  struct Job {
    RequestId request;
    std::vector<std::pair<BlockId, BlockId>> copies;
  };
  Mode mode_;
  Engine* donor_;
  OffloadContext context_;
  size_t matched_;
  std::vector<Job> queued_;
  JobId next_job_ = 0;
};

struct Outcome {
  std::vector<uint32_t> tokens;
  size_t computed = 0, external = 0, loads = 0;
};

class EngineOffloadTest : public ::testing::TestWithParam<std::string> {
 protected:
  std::unique_ptr<Engine> MakeEngine(EngineOptions o = {}) {
    auto config = ModelConfig::Load("builtin:" + GetParam());
    EXPECT_TRUE(config.ok());
    auto e = Engine::Create(*config, std::move(o));
    EXPECT_TRUE(e.ok()) << e.status().ToString();
    return std::move(e).value();
  }
  // Runs `prompt` on an engine whose offload is a FakeOffload in `mode`.
  Outcome RunWith(FakeOffload::Mode mode, Engine* donor, size_t matched,
                  const std::vector<uint32_t>& prompt, std::unique_ptr<Engine>* keep = nullptr) {
    FakeOffload* fake = nullptr;
    EngineOptions o;
    o.offload = [&](const OffloadContext& c) -> Result<std::unique_ptr<KvOffload>> {
      auto f = std::make_unique<FakeOffload>(mode, donor, c, matched);
      fake = f.get();
      return std::unique_ptr<KvOffload>(std::move(f));
    };
    std::unique_ptr<Engine> e = MakeEngine(std::move(o));
    auto r = e->Generate({prompt}, 6);
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    Outcome out;
    if (r.ok()) {
      out.tokens.assign((*r)[0]->output().begin(), (*r)[0]->output().end());
      out.computed = (*r)[0]->num_computed_prompt_tokens;
      out.external = (*r)[0]->num_external_tokens;
    }
    out.loads = fake->loads_;
    if (keep) *keep = std::move(e);
    return out;
  }
};

TEST_P(EngineOffloadTest, LoadedKvGivesTheSameTokensAndComputesOnlyTheRest) {
  const std::vector<uint32_t> prompt = Tokens(150, 1);
  std::unique_ptr<Engine> donor = MakeEngine();
  auto want = donor->Generate({prompt}, 6);  // also fills the donor's prefix cache
  ASSERT_TRUE(want.ok());
  const std::vector<uint32_t> tokens((*want)[0]->output().begin(), (*want)[0]->output().end());
  const Outcome got = RunWith(FakeOffload::Mode::kServe, donor.get(), 144, prompt);
  EXPECT_EQ(got.tokens, tokens);
  EXPECT_EQ(got.external, 144u);
  EXPECT_EQ(got.computed, 6u);
  EXPECT_EQ(got.loads, 1u);
}

TEST_P(EngineOffloadTest, BadOrRefusedLoadsAreRecomputedAndNeverCached) {
  const std::vector<uint32_t> prompt = Tokens(150, 2);
  std::unique_ptr<Engine> donor = MakeEngine();
  auto want = donor->Generate({prompt}, 6);
  ASSERT_TRUE(want.ok());
  const std::vector<uint32_t> tokens((*want)[0]->output().begin(), (*want)[0]->output().end());
  for (auto mode : {FakeOffload::Mode::kBadBlocks, FakeOffload::Mode::kRefuseStart}) {
    SCOPED_TRACE(mode == FakeOffload::Mode::kBadBlocks ? "bad blocks" : "refused start");
    std::unique_ptr<Engine> e;
    const Outcome got = RunWith(mode, donor.get(), 144, prompt, &e);
    EXPECT_EQ(got.tokens, tokens);
    EXPECT_EQ(got.external, 0u);
    EXPECT_EQ(got.computed, 150u);
    if (mode == FakeOffload::Mode::kBadBlocks) {
      EXPECT_EQ(e->counters().load_failures, 1u);
    }
    // The same prompt again on that engine hits its own prefix cache: had the poisoned pages
    // been cached, its tokens would differ.
    auto again = e->Generate({prompt}, 6);
    ASSERT_TRUE(again.ok());
    EXPECT_EQ(std::vector<uint32_t>((*again)[0]->output().begin(), (*again)[0]->output().end()),
              tokens);
    EXPECT_GT((*again)[0]->num_cached_tokens, 0u);
  }
}

INSTANTIATE_TEST_SUITE_P(Builtins, EngineOffloadTest, BuiltinModels(), BuiltinModelName);

TEST(EngineOffloadAskAgainTest, AskAgainForeverStillFinishes) {
  auto config = ModelConfig::Load("builtin:tiny-full");
  FakeOffload* fake = nullptr;
  EngineOptions o;
  o.offload = [&](const OffloadContext& c) -> Result<std::unique_ptr<KvOffload>> {
    auto f = std::make_unique<FakeOffload>(FakeOffload::Mode::kAskAgainForever, nullptr, c, 0);
    fake = f.get();
    return std::unique_ptr<KvOffload>(std::move(f));
  };
  auto e = Engine::Create(*config, std::move(o));
  ASSERT_TRUE(e.ok());
  auto r = (*e)->Generate({Tokens(40, 3)}, 3);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ((*r)[0]->num_output_tokens(), 3u);
  EXPECT_GT(fake->asked_, 100u);
}

}  // namespace
}  // namespace kvstash::engine
