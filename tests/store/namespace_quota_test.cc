// Namespace quotas in the block manager: a namespace at its ceiling makes room among its own
// blocks (its least recently used idle ones) and never another namespace's, is refused when none
// of its blocks can go, and the others compete for the tier as before. Per-namespace counts stay
// exact through stores, aborts, evictions, removals, resets and restores.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <random>

#include "kvstash/store/block_manager.h"
#include "test_util.h"

namespace kvstash::store {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using testing::MakeManager;
using testing::NsKey;
using testing::NsKeys;
using testing::PrepareLoad;
using testing::PrepareStore;
using testing::StoreAndCommit;

constexpr NamespaceId kA = 11;
constexpr NamespaceId kB = 22;
constexpr NamespaceId kC = 33;

NamespaceUsage Usage(NamespaceId id, size_t blocks, std::optional<size_t> quota = std::nullopt) {
  return NamespaceUsage{id, blocks, quota};
}

class BlockManagerQuotaTest : public ::testing::TestWithParam<EvictionPolicy> {
 protected:
  std::unique_ptr<BlockManager> Make(size_t capacity, NamespaceQuotas quotas) {
    return MakeManager({.capacity = capacity, .policy = GetParam(), .quotas = std::move(quotas)});
  }
};

TEST(BlockManagerQuotaOptionsTest, RejectsQuotasOutsideTheTier) {
  BlockManagerOptions options;
  options.capacity_blocks = 4;
  options.quotas.blocks[kA] = 0;
  auto zero = BlockManager::Create(options);
  ASSERT_FALSE(zero.ok());
  EXPECT_EQ(zero.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(zero.status().message()), HasSubstr("namespace 11"));
  options.quotas.blocks[kA] = 5;
  EXPECT_EQ(BlockManager::Create(options).status().code(), StatusCode::kInvalidArgument);
  options.quotas.blocks[kA] = 4;
  EXPECT_TRUE(BlockManager::Create(options).ok());
  options.quotas.default_blocks = 0;
  EXPECT_EQ(BlockManager::Create(options).status().code(), StatusCode::kInvalidArgument);
  options.quotas.default_blocks = 9;
  EXPECT_EQ(BlockManager::Create(options).status().code(), StatusCode::kInvalidArgument);
}

TEST_P(BlockManagerQuotaTest, NamespaceAtQuotaEvictsItsOwnOldestNeverAnothers) {
  auto m = Make(8, {.blocks = {{kA, 3}}});
  StoreAndCommit(*m, NsKeys(kB, {1, 2}));  // the tier's oldest blocks
  StoreAndCommit(*m, NsKeys(kA, {1, 2, 3}));
  // The tier has 3 free slots, but A is at its quota: its own oldest block goes.
  StorePlan plan = PrepareStore(*m, NsKeys(kA, {4}));
  EXPECT_THAT(plan.evicted, ElementsAre(NsKey(kA, 1)));
  EXPECT_THAT(plan.evicted_slots, ElementsAre(2));
  EXPECT_THAT(plan.slots, ElementsAre(5));  // fresh slots first, as always
  m->CompleteStore(NsKeys(kA, {4}), true);
  // A touched block is recent again within its namespace too.
  m->Touch(NsKeys(kA, {2}));
  EXPECT_THAT(PrepareStore(*m, NsKeys(kA, {5})).evicted, ElementsAre(NsKey(kA, 3)));
  m->CompleteStore(NsKeys(kA, {5}), true);
  for (uint64_t k : {1, 2}) EXPECT_EQ(m->Lookup(NsKey(kB, k)), LookupResult::kHit);
  EXPECT_EQ(m->Lookup(NsKey(kA, 1)), LookupResult::kMiss);
  EXPECT_THAT(m->NamespaceUsages(), ElementsAre(Usage(kA, 3, 3), Usage(kB, 2)));
  EXPECT_EQ(m->resident_blocks(), 5u);
}

TEST_P(BlockManagerQuotaTest, FullTierStillEvictsOwnBlocksOfANamespaceAtQuota) {
  auto m = Make(4, {.blocks = {{kA, 2}}});
  StoreAndCommit(*m, NsKeys(kB, {1}));
  StoreAndCommit(*m, NsKeys(kA, {1, 2}));
  StoreAndCommit(*m, NsKeys(kB, {2}));
  // B's block 1 is the tier's least recent, yet A at its quota takes its own oldest.
  EXPECT_THAT(PrepareStore(*m, NsKeys(kA, {3})).evicted, ElementsAre(NsKey(kA, 1)));
  // B has no quota: it evicts by the policy, from any namespace.
  StorePlan plan = PrepareStore(*m, NsKeys(kB, {3}));
  ASSERT_EQ(plan.evicted.size(), 1u);
  EXPECT_NE(plan.evicted[0], NsKey(kA, 3));  // being written
}

TEST_P(BlockManagerQuotaTest, QuotaReservesNothing) {
  auto m = Make(4, {.blocks = {{kA, 2}}});
  StoreAndCommit(*m, NsKeys(kB, {1, 2, 3, 4}));  // B may fill the whole tier
  EXPECT_THAT(m->NamespaceUsages(), ElementsAre(Usage(kA, 0, 2), Usage(kB, 4)));
  // A under its quota competes like anyone: the tier's least recent block goes.
  EXPECT_THAT(PrepareStore(*m, NsKeys(kA, {1})).evicted, ElementsAre(NsKey(kB, 1)));
}

TEST_P(BlockManagerQuotaTest, RefusedWhenNoneOfItsBlocksIsIdleAndNothingChanges) {
  auto m = Make(8, {.blocks = {{kA, 2}}});
  StoreAndCommit(*m, NsKeys(kA, {1}));
  PrepareLoad(*m, NsKeys(kA, {1}));   // pinned
  PrepareStore(*m, NsKeys(kA, {2}));  // being written: counts against the quota
  StoreAndCommit(*m, NsKeys(kB, {1}));
  m->TakeEvents();
  const BlockManagerState before = m->DebugState();
  StorePlan plan;
  plan.keys_to_store = NsKeys(kA, {42});  // stale content must not survive
  Status refused = m->PrepareStore(NsKeys(kA, {3}), &plan);
  EXPECT_EQ(refused.code(), StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(refused.message()), HasSubstr("namespace 11 is at its quota"));
  EXPECT_EQ(plan.quota_namespace, kA);
  EXPECT_EQ(plan.quota_refused, 1u);
  EXPECT_THAT(plan.keys_to_store, IsEmpty());
  EXPECT_THAT(plan.evicted, IsEmpty());
  const BlockManagerState after = m->DebugState();
  EXPECT_EQ(after.lru, before.lru);
  EXPECT_EQ(after.t1, before.t1);
  EXPECT_EQ(after.t2, before.t2);
  EXPECT_EQ(after.free_slots, before.free_slots);
  EXPECT_THAT(m->TakeEvents(), IsEmpty());
  // B is not affected.
  EXPECT_THAT(PrepareStore(*m, NsKeys(kB, {2})).evicted, IsEmpty());
  // Once A's store completes its block is idle, and goes for the next one.
  m->CompleteStore(NsKeys(kA, {2}), true);
  plan = PrepareStore(*m, NsKeys(kA, {3}));
  EXPECT_THAT(plan.evicted, ElementsAre(NsKey(kA, 2)));
  EXPECT_EQ(plan.quota_refused, 0u);
}

TEST_P(BlockManagerQuotaTest, KeysOfTheCallAreProtectedAndACallBeyondTheQuotaIsRefused) {
  auto m = Make(8, {.blocks = {{kA, 2}}});
  StoreAndCommit(*m, NsKeys(kA, {1, 2}));
  // 1 is a key of the call: 2 goes although 1 is older.
  StorePlan plan = PrepareStore(*m, NsKeys(kA, {1, 3}));
  EXPECT_THAT(plan.evicted, ElementsAre(NsKey(kA, 2)));
  m->CompleteStore(NsKeys(kA, {3}), true);
  // Both of A's blocks are keys of the call: nothing of A may go.
  StorePlan refused;
  EXPECT_EQ(m->PrepareStore(NsKeys(kA, {1, 3, 4}), &refused).code(),
            StatusCode::kResourceExhausted);
  EXPECT_EQ(refused.quota_refused, 1u);
  // Three new blocks can never fit a quota of two, however many are idle.
  Status too_many = m->PrepareStore(NsKeys(kA, {5, 6, 7}), &refused);
  EXPECT_EQ(too_many.code(), StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(too_many.message()), HasSubstr("3 new blocks of namespace 11 exceed"));
  EXPECT_EQ(refused.quota_refused, 3u);
  EXPECT_THAT(m->NamespaceUsages(), ElementsAre(Usage(kA, 2, 2)));
}

TEST_P(BlockManagerQuotaTest, DefaultQuotaBoundsEveryUnnamedNamespace) {
  auto m = Make(16, {.blocks = {{kA, 4}}, .default_blocks = 2});
  StoreAndCommit(*m, NsKeys(kA, {1, 2, 3, 4}));
  StoreAndCommit(*m, NsKeys(kB, {1, 2}));
  StoreAndCommit(*m, NsKeys(kC, {1}));
  EXPECT_THAT(PrepareStore(*m, NsKeys(kB, {3})).evicted, ElementsAre(NsKey(kB, 1)));
  EXPECT_THAT(PrepareStore(*m, NsKeys(kC, {2})).evicted, IsEmpty());
  EXPECT_THAT(PrepareStore(*m, NsKeys(kA, {5})).evicted, ElementsAre(NsKey(kA, 1)));
  EXPECT_THAT(m->NamespaceUsages(), ElementsAre(Usage(kA, 4, 4), Usage(kB, 2, 2), Usage(kC, 2, 2)));
}

TEST_P(BlockManagerQuotaTest, CountsStayExactThroughAbortsRemovalsResetAndRestore) {
  auto m = Make(8, {.blocks = {{kA, 3}}});
  StoreAndCommit(*m, NsKeys(kA, {1, 2}));
  PrepareStore(*m, NsKeys(kB, {1, 2}));
  EXPECT_THAT(m->NamespaceUsages(), ElementsAre(Usage(kA, 2, 3), Usage(kB, 2)));
  m->CompleteStore(NsKeys(kB, {1}), false);  // aborted
  EXPECT_EQ(m->Remove(NsKeys(kA, {1})), 1u);
  EXPECT_THAT(m->NamespaceUsages(), ElementsAre(Usage(kA, 1, 3), Usage(kB, 1)));
  m->CompleteStore(NsKeys(kB, {2}), false);
  // A namespace without a quota that holds nothing is forgotten; a named one stays.
  EXPECT_THAT(m->NamespaceUsages(), ElementsAre(Usage(kA, 1, 3)));
  m->Reset();
  EXPECT_THAT(m->NamespaceUsages(), ElementsAre(Usage(kA, 0, 3)));
  // A restore may leave A past its quota (a lower quota than before a restart); its next store
  // brings it back down, oldest first.
  std::vector<BlockInfo> blocks;
  for (uint32_t i = 0; i < 5; ++i) blocks.push_back({NsKey(kA, i), i, 0});
  blocks.push_back({NsKey(kB, 9), 5, 0});
  ASSERT_TRUE(m->Restore(blocks).ok());
  EXPECT_THAT(m->NamespaceUsages(), ElementsAre(Usage(kA, 5, 3), Usage(kB, 1)));
  EXPECT_THAT(PrepareStore(*m, NsKeys(kA, {7})).evicted,
              ElementsAre(NsKey(kA, 0), NsKey(kA, 1), NsKey(kA, 2)));
  EXPECT_THAT(m->NamespaceUsages(), ElementsAre(Usage(kA, 3, 3), Usage(kB, 1)));
}

// Counting namespaces without quotas changes no decision: the same operations give the same
// plans and state as on a manager that does not count.
TEST_P(BlockManagerQuotaTest, CountingWithoutQuotasChangesNothing) {
  auto plain = MakeManager({.capacity = 6, .policy = GetParam()});
  auto counting = MakeManager({.capacity = 6, .policy = GetParam(), .count_namespaces = true});
  EXPECT_THAT(plain->NamespaceUsages(), IsEmpty());
  std::mt19937_64 rng(7);
  std::map<NamespaceId, size_t> held;
  for (int step = 0; step < 400; ++step) {
    const NamespaceId ns = 1 + rng() % 3;
    const std::vector<BlockKey> keys = {NsKey(ns, rng() % 8), NsKey(ns, rng() % 8)};
    switch (rng() % 4) {
      case 0:
      case 1: {
        StorePlan a, b;
        const Status sa = plain->PrepareStore(keys, &a);
        const Status sb = counting->PrepareStore(keys, &b);
        ASSERT_EQ(sa.code(), sb.code());
        EXPECT_EQ(a.keys_to_store, b.keys_to_store);
        EXPECT_EQ(a.evicted, b.evicted);
        EXPECT_EQ(a.slots, b.slots);
        const bool commit = rng() % 4 != 0;
        plain->CompleteStore(a.keys_to_store, commit);
        counting->CompleteStore(b.keys_to_store, commit);
        break;
      }
      case 2:
        plain->Touch(keys);
        counting->Touch(keys);
        break;
      case 3:
        EXPECT_EQ(plain->Remove(keys), counting->Remove(keys));
        break;
    }
    const BlockManagerState a = plain->DebugState();
    const BlockManagerState b = counting->DebugState();
    ASSERT_EQ(a.lru, b.lru) << step;
    ASSERT_EQ(a.t1, b.t1) << step;
    ASSERT_EQ(a.t2, b.t2) << step;
    ASSERT_EQ(a.b1, b.b1) << step;
    ASSERT_EQ(a.b2, b.b2) << step;
    held.clear();
    for (const auto* list : {&b.lru, &b.t1, &b.t2}) {
      for (const BlockInfo& block : *list) ++held[block.key.namespace_id];
    }
    std::vector<NamespaceUsage> expected;
    for (const auto& [held_ns, blocks] : held) expected.push_back(Usage(held_ns, blocks));
    ASSERT_EQ(counting->NamespaceUsages(), expected) << step;
  }
}

// Random stores, commits, aborts, pins, touches and removals over three namespaces (two with
// quotas), checked against a naive model of the rules: a namespace never holds more than its
// quota; a store over the quota evicts exactly the namespace's least recently used idle blocks
// that are not keys of the call, and is refused (naming the namespace) when there are too few;
// under LRU the other victims are the tier's least recent idle blocks; the counts are exact.
TEST_P(BlockManagerQuotaTest, RandomOperationsFollowTheQuotaRules) {
  constexpr size_t kCapacity = 10;
  const std::map<NamespaceId, size_t> quotas = {{kA, 3}, {kB, 5}};
  auto m = Make(kCapacity, {.blocks = quotas});
  struct Block {
    int ref = 0;  // -1 being written, else pins
  };
  std::map<BlockKey, Block> blocks;
  std::vector<BlockKey> order;  // every resident key, least recent first
  auto to_back = [&](const BlockKey& key) {
    order.erase(std::find(order.begin(), order.end(), key));
    order.push_back(key);
  };
  auto held = [&](NamespaceId ns) {
    return static_cast<size_t>(std::count_if(blocks.begin(), blocks.end(), [ns](const auto& kv) {
      return kv.first.namespace_id == ns;
    }));
  };
  std::mt19937_64 rng(GetParam() == EvictionPolicy::kLru ? 1 : 2);
  size_t refusals = 0, own_evictions = 0;
  for (int step = 0; step < 4000; ++step) {
    const NamespaceId ns = std::vector<NamespaceId>{kA, kB, kC}[rng() % 3];
    std::vector<BlockKey> keys;
    const size_t n = 1 + rng() % 3;
    for (size_t i = 0; i < n; ++i) keys.push_back(NsKey(ns, rng() % 12));
    const auto op = rng() % 8;
    SCOPED_TRACE(::testing::Message() << "step " << step << " op " << op << " ns " << ns);
    if (op <= 2) {
      // Store. The model's expectation first.
      std::vector<BlockKey> fresh;
      for (const BlockKey& k : keys) {
        if (!blocks.count(k) && std::find(fresh.begin(), fresh.end(), k) == fresh.end()) {
          fresh.push_back(k);
        }
      }
      auto in_call = [&](const BlockKey& k) {
        return std::find(keys.begin(), keys.end(), k) != keys.end();
      };
      std::vector<BlockKey> own;
      bool quota_refused = false;
      if (auto q = quotas.find(ns); q != quotas.end() && !fresh.empty()) {
        const size_t h = held(ns);
        if (h + fresh.size() > q->second) {
          const size_t need = h + fresh.size() - q->second;
          for (const BlockKey& k : order) {
            if (own.size() == need) break;
            if (k.namespace_id == ns && blocks[k].ref == 0 && !in_call(k)) own.push_back(k);
          }
          quota_refused = fresh.size() > q->second || own.size() < need;
        }
      }
      StorePlan plan;
      const Status s = m->PrepareStore(keys, &plan);
      if (quota_refused) {
        ASSERT_EQ(s.code(), StatusCode::kResourceExhausted) << s.ToString();
        EXPECT_EQ(plan.quota_namespace, ns);
        EXPECT_EQ(plan.quota_refused, fresh.size());
        ++refusals;
        continue;
      }
      const size_t free_slots = kCapacity - blocks.size() + own.size();
      std::vector<BlockKey> global;  // what LRU must evict besides `own`
      for (const BlockKey& k : order) {
        if (global.size() + free_slots >= fresh.size()) break;
        if (blocks[k].ref == 0 && !in_call(k) &&
            std::find(own.begin(), own.end(), k) == own.end()) {
          global.push_back(k);
        }
      }
      if (global.size() + free_slots < fresh.size()) {
        ASSERT_EQ(s.code(), StatusCode::kResourceExhausted) << s.ToString();
        EXPECT_EQ(plan.quota_refused, 0u);
        continue;
      }
      ASSERT_TRUE(s.ok()) << s.ToString();
      ASSERT_EQ(plan.keys_to_store, fresh);
      ASSERT_GE(plan.evicted.size(), own.size());
      // The namespace's own victims come last, in its recency order.
      EXPECT_TRUE(std::equal(own.begin(), own.end(), plan.evicted.end() - own.size()));
      own_evictions += own.size();
      if (GetParam() == EvictionPolicy::kLru) {
        EXPECT_TRUE(std::equal(global.begin(), global.end(), plan.evicted.begin(),
                               plan.evicted.end() - own.size()));
      }
      for (const BlockKey& k : plan.evicted) {
        ASSERT_EQ(blocks.count(k), 1u);
        EXPECT_EQ(blocks[k].ref, 0);
        EXPECT_FALSE(in_call(k));
        blocks.erase(k);
        order.erase(std::find(order.begin(), order.end(), k));
      }
      for (const BlockKey& k : fresh) {
        blocks[k].ref = -1;
        order.push_back(k);
      }
      // Most stores complete at once; some stay in flight for a while.
      if (rng() % 3 != 0) {
        const bool ok = rng() % 5 != 0;
        m->CompleteStore(fresh, ok);
        for (const BlockKey& k : fresh) {
          if (ok) {
            blocks[k].ref = 0;
          } else {
            blocks.erase(k);
            order.erase(std::find(order.begin(), order.end(), k));
          }
        }
      }
    } else if (op == 3) {
      // Complete every store in flight in this namespace.
      std::vector<BlockKey> writing;
      for (auto& [k, b] : blocks) {
        if (k.namespace_id == ns && b.ref < 0) {
          writing.push_back(k);
          b.ref = 0;
        }
      }
      m->CompleteStore(writing, true);
    } else if (op == 4) {
      // Pin or unpin one readable key.
      const BlockKey k = keys[0];
      auto it = blocks.find(k);
      if (it == blocks.end() || it->second.ref < 0) continue;
      if (it->second.ref > 0 && rng() % 2 == 0) {
        ASSERT_TRUE(m->CompleteLoad(std::vector<BlockKey>{k}).ok());
        --it->second.ref;
      } else if (it->second.ref < 2) {
        PrepareLoad(*m, {k});
        ++it->second.ref;
      }
    } else if (op <= 6) {
      m->Touch(keys);
      for (size_t i = keys.size(); i-- > 0;) {
        if (blocks.count(keys[i])) to_back(keys[i]);
      }
    } else {
      std::vector<BlockKey> removed;
      m->Remove(keys, &removed);
      for (const BlockKey& k : removed) {
        ASSERT_EQ(blocks[k].ref, 0);
        blocks.erase(k);
        order.erase(std::find(order.begin(), order.end(), k));
      }
    }
    for (const auto& [q_ns, q] : quotas) ASSERT_LE(held(q_ns), q);
    std::vector<NamespaceUsage> expected;
    for (NamespaceId id : {kA, kB, kC}) {
      const size_t h = held(id);
      auto q = quotas.find(id);
      if (h == 0 && q == quotas.end()) continue;
      expected.push_back(Usage(id, h, q == quotas.end() ? std::nullopt : std::optional(q->second)));
    }
    ASSERT_EQ(m->NamespaceUsages(), expected);
    ASSERT_EQ(m->resident_blocks(), blocks.size());
  }
  // The run must have exercised both rules.
  EXPECT_GT(refusals, 20u);
  EXPECT_GT(own_evictions, 100u);
}

INSTANTIATE_TEST_SUITE_P(Policies, BlockManagerQuotaTest,
                         ::testing::Values(EvictionPolicy::kLru, EvictionPolicy::kArc),
                         [](const auto& param_info) {
                           return std::string(EvictionPolicyName(param_info.param));
                         });

}  // namespace
}  // namespace kvstash::store
