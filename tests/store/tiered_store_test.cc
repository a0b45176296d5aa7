#include "kvstash/store/tiered_store.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <condition_variable>
#include <fstream>
#include <mutex>
#include <thread>
#include <vector>

#include "block_pattern.h"
#include "temp_dir.h"
#include "test_util.h"

namespace kvstash::store {
namespace {

using kvstash::testing::FillPattern;
using kvstash::testing::MatchesPattern;
using kvstash::testing::TempDir;
using testing::Key;
using testing::Keys;

constexpr size_t kBlock = 8192;

// Holds background jobs until opened; counts the jobs that started.
class Gate {
 public:
  void Enter() {
    std::unique_lock lock(mu_);
    ++entered_;
    cv_.wait(lock, [this] { return open_; });
  }
  void Open() {
    {
      std::lock_guard lock(mu_);
      open_ = true;
    }
    cv_.notify_all();
  }
  void Close() {
    std::lock_guard lock(mu_);
    open_ = false;
  }
  int entered() {
    std::lock_guard lock(mu_);
    return entered_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool open_ = true;
  int entered_ = 0;
};

class TieredStoreTest : public ::testing::Test {
 protected:
  TieredStoreOptions Options(size_t cpu_blocks, size_t ssd_blocks,
                             CascadeMode mode = CascadeMode::kWriteThrough) {
    TieredStoreOptions o;
    o.block_bytes = kBlock;
    o.cpu_capacity_blocks = cpu_blocks;
    o.cascade = mode;
    o.prefault = false;
    if (ssd_blocks > 0) {
      SsdTierOptions ssd;
      ssd.dir = dir_ / "ssd";
      ssd.capacity_bytes = ssd_blocks * kBlock;
      o.ssd = ssd;
    }
    o.before_job_for_testing = [this] { gate_.Enter(); };
    return o;
  }
  std::unique_ptr<TieredStore> Open(const TieredStoreOptions& options) {
    auto store = TieredStore::Create(options);
    EXPECT_TRUE(store.ok()) << store.status().ToString();
    return store.ok() ? std::move(store).value() : nullptr;
  }
  // Stores each key k with Pattern(k).
  void Store(TieredStore& store, const std::vector<BlockKey>& keys) {
    StorePlan plan;
    Status s = store.PrepareStore(keys, &plan);
    ASSERT_TRUE(s.ok()) << s.ToString();
    for (size_t i = 0; i < plan.keys_to_store.size(); ++i) {
      FillPattern(plan.keys_to_store[i].hash.lo, store.CpuSlot(plan.slots[i]));
    }
    store.CompleteStore(keys, true);
  }
  void ExpectCpuBlock(TieredStore& store, uint64_t k) {
    const std::vector<BlockKey> keys = {Key(k)};
    std::vector<std::span<const std::byte>> blocks;
    Status s = store.PrepareLoad(keys, &blocks);
    ASSERT_TRUE(s.ok()) << "key " << k << ": " << s.ToString();
    EXPECT_TRUE(MatchesPattern(k, blocks[0])) << "key " << k;
    ASSERT_TRUE(store.CompleteLoad(keys).ok());
  }
  void ExpectSsdBlock(TieredStore& store, uint64_t k) {
    std::vector<std::byte> out;
    Status s = store.ssd()->Get(Key(k), &out);
    ASSERT_TRUE(s.ok()) << "key " << k << ": " << s.ToString();
    EXPECT_TRUE(MatchesPattern(k, out)) << "key " << k;
  }

  TempDir dir_;
  Gate gate_;
};

TEST_F(TieredStoreTest, ParsesCascadeModes) {
  EXPECT_EQ(*ParseCascadeMode("write-through"), CascadeMode::kWriteThrough);
  EXPECT_EQ(*ParseCascadeMode("write-back"), CascadeMode::kWriteBack);
  EXPECT_EQ(ParseCascadeMode("writeback").status().code(), StatusCode::kInvalidArgument);
}

TEST_F(TieredStoreTest, CpuOnlyStoreServesAndEvicts) {
  auto store = Open(Options(2, 0));
  EXPECT_EQ(store->ssd(), nullptr);
  Store(*store, Keys({1, 2}));
  EXPECT_EQ(store->Lookup(Key(1)), LookupResult::kHit);
  ExpectCpuBlock(*store, 1);
  Store(*store, Keys({3}));  // evicts 1
  EXPECT_EQ(store->Lookup(Key(1)), LookupResult::kMiss);
  ExpectCpuBlock(*store, 3);
}

TEST_F(TieredStoreTest, CpuTierUsesCallerMemory) {
  TieredStoreOptions options = Options(3, 0);
  auto bytes = CpuMemoryBytes(options);
  ASSERT_TRUE(bytes.ok());
  EXPECT_GE(*bytes, 3 * kBlock);
  std::vector<std::byte> backing(*bytes + 4096);
  auto* start = reinterpret_cast<std::byte*>((reinterpret_cast<uintptr_t>(backing.data()) + 4095) &
                                             ~uintptr_t{4095});
  options.cpu_memory = std::span<std::byte>(start, *bytes);
  auto store = Open(options);
  ASSERT_NE(store, nullptr);
  StorePlan plan;
  ASSERT_TRUE(store->PrepareStore(Keys({7}), &plan).ok());
  ASSERT_EQ(plan.slots.size(), 1u);
  const std::span<std::byte> slot = store->CpuSlot(plan.slots[0]);
  EXPECT_GE(slot.data(), start);
  EXPECT_LE(slot.data() + slot.size(), start + *bytes);
  FillPattern(7, slot);
  store->CompleteStore(Keys({7}), true);
  ExpectCpuBlock(*store, 7);
}

TEST_F(TieredStoreTest, WriteThroughCascadesEveryCommit) {
  auto store = Open(Options(4, 16));
  Store(*store, Keys({1, 2, 3}));
  store->WaitIdle();
  EXPECT_EQ(store->ssd()->resident_blocks(), 3u);
  for (uint64_t k : {1, 2, 3}) ExpectSsdBlock(*store, k);
  EXPECT_EQ(store->stats().cascades_done, 3u);
  // The CPU copies were unpinned after the cascade: all three can be evicted.
  Store(*store, Keys({4, 5, 6, 7}));
  store->WaitIdle();
  EXPECT_EQ(store->cpu().resident_blocks(), 4u);
  EXPECT_EQ(store->Lookup(Key(1)), LookupResult::kRetry);  // back from SSD
}

TEST_F(TieredStoreTest, WriteBackCascadesOnlyOnEviction) {
  auto store = Open(Options(2, 16, CascadeMode::kWriteBack));
  Store(*store, Keys({1, 2}));
  store->WaitIdle();
  EXPECT_EQ(store->ssd()->resident_blocks(), 0u);
  Store(*store, Keys({3}));  // evicts 1 to SSD, then 3 overwrites its CPU slot
  store->WaitIdle();
  EXPECT_EQ(store->ssd()->resident_blocks(), 1u);
  ExpectSsdBlock(*store, 1);
  ExpectCpuBlock(*store, 3);
  EXPECT_EQ(store->stats().writebacks_staged + store->stats().writebacks_unstaged, 1u);
}

TEST_F(TieredStoreTest, WriteBackWithoutStagingWritesFromTheSlotBeforeTheStoreReturns) {
  TieredStoreOptions options = Options(2, 16, CascadeMode::kWriteBack);
  options.writeback_staging_blocks = 0;
  auto store = Open(options);
  Store(*store, Keys({1, 2}));
  Store(*store, Keys({3, 4}));
  EXPECT_EQ(store->stats().writebacks_unstaged, 2u);
  EXPECT_EQ(store->ssd()->resident_blocks(), 2u);  // written before PrepareStore returned
  ExpectSsdBlock(*store, 1);
  ExpectSsdBlock(*store, 2);
}

TEST_F(TieredStoreTest, PromotionAnswersRetryThenHit) {
  auto store = Open(Options(2, 16));
  Store(*store, Keys({1, 2}));
  store->WaitIdle();
  Store(*store, Keys({3, 4}));  // 1 and 2 now only on SSD
  store->WaitIdle();
  gate_.Close();
  EXPECT_EQ(store->Lookup(Key(1)), LookupResult::kRetry);
  EXPECT_EQ(store->Lookup(Key(1)), LookupResult::kRetry);  // still in flight: no second copy
  EXPECT_EQ(store->stats().promotions_started, 1u);
  EXPECT_EQ(store->Lookup(Key(9)), LookupResult::kMiss);
  std::vector<std::span<const std::byte>> blocks;
  EXPECT_EQ(store->PrepareLoad(Keys({1}), &blocks).code(), StatusCode::kFailedPrecondition);
  gate_.Open();
  store->WaitIdle();
  EXPECT_EQ(store->Lookup(Key(1)), LookupResult::kHit);
  ExpectCpuBlock(*store, 1);
  EXPECT_EQ(store->stats().promotions_done, 1u);
}

TEST_F(TieredStoreTest, PromotionsOfOneLookupAreOneJob) {
  auto store = Open(Options(4, 16));
  Store(*store, Keys({1, 2, 3, 4}));
  store->WaitIdle();
  Store(*store, Keys({5, 6, 7, 8}));
  store->WaitIdle();
  const int jobs_before = gate_.entered();
  const std::vector<BlockKey> keys = Keys({1, 2, 3});
  std::vector<LookupResult> results(3);
  store->Lookup(keys, results);
  EXPECT_THAT(results, ::testing::Each(LookupResult::kRetry));
  store->WaitIdle();
  EXPECT_EQ(gate_.entered() - jobs_before, 1);
  EXPECT_EQ(store->LookupPrefix(keys), ScanResult(3));
  for (uint64_t k : {1, 2, 3}) ExpectCpuBlock(*store, k);
}

TEST_F(TieredStoreTest, ScansStartPromotionsAndRetry) {
  auto store = Open(Options(4, 16));
  Store(*store, Keys({1, 2, 3, 4}));
  store->WaitIdle();
  Store(*store, Keys({5, 6}));  // evicts 1 and 2 from CPU
  store->WaitIdle();
  const std::vector<BlockKey> keys = Keys({1, 2, 3, 4, 99});
  // 1 and 2 are promoted, evicting 3 and 4 from CPU, which the scan then finds on SSD and
  // promotes too (evicting 5 and 6): all four come back in one pass.
  EXPECT_EQ(store->LookupPrefix(keys), std::nullopt);
  EXPECT_EQ(store->stats().promotions_started, 4u);
  store->WaitIdle();
  EXPECT_EQ(store->LookupPrefix(keys), ScanResult(4));
  EXPECT_EQ(store->LookupWindow(keys, 2), ScanResult(4));
  EXPECT_EQ(store->Lookup(Key(5)), LookupResult::kRetry);
}

TEST_F(TieredStoreTest, CascadingBlockIsPinnedAgainstEviction) {
  auto store = Open(Options(2, 16));
  gate_.Close();
  Store(*store, Keys({1}));  // its cascade waits at the gate: 1 is pinned in the CPU tier
  Store(*store, Keys({2}));  // pinned too
  StorePlan plan;
  EXPECT_EQ(store->PrepareStore(Keys({3}), &plan).code(), StatusCode::kResourceExhausted);
  gate_.Open();
  store->WaitIdle();
  ExpectSsdBlock(*store, 1);
  Store(*store, Keys({3}));
  EXPECT_EQ(store->Lookup(Key(2)), LookupResult::kHit);  // 1 was the least recent
  EXPECT_EQ(store->Lookup(Key(1)), LookupResult::kRetry);
  store->WaitIdle();
}

// A disk behind the stores never pins the CPU tier full: past max_cascades_in_flight a
// committed block's cascade waits for its eviction, which writes it (as write-back), so stores
// keep finding room and nothing committed is lost.
TEST_F(TieredStoreTest, CascadesPastTheCapWaitForEvictionAndStoresKeepFindingRoom) {
  TieredStoreOptions options = Options(4, 32);
  options.max_cascades_in_flight = 1;
  auto store = Open(options);
  gate_.Close();
  Store(*store, Keys({1}));        // cascading (held at the gate): pinned
  Store(*store, Keys({2, 3, 4}));  // past the cap: not pinned, cascade deferred
  EXPECT_EQ(store->stats().cascades_deferred, 3u);
  // Without the cap all four would be pinned and this store refused.
  Store(*store, Keys({5, 6}));  // evicts 2 and 3, which go to SSD now
  gate_.Open();
  store->WaitIdle();
  EXPECT_EQ(store->stats().cascades_deferred, 5u);  // 5 and 6 came while 1 was still out
  for (uint64_t k : {1, 2, 3}) ExpectSsdBlock(*store, k);
  std::vector<std::byte> out;
  for (uint64_t k : {4, 5, 6}) {
    EXPECT_EQ(store->ssd()->Get(Key(k), &out).code(), StatusCode::kNotFound) << k;
  }
  // Flush (a node stopping) writes what is left.
  ASSERT_TRUE(store->Flush().ok());
  for (uint64_t k : {1, 2, 3, 4, 5, 6}) ExpectSsdBlock(*store, k);
}

// Lookups faster than the disk never fill the CPU tier with promotions: past
// max_promotions_in_flight a lookup of an SSD-only block answers RETRY without starting one.
TEST_F(TieredStoreTest, PromotionsPastTheCapAnswerRetryWithoutReservingSlots) {
  TieredStoreOptions options = Options(4, 32);
  options.max_promotions_in_flight = 2;
  auto store = Open(options);
  Store(*store, Keys({1, 2, 3, 4}));
  store->WaitIdle();
  Store(*store, Keys({11, 12, 13, 14}));  // 1..4 now only on SSD
  store->WaitIdle();
  gate_.Close();
  for (uint64_t k : {1, 2, 3, 4}) EXPECT_EQ(store->Lookup(Key(k)), LookupResult::kRetry) << k;
  EXPECT_EQ(store->stats().promotions_started, 2u);
  EXPECT_EQ(store->stats().promotions_deferred, 2u);
  // Two CPU slots are being written; the other two still take a store.
  Store(*store, Keys({21, 22}));
  gate_.Open();
  store->WaitIdle();
  // A later lookup starts what was deferred.
  for (uint64_t k : {3, 4}) EXPECT_EQ(store->Lookup(Key(k)), LookupResult::kRetry) << k;
  store->WaitIdle();
  for (uint64_t k : {3, 4}) EXPECT_EQ(store->Lookup(Key(k)), LookupResult::kHit) << k;
}

// Recency on SSD follows the same rule as in the CPU tier: a touched block outlives blocks
// written after it that nobody used.
TEST_F(TieredStoreTest, TouchKeepsABlockOnSsdOverNewerUntouchedOnes) {
  auto store = Open(Options(2, 4));
  Store(*store, Keys({1, 2}));
  store->WaitIdle();
  Store(*store, Keys({3, 4}));  // SSD full, 1 and 2 only there, 1 the least recently written
  store->WaitIdle();
  store->Touch(Keys({1}));
  Store(*store, Keys({5}));  // the SSD tier evicts its least recent: 2, not 1
  store->WaitIdle();
  std::vector<std::byte> out;
  EXPECT_TRUE(store->ssd()->Get(Key(1), &out).ok());
  EXPECT_EQ(store->ssd()->Get(Key(2), &out).code(), StatusCode::kNotFound);
  ExpectSsdBlock(*store, 5);
}

// A CPU quota bounds a namespace's stores and promotions alike: a promotion into a namespace at
// its quota evicts that namespace's own CPU block (still on SSD), and one that cannot is asked
// for again (RETRY: the block is held, docs/semantics.md §5).
TEST_F(TieredStoreTest, CpuQuotaBoundsStoresAndPromotions) {
  constexpr NamespaceId kA = 1, kB = 2;
  TieredStoreOptions options = Options(8, 32);
  options.cpu_quotas.blocks[kA] = 2;
  auto store = Open(options);
  using testing::NsKey;
  using testing::NsKeys;
  Store(*store, NsKeys(kA, {1, 2}));
  Store(*store, NsKeys(kB, {1, 2, 3}));
  store->WaitIdle();
  Store(*store, NsKeys(kA, {3}));  // A's block 1 leaves the CPU tier; its SSD copy stays
  store->WaitIdle();
  EXPECT_EQ(store->stats().cpu_evictions, 1u);
  EXPECT_EQ(store->Lookup(NsKey(kA, 1)), LookupResult::kRetry);  // promoted, evicting A's 2
  store->WaitIdle();
  EXPECT_EQ(store->Lookup(NsKey(kA, 1)), LookupResult::kHit);
  EXPECT_EQ(store->Lookup(NsKey(kA, 3)), LookupResult::kHit);
  for (uint64_t k : {1, 2, 3}) EXPECT_EQ(store->Lookup(NsKey(kB, k)), LookupResult::kHit);
  EXPECT_THAT(store->cpu().NamespaceUsages(),
              ::testing::ElementsAre(NamespaceUsage{kA, 2, 2}, NamespaceUsage{kB, 3, {}}));
  // With both of A's CPU blocks pinned, neither a promotion nor a store of A finds room.
  std::vector<std::span<const std::byte>> blocks;
  ASSERT_TRUE(store->PrepareLoad(NsKeys(kA, {1, 3}), &blocks).ok());
  const uint64_t deferred = store->stats().promotions_deferred;
  EXPECT_EQ(store->Lookup(NsKey(kA, 2)), LookupResult::kRetry);
  EXPECT_EQ(store->stats().promotions_deferred, deferred + 1);
  EXPECT_EQ(store->stats().promotions_started, 1u);  // the first promotion only
  StorePlan plan;
  EXPECT_EQ(store->PrepareStore(NsKeys(kA, {4}), &plan).code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(store->stats().quota_refusals, 2u);
  ASSERT_TRUE(store->CompleteLoad(NsKeys(kA, {1, 3})).ok());
  EXPECT_EQ(store->Lookup(NsKey(kA, 2)), LookupResult::kRetry);
  store->WaitIdle();
}

// A block held only on SSD while every CPU slot is pinned is asked for again, never a miss;
// once a pin goes it is promoted.
TEST_F(TieredStoreTest, ABlockOnSsdWithTheCpuTierPinnedFullIsARetryNotAMiss) {
  auto store = Open(Options(2, 16));
  Store(*store, Keys({1, 2}));
  store->WaitIdle();
  Store(*store, Keys({3, 4}));  // 1 and 2 now only on SSD
  store->WaitIdle();
  std::vector<std::span<const std::byte>> blocks;
  ASSERT_TRUE(store->PrepareLoad(Keys({3, 4}), &blocks).ok());  // the whole CPU tier pinned
  EXPECT_EQ(store->Lookup(Key(1)), LookupResult::kRetry);
  EXPECT_EQ(store->stats().promotions_started, 0u);
  ASSERT_TRUE(store->CompleteLoad(Keys({3})).ok());
  EXPECT_EQ(store->Lookup(Key(1)), LookupResult::kRetry);  // promoted now, over block 3
  store->WaitIdle();
  EXPECT_EQ(store->Lookup(Key(1)), LookupResult::kHit);
  ExpectCpuBlock(*store, 1);
  ASSERT_TRUE(store->CompleteLoad(Keys({4})).ok());
}

TEST_F(TieredStoreTest, PromotedBlockIsPinnedOnSsdAgainstEviction) {
  auto store = Open(Options(2, 2));
  for (uint64_t k : {1, 2}) {
    std::vector<std::byte> bytes(kBlock);
    FillPattern(k, bytes);
    ASSERT_TRUE(store->ssd()->Put(Key(k), bytes).ok());
  }
  gate_.Close();
  EXPECT_EQ(store->Lookup(Key(1)), LookupResult::kRetry);  // promotion waits at the gate
  // The SSD tier needs room: 1 is the least recent but pinned by the promotion, so 2 goes.
  std::vector<std::byte> bytes(kBlock);
  FillPattern(3, bytes);
  ASSERT_TRUE(store->ssd()->Put(Key(3), bytes).ok());
  EXPECT_EQ(store->ssd()->Lookup(Key(2)), LookupResult::kMiss);
  EXPECT_EQ(store->ssd()->Lookup(Key(1)), LookupResult::kHit);
  gate_.Open();
  store->WaitIdle();
  ExpectCpuBlock(*store, 1);
}

// A cascade that cannot start (every SSD slot pinned by promotions) leaves its block to be
// written at its eviction; before, the block was on no list, and its eviction took it as on
// SSD already: a committed block lost (the soak test's "committed block missed").
TEST_F(TieredStoreTest, ACascadeThatCannotStartWritesItsBlockAtEviction) {
  auto store = Open(Options(8, 3));
  for (uint64_t k : {7, 8, 9}) {
    std::vector<std::byte> bytes(kBlock);
    FillPattern(k, bytes);
    ASSERT_TRUE(store->ssd()->Put(Key(k), bytes).ok());
  }
  gate_.Close();
  for (uint64_t k : {7, 8, 9}) EXPECT_EQ(store->Lookup(Key(k)), LookupResult::kRetry);
  Store(*store, Keys({1}));  // its cascade finds every SSD slot pinned by a promotion
  EXPECT_EQ(store->stats().cascade_failures, 1u);
  gate_.Open();
  store->WaitIdle();
  Store(*store, Keys({2, 3, 4, 5}));  // the CPU tier full: 1, 7, 8, 9, 2..5
  store->WaitIdle();
  store->Touch(Keys({7, 8, 9, 2, 3, 4, 5}));  // 1 the least recent
  Store(*store, Keys({6}));                   // evicts 1
  store->WaitIdle();
  EXPECT_NE(store->Lookup(Key(1)), LookupResult::kMiss);  // on SSD: promoted
  store->WaitIdle();
  ExpectCpuBlock(*store, 1);
}

// One lookup of several keys: a promotion early in it evicts a block looked up later in it.
// That block's write-back is planned after the last key, so it was answered MISS though held
// (the soak test's "committed block missed", 1 lookup in about 10^5); it is a RETRY.
TEST_F(TieredStoreTest, ABlockEvictedByAPromotionOfTheSameLookupIsARetry) {
  auto store = Open(Options(2, 16, CascadeMode::kWriteBack));
  std::vector<std::byte> bytes(kBlock);
  FillPattern(9, bytes);
  ASSERT_TRUE(store->ssd()->Put(Key(9), bytes).ok());
  Store(*store, Keys({1}));
  Store(*store, Keys({2}));  // the CPU tier full; 1 the least recent, on no SSD yet
  std::vector<LookupResult> results(3);
  store->Lookup(Keys({9, 1, 2}), results);  // promoting 9 evicts 1
  EXPECT_EQ(results[0], LookupResult::kRetry);
  EXPECT_EQ(results[1], LookupResult::kRetry) << "1 is being written back, not missing";
  EXPECT_EQ(results[2], LookupResult::kHit);
  store->WaitIdle();
  ExpectSsdBlock(*store, 1);
  ExpectCpuBlock(*store, 9);
}

TEST_F(TieredStoreTest, FailedStoreLeavesNothing) {
  auto store = Open(Options(4, 16));
  StorePlan plan;
  ASSERT_TRUE(store->PrepareStore(Keys({1, 2}), &plan).ok());
  EXPECT_EQ(store->Lookup(Key(1)), LookupResult::kRetry);
  store->CompleteStore(Keys({1, 2}), false);
  store->WaitIdle();
  EXPECT_EQ(store->Lookup(Key(1)), LookupResult::kMiss);
  EXPECT_EQ(store->Lookup(Key(2)), LookupResult::kMiss);
  EXPECT_EQ(store->cpu().resident_blocks(), 0u);
  EXPECT_EQ(store->ssd()->resident_blocks(), 0u);
  EXPECT_EQ(store->stats().cascades_done, 0u);
}

TEST_F(TieredStoreTest, CorruptSsdBlockIsAMissAfterPromotion) {
  const TieredStoreOptions options = Options(1, 16);
  {
    auto store = Open(options);
    Store(*store, Keys({1}));
    store->WaitIdle();
  }
  {
    // Key 1 is in SSD slot 0.
    std::fstream f(options.ssd->dir + "/blocks.dat", std::ios::in | std::ios::out);
    f.seekp(100);
    f.put('\x7f');
  }
  auto store = Open(options);
  EXPECT_EQ(store->Lookup(Key(1)), LookupResult::kRetry);
  store->WaitIdle();
  EXPECT_EQ(store->Lookup(Key(1)), LookupResult::kMiss);
  EXPECT_EQ(store->stats().promotion_failures, 1u);
  EXPECT_EQ(store->ssd()->stats().checksum_failures, 1u);
  EXPECT_EQ(store->ssd()->Lookup(Key(1)), LookupResult::kMiss);
  // The CPU slot it would have used is free again.
  Store(*store, Keys({2}));
  ExpectCpuBlock(*store, 2);
}

TEST_F(TieredStoreTest, RestartServesCommittedBlocksFromSsd) {
  const TieredStoreOptions options = Options(4, 16);
  {
    auto store = Open(options);
    Store(*store, Keys({1, 2, 3}));
  }  // the destructor waits for the cascades
  auto store = Open(options);
  EXPECT_EQ(store->cpu().resident_blocks(), 0u);
  const std::vector<BlockKey> keys = Keys({1, 2, 3});
  EXPECT_EQ(store->LookupPrefix(keys), std::nullopt);
  store->WaitIdle();
  EXPECT_EQ(store->LookupPrefix(keys), ScanResult(3));
  for (uint64_t k : {1, 2, 3}) ExpectCpuBlock(*store, k);
}

TEST_F(TieredStoreTest, WriteBackFlushPersistsCpuBlocks) {
  const TieredStoreOptions options = Options(4, 16, CascadeMode::kWriteBack);
  {
    auto store = Open(options);
    Store(*store, Keys({1, 2}));
    EXPECT_EQ(store->ssd()->resident_blocks(), 0u);
    ASSERT_TRUE(store->Flush().ok());
    EXPECT_EQ(store->ssd()->resident_blocks(), 2u);
  }
  auto store = Open(options);
  ExpectSsdBlock(*store, 1);
  ExpectSsdBlock(*store, 2);
}

}  // namespace
}  // namespace kvstash::store

namespace kvstash::store {
namespace {

// Several threads store, look up (promoting from SSD) and load through a small CPU tier over a
// small SSD tier; every block any thread reads must hold exactly the bytes stored for its key.
class TieredStoreStressTest : public ::testing::TestWithParam<CascadeMode> {};

TEST_P(TieredStoreStressTest, ConcurrentTrafficNeverServesWrongBytes) {
  TempDir dir;
  TieredStoreOptions options;
  options.block_bytes = 4096;
  options.cpu_capacity_blocks = 16;
  options.prefault = false;
  options.cascade = GetParam();
  options.writeback_staging_blocks = 4;
  SsdTierOptions ssd;
  ssd.dir = dir / "ssd";
  ssd.capacity_bytes = 48 * 4096;
  options.ssd = ssd;
  auto opened = TieredStore::Create(options);
  ASSERT_TRUE(opened.ok()) << opened.status().ToString();
  TieredStore& store = **opened;

  constexpr int kThreads = 4;
  constexpr int kOps = 3000;
  constexpr uint64_t kKeys = 96;
  std::atomic<uint64_t> loads{0}, wrong{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      uint64_t x = 0x9e3779b97f4a7c15ULL * (t + 1);
      auto next = [&x] {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        return x;
      };
      for (int op = 0; op < kOps; ++op) {
        // Let the I/O threads catch up now and then: with every CPU block pinned by queued
        // cascades, stores and promotions are refused (correctly) and nothing is exercised.
        if (op % 32 == 31) store.WaitIdle();
        const uint64_t k = next() % kKeys;
        const std::vector<BlockKey> keys = {Key(k), Key((k + 1) % kKeys)};
        switch (next() % 4) {
          case 0: {
            StorePlan plan;
            if (!store.PrepareStore(keys, &plan).ok()) break;
            for (size_t i = 0; i < plan.keys_to_store.size(); ++i) {
              FillPattern(plan.keys_to_store[i].hash.lo, store.CpuSlot(plan.slots[i]));
            }
            store.CompleteStore(plan.keys_to_store, next() % 8 != 0);  // some stores fail
            break;
          }
          case 1: {
            std::vector<LookupResult> results(keys.size());
            store.Lookup(keys, results);
            break;
          }
          case 2:
            store.LookupPrefix(keys).has_value();
            break;
          case 3: {
            // One key: a pair is rarely resident in a 16-block CPU tier at the same moment.
            const std::vector<BlockKey> one = {keys[0]};
            std::vector<std::span<const std::byte>> blocks;
            if (!store.PrepareLoad(one, &blocks).ok()) break;
            if (!MatchesPattern(one[0].hash.lo, blocks[0])) ++wrong;
            loads += 1;
            EXPECT_TRUE(store.CompleteLoad(one).ok());
            break;
          }
        }
      }
    });
  }
  for (std::thread& t : threads) t.join();
  store.WaitIdle();
  EXPECT_EQ(wrong, 0u);
  EXPECT_GT(loads, 0u);
  const TieredStoreStats stats = store.stats();
  EXPECT_GT(stats.promotions_done, 0u);
  EXPECT_GT(stats.cascades_done, 0u);
  EXPECT_EQ(stats.promotion_failures, 0u);
  EXPECT_EQ(store.ssd()->stats().checksum_failures, 0u);
  // Every block either tier holds now reads back intact.
  for (uint64_t k = 0; k < kKeys; ++k) {
    if (store.ssd()->Lookup(Key(k)) == LookupResult::kHit) {
      std::vector<std::byte> out;
      ASSERT_TRUE(store.ssd()->Get(Key(k), &out).ok()) << k;
      EXPECT_TRUE(MatchesPattern(k, out)) << k;
    }
  }
  // Nothing is left pinned or in flight: the whole CPU tier can be replaced.
  std::vector<BlockKey> fresh;
  for (uint64_t k = 1000; k < 1016; ++k) fresh.push_back(Key(k));
  StorePlan plan;
  EXPECT_TRUE(store.PrepareStore(fresh, &plan).ok());
  store.CompleteStore(fresh, false);
}

INSTANTIATE_TEST_SUITE_P(Modes, TieredStoreStressTest,
                         ::testing::Values(CascadeMode::kWriteThrough, CascadeMode::kWriteBack),
                         [](const auto& param_info) {
                           return param_info.param == CascadeMode::kWriteBack ? "write_back"
                                                                              : "write_through";
                         });

}  // namespace
}  // namespace kvstash::store
