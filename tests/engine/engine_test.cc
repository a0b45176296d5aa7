// The engine end to end: the same tokens with and without prefix caching, under any chunked-
// prefill budget, and after preemption and resume; bad requests refused; a request that can
// never fit fails instead of spinning.

#include "kvstash/engine/engine.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "builtin_models.h"
#include "generate_util.h"
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

// MinBlocksHeldAt is exact: a request computing one token per step (the least any schedule
// holds at a position) holds exactly that many blocks after each step, for every attention
// type (windows, chunks and states free what they no longer need).
TEST_P(EngineModelTest, MinBlocksHeldAtIsWhatAOneTokenStepHolds) {
  EngineOptions o;
  o.prefix_caching = false;  // freed blocks are free at once
  o.scheduler.max_num_batched_tokens = 1;
  auto e = Make(GetParam(), o);
  ASSERT_TRUE(e->AddRequest(Tokens(150, 4), 30).ok());
  for (size_t position = 0; e->HasUnfinished(); ++position) {
    if (!e->Step().empty()) break;  // the last step frees everything
    EXPECT_EQ(o.num_blocks - 1 - e->kv_cache().num_free_blocks(),
              e->kv_cache().MinBlocksHeldAt(position))
        << "position " << position;
  }
  EXPECT_FALSE(e->HasUnfinished());
}

INSTANTIATE_TEST_SUITE_P(Builtins, EngineModelTest, BuiltinModels(), BuiltinModelName);

// "cpu-staged" keeps the pool, the weights and the scratch in memory apart from what the
// runner reads on the host, as a GPU does: the same kernels must give the same tokens (bit for
// bit), with prefix-cache hits, chunked prefill and the ring layout, and a missing copy
// between the two shows up as different tokens.
TEST_P(EngineModelTest, StagedDeviceGivesTheCpuTokens) {
  const auto prompts = SharedPrefixPrompts();
  for (bool ring : {false, true}) {
    SCOPED_TRACE(ring ? "swa ring" : "pool layout");
    EngineOptions o;
    o.swa_ring = ring;
    o.scheduler.max_num_batched_tokens = 40;
    auto cpu = Make(GetParam(), o);
    o.device = "cpu-staged";
    auto staged = Make(GetParam(), o);
    EXPECT_EQ(staged->runner().device().name(), "cpu-staged");
    EXPECT_FALSE(staged->runner().host_pool_is_pool());
    for (const auto& p : prompts) {
      EXPECT_EQ(GenerateAll(*staged, {p}, 10), GenerateAll(*cpu, {p}, 10));
    }
    EXPECT_EQ(GenerateAll(*staged, prompts, 10), GenerateAll(*cpu, prompts, 10));
  }
}

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
  for (int i = 0; i < 1000 && e->HasUnfinished(); ++i) {
    for (RequestId id : e->Step()) done.push_back(e->TakeResult(id));
  }
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

// CheckFits refuses exactly the requests whose last prompt token or last computed token needs
// more blocks than the pool: 4 full-attention groups of 16-token blocks in 12 blocks hold 48
// positions. The largest request it lets through runs to its end; one token more fails in the
// engine as well.
TEST(EngineTest, CheckFitsRefusesExactlyWhatThePoolCanNeverHold) {
  EngineOptions o;
  o.num_blocks = 13;
  auto e = Make("tiny-full", o);
  EXPECT_TRUE(e->CheckFits(40, 9).ok());  // positions 0..47: the 48th token is only sampled
  EXPECT_TRUE(e->CheckFits(48, 1).ok());
  const Status longer = e->CheckFits(40, 10);
  EXPECT_EQ(longer.code(), StatusCode::kOutOfRange);
  EXPECT_NE(longer.message().find("a prompt of 40 tokens and 10 new tokens need 16 KV-cache "
                                  "blocks of 16 tokens at their peak, more than the pool's 12"),
            std::string::npos)
      << longer.ToString();
  const Status prompt = e->CheckFits(49, 1);
  EXPECT_EQ(prompt.code(), StatusCode::kOutOfRange);
  EXPECT_NE(prompt.message().find("a prompt of 49 tokens needs 16 KV-cache blocks"),
            std::string::npos)
      << prompt.ToString();
  EXPECT_EQ(e->CheckFits(1000000, 1).code(), StatusCode::kOutOfRange);
  EXPECT_EQ(e->CheckFits(1, size_t{1} << 20).code(), StatusCode::kOutOfRange);

  auto fits = e->Generate({Tokens(40, 5)}, 9);
  ASSERT_TRUE(fits.ok()) << fits.status().ToString();
  EXPECT_EQ((*fits)[0]->num_output_tokens(), 9u);
  auto over = e->Generate({Tokens(40, 5)}, 10);
  ASSERT_FALSE(over.ok());
  EXPECT_EQ(over.status().code(), StatusCode::kResourceExhausted);
}

// A sliding-window model needs only its windows: CheckFits lets a request far longer than the
// pool through, and it runs.
TEST(EngineTest, CheckFitsCountsOnlyTheWindowOfASlidingWindowModel) {
  EngineOptions o;
  o.num_blocks = 17;  // 16 blocks: 256 tokens of one group, 64 of the model's four
  o.scheduler.max_num_batched_tokens = 16;
  auto e = Make("tiny-swa", o);
  EXPECT_TRUE(e->CheckFits(400, 200).ok());
  EXPECT_TRUE(e->CheckFits(100000, size_t{1} << 20).ok());
  auto r = e->Generate({Tokens(400, 6)}, 200);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ((*r)[0]->num_output_tokens(), 200u);
}

// In a hybrid pool too small for a whole prefill chunk past the windows, the largest request
// CheckFits lets through runs alone (the scheduler shortens its chunks), and one more token is
// refused.
TEST(EngineTest, CheckFitsLetsThroughWhatRunsAloneInAHybridModel) {
  EngineOptions o;
  o.num_blocks = 64;
  auto e = Make("tiny-hybrid", o);
  const size_t prompt = 300;
  size_t most = 0;  // the largest max_new_tokens that fits after the prompt
  while (e->CheckFits(prompt, most + 1).ok()) ++most;
  ASSERT_GT(most, 10u);
  EXPECT_EQ(e->CheckFits(prompt, most + 1).code(), StatusCode::kOutOfRange);
  auto r = e->Generate({Tokens(prompt, 11)}, most);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ((*r)[0]->num_output_tokens(), most);
  auto over = e->Generate({Tokens(prompt, 12)}, most + 1);
  ASSERT_FALSE(over.ok());
  EXPECT_EQ(over.status().code(), StatusCode::kResourceExhausted) << over.status().ToString();
}

// Abort drops a running or a waiting request: its blocks go back, the engine forgets it, and
// the request left generates what it generates alone.
TEST(EngineTest, AbortFreesARequestsBlocksAndLeavesTheOthersAlone) {
  EngineOptions o;
  o.scheduler.max_num_seqs = 2;
  auto alone = Make("tiny-hybrid", o);
  const Outputs want = GenerateAll(*alone, {Tokens(70, 8)}, 40);
  auto e = Make("tiny-hybrid", o);
  auto kept = e->AddRequest(Tokens(70, 8), 40);
  auto running = e->AddRequest(Tokens(300, 9), 500);
  auto waiting = e->AddRequest(Tokens(50, 10), 500);
  ASSERT_TRUE(kept.ok() && running.ok() && waiting.ok());
  for (int i = 0; i < 5; ++i) EXPECT_TRUE(e->Step().empty());
  ASSERT_NE(e->Find(*running), nullptr);
  ASSERT_GT(e->Find(*running)->num_computed_tokens, 0u);
  const size_t free_before = e->kv_cache().num_free_blocks();
  EXPECT_TRUE(e->Abort(*running).ok());
  EXPECT_GT(e->kv_cache().num_free_blocks(), free_before);
  EXPECT_EQ(e->Find(*running), nullptr);
  EXPECT_EQ(e->TakeResult(*running), nullptr);
  EXPECT_EQ(e->Abort(*running).code(), StatusCode::kNotFound);
  EXPECT_TRUE(e->Abort(*waiting).ok());
  std::unique_ptr<Request> result;
  while (e->HasUnfinished()) {
    for (RequestId id : e->Step()) {
      EXPECT_EQ(id, *kept);
      result = e->TakeResult(id);
    }
  }
  ASSERT_NE(result, nullptr);
  EXPECT_EQ(std::vector<uint32_t>(result->output().begin(), result->output().end()), want[0]);
  EXPECT_EQ(e->kv_cache().num_free_blocks(), o.num_blocks - 1);
}

TEST(EngineTest, UnknownOrMissingDevicesAreRefusedAtCreate) {
  auto config = ModelConfig::Load("builtin:tiny-hybrid");
  ASSERT_TRUE(config.ok());
  EngineOptions o;
  o.device = "tpu";
  auto bad = Engine::Create(*config, o);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("cpu, cpu-staged or cuda"), std::string::npos);
  // "cuda" works where a GPU is; elsewhere it says why not.
  o.device = "cuda";
  auto cuda = Engine::Create(*config, o);
  if (!cuda.ok()) {
    EXPECT_TRUE(cuda.status().code() == StatusCode::kUnimplemented ||
                cuda.status().code() == StatusCode::kFailedPrecondition)
        << cuda.status().ToString();
  } else {
    EXPECT_EQ((*cuda)->runner().device().name(), "cuda");
  }
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

// ---- Ring mode (EngineOptions::swa_ring) ---------------------------------------------------

struct RunResult {
  Outputs outputs;
  std::vector<size_t> cached;  // num_cached_tokens per prompt
};

// Runs the prompts, all queued at once, or one after another when `one_by_one`.
RunResult RunPrompts(Engine& e, const std::vector<std::vector<uint32_t>>& prompts, size_t max_new,
                     bool one_by_one = false) {
  RunResult out;
  auto take = [&](const std::vector<std::vector<uint32_t>>& batch) {
    auto results = e.Generate(batch, max_new);
    EXPECT_TRUE(results.ok()) << results.status().ToString();
    if (!results.ok()) return;
    for (const auto& r : *results) {
      out.outputs.emplace_back(r->output().begin(), r->output().end());
      out.cached.push_back(r->num_cached_tokens);
    }
  };
  if (one_by_one) {
    for (const auto& p : prompts) take({p});
  } else {
    take(prompts);
  }
  return out;
}

class EngineRingTest : public ::testing::TestWithParam<std::string> {};

// The same tokens and the same prefix-cache hits as the pool layout, with and without prefix
// caching, under budgets that split prompts at every offset, past the window and not.
TEST_P(EngineRingTest, SameTokensAndHitsAsThePoolLayout) {
  const auto prompts = SharedPrefixPrompts();
  for (bool caching : {true, false}) {
    for (size_t budget : {1, 7, 64}) {
      for (bool one_by_one : {false, true}) {
        EngineOptions o;
        o.prefix_caching = caching;
        o.scheduler.max_num_batched_tokens = budget;
        auto pool = Make(GetParam(), o);
        o.swa_ring = true;
        auto ring = Make(GetParam(), o);
        const RunResult want = RunPrompts(*pool, prompts, 8, one_by_one);
        const RunResult got = RunPrompts(*ring, prompts, 8, one_by_one);
        const std::string where = "caching " + std::to_string(caching) + " budget " +
                                  std::to_string(budget) + " one_by_one " +
                                  std::to_string(one_by_one);
        EXPECT_EQ(got.outputs, want.outputs) << where;
        EXPECT_EQ(got.cached, want.cached) << where;
        EXPECT_EQ(ring->runner().num_rings(), 0u) << where;
        EXPECT_EQ(ring->kv_cache().num_free_blocks(), o.num_blocks - 1) << where;
        if (caching && one_by_one) {
          size_t hits = 0;
          for (size_t c : got.cached) hits += c;
          EXPECT_GT(hits, 0u) << where;
        }
      }
    }
  }
}

// Preempted requests give their rings back and recompute from their hits: the same tokens as a
// roomy pool in the pool layout.
TEST_P(EngineRingTest, PreemptionAndResumeGiveTheSameTokens) {
  const auto prompts = SharedPrefixPrompts();
  auto roomy = Make(GetParam());
  const Outputs want = GenerateAll(*roomy, prompts, 24);
  for (bool caching : {true, false}) {
    EngineOptions o;
    o.swa_ring = true;
    o.prefix_caching = caching;
    // Ring groups hold only cached blocks, so the sliding-window model needs a smaller pool to
    // run out (and none at all without caching: it holds no block).
    const std::string& m = GetParam();
    o.num_blocks = m == "tiny-swa" ? 24 : m == "tiny-hybrid" ? 32 : m == "tiny-full" ? 40 : 50;
    o.scheduler.max_num_batched_tokens = 32;
    auto tight = Make(GetParam(), o);
    EXPECT_EQ(GenerateAll(*tight, prompts, 24), want) << caching;
    if (caching || GetParam() != "tiny-swa") {
      EXPECT_GT(tight->counters().preemptions, 0u) << caching;
    }
    EXPECT_EQ(tight->kv_cache().num_free_blocks(), o.num_blocks - 1);
    EXPECT_EQ(tight->runner().num_rings(), 0u);
  }
}

INSTANTIATE_TEST_SUITE_P(Builtins, EngineRingTest, BuiltinModels(), BuiltinModelName);

// Without prefix caching a ring-mode sliding-window model holds no pool block at all: its KV is
// in its rings, one per request and layer, while a 400-token prompt runs.
TEST(EngineTest, RingModeWithoutPrefixCachingHoldsNoPoolBlock) {
  EngineOptions o;
  o.scheduler.max_num_batched_tokens = 16;
  o.prefix_caching = false;
  auto pool = Make("tiny-swa", o);
  const Outputs want = GenerateAll(*pool, {Tokens(400, 3)}, 4);
  o.swa_ring = true;
  auto e = Make("tiny-swa", o);
  auto id = e->AddRequest(Tokens(400, 3), 4);
  ASSERT_TRUE(id.ok());
  size_t peak = 0, steps = 0;
  Outputs got;
  while (e->HasUnfinished()) {
    for (RequestId done : e->Step()) {
      auto r = e->TakeResult(done);
      got.emplace_back(r->output().begin(), r->output().end());
    }
    peak = std::max(peak, o.num_blocks - 1 - e->kv_cache().num_free_blocks());
    if (e->HasUnfinished()) {
      EXPECT_EQ(e->runner().num_rings(), 1u);
    }
    ++steps;
  }
  EXPECT_EQ(peak, 0u);
  EXPECT_GE(steps, 25u);
  EXPECT_EQ(got, want);
  EXPECT_EQ(e->runner().num_rings(), 0u);
  // 4 layers of 32 tokens' keys and values of 2 heads of 16.
  EXPECT_EQ(e->runner().ring_floats_per_request(), 4u * 32 * 2 * 2 * 16);
}

// With prefix caching, a request sharing a long prefix with an earlier one hits the blocks the
// ring layers copied to the pool, as long a hit as the pool layout's, with the same tokens.
TEST(EngineTest, RingModeHitsASharedPrefix) {
  for (const std::string model : {"tiny-swa", "tiny-hybrid"}) {
    const std::vector<uint32_t> base = Tokens(150, 21);
    std::vector<uint32_t> second(base.begin(), base.begin() + 130);
    for (uint32_t t : Tokens(20, 22)) second.push_back(t);
    EngineOptions o;
    o.prefix_caching = false;
    auto plain = Make(model, o);
    const Outputs want = GenerateAll(*plain, {base, second}, 10);
    o.prefix_caching = true;
    auto pool = Make(model, o);
    o.swa_ring = true;
    auto ring = Make(model, o);
    const RunResult pool_run = RunPrompts(*pool, {base, second}, 10, /*one_by_one=*/true);
    const RunResult ring_run = RunPrompts(*ring, {base, second}, 10, /*one_by_one=*/true);
    EXPECT_EQ(ring_run.outputs, want) << model;
    EXPECT_EQ(pool_run.outputs, want) << model;
    EXPECT_EQ(ring_run.cached[0], 0u) << model;
    EXPECT_EQ(ring_run.cached[1], 128u) << model;  // the last 16-token block before 130
    EXPECT_EQ(ring_run.cached, pool_run.cached) << model;
  }
}

}  // namespace
}  // namespace kvstash::engine
