// The router's score of a worker equals the hit its engine really gets, from what the worker's
// KV events said (real engines, their events into a KvIndex), where a group-blind count is
// wrong: a hybrid model whose state snapshots of a prefix were evicted.
#include "kvstash/router/scoring.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <thread>

#include "cache_events.h"
#include "kvstash/engine/engine.h"

namespace kvstash::router {
namespace {

using engine::Engine;

std::vector<uint32_t> Tokens(size_t n, uint64_t seed) {
  std::vector<uint32_t> t(n);
  for (size_t i = 0; i < n; ++i) t[i] = static_cast<uint32_t>(Mix64(seed * 7919 + i) % 200);
  return t;
}

struct Worker {
  std::string name;
  std::unique_ptr<Engine> engine;
  int64_t seq = 0;

  Worker(std::string n, const std::string& model) : name(std::move(n)) {
    auto config = engine::ModelConfig::Load("builtin:" + model);
    EXPECT_TRUE(config.ok());
    engine::EngineOptions o;
    o.record_cache_events = true;
    auto e = Engine::Create(*config, o);
    EXPECT_TRUE(e.ok()) << e.status().ToString();
    engine = std::move(*e);
  }
  CacheLayout Layout() const {
    return {engine->layout().groups, engine->kv_cache().hash_block_size(), engine->cache_salt()};
  }
  // What the worker's events say, into the index (as a router's subscriber would hand them).
  void Drain(events::KvIndex& index) {
    const auto& groups = engine->layout().groups;
    index.Apply(name, events::Delivery{
                          seq, worker::CacheEventBatch(engine->TakeCacheEvents(), groups, seq == 0),
                          false});
    ++seq;
  }
  void Run(const std::vector<uint32_t>& prompt, events::KvIndex& index) {
    ASSERT_TRUE(engine->AddRequest(prompt, 1).ok());
    while (engine->HasUnfinished()) (void)engine->Step();
    Drain(index);
  }
  // The hit the engine itself would give `prompt` now.
  size_t Truth(const std::vector<uint32_t>& prompt) {
    const std::vector<BlockHash> hashes = PromptHashes(Layout(), prompt);
    return engine->kv_cache().GetComputedBlocks(hashes, prompt.size()).tokens;
  }
};

TEST(ScoringTest, AnEvictedStateSnapshotIsScoredByTheHitReallyUsable) {
  events::KvIndex index;
  Worker a("a", "tiny-state-hybrid");
  Worker b("b", "tiny-state-hybrid");
  const CacheLayout layout = a.Layout();
  ASSERT_EQ(layout.cache_salt, b.Layout().cache_salt);  // one model: one salt
  const uint32_t bs = layout.groups[0].block_size;

  // a computed the whole prompt; b only its first 6 blocks.
  const std::vector<uint32_t> prompt = Tokens(bs * 12 + 3, 1);
  a.Run(prompt, index);
  std::vector<uint32_t> shorter(prompt.begin(), prompt.begin() + bs * 6);
  const std::vector<uint32_t> tail = Tokens(5, 2);
  shorter.insert(shorter.end(), tail.begin(), tail.end());
  b.Run(shorter, index);

  // a then loses its state snapshots from block 2 on (evicted, as memory pressure would).
  const std::vector<BlockHash> hashes = PromptHashes(layout, prompt);
  size_t evicted = 0;
  for (size_t g = 0; g < layout.groups.size(); ++g) {
    if (layout.groups[g].kind != engine::AttentionSpec::Kind::kState) continue;
    const size_t k = layout.groups[g].block_size / layout.hash_block_size;
    for (size_t i = 2; i < hashes.size() / k; ++i) {
      evicted += a.engine->kv_cache().pool().EvictCachedHash(
          engine::CachedKey{hashes[i * k + k - 1], static_cast<uint32_t>(g)});
    }
  }
  ASSERT_GT(evicted, 0u);
  a.Drain(index);

  const size_t hit_a = HybridHitTokens(index, "a", "GPU", layout, hashes, prompt.size());
  const size_t hit_b = HybridHitTokens(index, "b", "GPU", layout, hashes, prompt.size());
  // The score is the engines' own answer.
  EXPECT_EQ(hit_a, a.Truth(prompt));
  EXPECT_EQ(hit_b, b.Truth(prompt));
  EXPECT_EQ(hit_b, size_t{bs} * 6);
  EXPECT_LT(hit_a, hit_b);
  // A group-blind count would send the prompt to a, which holds more full-attention blocks but
  // can use fewer of them.
  const size_t blind_a = GroupBlindHitTokens(index, "a", "GPU", layout, hashes, prompt.size());
  const size_t blind_b = GroupBlindHitTokens(index, "b", "GPU", layout, hashes, prompt.size());
  EXPECT_GT(blind_a, blind_b);
  EXPECT_EQ(blind_a, size_t{bs} * 12);
}

TEST(ScoringTest, SlidingWindowAndFullGroupsScoreAsTheEngineHits) {
  events::KvIndex index;
  Worker w("w", "tiny-hybrid");
  const CacheLayout layout = w.Layout();
  const std::vector<uint32_t> first = Tokens(layout.groups[0].block_size * 10 + 7, 3);
  w.Run(first, index);
  // Prompts sharing prefixes of various lengths with what it computed, and one sharing none.
  for (size_t cut : {size_t{0}, size_t{20}, size_t{64}, first.size()}) {
    std::vector<uint32_t> p(first.begin(), first.begin() + static_cast<ptrdiff_t>(cut));
    const std::vector<uint32_t> tail = Tokens(40, cut + 9);
    p.insert(p.end(), tail.begin(), tail.end());
    const std::vector<BlockHash> hashes = PromptHashes(layout, p);
    EXPECT_EQ(HybridHitTokens(index, "w", "GPU", layout, hashes, p.size()), w.Truth(p))
        << "cut " << cut;
  }
  // Nothing is held by a worker the index never heard of.
  const std::vector<BlockHash> hashes = PromptHashes(layout, first);
  EXPECT_EQ(HybridHitTokens(index, "nobody", "", layout, hashes, first.size()), 0u);
}

// The nodes of a cluster each hold part of a prompt's blocks: a worker pulling from the cluster
// gets their union, which no node alone would score.
TEST(ScoringTest, NodesAreScoredTogetherAsTheClusterAWorkerPullsFrom) {
  const CacheLayout layout{{{engine::AttentionSpec::Kind::kFull, 16}}, 16, "salt"};
  const std::vector<uint32_t> prompt = Tokens(16 * 8 + 1, 5);
  const std::vector<BlockHash> hashes = PromptHashes(layout, prompt);
  ASSERT_EQ(hashes.size(), 8u);
  events::KvIndex index;
  events::BlockStored even, odd;
  even.medium = odd.medium = "CPU";
  even.group_idx = odd.group_idx = 0;
  for (size_t i = 0; i < hashes.size(); ++i) {
    (i % 2 == 0 ? even : odd).block_hashes.push_back(events::ExternalHashOf(hashes[i]));
  }
  index.Apply("node-1", events::Delivery{0, {1.0, {even}, std::nullopt}, false});
  index.Apply("node-2", events::Delivery{0, {1.0, {odd}, std::nullopt}, false});
  const std::vector<std::string> both = {"node-1", "node-2"};
  EXPECT_EQ(HybridHitTokens(index, both, "CPU", layout, hashes, prompt.size()), 128u);
  EXPECT_EQ(HybridHitTokens(index, "node-1", "CPU", layout, hashes, prompt.size()), 16u);
  EXPECT_EQ(HybridHitTokens(index, "node-2", "CPU", layout, hashes, prompt.size()), 0u);
  // Another medium, or another salt (another model's hashes), holds nothing.
  EXPECT_EQ(HybridHitTokens(index, both, "SSD", layout, hashes, prompt.size()), 0u);
  CacheLayout other = layout;
  other.cache_salt = "pepper";
  EXPECT_EQ(HybridHitTokens(index, both, "CPU", other, PromptHashes(other, prompt), prompt.size()),
            0u);
}

// The index changes while a router scores (events arrive on their own threads): a block held
// when the search first asks and gone when it asks again must not break the search (it threw
// bad_optional_access, which the router answered with a 500, 1 request in 4,000 of a trace).
TEST(ScoringTest, ScoringWhileEventsChangeTheIndexGivesAHitItCouldHaveSeen) {
  const CacheLayout layout{{{engine::AttentionSpec::Kind::kFull, 16},
                            {engine::AttentionSpec::Kind::kSlidingWindow, 16, 32}},
                           16,
                           "salt"};
  const std::vector<uint32_t> prompt = Tokens(16 * 64 + 1, 9);
  const std::vector<BlockHash> hashes = PromptHashes(layout, prompt);
  events::KvIndex index;
  std::vector<events::KvEvent> all;
  for (int64_t g = 0; g < 2; ++g) {
    events::BlockStored stored;
    stored.medium = "GPU";
    stored.group_idx = g;
    for (const BlockHash& h : hashes) stored.block_hashes.push_back(events::ExternalHashOf(h));
    all.push_back(stored);
  }
  std::atomic<bool> stop{false};
  std::thread churn([&] {
    // Every block stored, then the last few of the window's group removed, over and over.
    for (int64_t seq = 0; !stop.load(); ++seq) {
      if (seq % 2 == 0) {
        index.Apply("w", events::Delivery{seq, {1.0, all, std::nullopt}, false});
      } else {
        events::BlockRemoved removed;
        removed.medium = "GPU";
        removed.group_idx = 1;
        for (size_t i = hashes.size() - 8; i < hashes.size(); ++i) {
          removed.block_hashes.push_back(events::ExternalHashOf(hashes[i]));
        }
        index.Apply("w", events::Delivery{seq, {1.0, {removed}, std::nullopt}, false});
      }
    }
  });
  // The churn stops however the loop ends (a failed assertion, an exception).
  struct Joiner {
    std::atomic<bool>& stop;
    std::thread& thread;
    ~Joiner() {
      stop = true;
      thread.join();
    }
  } joiner{stop, churn};
  // 300 searches: without the fix the first few threw (1 ms); under ASan each takes about 8 ms.
  for (int i = 0; i < 300; ++i) {
    size_t hit = 0;
    ASSERT_NO_THROW(hit = HybridHitTokens(index, "w", "GPU", layout, hashes, prompt.size()));
    ASSERT_EQ(hit % 16, 0u) << hit;
    ASSERT_LE(hit, 16u * 64);
  }
}

}  // namespace
}  // namespace kvstash::router
