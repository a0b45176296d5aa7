// The test vectors (docs/semantics.md §12) for the block manager: §12.A (vLLM's own tests) and
// §12.B (derived by running vLLM's code; kvstash's B5 differs on purpose).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "test_util.h"

namespace kvstash::store {
namespace {

using testing::Block;
using ::testing::ElementsAre;
using ::testing::IsEmpty;
using testing::Key;
using testing::Keys;
using testing::MakeManager;
using testing::PrepareLoad;
using testing::PrepareStore;
using testing::Removed;
using testing::StoreAndCommit;
using testing::Stored;

constexpr auto kLru = EvictionPolicy::kLru;
constexpr auto kArc = EvictionPolicy::kArc;
constexpr auto kHit = LookupResult::kHit;
constexpr auto kMiss = LookupResult::kMiss;
constexpr auto kRetry = LookupResult::kRetry;

std::vector<LookupResult> LookupAll(BlockManager& m, std::initializer_list<uint64_t> ids) {
  std::vector<LookupResult> out;
  for (uint64_t i : ids) out.push_back(m.Lookup(Key(i)));
  return out;
}

Status TryPrepareStore(BlockManager& m, std::initializer_list<uint64_t> ids) {
  StorePlan plan;
  return m.PrepareStore(Keys(ids), &plan);
}

#define EXPECT_PLAN(plan, want_store, want_ids, want_evicted)                 \
  do {                                                                        \
    const StorePlan& plan_ = (plan);                                          \
    EXPECT_EQ(plan_.keys_to_store, Keys(want_store)) << "keys to store";      \
    EXPECT_THAT(plan_.slots, ::testing::ElementsAreArray(want_ids)) << "ids"; \
    EXPECT_EQ(plan_.evicted, Keys(want_evicted)) << "evicted";                \
  } while (false)

using Ids = std::vector<SlotId>;
using K = std::initializer_list<uint64_t>;

// ---- §12.A: quoted vLLM tests ---------------------------------------------------------------

TEST(ManagerVectorsA, A1AlreadyStoredBlockNotEvictedDuringPrepareStoreLru) {
  auto m = MakeManager({.capacity = 4, .policy = kLru});
  StoreAndCommit(*m, Keys({1, 2}));
  m->Touch(Keys({1}));
  StorePlan plan = PrepareStore(*m, Keys({2, 3, 4, 5}));
  EXPECT_PLAN(plan, K({3, 4, 5}), Ids({2, 3, 0}), K({1}));
  m->CompleteStore(Keys({2, 3, 4, 5}), true);
  EXPECT_EQ(m->Lookup(Key(2)), kHit);
  EXPECT_THAT(m->DebugState().lru, ElementsAre(Block(2, 1), Block(3, 2), Block(4, 3), Block(5, 0)));
  EXPECT_THAT(m->TakeEvents(), ElementsAre(Stored({1, 2}), Removed({1}), Stored({3, 4, 5})));
}

TEST(ManagerVectorsA, A2AlreadyStoredBlockNotEvictedDuringPrepareStoreArc) {
  auto m = MakeManager({.capacity = 4, .policy = kArc});
  StoreAndCommit(*m, Keys({1, 2}));
  m->Touch(Keys({1}));
  BlockManagerState s = m->DebugState();
  EXPECT_THAT(s.t1, ElementsAre(Block(2, 1)));
  EXPECT_THAT(s.t2, ElementsAre(Block(1, 0)));
  StorePlan plan = PrepareStore(*m, Keys({2, 3, 4, 5}));
  EXPECT_PLAN(plan, K({3, 4, 5}), Ids({2, 3, 0}), K({1}));
  m->CompleteStore(Keys({2, 3, 4, 5}), true);
  EXPECT_EQ(m->Lookup(Key(2)), kHit);
  s = m->DebugState();
  EXPECT_THAT(s.t1, ElementsAre(Block(2, 1), Block(3, 2), Block(4, 3), Block(5, 0)));
  EXPECT_THAT(s.t2, IsEmpty());
  EXPECT_THAT(s.b1, IsEmpty());
  EXPECT_EQ(s.b2, Keys({1}));
  EXPECT_EQ(s.arc_target, 0.0);
}

TEST(ManagerVectorsA, A3CpuManagerLru) {
  auto m = MakeManager({.capacity = 4, .policy = kLru});
  // 1
  EXPECT_PLAN(PrepareStore(*m, Keys({1, 2})), K({1, 2}), Ids({0, 1}), K({}));
  // 2-3
  EXPECT_THAT(LookupAll(*m, {1, 2}), ElementsAre(kRetry, kRetry));
  EXPECT_THAT(m->TakeEvents(), IsEmpty());
  // 4
  m->CompleteStore(Keys({1, 2}), true);
  EXPECT_THAT(m->TakeEvents(), ElementsAre(Stored({1, 2})));
  // 5
  EXPECT_THAT(LookupAll(*m, {1, 2, 3}), ElementsAre(kHit, kHit, kMiss));
  // 6-7
  EXPECT_PLAN(PrepareStore(*m, Keys({2, 3, 4, 5})), K({3, 4, 5}), Ids({2, 3, 0}), K({1}));
  EXPECT_THAT(m->DebugState().lru,
              ElementsAre(Block(2, 1, 0), Block(3, 2, -1), Block(4, 3, -1), Block(5, 0, -1)));
  EXPECT_THAT(m->TakeEvents(), ElementsAre(Removed({1})));
  // 8: 3,4,5 not ready, 2 protected: refused, state unchanged.
  BlockManagerState before = m->DebugState();
  Status refused = TryPrepareStore(*m, {1, 6});
  EXPECT_EQ(refused.code(), StatusCode::kResourceExhausted) << refused.ToString();
  EXPECT_EQ(m->DebugState().lru, before.lru);
  EXPECT_EQ(m->DebugState().free_slots, before.free_slots);
  // 9
  m->CompleteStore(Keys({2, 3, 4, 5}), true);
  // 10
  EXPECT_THAT(LookupAll(*m, {1, 2, 3, 4, 5, 0}), ElementsAre(kMiss, kHit, kHit, kHit, kHit, kMiss));
  // 11
  EXPECT_THAT(PrepareLoad(*m, Keys({2, 3})), ElementsAre(1, 2));
  EXPECT_THAT(m->DebugState().lru,
              ElementsAre(Block(2, 1, 1), Block(3, 2, 1), Block(4, 3, 0), Block(5, 0, 0)));
  // 12: only 4 and 5 evictable.
  EXPECT_EQ(TryPrepareStore(*m, {6, 7, 8}).code(), StatusCode::kResourceExhausted);
  // 13-14
  ASSERT_TRUE(m->CompleteLoad(Keys({2, 3})).ok());
  EXPECT_PLAN(PrepareStore(*m, Keys({6, 7, 8})), K({6, 7, 8}), Ids({3, 2, 1}), K({2, 3, 4}));
  EXPECT_THAT(m->DebugState().free_slots, IsEmpty());
  // 15
  m->CompleteStore(Keys({6, 7, 8}), true);
  EXPECT_THAT(m->DebugState().lru, ElementsAre(Block(5, 0), Block(6, 3), Block(7, 2), Block(8, 1)));
  // 16
  m->Touch(Keys({5, 6, 7}));
  EXPECT_THAT(m->DebugState().lru, ElementsAre(Block(8, 1), Block(7, 2), Block(6, 3), Block(5, 0)));
  // 17
  EXPECT_PLAN(PrepareStore(*m, Keys({9})), K({9}), Ids({1}), K({8}));
  // 18
  m->CompleteStore(Keys({7, 9}), false);
  EXPECT_THAT(m->DebugState().free_slots, ElementsAre(1));
  // 19
  EXPECT_THAT(LookupAll(*m, {7, 9}), ElementsAre(kHit, kMiss));
  // 20
  EXPECT_THAT(m->TakeEvents(),
              ElementsAre(Stored({3, 4, 5}), Removed({2, 3, 4}), Stored({6, 7, 8}), Removed({8})));
}

TEST(ManagerVectorsA, A4PrepareLoadPreservesKeyOrder) {
  auto m = MakeManager({.capacity = 4, .policy = kLru});
  StoreAndCommit(*m, Keys({0, 1, 2}));
  EXPECT_THAT(PrepareLoad(*m, Keys({0, 1, 2})), ElementsAre(0, 1, 2));
  ASSERT_TRUE(m->CompleteLoad(Keys({0, 1, 2})).ok());
  EXPECT_THAT(PrepareLoad(*m, Keys({1, 2, 0})), ElementsAre(1, 2, 0));
}

TEST(ManagerVectorsA, A5ArcBasic) {
  auto m = MakeManager({.capacity = 4, .policy = kArc});
  EXPECT_PLAN(PrepareStore(*m, Keys({1, 2})), K({1, 2}), Ids({0, 1}), K({}));
  EXPECT_THAT(LookupAll(*m, {1, 2}), ElementsAre(kRetry, kRetry));
  EXPECT_THAT(m->TakeEvents(), IsEmpty());
  m->CompleteStore(Keys({1, 2}), true);
  EXPECT_THAT(m->TakeEvents(), ElementsAre(Stored({1, 2})));
  EXPECT_THAT(LookupAll(*m, {1, 2, 3}), ElementsAre(kHit, kHit, kMiss));
  EXPECT_EQ(m->DebugState().t1.size(), 2u);
  EXPECT_EQ(m->DebugState().t2.size(), 0u);
}

TEST(ManagerVectorsA, A6ArcT1ToT2Promotion) {
  auto m = MakeManager({.capacity = 4, .policy = kArc});
  StoreAndCommit(*m, Keys({1}));
  EXPECT_THAT(m->DebugState().t1, ElementsAre(Block(1, 0)));
  EXPECT_THAT(m->DebugState().t2, IsEmpty());
  m->Touch(Keys({1}));
  EXPECT_THAT(m->DebugState().t1, IsEmpty());
  EXPECT_THAT(m->DebugState().t2, ElementsAre(Block(1, 0)));
}

TEST(ManagerVectorsA, A7ArcEvictionWithLoad) {
  auto m = MakeManager({.capacity = 4, .policy = kArc});
  EXPECT_PLAN(PrepareStore(*m, Keys({1, 2, 3, 4})), K({1, 2, 3, 4}), Ids({0, 1, 2, 3}), K({}));
  m->CompleteStore(Keys({1, 2, 3, 4}), true);
  EXPECT_THAT(PrepareLoad(*m, Keys({2, 3})), ElementsAre(1, 2));
  EXPECT_EQ(TryPrepareStore(*m, {5, 6, 7}).code(), StatusCode::kResourceExhausted);
  ASSERT_TRUE(m->CompleteLoad(Keys({2, 3})).ok());
  EXPECT_PLAN(PrepareStore(*m, Keys({5, 6, 7})), K({5, 6, 7}), Ids({2, 1, 0}), K({1, 2, 3}));
  m->CompleteStore(Keys({5, 6, 7}), true);
  BlockManagerState s = m->DebugState();
  EXPECT_THAT(s.t1, ElementsAre(Block(4, 3), Block(5, 2), Block(6, 1), Block(7, 0)));
  EXPECT_EQ(s.b1, Keys({1, 2, 3}));
  EXPECT_EQ(s.arc_target, 0.0);
  EXPECT_THAT(m->TakeEvents(),
              ElementsAre(Stored({1, 2, 3, 4}), Removed({1, 2, 3}), Stored({5, 6, 7})));
}

TEST(ManagerVectorsA, A8ArcAdaptiveTarget) {
  auto m = MakeManager({.capacity = 2, .policy = kArc});
  StoreAndCommit(*m, Keys({1, 2}));
  EXPECT_PLAN(PrepareStore(*m, Keys({3})), K({3}), Ids({0}), K({1}));
  EXPECT_EQ(m->DebugState().b1, Keys({1}));
  EXPECT_EQ(m->DebugState().arc_target, 0.0);
  m->Touch(Keys({1}));
  EXPECT_EQ(m->DebugState().arc_target, 1.0);
}

TEST(ManagerVectorsA, A9ArcT1T2EvictionPolicy) {
  auto m = MakeManager({.capacity = 4, .policy = kArc});
  StoreAndCommit(*m, Keys({1, 2, 3, 4}));
  m->Touch(Keys({3, 4}));
  BlockManagerState s = m->DebugState();
  EXPECT_THAT(s.t1, ElementsAre(Block(1, 0), Block(2, 1)));
  EXPECT_THAT(s.t2, ElementsAre(Block(4, 3), Block(3, 2)));
  ASSERT_TRUE(m->SetArcTargetForTesting(1.0).ok());
  EXPECT_PLAN(PrepareStore(*m, Keys({5})), K({5}), Ids({0}), K({1}));
  m->CompleteStore(Keys({5}), true);
  s = m->DebugState();
  EXPECT_EQ(s.b1, Keys({1}));
  EXPECT_THAT(s.t1, ElementsAre(Block(2, 1), Block(5, 0)));
}

TEST(ManagerVectorsA, A10ArcGhostListBounds) {
  auto m = MakeManager({.capacity = 2, .policy = kArc});
  StoreAndCommit(*m, Keys({1, 2}));
  for (uint64_t i = 3; i <= 19; ++i) {
    StoreAndCommit(*m, {Key(i)});
    BlockManagerState s = m->DebugState();
    EXPECT_LE(s.b1.size(), 2u);
    EXPECT_LE(s.b2.size(), 2u);
  }
  BlockManagerState s = m->DebugState();
  EXPECT_THAT(s.t1, ElementsAre(Block(18, 1), Block(19, 0)));
  EXPECT_EQ(s.b1, Keys({16, 17}));
  EXPECT_THAT(s.b2, IsEmpty());
}

TEST(ManagerVectorsA, A11ArcTouchOrdering) {
  auto m = MakeManager({.capacity = 4, .policy = kArc});
  StoreAndCommit(*m, Keys({1, 2, 3, 4}));
  m->Touch(Keys({3, 4}));
  m->Touch(Keys({1, 3, 4}));
  BlockManagerState s = m->DebugState();
  EXPECT_THAT(s.t1, ElementsAre(Block(2, 1)));
  EXPECT_THAT(s.t2, ElementsAre(Block(4, 3), Block(3, 2), Block(1, 0)));
  EXPECT_PLAN(PrepareStore(*m, Keys({5})), K({5}), Ids({1}), K({2}));
}

TEST(ManagerVectorsA, A12ArcFailedStore) {
  auto m = MakeManager({.capacity = 4, .policy = kArc});
  StoreAndCommit(*m, Keys({1, 2, 3, 4}));
  EXPECT_PLAN(PrepareStore(*m, Keys({5})), K({5}), Ids({0}), K({1}));
  m->CompleteStore(Keys({5}), false);
  EXPECT_EQ(m->Lookup(Key(5)), kMiss);
  BlockManagerState s = m->DebugState();
  for (const auto& b : s.t1) EXPECT_NE(b.key, Key(5));
  for (const auto& b : s.t2) EXPECT_NE(b.key, Key(5));
  EXPECT_EQ(s.b1, Keys({1}));
  EXPECT_THAT(s.free_slots, ElementsAre(0));
}

TEST(ManagerVectorsA, A13ArcFullScenario) {
  auto m = MakeManager({.capacity = 4, .policy = kArc});
  StoreAndCommit(*m, Keys({1, 2}));
  EXPECT_PLAN(PrepareStore(*m, Keys({3, 4, 5})), K({3, 4, 5}), Ids({2, 3, 0}), K({1}));
  m->CompleteStore(Keys({3, 4, 5}), true);
  m->Touch(Keys({2, 3}));
  BlockManagerState s = m->DebugState();
  EXPECT_THAT(s.t1, ElementsAre(Block(4, 3), Block(5, 0)));
  EXPECT_THAT(s.t2, ElementsAre(Block(3, 2), Block(2, 1)));
  EXPECT_PLAN(PrepareStore(*m, Keys({6})), K({6}), Ids({3}), K({4}));
  m->CompleteStore(Keys({6}), true);
  EXPECT_THAT(LookupAll(*m, {2, 3}), ElementsAre(kHit, kHit));
  EXPECT_THAT(m->TakeEvents(), ElementsAre(Stored({1, 2}), Removed({1}), Stored({3, 4, 5}),
                                           Removed({4}), Stored({6})));
  s = m->DebugState();
  EXPECT_THAT(s.t1, ElementsAre(Block(5, 0), Block(6, 3)));
  EXPECT_THAT(s.t2, ElementsAre(Block(3, 2), Block(2, 1)));
  EXPECT_EQ(s.b1, Keys({1, 4}));
}

TEST(ManagerVectorsA, A14FilterReusedManager) {
  auto m =
      MakeManager({.capacity = 4, .policy = kLru, .store_threshold = 2, .max_tracker_size = 3});
  EXPECT_THAT(LookupAll(*m, {1, 2}), ElementsAre(kMiss, kMiss));  // tracker {1:1, 2:1}
  EXPECT_THAT(PrepareStore(*m, Keys({1, 2})).keys_to_store, IsEmpty());
  EXPECT_EQ(m->Lookup(Key(1)), kMiss);  // count 2
  EXPECT_EQ(PrepareStore(*m, Keys({1, 2})).keys_to_store, Keys({1}));
  // Tracker holds {2, 1}; 3 makes it full; 4 drops its least recent entry, 2.
  EXPECT_THAT(LookupAll(*m, {3, 4}), ElementsAre(kMiss, kMiss));
  EXPECT_EQ(m->Lookup(Key(2)), kMiss);  // back with count 1
  EXPECT_THAT(PrepareStore(*m, Keys({2})).keys_to_store, IsEmpty());
  m->CompleteStore(Keys({1}), true);
  EXPECT_EQ(m->Lookup(Key(1)), kHit);
  // 2 reaches the threshold on its second counted lookup.
  EXPECT_EQ(m->Lookup(Key(2)), kMiss);
  EXPECT_EQ(PrepareStore(*m, Keys({2})).keys_to_store, Keys({2}));
}

// ---- §12.B: derived vectors ------------------------------------------------------------------

TEST(ManagerVectorsB, B1ArcB2HitLowersTarget) {
  auto m = MakeManager({.capacity = 2, .policy = kArc});
  StoreAndCommit(*m, Keys({1, 2}));
  m->Touch(Keys({1, 2}));
  EXPECT_THAT(m->DebugState().t2, ElementsAre(Block(2, 1), Block(1, 0)));
  EXPECT_PLAN(PrepareStore(*m, Keys({3})), K({3}), Ids({1}), K({2}));
  BlockManagerState s = m->DebugState();
  EXPECT_THAT(s.t1, ElementsAre(Block(3, 1, -1)));
  EXPECT_THAT(s.t2, ElementsAre(Block(1, 0)));
  EXPECT_EQ(s.b2, Keys({2}));
  ASSERT_TRUE(m->SetArcTargetForTesting(2.0).ok());
  m->Touch(Keys({2}));
  EXPECT_EQ(m->DebugState().arc_target, 1.0);
  m->Touch(Keys({2}));
  EXPECT_EQ(m->DebugState().arc_target, 0.0);
  m->Touch(Keys({2}));
  EXPECT_EQ(m->DebugState().arc_target, 0.0);
}

TEST(ManagerVectorsB, B2ArcB1HitWithFractionalDelta) {
  auto m = MakeManager({.capacity = 4, .policy = kArc});
  StoreAndCommit(*m, Keys({1, 2, 3, 4}));
  m->Touch(Keys({3, 4}));
  ASSERT_TRUE(m->SetArcTargetForTesting(3.0).ok());
  EXPECT_PLAN(PrepareStore(*m, Keys({5, 6})), K({5, 6}), Ids({2, 3}), K({4, 3}));
  m->CompleteStore(Keys({5, 6}), true);
  EXPECT_EQ(m->DebugState().b2, Keys({4, 3}));
  ASSERT_TRUE(m->SetArcTargetForTesting(0.0).ok());
  EXPECT_PLAN(PrepareStore(*m, Keys({7})), K({7}), Ids({0}), K({1}));
  EXPECT_EQ(m->DebugState().b1, Keys({1}));
  m->Touch(Keys({1}));
  EXPECT_EQ(m->DebugState().arc_target, 2.0);
}

TEST(ManagerVectorsB, B3ArcMixedEvictionDrivenByVirtualT1) {
  auto m = MakeManager({.capacity = 4, .policy = kArc});
  StoreAndCommit(*m, Keys({1, 2, 3, 4}));
  m->Touch(Keys({4}));
  ASSERT_TRUE(m->SetArcTargetForTesting(2.0).ok());
  EXPECT_PLAN(PrepareStore(*m, Keys({5, 6, 7})), K({5, 6, 7}), Ids({3, 1, 0}), K({1, 2, 4}));
  m->CompleteStore(Keys({5, 6, 7}), true);
  BlockManagerState s = m->DebugState();
  EXPECT_THAT(s.t1, ElementsAre(Block(3, 2), Block(5, 3), Block(6, 1), Block(7, 0)));
  EXPECT_EQ(s.b1, Keys({1, 2}));
  EXPECT_EQ(s.b2, Keys({4}));
  EXPECT_THAT(m->TakeEvents(),
              ElementsAre(Stored({1, 2, 3, 4}), Removed({1, 2, 4}), Stored({5, 6, 7})));
}

TEST(ManagerVectorsB, B4ArcTargetIsTruncated) {
  auto m = MakeManager({.capacity = 3, .policy = kArc});
  StoreAndCommit(*m, Keys({1, 2, 3}));
  m->Touch(Keys({3}));
  ASSERT_TRUE(m->SetArcTargetForTesting(2.5).ok());
  EXPECT_PLAN(PrepareStore(*m, Keys({4, 5})), K({4, 5}), Ids({2, 0}), K({1, 3}));
  m->CompleteStore(Keys({4, 5}), true);
  BlockManagerState s = m->DebugState();
  EXPECT_THAT(s.t1, ElementsAre(Block(2, 1), Block(4, 2), Block(5, 0)));
  EXPECT_EQ(s.b1, Keys({1}));
  EXPECT_EQ(s.b2, Keys({3}));
}

// kvstash differs from vLLM here on purpose: vLLM refuses the store with p=2.0.
TEST(ManagerVectorsB, B5ArcFallsBackToT1WhenT2HasNothingEvictable) {
  for (double p : {2.0, 1.0}) {
    SCOPED_TRACE(p);
    auto m = MakeManager({.capacity = 2, .policy = kArc});
    StoreAndCommit(*m, Keys({1, 2}));
    m->Touch(Keys({2}));
    EXPECT_THAT(m->DebugState().t1, ElementsAre(Block(1, 0)));
    EXPECT_THAT(m->DebugState().t2, ElementsAre(Block(2, 1)));
    PrepareLoad(*m, Keys({2}));
    ASSERT_TRUE(m->SetArcTargetForTesting(p).ok());
    EXPECT_PLAN(PrepareStore(*m, Keys({3})), K({3}), Ids({0}), K({1}));
    EXPECT_EQ(m->DebugState().b1, Keys({1}));
  }
}

TEST(ManagerVectorsB, B6LruTouchOrder) {
  auto m = MakeManager({.capacity = 4, .policy = kLru});
  StoreAndCommit(*m, Keys({1, 2, 3, 4}));
  m->Touch(Keys({1, 2, 3}));
  EXPECT_THAT(m->DebugState().lru, ElementsAre(Block(4, 3), Block(3, 2), Block(2, 1), Block(1, 0)));
  EXPECT_PLAN(PrepareStore(*m, Keys({5})), K({5}), Ids({3}), K({4}));
}

TEST(ManagerVectorsB, B7InFlightKeyIsNotStoredAgain) {
  for (auto policy : {kLru, kArc}) {
    auto m = MakeManager({.capacity = 4, .policy = policy});
    EXPECT_PLAN(PrepareStore(*m, Keys({1})), K({1}), Ids({0}), K({}));
    EXPECT_PLAN(PrepareStore(*m, Keys({1, 2})), K({2}), Ids({1}), K({}));
    EXPECT_EQ(m->Lookup(Key(1)), kRetry);
  }
}

TEST(ManagerVectorsB, B8ArcTouchWhileNotReady) {
  auto m = MakeManager({.capacity = 4, .policy = kArc});
  PrepareStore(*m, Keys({1, 2}));
  m->Touch(Keys({1, 2}));
  EXPECT_THAT(m->DebugState().t1, ElementsAre(Block(2, 1, -1), Block(1, 0, -1)));
  EXPECT_THAT(m->DebugState().t2, IsEmpty());
  m->CompleteStore(Keys({1, 2}), true);
  m->Touch(Keys({1, 2}));
  EXPECT_THAT(m->DebugState().t2, ElementsAre(Block(2, 1), Block(1, 0)));
  EXPECT_THAT(m->DebugState().t1, IsEmpty());
}

TEST(ManagerVectorsB, B9ResetCache) {
  auto m = MakeManager({.capacity = 4, .policy = kArc});
  StoreAndCommit(*m, Keys({1, 2}));
  m->Touch(Keys({1}));
  m->Reset();
  BlockManagerState s = m->DebugState();
  EXPECT_THAT(s.t1, IsEmpty());
  EXPECT_THAT(s.t2, IsEmpty());
  EXPECT_THAT(s.b1, IsEmpty());
  EXPECT_THAT(s.b2, IsEmpty());
  EXPECT_EQ(s.arc_target, 0.0);
  EXPECT_EQ(s.fresh_slots_used, 0u);
  EXPECT_THAT(s.free_slots, IsEmpty());
  EXPECT_EQ(m->Lookup(Key(1)), kMiss);
  EXPECT_EQ(m->resident_blocks(), 0u);
  EXPECT_PLAN(PrepareStore(*m, Keys({3})), K({3}), Ids({0}), K({}));
}

// B12 then B10: ghost growth, then a ghost key stored again after the trim.
TEST(ManagerVectorsB, B12GhostGrowthThenB10TrimBeforeInsert) {
  auto m = MakeManager({.capacity = 2, .policy = kArc});
  StoreAndCommit(*m, Keys({1, 2}));
  EXPECT_PLAN(PrepareStore(*m, Keys({3})), K({3}), Ids({0}), K({1}));
  m->CompleteStore(Keys({3}), true);
  EXPECT_EQ(m->DebugState().b1, Keys({1}));
  EXPECT_PLAN(PrepareStore(*m, Keys({4})), K({4}), Ids({1}), K({2}));
  m->CompleteStore(Keys({4}), true);
  EXPECT_EQ(m->DebugState().b1, Keys({1, 2}));
  EXPECT_PLAN(PrepareStore(*m, Keys({5})), K({5}), Ids({0}), K({3}));
  m->CompleteStore(Keys({5}), true);
  BlockManagerState s = m->DebugState();
  EXPECT_EQ(s.b1, Keys({2, 3}));
  EXPECT_THAT(s.t1, ElementsAre(Block(4, 1), Block(5, 0)));
  // B10
  m->Touch(Keys({3}));
  EXPECT_EQ(m->DebugState().arc_target, 1.0);
  EXPECT_PLAN(PrepareStore(*m, Keys({3})), K({3}), Ids({1}), K({4}));
  s = m->DebugState();
  EXPECT_EQ(s.b1, Keys({4}));
  EXPECT_THAT(s.t1, ElementsAre(Block(5, 0), Block(3, 1, -1)));
}

TEST(ManagerVectorsB, B11TouchOfUnknownKeyIsNoOp) {
  for (auto policy : {kLru, kArc}) {
    auto m = MakeManager({.capacity = 4, .policy = policy});
    m->Touch(Keys({9}));
    BlockManagerState s = m->DebugState();
    EXPECT_THAT(s.lru, IsEmpty());
    EXPECT_THAT(s.t1, IsEmpty());
    EXPECT_EQ(s.arc_target, 0.0);
  }
}

}  // namespace
}  // namespace kvstash::store
