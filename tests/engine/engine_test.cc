// The engine end to end: the same tokens with and without prefix caching, under any chunked-
// prefill budget, and after preemption and resume; bad requests refused; a request that can
// never fit fails instead of spinning.

#include "kvstash/engine/engine.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "kvstash/common/hash.h"

namespace kvstash::engine {
namespace {

std::vector<uint32_t> Tokens(size_t n, uint64_t seed, uint32_t vocab = 256) {
  std::vector<uint32_t> t(n);
  for (size_t i = 0; i < n; ++i) t[i] = static_cast<uint32_t>(Mix64(seed * 7919 + i) % vocab);
  return t;
}

std::unique_ptr<Engine> Make(const std::string& model, EngineOptions o = {}) {
  auto config = ModelConfig::Load("builtin:" + model);
  EXPECT_TRUE(config.ok());
  auto engine = Engine::Create(*config, o);
  EXPECT_TRUE(engine.ok()) << engine.status().ToString();
  return std::move(engine).value();
}

using Outputs = std::vector<std::vector<uint32_t>>;

// Runs the prompts, all queued at once, and returns each one's generated tokens.
Outputs GenerateAll(Engine& e, const std::vector<std::vector<uint32_t>>& prompts, size_t max_new) {
  auto results = e.Generate(prompts, max_new);
  EXPECT_TRUE(results.ok()) << results.status().ToString();
  Outputs out;
  if (!results.ok()) return out;
  for (const auto& r : *results) out.emplace_back(r->output().begin(), r->output().end());
  return out;
}

// Prompts that share prefixes of various lengths (a conversation and its branches).
std::vector<std::vector<uint32_t>> SharedPrefixPrompts() {
  const std::vector<uint32_t> base = Tokens(90, 1);
  std::vector<std::vector<uint32_t>> prompts;
  for (size_t cut : {90, 70, 33, 16, 5}) {
    std::vector<uint32_t> p(base.begin(), base.begin() + cut);
    const std::vector<uint32_t> tail = Tokens(cut % 17 + 3, cut);
    p.insert(p.end(), tail.begin(), tail.end());
    prompts.push_back(p);
  }
  return prompts;
}

class EngineModelTest : public ::testing::TestWithParam<std::string> {};

TEST_P(EngineModelTest, PrefixCachingChangesNoTokenAndHits) {
  const auto prompts = SharedPrefixPrompts();
  EngineOptions off;
  off.prefix_caching = false;
  auto plain = Make(GetParam(), off);
  // One request at a time, so later ones can hit what earlier ones cached.
  Outputs want, got;
  auto cached = Make(GetParam());
  size_t hits = 0;
  for (const auto& p : prompts) {
    want.push_back(GenerateAll(*plain, {p}, 12)[0]);
    auto r = cached->Generate({p}, 12);
    ASSERT_TRUE(r.ok());
    got.emplace_back((*r)[0]->output().begin(), (*r)[0]->output().end());
    hits += (*r)[0]->num_cached_tokens;
    EXPECT_EQ((*r)[0]->num_cached_tokens + (*r)[0]->num_computed_prompt_tokens, p.size());
  }
  EXPECT_EQ(got, want);
  EXPECT_GT(hits, 0u);
  // The same prompt again hits all but its last, unaligned, part.
  auto again = cached->Generate({prompts[0]}, 12);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(std::vector<uint32_t>((*again)[0]->output().begin(), (*again)[0]->output().end()),
            want[0]);
  EXPECT_GE((*again)[0]->num_cached_tokens, 64u);
}

TEST_P(EngineModelTest, AnyChunkedPrefillBudgetGivesTheSameTokens) {
  const auto prompts = SharedPrefixPrompts();
  Outputs want;
  for (size_t budget : {4096, 1, 3, 16, 17, 50}) {
    EngineOptions o;
    o.scheduler.max_num_batched_tokens = budget;
    auto e = Make(GetParam(), o);
    const Outputs got = GenerateAll(*e, prompts, 8);
    if (want.empty()) {
      want = got;
    } else {
      EXPECT_EQ(got, want) << "budget " << budget;
    }
  }
}

TEST_P(EngineModelTest, PreemptionAndResumeGiveTheSameTokens) {
  const auto prompts = SharedPrefixPrompts();
  auto roomy = Make(GetParam());
  const Outputs want = GenerateAll(*roomy, prompts, 24);
  EXPECT_EQ(roomy->counters().preemptions, 0u);
  // A pool big enough for any one request but not for all of them at once.
  EngineOptions o;
  o.num_blocks = GetParam() == "tiny-swa" ? 28 : GetParam() == "tiny-full" ? 40 : 70;
  o.scheduler.max_num_batched_tokens = 32;
  auto tight = Make(GetParam(), o);
  EXPECT_EQ(GenerateAll(*tight, prompts, 24), want);
  EXPECT_GT(tight->counters().preemptions, 0u);
  EXPECT_EQ(tight->kv_cache().num_free_blocks(), o.num_blocks - 1);  // everything came back
}

INSTANTIATE_TEST_SUITE_P(Builtins, EngineModelTest,
                         ::testing::Values("tiny-full", "tiny-swa", "tiny-hybrid",
                                           "tiny-state-hybrid"),
                         [](const auto& info) {
                           std::string s = info.param;
                           for (char& c : s)
                             if (c == '-') c = '_';
                           return s;
                         });

TEST(EngineTest, AttentionPackingChangesNoTokenAndRefinesHits) {
  const auto prompts = SharedPrefixPrompts();
  Outputs want;
  size_t hits[2] = {0, 0};
  for (uint32_t pack : {1u, 4u}) {
    EngineOptions o;
    o.attn_pack = pack;
    auto e = Make("tiny-state-hybrid", o);
    Outputs got;
    for (const auto& p : prompts) {
      auto r = e->Generate({p}, 6);
      ASSERT_TRUE(r.ok());
      got.emplace_back((*r)[0]->output().begin(), (*r)[0]->output().end());
      hits[pack == 4] += (*r)[0]->num_cached_tokens;
    }
    if (want.empty()) {
      want = got;
    } else {
      EXPECT_EQ(got, want);
    }
  }
  EXPECT_GT(hits[1], hits[0]);  // 4-token blocks catch more of each shared prefix than 16
}

TEST(EngineTest, SlidingWindowModelHoldsBlocksForItsWindowOnly) {
  EngineOptions o;
  o.scheduler.max_num_batched_tokens = 16;
  o.prefix_caching = false;
  auto e = Make("tiny-swa", o);
  ASSERT_TRUE(e->AddRequest(Tokens(400, 3), 4).ok());
  size_t peak = 0;
  while (e->HasUnfinished()) {
    for (RequestId id : e->Step()) e->TakeResult(id);
    peak = std::max(peak, o.num_blocks - 1 - e->kv_cache().num_free_blocks());
  }
  // 4 groups; each holds the blocks of its 32-token window plus the step's 16 new tokens:
  // at most ceil((31 + 16) / 16) + 1 = 4 blocks per group, never the 25 of the whole prompt.
  EXPECT_LE(peak, 4u * 4u);
}

TEST(EngineTest, BadRequestsAreRefused) {
  auto e = Make("tiny-full");
  EXPECT_EQ(e->AddRequest({}, 4).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(e->AddRequest({1, 2}, 0).status().code(), StatusCode::kInvalidArgument);
  auto past = e->AddRequest({1, 256}, 4);
  ASSERT_FALSE(past.ok());
  EXPECT_NE(past.status().message().find("token 256 at position 1"), std::string::npos);
}

TEST(EngineTest, RequestLargerThanThePoolFailsInsteadOfSpinning) {
  EngineOptions o;
  o.num_blocks = 5;  // 4 usable blocks of 16 tokens, 4 groups: one block per group
  o.scheduler.max_num_batched_tokens = 8;
  auto e = Make("tiny-full", o);
  auto small = e->AddRequest(Tokens(10, 1), 3);
  auto big = e->AddRequest(Tokens(40, 2), 3);
  ASSERT_TRUE(small.ok() && big.ok());
  std::vector<std::unique_ptr<Request>> done;
  for (int i = 0; i < 1000 && e->HasUnfinished(); ++i)
    for (RequestId id : e->Step()) done.push_back(e->TakeResult(id));
  ASSERT_FALSE(e->HasUnfinished());
  ASSERT_EQ(done.size(), 2u);
  for (const auto& r : done) {
    if (r->id == *big) {
      EXPECT_EQ(r->state, Request::State::kFailed);
      EXPECT_EQ(r->error.code(), StatusCode::kResourceExhausted);
    } else {
      EXPECT_EQ(r->state, Request::State::kFinished);
      EXPECT_EQ(r->num_output_tokens(), 3u);
    }
  }
  EXPECT_EQ(e->kv_cache().num_free_blocks(), 4u);
}

TEST(EngineTest, BadLayoutsAreRefusedAtCreate) {
  auto config = ModelConfig::Load("builtin:tiny-state-hybrid");
  EngineOptions o;
  o.block_size = 8;
  auto e = Engine::Create(*config, o);
  ASSERT_FALSE(e.ok());
  EXPECT_EQ(e.status().code(), StatusCode::kInvalidArgument);
  o.block_size = 0;
  o.weights_path = "/nonexistent/weights.safetensors";
  EXPECT_EQ(Engine::Create(*config, o).status().code(), StatusCode::kNotFound);
}

}  // namespace
}  // namespace kvstash::engine
