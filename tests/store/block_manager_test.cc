// Behaviour of the block manager beyond the vectors of docs/semantics.md §12: errors change
// nothing, options are validated, groups and namespaces never mix, and eviction skips pinned blocks
// cheaply.
#include "kvstash/store/block_manager.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "test_util.h"

namespace kvstash::store {
namespace {

using testing::Block;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using testing::Key;
using testing::Keys;
using testing::MakeManager;
using testing::PrepareLoad;
using testing::PrepareStore;
using testing::Removed;
using testing::StoreAndCommit;

class BlockManagerTest : public ::testing::TestWithParam<EvictionPolicy> {
 protected:
  std::unique_ptr<BlockManager> Make(size_t capacity) {
    return MakeManager({.capacity = capacity, .policy = GetParam()});
  }
};

// Everything except events, which tests compare separately.
std::string StateString(const BlockManagerState& s) {
  std::string out;
  auto blocks = [&](const char* name, const std::vector<BlockInfo>& v) {
    out += name;
    for (const auto& b : v) {
      out +=
          " " + b.key.ToString() + ":" + std::to_string(b.slot) + ":" + std::to_string(b.ref_count);
    }
    out += "\n";
  };
  auto keys = [&](const char* name, const std::vector<BlockKey>& v) {
    out += name;
    for (const auto& k : v) out += " " + k.ToString();
    out += "\n";
  };
  blocks("lru", s.lru);
  blocks("t1", s.t1);
  blocks("t2", s.t2);
  keys("b1", s.b1);
  keys("b2", s.b2);
  out += "p " + std::to_string(s.arc_target) + " fresh " + std::to_string(s.fresh_slots_used) +
         " free";
  for (SlotId id : s.free_slots) out += " " + std::to_string(id);
  return out;
}

TEST(BlockManagerOptionsTest, RejectsBadOptions) {
  BlockManagerOptions options;
  options.capacity_blocks = 0;
  auto zero = BlockManager::Create(options);
  ASSERT_FALSE(zero.ok());
  EXPECT_EQ(zero.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(zero.status().message()), HasSubstr("capacity of 0 blocks"));

  options.capacity_blocks = (size_t{1} << 31) + 1;
  EXPECT_EQ(BlockManager::Create(options).status().code(), StatusCode::kInvalidArgument);

  options.capacity_blocks = 4;
  options.store_threshold = 2;
  options.max_tracker_size = 0;
  EXPECT_EQ(BlockManager::Create(options).status().code(), StatusCode::kInvalidArgument);

  options.max_tracker_size = 16;
  options.store_threshold = 0;
  options.adaptive_admission = true;
  auto adaptive = BlockManager::Create(options);
  ASSERT_FALSE(adaptive.ok());
  EXPECT_THAT(std::string(adaptive.status().message()), HasSubstr("store threshold of 2"));
}

TEST(BlockManagerOptionsTest, ParsesPolicyNames) {
  EXPECT_EQ(*ParseEvictionPolicy("lru"), EvictionPolicy::kLru);
  EXPECT_EQ(*ParseEvictionPolicy("arc"), EvictionPolicy::kArc);
  EXPECT_EQ(*ParseEvictionPolicy("aflru"), EvictionPolicy::kAfLru);
  EXPECT_EQ(EvictionPolicyName(EvictionPolicy::kAfLru), "aflru");
  auto bad = ParseEvictionPolicy("fifo");
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr("'fifo'"));
  EXPECT_EQ(EvictionPolicyName(EvictionPolicy::kArc), "arc");
}

TEST_P(BlockManagerTest, LoadOfMissingOrUnreadyKeyFailsAndChangesNothing) {
  auto m = Make(4);
  StoreAndCommit(*m, Keys({1, 2}));
  PrepareStore(*m, Keys({3}));
  const std::string before = StateString(m->DebugState());
  std::vector<SlotId> slots = {99};
  Status missing = m->PrepareLoad(Keys({1, 9}), &slots);
  EXPECT_EQ(missing.code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(missing.message()), HasSubstr("key 0x9 (2 of 2): it is not stored"));
  EXPECT_THAT(slots, IsEmpty());
  Status writing = m->PrepareLoad(Keys({2, 3}), &slots);
  EXPECT_EQ(writing.code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(writing.message()), HasSubstr("still being written"));
  EXPECT_EQ(StateString(m->DebugState()), before);  // key 1 and 2 were not pinned
}

TEST_P(BlockManagerTest, UnloadOfUnpinnedKeyFailsAndChangesNothing) {
  auto m = Make(4);
  StoreAndCommit(*m, Keys({1, 2}));
  PrepareLoad(*m, Keys({1}));
  const std::string before = StateString(m->DebugState());
  Status unpinned = m->CompleteLoad(Keys({1, 2}));
  EXPECT_EQ(unpinned.code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(unpinned.message()), HasSubstr("not pinned"));
  // Unloading 1 twice needs two pins.
  EXPECT_EQ(m->CompleteLoad(Keys({1, 1})).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(m->CompleteLoad(Keys({7})).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(StateString(m->DebugState()), before);
  EXPECT_TRUE(m->CompleteLoad(Keys({1})).ok());
}

TEST_P(BlockManagerTest, RepeatedKeysPinAndUnpinPerOccurrence) {
  auto m = Make(1);
  StoreAndCommit(*m, Keys({1}));
  EXPECT_THAT(PrepareLoad(*m, Keys({1, 1})), ElementsAre(0, 0));
  ASSERT_TRUE(m->CompleteLoad(Keys({1})).ok());
  // Still pinned once: a store that needs its slot is refused.
  StorePlan plan;
  EXPECT_EQ(m->PrepareStore(Keys({3}), &plan).code(), StatusCode::kResourceExhausted);
  ASSERT_TRUE(m->CompleteLoad(Keys({1})).ok());
  EXPECT_TRUE(m->PrepareStore(Keys({3}), &plan).ok());
  EXPECT_EQ(plan.evicted, Keys({1}));
}

TEST_P(BlockManagerTest, RepeatedKeyInOneStoreTakesOneSlot) {
  auto m = Make(4);
  StorePlan plan = PrepareStore(*m, Keys({1, 2, 1, 2, 3}));
  EXPECT_EQ(plan.keys_to_store, Keys({1, 2, 3}));
  EXPECT_THAT(plan.slots, ElementsAre(0, 1, 2));
  EXPECT_EQ(m->resident_blocks(), 3u);
}

TEST_P(BlockManagerTest, RefusedStoreChangesNothing) {
  auto m = Make(3);
  StoreAndCommit(*m, Keys({1, 2, 3}));
  PrepareLoad(*m, Keys({1}));
  m->Touch(Keys({2}));
  const std::string before = StateString(m->DebugState());
  StorePlan plan;
  plan.keys_to_store = Keys({42});  // stale content must not survive
  Status refused = m->PrepareStore(Keys({2, 4, 5, 6}), &plan);
  EXPECT_EQ(refused.code(), StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(refused.message()), HasSubstr("no room for 3 new blocks"));
  EXPECT_THAT(plan.keys_to_store, IsEmpty());
  EXPECT_EQ(StateString(m->DebugState()), before);
  EXPECT_THAT(m->TakeEvents(), ElementsAre(testing::Stored({1, 2, 3})));
  // One new block fits by evicting 3 (1 pinned, 2 protected).
  EXPECT_EQ(PrepareStore(*m, Keys({2, 4})).evicted, Keys({3}));
}

TEST_P(BlockManagerTest, StoreOfPresentKeysNeverEvicts) {
  auto m = Make(2);
  StoreAndCommit(*m, Keys({1, 2}));
  StorePlan plan = PrepareStore(*m, Keys({2, 1}));
  EXPECT_THAT(plan.keys_to_store, IsEmpty());
  EXPECT_THAT(plan.evicted, IsEmpty());
}

TEST_P(BlockManagerTest, GroupsAndNamespacesAreDistinctKeys) {
  auto m = Make(8);
  BlockKey a = Key(5, 0);
  BlockKey b = Key(5, 1);
  BlockKey c = Key(5, 0);
  c.namespace_id = 3;
  StoreAndCommit(*m, {a});
  EXPECT_EQ(m->Lookup(a), LookupResult::kHit);
  EXPECT_EQ(m->Lookup(b), LookupResult::kMiss);
  EXPECT_EQ(m->Lookup(c), LookupResult::kMiss);
  StoreAndCommit(*m, {b, c});
  EXPECT_EQ(m->resident_blocks(), 3u);
}

TEST_P(BlockManagerTest, CommitAndAbortIgnoreReadyAndAbsentKeys) {
  auto m = Make(4);
  StoreAndCommit(*m, Keys({1}));
  m->TakeEvents();
  PrepareStore(*m, Keys({2}));
  m->CompleteStore(Keys({1, 2, 9}), true);
  EXPECT_THAT(m->TakeEvents(), ElementsAre(testing::Stored({2})));
  m->CompleteStore(Keys({1, 2, 9}), false);  // all ready or absent: nothing dropped
  EXPECT_EQ(m->resident_blocks(), 2u);
  m->CompleteStore(Keys({1, 2}), true);  // already ready: no second event
  EXPECT_THAT(m->TakeEvents(), IsEmpty());
}

TEST_P(BlockManagerTest, EventsOffRecordsNothing) {
  auto m = MakeManager({.capacity = 1, .policy = GetParam(), .events = false});
  StoreAndCommit(*m, Keys({1}));
  StoreAndCommit(*m, Keys({2}));
  EXPECT_THAT(m->TakeEvents(), IsEmpty());
}

// Undrained events past the bound are all dropped for one lost mark; what follows it is kept,
// and a drain starts the count again.
TEST_P(BlockManagerTest, UndrainedEventsPastTheirBoundBecomeOneLostMark) {
  auto m = MakeManager({.capacity = 4, .policy = GetParam(), .max_pending_event_keys = 3});
  StoreAndCommit(*m, Keys({1, 2}));
  StoreAndCommit(*m, Keys({3}));
  EXPECT_THAT(m->TakeEvents(), ElementsAre(testing::Stored({1, 2}), testing::Stored({3})));
  StoreAndCommit(*m, Keys({4}));
  StoreAndCommit(*m, Keys({5, 6}));  // evicts 1, 2: 2 + 1 + 2 keys > 3
  StoreAndCommit(*m, Keys({7}));     // evicts 3
  EXPECT_THAT(m->TakeEvents(),
              ElementsAre(testing::Lost(), testing::Removed({3}), testing::Stored({7})));
  EXPECT_THAT(m->TakeEvents(), IsEmpty());
}

// A long run of pinned blocks at the old end is parked once and never rescanned; after they
// are unpinned they are evicted in their original recency order.
TEST_P(BlockManagerTest, PinnedBlocksAtTheOldEndKeepTheirOrder) {
  auto m = Make(8);
  StoreAndCommit(*m, Keys({1, 2, 3, 4, 5, 6, 7, 8}));
  PrepareLoad(*m, Keys({1, 2, 3, 4}));
  EXPECT_EQ(PrepareStore(*m, Keys({9, 10})).evicted, Keys({5, 6}));
  m->CompleteStore(Keys({9, 10}), true);
  ASSERT_TRUE(m->CompleteLoad(Keys({3, 1})).ok());
  EXPECT_EQ(PrepareStore(*m, Keys({11})).evicted, Keys({1}));
  ASSERT_TRUE(m->CompleteLoad(Keys({4, 2})).ok());
  EXPECT_EQ(PrepareStore(*m, Keys({12, 13, 14})).evicted, Keys({2, 3, 4}));
  EXPECT_EQ(PrepareStore(*m, Keys({15})).evicted, Keys({7}));
}

TEST_P(BlockManagerTest, TouchOfUnpinnedParkedBlockMakesItMostRecent) {
  auto m = Make(4);
  StoreAndCommit(*m, Keys({1, 2, 3, 4}));
  PrepareLoad(*m, Keys({1}));
  EXPECT_EQ(PrepareStore(*m, Keys({5})).evicted, Keys({2}));  // parks 1
  m->CompleteStore(Keys({5}), true);
  ASSERT_TRUE(m->CompleteLoad(Keys({1})).ok());
  m->Touch(Keys({1}));
  if (GetParam() == EvictionPolicy::kLru) {
    EXPECT_THAT(m->DebugState().lru,
                ElementsAre(Block(3, 2), Block(4, 3), Block(5, 1), Block(1, 0)));
  }
  EXPECT_EQ(PrepareStore(*m, Keys({6})).evicted, Keys({3}));
}

TEST_P(BlockManagerTest, ResetDropsPinnedAndInFlightBlocks) {
  auto m = Make(4);
  StoreAndCommit(*m, Keys({1, 2}));
  PrepareLoad(*m, Keys({1}));
  PrepareStore(*m, Keys({3}));
  m->Reset();
  EXPECT_EQ(m->resident_blocks(), 0u);
  EXPECT_EQ(m->Lookup(Key(1)), LookupResult::kMiss);
  EXPECT_EQ(m->Lookup(Key(3)), LookupResult::kMiss);
  // Stale completions after a reset are harmless.
  EXPECT_EQ(m->CompleteLoad(Keys({1})).code(), StatusCode::kFailedPrecondition);
  m->CompleteStore(Keys({3}), true);
  EXPECT_EQ(m->Lookup(Key(3)), LookupResult::kMiss);
  EXPECT_THAT(PrepareStore(*m, Keys({1, 2, 3, 4})).slots, ElementsAre(0, 1, 2, 3));
}

TEST_P(BlockManagerTest, StampRenumberingKeepsOrder) {
  BlockManagerOptions options;
  options.capacity_blocks = 4;
  options.policy = GetParam();
  options.first_recency_stamp = UINT32_MAX - 3;
  auto m = std::move(BlockManager::Create(options)).value();
  StoreAndCommit(*m, Keys({1, 2, 3, 4}));
  PrepareLoad(*m, Keys({1}));
  m->Touch(Keys({3, 2}));  // renumbers on the way
  if (GetParam() == EvictionPolicy::kLru) {
    EXPECT_THAT(m->DebugState().lru,
                ElementsAre(Block(1, 0, 1), Block(4, 3), Block(2, 1), Block(3, 2)));
  }
  EXPECT_EQ(PrepareStore(*m, Keys({5})).evicted, Keys({4}));
}

// The goal is <= 64 bytes per resident block for LRU at a million blocks; at 10^5 the fixed
// overheads are already negligible. ARC adds its ghost directory (two lists of up to capacity
// keys each, as in vLLM).
TEST_P(BlockManagerTest, MetadataIsBoundedPerBlock) {
  constexpr size_t kBlocks = 100000;
  auto m = Make(kBlocks);
  std::vector<BlockKey> keys;
  for (uint64_t i = 0; i < kBlocks; ++i) keys.push_back(Key(i));
  StoreAndCommit(*m, keys);
  const double per_block = static_cast<double>(m->MetadataBytes()) / kBlocks;
  EXPECT_GT(per_block, 40.0);  // at least the entries themselves
  EXPECT_LT(per_block, GetParam() == EvictionPolicy::kLru ? 64.0 : 200.0);
}

TEST_P(BlockManagerTest, RemoveDropsOnlyIdleStoredKeys) {
  auto m = Make(4);
  StoreAndCommit(*m, Keys({1, 2, 3}));
  PrepareLoad(*m, Keys({2}));
  PrepareStore(*m, Keys({4}));
  m->TakeEvents();
  // 1 idle: dropped; 2 pinned, 4 being written, 9 absent: skipped.
  EXPECT_EQ(m->Remove(Keys({1, 2, 4, 9})), 1u);
  EXPECT_THAT(m->TakeEvents(), ElementsAre(Removed({1})));
  EXPECT_EQ(m->Lookup(Key(1)), LookupResult::kMiss);
  EXPECT_EQ(m->Lookup(Key(2)), LookupResult::kHit);
  EXPECT_EQ(m->Lookup(Key(4)), LookupResult::kRetry);
  EXPECT_EQ(m->resident_blocks(), 3u);
  // The freed slot is reused first, and no ghost of key 1 is kept.
  EXPECT_THAT(PrepareStore(*m, Keys({5})).slots, ElementsAre(0));
  const BlockManagerState state = m->DebugState();
  EXPECT_TRUE(state.b1.empty());
  EXPECT_TRUE(state.b2.empty());
}

TEST_P(BlockManagerTest, RestoreRebuildsIndexInGivenOrder) {
  auto m = Make(6);
  const std::vector<BlockInfo> blocks = {Block(7, 4), Block(8, 1), Block(9, 2)};
  ASSERT_TRUE(m->Restore(blocks).ok());
  EXPECT_EQ(m->resident_blocks(), 3u);
  for (uint64_t k : {7, 8, 9}) EXPECT_EQ(m->Lookup(Key(k)), LookupResult::kHit);
  EXPECT_THAT(PrepareLoad(*m, Keys({7, 8, 9})), ElementsAre(4, 1, 2));
  ASSERT_TRUE(m->CompleteLoad(Keys({7, 8, 9})).ok());
  // As always, fresh slots first; then the holes below the highest restored slot, lowest first.
  EXPECT_THAT(PrepareStore(*m, Keys({10, 11, 12})).slots, ElementsAre(5, 0, 3));
  m->CompleteStore(Keys({10, 11, 12}), true);
  // The first restored block is the least recent: it is evicted first.
  EXPECT_THAT(PrepareStore(*m, Keys({13})).evicted, ElementsAre(Key(7)));
}

TEST_P(BlockManagerTest, RestoreRejectsBadInputAndChangesNothing) {
  auto m = Make(4);
  EXPECT_EQ(m->Restore(std::vector<BlockInfo>{Block(1, 4)}).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(m->Restore(std::vector<BlockInfo>{Block(1, 0), Block(2, 0)}).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(m->Restore(std::vector<BlockInfo>{Block(1, 0), Block(1, 1)}).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(m->resident_blocks(), 0u);
  EXPECT_EQ(m->Lookup(Key(1)), LookupResult::kMiss);
  EXPECT_THAT(PrepareStore(*m, Keys({1, 2})).slots, ElementsAre(0, 1));
  EXPECT_EQ(m->Restore(std::vector<BlockInfo>{Block(3, 3)}).code(), StatusCode::kInvalidArgument);
}

// Adaptive admission (docs/semantics.md §2a) over `requests`, each a list of keys looked up and
// then stored, as a node sees them. Returns the manager.
std::unique_ptr<BlockManager> AdaptiveRun(EvictionPolicy policy, size_t capacity,
                                          const std::vector<std::vector<uint64_t>>& requests,
                                          uint64_t* hits) {
  BlockManagerOptions options;
  options.capacity_blocks = capacity;
  options.policy = policy;
  options.store_threshold = 2;
  options.adaptive_admission = true;
  auto manager = BlockManager::Create(options);
  EXPECT_TRUE(manager.ok());
  *hits = 0;
  for (const std::vector<uint64_t>& ids : requests) {
    std::vector<BlockKey> keys;
    for (uint64_t id : ids) keys.push_back(Key(id));
    for (const BlockKey& key : keys) *hits += (*manager)->Lookup(key) == LookupResult::kHit;
    (*manager)->Touch(keys);
    StorePlan plan;
    if ((*manager)->PrepareStore(keys, &plan).ok()) {
      (*manager)->CompleteStore(plan.keys_to_store, true);
    }
  }
  return std::move(*manager);
}

TEST_P(BlockManagerTest, AdaptiveAdmissionFiltersOneOffsThatWouldFlushAHotSet) {
  // A hot set of 64 keys, each request one of them and 8 keys seen once: without the filter
  // the one-offs push the hot keys out of 256 slots; with it they are never stored.
  std::vector<std::vector<uint64_t>> requests;
  uint64_t next = 1000;
  for (uint64_t r = 0; r < 2000; ++r) {
    std::vector<uint64_t> ids = {r % 64};
    for (int i = 0; i < 8; ++i) ids.push_back(next++);
    requests.push_back(ids);
  }
  uint64_t hits = 0;
  auto m = AdaptiveRun(GetParam(), 256, requests, &hits);
  const AdmissionState state = m->admission();
  EXPECT_TRUE(state.adaptive);
  EXPECT_TRUE(state.filter_on);
  EXPECT_GT(state.shadow_hits_filter, state.shadow_hits_all);
  EXPECT_EQ(state.sample_rate, 1u);
  EXPECT_GT(hits, 1500u);  // the hot set hits once the filter is on
  // A one-off key offered now is turned away, and said so.
  StorePlan plan;
  ASSERT_TRUE(m->PrepareStore(Keys({999999}), &plan).ok());
  EXPECT_THAT(plan.keys_to_store, IsEmpty());
  EXPECT_EQ(plan.filtered, 1u);
}

TEST_P(BlockManagerTest, AdaptiveAdmissionStoresEverythingWhenBlocksComeBackOnce) {
  // Each key is asked for twice, 50 requests apart, and 256 slots hold that distance: every
  // second ask hits when every block is stored, none when stored on the second ask.
  std::vector<std::vector<uint64_t>> requests;
  for (uint64_t r = 0; r < 6000; ++r) {
    std::vector<uint64_t> ids = {r};
    if (r >= 50) ids.push_back(r - 50);
    requests.push_back(ids);
  }
  uint64_t hits = 0;
  auto m = AdaptiveRun(GetParam(), 256, requests, &hits);
  const AdmissionState state = m->admission();
  EXPECT_FALSE(state.filter_on);
  EXPECT_GT(state.shadow_hits_all, state.shadow_hits_filter);
  EXPECT_GT(hits, 5500u);  // of 5,950 second asks; none with the filter on
}

TEST(BlockManagerAdmissionTest, AFixedFilterOrNoneSaysSo) {
  BlockManagerOptions options;
  options.capacity_blocks = 8;
  EXPECT_FALSE(BlockManager::Create(options).value()->admission().filter_on);
  options.store_threshold = 2;
  const AdmissionState fixed = BlockManager::Create(options).value()->admission();
  EXPECT_TRUE(fixed.filter_on);
  EXPECT_FALSE(fixed.adaptive);
}

INSTANTIATE_TEST_SUITE_P(Policies, BlockManagerTest,
                         ::testing::Values(EvictionPolicy::kLru, EvictionPolicy::kArc,
                                           EvictionPolicy::kAfLru),
                         [](const auto& param_info) {
                           return std::string(EvictionPolicyName(param_info.param));
                         });

}  // namespace
}  // namespace kvstash::store
