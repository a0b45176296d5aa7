// The block pool and its free queue against the vectors of docs/semantics.md
// (docs/semantics.md §12.N, and the allocation orders of §12.L1).

#include "kvstash/engine/block_pool.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace kvstash::engine {
namespace {

using ::testing::ElementsAre;

std::vector<BlockId> Ids(std::initializer_list<BlockId> ids) { return ids; }

// §12.N1
TEST(FreeBlockQueueTest, N1PopRemoveAppend) {
  FreeBlockQueue queue(5, Ids({0, 1, 2, 3, 4}));
  EXPECT_EQ(*queue.PopLeft(), 0u);
  queue.Remove(2);
  EXPECT_THAT(queue.All(), ElementsAre(1, 3, 4));  // 1 <-> 3 linked
  queue.Append(2);
  EXPECT_THAT(queue.All(), ElementsAre(1, 3, 4, 2));  // tail 2, after 4
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(queue.PopLeft().ok());
  EXPECT_EQ(queue.size(), 0u);
  const auto empty = queue.PopLeft();
  EXPECT_EQ(empty.status().code(), StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(empty.status().message()),
              ::testing::HasSubstr("No free blocks available"));
}

// §12.N2
TEST(FreeBlockQueueTest, N2AppendN) {
  FreeBlockQueue queue(6, {});
  queue.AppendN({});
  EXPECT_EQ(queue.size(), 0u);
  queue.AppendN(Ids({0}));
  queue.AppendN(Ids({4, 5}));
  queue.AppendN(Ids({1, 2, 3}));
  EXPECT_THAT(queue.All(), ElementsAre(0, 4, 5, 1, 2, 3));
}

// §12.N3
TEST(FreeBlockQueueTest, N3PopLeftN) {
  FreeBlockQueue queue(6, Ids({1, 3, 5, 4, 0, 2}));
  EXPECT_THAT(*queue.PopLeftN(0), ElementsAre());
  EXPECT_THAT(*queue.PopLeftN(1), ElementsAre(1));
  EXPECT_THAT(*queue.PopLeftN(2), ElementsAre(3, 5));
  EXPECT_THAT(*queue.PopLeftN(3), ElementsAre(4, 0, 2));
  EXPECT_FALSE(queue.contains(4));
  EXPECT_EQ(queue.PopLeftN(1).status().code(), StatusCode::kResourceExhausted);
}

// §12.N4
TEST(FreeBlockQueueTest, N4AllFreeBlocks) {
  FreeBlockQueue queue(5, Ids({0, 1, 2, 3, 4}));
  (void)queue.PopLeft();
  queue.Remove(2);
  queue.Append(2);
  EXPECT_THAT(queue.All(), ElementsAre(1, 3, 4, 2));
}

CachedKey Key(uint64_t h, uint32_t group = 0) { return CachedKey{Hash128{h, ~h}, group}; }

// §12.L1 at the pool: 11 blocks (block 0 null), bs 16; what the manager does for each request
// (look up the cached prefix, touch it, take new blocks, cache the full ones, free in reverse).
TEST(BlockPoolTest, L1PrefillAllocationAndFreeOrder) {
  BlockPool pool(11, /*prefix_caching=*/true, /*record_events=*/true);
  EXPECT_EQ(pool.num_free(), 10u);
  const std::vector<uint32_t> group0 = {0};
  auto lookup = [&](std::initializer_list<uint64_t> hashes) {
    std::vector<BlockId> hit;
    for (uint64_t h : hashes) {
      auto blocks = pool.GetCachedBlock(Key(h).hash, group0);
      if (!blocks) break;
      hit.push_back((*blocks)[0]);
    }
    return hit;
  };
  // req0: 48 + 7 tokens, hashes 1..3, no hit; 4 new blocks, the 3 full ones cached.
  EXPECT_THAT(lookup({1, 2, 3}), ElementsAre());
  const auto req0 = *pool.GetNewBlocks(4);
  EXPECT_THAT(req0, ElementsAre(1, 2, 3, 4));
  for (int i = 0; i < 3; ++i) pool.CacheBlock(req0[i], Key(i + 1));
  EXPECT_FALSE(pool.key_of(4).has_value());  // the partial block has no hash
  EXPECT_EQ(pool.ref_count(1), 1u);
  // req1: 48 + 5, hits [1,2,3]; one new block.
  const auto hit1 = lookup({1, 2, 3});
  EXPECT_THAT(hit1, ElementsAre(1, 2, 3));
  pool.Touch(hit1);
  const auto new1 = *pool.GetNewBlocks(1);
  EXPECT_THAT(new1, ElementsAre(5));
  EXPECT_EQ(pool.ref_count(2), 2u);
  EXPECT_EQ(pool.num_free(), 5u);
  // Both finish: each frees its blocks in reverse.
  pool.FreeBlocks(Ids({4, 3, 2, 1}));
  pool.FreeBlocks(Ids({5, 3, 2, 1}));
  EXPECT_EQ(pool.num_free(), 10u);
  // req2: 48 + 6, hits [1,2,3] again (freed blocks keep their hashes); one new block.
  const auto hit2 = lookup({1, 2, 3});
  EXPECT_THAT(hit2, ElementsAre(1, 2, 3));
  pool.Touch(hit2);
  EXPECT_THAT(*pool.GetNewBlocks(1), ElementsAre(6));
  EXPECT_EQ(pool.num_free(), 6u);
  pool.FreeBlocks(Ids({6, 3, 2, 1}));
  // req3: 160 tokens of 99, no hit; 10 blocks in eviction order, the cached ones evicted.
  EXPECT_THAT(lookup({99}), ElementsAre());
  EXPECT_THAT(*pool.GetNewBlocks(10), ElementsAre(7, 8, 9, 10, 4, 5, 6, 3, 2, 1));
  std::vector<uint64_t> removed;
  for (const CachedKey& k : pool.TakeRemoved()) removed.push_back(k.hash.lo);
  EXPECT_THAT(removed, ElementsAre(3, 2, 1));
  EXPECT_THAT(lookup({1}), ElementsAre());
  EXPECT_EQ(pool.GetNewBlocks(1).status().code(), StatusCode::kResourceExhausted);
}

// The events a worker publishes: hashes cached (with their parents) and dropped, in order;
// nothing is recorded unless asked for, so a pool nobody drains holds no log.
TEST(BlockPoolTest, RecordsCachedAndDroppedHashesInOrderOnlyWhenAsked) {
  BlockPool pool(4, true, /*record_events=*/true);
  const auto blocks = *pool.GetNewBlocks(3);
  pool.CacheBlock(blocks[0], Key(1), std::nullopt);
  pool.CacheBlock(blocks[1], Key(2), Key(1).hash);
  pool.CacheBlock(blocks[2], Key(1), std::nullopt);  // cached already: no event
  pool.FreeBlocks(Ids({blocks[1], blocks[0], blocks[2]}));
  (void)*pool.GetNewBlocks(1);  // the free queue starts with blocks[1]
  EXPECT_THAT(pool.TakeEvents(),
              ElementsAre(CacheEvent{CacheEvent::Kind::kStored, Key(1), std::nullopt},
                          CacheEvent{CacheEvent::Kind::kStored, Key(2), Key(1).hash},
                          CacheEvent{CacheEvent::Kind::kRemoved, Key(2), std::nullopt}));
  EXPECT_THAT(pool.TakeEvents(), ::testing::IsEmpty());

  BlockPool quiet(4, true);
  const auto b = *quiet.GetNewBlocks(1);
  quiet.CacheBlock(b[0], Key(1));
  quiet.FreeBlocks(Ids({b[0]}));
  (void)*quiet.GetNewBlocks(3);
  EXPECT_THAT(quiet.TakeEvents(), ::testing::IsEmpty());
}

TEST(BlockPoolTest, GroupsMustAllHitAndPrefixCachingOffCachesNothing) {
  BlockPool pool(8, true);
  const auto blocks = *pool.GetNewBlocks(2);
  pool.CacheBlock(blocks[0], Key(7, 0));
  pool.CacheBlock(blocks[1], Key(7, 1));
  const std::vector<uint32_t> both = {0, 1}, three = {0, 1, 2};
  EXPECT_THAT(*pool.GetCachedBlock(Key(7).hash, both), ElementsAre(blocks[0], blocks[1]));
  EXPECT_FALSE(pool.GetCachedBlock(Key(7).hash, three).has_value());
  // The null block is never handed out, touched or freed.
  pool.Touch(Ids({kNullBlock}));
  pool.FreeBlocks(Ids({kNullBlock}));
  EXPECT_EQ(pool.num_free(), 5u);

  BlockPool off(4, false);
  const auto b = *off.GetNewBlocks(1);
  off.CacheBlock(b[0], Key(1));
  const std::vector<uint32_t> g0 = {0};
  EXPECT_FALSE(off.GetCachedBlock(Key(1).hash, g0).has_value());
}

TEST(BlockPoolTest, EvictCachedHashForgetsTheKeyButKeepsTheBlock) {
  BlockPool pool(8, true, /*record_events=*/true);
  const auto blocks = *pool.GetNewBlocks(2);
  pool.CacheBlock(blocks[0], Key(7, 1));
  pool.FreeBlocks(Ids({blocks[0]}));
  const std::vector<uint32_t> g1 = {1};
  ASSERT_TRUE(pool.GetCachedBlock(Key(7).hash, g1).has_value());
  EXPECT_FALSE(pool.EvictCachedHash(Key(7, 0)));  // another group's key
  EXPECT_TRUE(pool.EvictCachedHash(Key(7, 1)));
  EXPECT_FALSE(pool.GetCachedBlock(Key(7).hash, g1).has_value());
  EXPECT_FALSE(pool.key_of(blocks[0]).has_value());
  EXPECT_THAT(pool.TakeRemoved(), ElementsAre(Key(7, 1)));
  EXPECT_FALSE(pool.EvictCachedHash(Key(7, 1)));
  // The block stays free, at its place in the queue, and can be cached again.
  EXPECT_THAT(pool.free_queue().All(), ElementsAre(3, 4, 5, 6, 7, blocks[0]));
  pool.CacheBlock(blocks[0], Key(7, 1));
  EXPECT_EQ((*pool.GetCachedBlock(Key(7).hash, g1))[0], blocks[0]);
}

}  // namespace
}  // namespace kvstash::engine
