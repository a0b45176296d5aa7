#include "kvstash/connector/offload_scheduler.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <numeric>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "kvstash/common/hash.h"

namespace kvstash::connector {
namespace {

using ::testing::ElementsAre;
using ::testing::ElementsAreArray;
using ::testing::IsEmpty;

using KeySet = std::set<BlockKey>;

// An offload manager that records every call. Lookups answer from `lookup` when it is set, else
// as a real manager would: kHit once a store completed, kRetry while it is being written, kMiss
// otherwise. `prepare_store` decides what to store (by default every key offered, as vLLM's
// tests do).
class FakeManager : public OffloadManager {
 public:
  using StorePolicy =
      std::function<std::optional<std::vector<BlockKey>>(std::span<const BlockKey>)>;

  LookupResult Lookup(const BlockKey& key) override {
    lookups.push_back(key);
    if (lookup) return lookup(key);
    if (stored.contains(key)) return LookupResult::kHit;
    if (writing.contains(key)) return LookupResult::kRetry;
    return LookupResult::kMiss;
  }
  void PrepareLoad(std::span<const BlockKey> keys) override {
    prepare_loads.emplace_back(keys.begin(), keys.end());
  }
  void CompleteLoad(std::span<const BlockKey> keys) override {
    complete_loads.emplace_back(keys.begin(), keys.end());
  }
  std::optional<std::vector<BlockKey>> PrepareStore(std::span<const BlockKey> keys) override {
    prepare_stores.emplace_back(keys.begin(), keys.end());
    std::optional<std::vector<BlockKey>> out =
        prepare_store ? prepare_store(keys) : std::vector<BlockKey>(keys.begin(), keys.end());
    if (out.has_value()) writing.insert(out->begin(), out->end());
    return out;
  }
  void CompleteStore(std::span<const BlockKey> keys) override {
    complete_stores.emplace_back(keys.begin(), keys.end());
    for (const BlockKey& key : keys) {
      writing.erase(key);
      stored.insert(key);
    }
  }
  void Touch(std::span<const BlockKey> keys) override {
    touches.emplace_back(keys.begin(), keys.end());
  }
  void ResetCache() override {
    ++reset_calls;
    stored.clear();
    writing.clear();
  }

  void ClearLog() {
    lookups.clear();
    touches.clear();
    prepare_stores.clear();
    complete_stores.clear();
    prepare_loads.clear();
    complete_loads.clear();
    reset_calls = 0;
  }

  std::function<LookupResult(const BlockKey&)> lookup;
  StorePolicy prepare_store;
  KeySet stored;
  KeySet writing;

  std::vector<BlockKey> lookups;
  std::vector<std::vector<BlockKey>> touches;
  std::vector<std::vector<BlockKey>> prepare_stores;
  std::vector<std::vector<BlockKey>> complete_stores;
  std::vector<std::vector<BlockKey>> prepare_loads;
  std::vector<std::vector<BlockKey>> complete_loads;
  int reset_calls = 0;
};

std::optional<std::vector<BlockKey>> StoreAll(std::span<const BlockKey> keys) {
  return std::vector<BlockKey>(keys.begin(), keys.end());
}
std::optional<std::vector<BlockKey>> StoreNone(std::span<const BlockKey>) {
  return std::vector<BlockKey>();
}
std::optional<std::vector<BlockKey>> Refuse(std::span<const BlockKey>) { return std::nullopt; }
LookupResult AllHit(const BlockKey&) { return LookupResult::kHit; }

// A full-attention block's metadata as a store job carries it.
BlockMeta FullMeta(std::optional<BlockHash> parent, uint32_t tokens) {
  BlockMeta meta;
  meta.parent = parent;
  meta.tokens = tokens;
  meta.kind = BlockMeta::Kind::kFull;
  return meta;
}

struct Fixture {
  std::unique_ptr<OffloadScheduler> scheduler;
  FakeManager* manager = nullptr;  // owned by scheduler
};

Fixture MakeScheduler(OffloadSchedulerOptions options) {
  auto manager = std::make_unique<FakeManager>();
  Fixture fixture;
  fixture.manager = manager.get();
  auto scheduler = OffloadScheduler::Create(std::move(options), std::move(manager));
  EXPECT_TRUE(scheduler.ok()) << scheduler.status().ToString();
  fixture.scheduler = std::move(scheduler).value();
  return fixture;
}

BlockHash H(uint64_t i) { return BlockHash{i, 0x5eed}; }

ScheduledRequestView Sched(const OffloadRequestView& request, size_t num_computed,
                           size_t num_scheduled, std::vector<std::vector<GpuBlockId>> blocks = {}) {
  ScheduledRequestView view;
  view.request = request;
  view.num_computed_tokens = num_computed;
  view.num_scheduled_tokens = num_scheduled;
  view.new_block_ids = std::move(blocks);
  return view;
}
SchedulerStepView Step(std::vector<ScheduledRequestView> scheduled,
                       std::vector<RequestId> finished = {},
                       std::vector<RequestId> preempted = {}) {
  SchedulerStepView step;
  step.scheduled = std::move(scheduled);
  step.finished = std::move(finished);
  step.preempted = std::move(preempted);
  return step;
}
std::vector<BlockHash> Hashes(size_t n) {
  std::vector<BlockHash> hashes;
  for (size_t i = 0; i < n; ++i) hashes.push_back(H(i));
  return hashes;
}

// ------------------------------------------------------------------------------------------
// Configuration (§7.1) and keys (§7.2)

TEST(OffloadSchedulerConfigTest, WindowBlocksPerKindAndLookupOrder) {
  using K = OffloadGroupKind;
  Fixture f = MakeScheduler({.groups = {{K::kFull, 4, 1, 0},
                                        {K::kSlidingWindow, 4, 1, 8},
                                        {K::kState, 4, 1, 0},
                                        {K::kChunkedLocal, 4, 1, 10},
                                        {K::kSlidingWindow, 4, 1, 16},
                                        {K::kFull, 4, 1, 0},
                                        {K::kSlidingWindow, 4, 3, 13}},
                             .hash_block_size = 4});
  std::vector<std::optional<uint32_t>> windows;
  for (const OffloadGroupInfo& g : f.scheduler->groups()) windows.push_back(g.window_blocks);
  // Sliding: ceil(window / offloaded block); state: 1; chunked-local: ceil(chunk / block).
  EXPECT_THAT(windows, ElementsAre(std::nullopt, 2u, 1u, 3u, 4u, std::nullopt, 2u));
  EXPECT_EQ(f.scheduler->groups()[6].offloaded_block_size, 12u);
  EXPECT_EQ(f.scheduler->groups()[6].hashes_per_block, 3u);
  // Full groups first, then windows widest first (ties in group order).
  EXPECT_THAT(f.scheduler->lookup_order(), ElementsAre(0u, 5u, 4u, 3u, 1u, 6u, 2u));
}

TEST(OffloadSchedulerConfigTest, CreateRejectsBadOptions) {
  using K = OffloadGroupKind;
  auto create = [](OffloadSchedulerOptions options) {
    return OffloadScheduler::Create(std::move(options), std::make_unique<FakeManager>()).status();
  };
  EXPECT_EQ(create({.groups = {}}).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(create({.groups = {{K::kFull, 6, 1, 0}}, .hash_block_size = 4}).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(create({.groups = {{K::kSlidingWindow, 4, 1, 0}}, .hash_block_size = 4}).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(create({.groups = {{K::kFull, 4, 0, 0}}, .hash_block_size = 4}).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(create({.groups = {{K::kFull, 4, 1, 0}}, .hash_block_size = 4, .world_size = 0}).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(OffloadScheduler::Create({.groups = {{}}}, nullptr).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_TRUE(create({.groups = {{K::kFull, 12, 1, 0}}, .hash_block_size = 4}).ok());
}

TEST(OffloadSchedulerKeysTest, KeyIsLastHashOfEachOffloadedBlockAndGrowsIncrementally) {
  // §7.2: f = 3, hashes h0..h6 -> [h2, h5]; with h7, h8 added -> [h2, h5, h8].
  Fixture f = MakeScheduler({.groups = {{OffloadGroupKind::kFull, 4, 3, 0}}, .hash_block_size = 4});
  std::vector<BlockHash> hashes = Hashes(7);
  OffloadRequestView view{.id = 1, .num_tokens = 28, .block_hashes = hashes};
  EXPECT_EQ(f.scheduler->GetNumNewMatchedTokens(view, 0), 0u);
  ASSERT_EQ(f.manager->touches.size(), 1u);  // a full group touches all its keys
  EXPECT_THAT(f.manager->touches[0], ElementsAre(BlockKey{H(2), 0}, BlockKey{H(5), 0}));
  hashes = Hashes(9);
  view.num_tokens = 36;
  view.block_hashes = hashes;
  EXPECT_EQ(f.scheduler->GetNumNewMatchedTokens(view, 0), 0u);
  EXPECT_THAT(f.manager->touches.back(),
              ElementsAre(BlockKey{H(2), 0}, BlockKey{H(5), 0}, BlockKey{H(8), 0}));
}

TEST(OffloadSchedulerKeysTest, GroupsOfDifferentBlockSizesKeyTheirOwnBlocks) {
  // Hash block 4; groups of 12 and 16 tokens: keys h2, h5, ... and h3, h7, ...
  Fixture f = MakeScheduler(
      {.groups = {{OffloadGroupKind::kFull, 12, 1, 0}, {OffloadGroupKind::kFull, 16, 1, 0}},
       .hash_block_size = 4});
  std::vector<BlockHash> hashes = Hashes(8);
  EXPECT_EQ(
      f.scheduler->GetNumNewMatchedTokens({.id = 1, .num_tokens = 33, .block_hashes = hashes}, 0),
      0u);
  ASSERT_EQ(f.manager->touches.size(), 2u);
  EXPECT_THAT(f.manager->touches[0], ElementsAre(BlockKey{H(2), 0}, BlockKey{H(5), 0}));
  EXPECT_THAT(f.manager->touches[1], ElementsAre(BlockKey{H(3), 1}, BlockKey{H(7), 1}));
}

// ------------------------------------------------------------------------------------------
// §12.G: `_lookup` across groups. A group is (offloaded block size, window in blocks); -1 is
// full attention, window 1 is the state (mamba) case. Request hashes are H(0), H(1), ... at a
// hash block of 4 tokens, so key i of a group of f hashes per block is H(i*f + f - 1).

struct LookupGroup {
  uint32_t block = 4;
  int window = -1;
};

struct Loader {  // a second request whose load puts keys into the blocks being loaded
  size_t num_tokens = 0;
  size_t computed = 0;
  std::vector<std::vector<GpuBlockId>> tables;
};

struct LookupVector {
  std::string id;
  std::vector<LookupGroup> groups;
  size_t num_tokens = 0;
  size_t computed = 0;
  std::vector<std::set<size_t>> hits;   // per group
  std::vector<std::set<size_t>> retry;  // per group (vLLM's None)
  std::optional<size_t> result;
  std::vector<std::pair<uint32_t, size_t>> order;
  std::optional<Loader> loader;
  std::vector<std::pair<uint32_t, size_t>> being_loaded;  // expected, when a loader is given
};

std::vector<std::pair<uint32_t, size_t>> Seq(uint32_t g, size_t from, size_t to) {
  std::vector<std::pair<uint32_t, size_t>> out;
  for (size_t i = from; i <= to; ++i) out.emplace_back(g, i);
  return out;
}
std::vector<std::pair<uint32_t, size_t>> Cat(
    std::initializer_list<std::vector<std::pair<uint32_t, size_t>>> parts) {
  std::vector<std::pair<uint32_t, size_t>> out;
  for (const auto& part : parts) out.insert(out.end(), part.begin(), part.end());
  return out;
}
std::vector<std::pair<uint32_t, size_t>> At(std::initializer_list<std::pair<uint32_t, size_t>> l) {
  return l;
}

std::vector<LookupVector> LookupVectors() {
  const std::vector<LookupGroup> full = {{4, -1}};
  const std::vector<LookupGroup> hybrid = {{4, -1}, {4, 2}};
  const std::vector<LookupGroup> mamba = {{4, -1}, {4, 1}};
  const std::vector<LookupGroup> three = {{4, -1}, {4, 3}, {4, 1}};
  const std::vector<LookupGroup> sizes = {{12, -1}, {16, -1}};
  const auto h1_order = Cat({Seq(0, 0, 2), At({{1, 2}, {1, 1}})});
  return {
      {"L1", full, 17, 0, {{0, 1, 2}}, {{}}, 12, Seq(0, 0, 3), std::nullopt, {}},
      {"L2", full, 17, 0, {{}}, {{}}, 0, At({{0, 0}}), std::nullopt, {}},
      {"L3", full, 17, 0, {{0, 1, 2, 3}}, {{}}, 16, Seq(0, 0, 3), std::nullopt, {}},
      {"L4", full, 16, 0, {{0, 1, 2, 3}}, {{}}, 16, Seq(0, 0, 3), std::nullopt, {}},
      {"L5", full, 17, 0, {{1, 2, 3}}, {{}}, 0, At({{0, 0}}), std::nullopt, {}},
      {"L6", full, 17, 4, {{1, 2}}, {{}}, 8, Seq(0, 1, 3), std::nullopt, {}},
      {"L7", full, 17, 16, {{0, 1, 2, 3}}, {{}}, 0, {}, std::nullopt, {}},
      {"L8", full, 17, 14, {{3}}, {{}}, 0, {}, std::nullopt, {}},
      {"L9", full, 17, 0, {{0, 2}}, {{1}}, std::nullopt, Seq(0, 0, 3), std::nullopt, {}},
      {"H1", hybrid, 13, 0, {{0, 1, 2}, {0, 1, 2}}, {{}, {}}, 12, h1_order, std::nullopt, {}},
      {"H2", hybrid, 13, 0, {{0, 1, 2}, {1, 2}}, {{}, {}}, 12, h1_order, std::nullopt, {}},
      {"H3",
       hybrid,
       13,
       0,
       {{0, 1, 2}, {0, 1}},
       {{}, {}},
       8,
       Cat({Seq(0, 0, 2), At({{1, 2}, {1, 1}, {1, 0}})}),
       std::nullopt,
       {}},
      {"H4",
       hybrid,
       13,
       0,
       {{0, 1, 2}, {2}},
       {{}, {}},
       0,
       Cat({Seq(0, 0, 2), At({{1, 2}, {1, 1}, {1, 0}})}),
       std::nullopt,
       {}},
      {"H5",
       hybrid,
       13,
       0,
       {{0, 1}, {0, 1, 2}},
       {{}, {}},
       8,
       Cat({Seq(0, 0, 2), At({{1, 1}, {1, 0}})}),
       std::nullopt,
       {}},
      {"H6",
       hybrid,
       13,
       0,
       {{0}, {0, 1, 2}},
       {{}, {}},
       4,
       At({{0, 0}, {0, 1}, {1, 0}}),
       std::nullopt,
       {}},
      {"H7",
       hybrid,
       17,
       0,
       {{0, 1, 2, 3}, {0, 1, 2, 3}},
       {{}, {}},
       16,
       Cat({Seq(0, 0, 3), At({{1, 3}, {1, 2}})}),
       std::nullopt,
       {}},
      {"H8",
       hybrid,
       17,
       4,
       {{1, 2, 3}, {2, 3}},
       {{}, {}},
       12,
       Cat({Seq(0, 1, 3), At({{1, 3}, {1, 2}})}),
       std::nullopt,
       {}},
      {"H9", hybrid, 12, 0, {{0, 1, 2}, {0, 1, 2}}, {{}, {}}, 11, h1_order, std::nullopt, {}},
      {"M1",
       mamba,
       13,
       0,
       {{0, 1, 2}, {2}},
       {{}, {}},
       12,
       Cat({Seq(0, 0, 2), At({{1, 2}})}),
       std::nullopt,
       {}},
      {"M2",
       mamba,
       13,
       0,
       {{0, 1, 2}, {1}},
       {{}, {}},
       8,
       Cat({Seq(0, 0, 2), At({{1, 2}, {1, 1}})}),
       std::nullopt,
       {}},
      {"M3",
       mamba,
       13,
       0,
       {{0, 1, 2}, {0}},
       {{}, {}},
       4,
       Cat({Seq(0, 0, 2), At({{1, 2}, {1, 1}, {1, 0}})}),
       std::nullopt,
       {}},
      {"S1",
       three,
       21,
       0,
       {{0, 1, 2, 3, 4}, {2, 3, 4}, {3}},
       {{}, {}, {}},
       0,
       Cat({Seq(0, 0, 4),
            At({{1, 4}, {1, 3}, {1, 2}, {2, 4}, {2, 3}, {1, 3}, {1, 2}, {1, 1}, {1, 0}})}),
       std::nullopt,
       {}},
      {"S2",
       three,
       21,
       0,
       {{0, 1, 2, 3, 4}, {1, 2, 3, 4}, {3}},
       {{}, {}, {}},
       16,
       Cat({Seq(0, 0, 4),
            At({{1, 4}, {1, 3}, {1, 2}, {2, 4}, {2, 3}, {1, 3}, {1, 2}, {1, 1}, {2, 3}})}),
       std::nullopt,
       {}},
      {"S3",
       {{4, 3}, {4, 1}},
       21,
       0,
       {{1, 2, 3, 4}, {3}},
       {{}, {}},
       16,
       At({{0, 4}, {0, 3}, {0, 2}, {1, 4}, {1, 3}, {0, 3}, {0, 2}, {0, 1}, {1, 3}}),
       std::nullopt,
       {}},
      {"D1",
       hybrid,
       13,
       0,
       {{0, 1}, {0, 1, 2}},
       {{2}, {}},
       std::nullopt,
       At({{0, 0}, {0, 1}, {0, 2}, {1, 2}, {1, 1}}),
       std::nullopt,
       {}},
      {"D2",
       hybrid,
       13,
       0,
       {{0, 1, 2}, {0, 2}},
       {{}, {1}},
       std::nullopt,
       Cat({Seq(0, 0, 2), At({{1, 2}, {1, 1}, {1, 0}})}),
       std::nullopt,
       {}},
      {"D3",
       hybrid,
       13,
       0,
       {{0, 1}, {0, 1}},
       {{}, {2}},
       8,
       At({{0, 0}, {0, 1}, {0, 2}, {1, 1}, {1, 0}}),
       std::nullopt,
       {}},
      {"D4",
       hybrid,
       13,
       0,
       {{0, 1}, {0}},
       {{2}, {}},
       4,
       At({{0, 0}, {0, 1}, {0, 2}, {1, 2}, {1, 1}, {1, 0}, {0, 0}, {1, 0}}),
       std::nullopt,
       {}},
      {"B1",
       sizes,
       49,
       0,
       {{0, 1, 2, 3}, {0, 1, 2}},
       {{}, {}},
       48,
       Cat({Seq(0, 0, 3), Seq(1, 0, 2)}),
       std::nullopt,
       {}},
      {"B2",
       sizes,
       85,
       48,
       {{0, 1, 2, 3, 4, 5, 6}, {0, 1, 2, 3, 4}},
       {{}, {}},
       32,
       At({{0, 4}, {0, 5}, {0, 6}, {1, 3}, {1, 4}}),
       std::nullopt,
       {}},
      // BL1: a load of key 1 (a request with a GPU hit of block 0, 8 tokens) is in flight.
      {"BL1",
       full,
       17,
       0,
       {{0, 1, 2}},
       {{}},
       std::nullopt,
       Seq(0, 0, 3),
       Loader{9, 4, {{5, 6}}},
       At({{0, 1}})},
      // BL2: a load of key 3 only; the hit ends before it.
      {"BL2",
       full,
       17,
       0,
       {{0, 1, 2}},
       {{}},
       12,
       Seq(0, 0, 3),
       Loader{17, 12, {{1, 2, 3, 7}}},
       At({{0, 3}})},
      // BL3: a load of key 0 of the window group only (the full group's table says it needs no
      // block: a null entry); only the window's last 2 keys of the hit are checked.
      {"BL3",
       hybrid,
       13,
       0,
       {{0, 1, 2}, {0, 1, 2}},
       {{}, {}},
       12,
       h1_order,
       Loader{5, 0, {{kNullGpuBlock}, {7}}},
       At({{1, 0}})},
  };
}

TEST(OffloadSchedulerLookupTest, CrossGroupVectors) {
  for (const LookupVector& v : LookupVectors()) {
    SCOPED_TRACE(v.id);
    OffloadSchedulerOptions options{.groups = {}, .hash_block_size = 4};
    for (const LookupGroup& g : v.groups) {
      OffloadGroupConfig config{.gpu_block_size = g.block};
      if (g.window == 1) {
        config.kind = OffloadGroupKind::kState;
      } else if (g.window > 1) {
        config.kind = OffloadGroupKind::kSlidingWindow;
        config.window = g.window * g.block;  // ceil(window / block) blocks
      }
      options.groups.push_back(config);
    }
    Fixture f = MakeScheduler(options);
    auto index_of = [&](const BlockKey& key) {
      const uint64_t per_block = v.groups[key.group].block / 4;
      return static_cast<size_t>((key.hash.lo + 1) / per_block - 1);
    };
    std::vector<BlockHash> hashes = Hashes(v.num_tokens / 4);
    if (v.loader.has_value()) {
      f.manager->lookup = AllHit;
      const OffloadRequestView loader{
          .id = 99,
          .num_tokens = v.loader->num_tokens,
          .block_hashes = std::span(hashes).first(v.loader->num_tokens / 4)};
      const std::optional<size_t> loaded =
          f.scheduler->GetNumNewMatchedTokens(loader, v.loader->computed);
      ASSERT_TRUE(loaded.has_value() && *loaded > 0);
      ASSERT_TRUE(f.scheduler->UpdateStateAfterAlloc(loader, v.loader->tables, *loaded).ok());
      std::vector<std::pair<uint32_t, size_t>> being_loaded;
      for (const BlockKey& key : f.scheduler->BlocksBeingLoaded()) {
        being_loaded.emplace_back(key.group, index_of(key));
      }
      ASSERT_EQ(being_loaded, v.being_loaded);
    }
    f.manager->lookups.clear();
    f.manager->lookup = [&](const BlockKey& key) {
      const size_t i = index_of(key);
      if (v.hits[key.group].contains(i)) return LookupResult::kHit;
      if (v.retry[key.group].contains(i)) return LookupResult::kRetry;
      return LookupResult::kMiss;
    };
    const OffloadRequestView request{.id = 1, .num_tokens = v.num_tokens, .block_hashes = hashes};
    EXPECT_EQ(f.scheduler->GetNumNewMatchedTokens(request, v.computed), v.result);
    std::vector<std::pair<uint32_t, size_t>> order;
    for (const BlockKey& key : f.manager->lookups) order.emplace_back(key.group, index_of(key));
    EXPECT_EQ(order, v.order);
  }
}

TEST(OffloadSchedulerLookupTest, BlocksBeingLoadedAreIgnoredWithoutPrefixCaching) {
  Fixture f = MakeScheduler({.groups = {{}}, .hash_block_size = 16, .prefix_caching = false});
  f.manager->lookup = AllHit;
  std::vector<BlockHash> hashes = Hashes(2);
  const OffloadRequestView a{.id = 1, .num_tokens = 33, .block_hashes = hashes};
  ASSERT_EQ(f.scheduler->GetNumNewMatchedTokens(a, 0), 32u);
  const std::vector<std::vector<GpuBlockId>> tables = {{1, 2}};
  ASSERT_TRUE(f.scheduler->UpdateStateAfterAlloc(a, tables, 32).ok());
  EXPECT_THAT(f.scheduler->BlocksBeingLoaded(), IsEmpty());
  EXPECT_EQ(
      f.scheduler->GetNumNewMatchedTokens({.id = 2, .num_tokens = 33, .block_hashes = hashes}, 0),
      32u);
}

TEST(OffloadSchedulerLookupTest, ChunkedLocalIsLookedUpAsAWindowOfItsChunk) {
  // A chunk of 10 tokens over blocks of 4: a window of 3 blocks.
  Fixture f = MakeScheduler(
      {.groups = {{OffloadGroupKind::kFull, 4, 1, 0}, {OffloadGroupKind::kChunkedLocal, 4, 1, 10}},
       .hash_block_size = 4});
  const std::set<uint64_t> window_hits = {2, 3, 4};  // blocks 2..4 of group 1
  f.manager->lookup = [&](const BlockKey& key) {
    return key.group == 0 || window_hits.contains(key.hash.lo) ? LookupResult::kHit
                                                               : LookupResult::kMiss;
  };
  std::vector<BlockHash> hashes = Hashes(6);
  EXPECT_EQ(
      f.scheduler->GetNumNewMatchedTokens({.id = 1, .num_tokens = 25, .block_hashes = hashes}, 0),
      20u);
}

// ------------------------------------------------------------------------------------------
// §12.I: acknowledgements summed over workers, and completion after world_size of them.

TEST(OffloadSchedulerOutputTest, AggregatesAcknowledgementsAcrossWorkers) {
  EXPECT_EQ(
      AggregateCompletedJobs(std::vector<CompletedJobs>{{{42, 1}, {7, 1}}, {{42, 1}, {7, 1}}}),
      (CompletedJobs{{42, 2}, {7, 2}}));
  EXPECT_EQ(
      AggregateCompletedJobs(std::vector<CompletedJobs>{{{42, 1}, {7, 1}}, {{43, 1}, {8, 1}}}),
      (CompletedJobs{{42, 1}, {7, 1}, {43, 1}, {8, 1}}));
  EXPECT_EQ(AggregateCompletedJobs(std::vector<CompletedJobs>{
                {{42, 1}, {43, 1}, {7, 1}}, {{42, 1}, {7, 1}, {8, 1}}, {{42, 1}, {43, 1}, {8, 1}}}),
            (CompletedJobs{{42, 3}, {43, 2}, {7, 2}, {8, 2}}));
  EXPECT_THAT(AggregateCompletedJobs({}), IsEmpty());
}

// One full group of 4-token blocks; request 1 of 8 tokens scheduled in one step: a store job of
// its two blocks (GPU blocks 1 and 2).
struct StoredRequest {
  Fixture f;
  std::vector<BlockHash> hashes = Hashes(2);
  JobId job = 0;
};

StoredRequest StartStore(uint32_t world_size) {
  StoredRequest s{MakeScheduler({.groups = {{OffloadGroupKind::kFull, 4, 1, 0}},
                                 .hash_block_size = 4,
                                 .world_size = world_size})};
  const OffloadRequestView view{.id = 1, .num_tokens = 8, .block_hashes = s.hashes};
  EXPECT_EQ(s.f.scheduler->GetNumNewMatchedTokens(view, 0), 0u);
  auto meta = s.f.scheduler->BuildConnectorMeta(Step({Sched(view, 0, 8, {{1, 2}})}));
  EXPECT_TRUE(meta.ok());
  EXPECT_EQ(meta->store_jobs.size(), 1u);
  if (!meta->store_jobs.empty()) s.job = meta->store_jobs[0].id;
  return s;
}

TEST(OffloadSchedulerOutputTest, JobCompletesAfterEveryWorkerAcknowledged) {
  StoredRequest s = StartStore(/*world_size=*/2);
  OffloadScheduler& scheduler = *s.f.scheduler;
  ASSERT_TRUE(scheduler.UpdateConnectorOutput({{s.job, 1}}).ok());
  EXPECT_THAT(s.f.manager->complete_stores, IsEmpty());
  ASSERT_EQ(scheduler.InFlightJobs().size(), 1u);
  EXPECT_EQ(scheduler.InFlightJobs()[0].pending, 1u);
  ASSERT_TRUE(scheduler.UpdateConnectorOutput({{s.job, 1}}).ok());
  ASSERT_EQ(s.f.manager->complete_stores.size(), 1u);
  EXPECT_THAT(s.f.manager->complete_stores[0], ElementsAre(BlockKey{H(0), 0}, BlockKey{H(1), 0}));
  EXPECT_THAT(scheduler.InFlightJobs(), IsEmpty());
}

TEST(OffloadSchedulerOutputTest, RejectsBadAcknowledgementsWithoutApplyingAny) {
  StoredRequest s = StartStore(/*world_size=*/2);
  OffloadScheduler& scheduler = *s.f.scheduler;
  EXPECT_EQ(scheduler.UpdateConnectorOutput({{s.job, 3}}).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(scheduler.UpdateConnectorOutput({{s.job, 0}}).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(scheduler.UpdateConnectorOutput({{s.job, 2}, {s.job + 7, 1}}).code(),
            StatusCode::kNotFound);
  ASSERT_EQ(scheduler.InFlightJobs().size(), 1u);
  EXPECT_EQ(scheduler.InFlightJobs()[0].pending, 2u);
  EXPECT_THAT(s.f.manager->complete_stores, IsEmpty());
}

TEST(OffloadSchedulerOutputTest, IgnoresAcknowledgementsOfJobsFromBeforeAReset) {
  StoredRequest s = StartStore(/*world_size=*/1);
  OffloadScheduler& scheduler = *s.f.scheduler;
  scheduler.ResetCache();
  EXPECT_EQ(scheduler.stale_job_threshold(), s.job + 1);
  EXPECT_TRUE(scheduler.UpdateConnectorOutput({{s.job, 1}}).ok());
  EXPECT_THAT(s.f.manager->complete_stores, IsEmpty());
  auto meta = scheduler.BuildConnectorMeta({});
  ASSERT_TRUE(meta.ok());
  EXPECT_THAT(meta->jobs_to_flush, ElementsAre(s.job));
}

// ------------------------------------------------------------------------------------------
// Direct API checks of §7.5-§7.7 that the scenarios below do not reach.

TEST(OffloadSchedulerApiTest, UpdateStateAfterAllocRejectsBadCalls) {
  Fixture f = MakeScheduler({.groups = {{}}, .hash_block_size = 16});
  f.manager->lookup = AllHit;
  std::vector<BlockHash> hashes = Hashes(2);
  const OffloadRequestView view{.id = 1, .num_tokens = 33, .block_hashes = hashes};
  const std::vector<std::vector<GpuBlockId>> tables = {{1, 2}};
  EXPECT_EQ(f.scheduler->UpdateStateAfterAlloc(view, tables, 32).code(),
            StatusCode::kFailedPrecondition);                             // never looked up
  EXPECT_TRUE(f.scheduler->UpdateStateAfterAlloc(view, tables, 0).ok());  // nothing to load
  ASSERT_EQ(f.scheduler->GetNumNewMatchedTokens(view, 0), 32u);
  const std::vector<std::vector<GpuBlockId>> two_groups = {{1, 2}, {3, 4}};
  EXPECT_EQ(f.scheduler->UpdateStateAfterAlloc(view, two_groups, 32).code(),
            StatusCode::kInvalidArgument);
  const std::vector<std::vector<GpuBlockId>> short_table = {{1}};
  EXPECT_EQ(f.scheduler->UpdateStateAfterAlloc(view, short_table, 32).code(),
            StatusCode::kInvalidArgument);
  const std::vector<std::vector<GpuBlockId>> three_blocks = {{1, 2, 3}};
  EXPECT_EQ(f.scheduler->UpdateStateAfterAlloc(view, three_blocks, 48).code(),
            StatusCode::kFailedPrecondition);  // more than the keys cover
  EXPECT_THAT(f.scheduler->InFlightJobs(), IsEmpty());
  ASSERT_TRUE(f.scheduler->UpdateStateAfterAlloc(view, tables, 32).ok());
  EXPECT_EQ(f.scheduler->UpdateStateAfterAlloc(view, tables, 32).code(),
            StatusCode::kFailedPrecondition);  // a load in flight already
  // Scheduling it while the load runs is a caller error too.
  auto meta = f.scheduler->BuildConnectorMeta(Step({Sched(view, 0, 1, tables)}));
  EXPECT_EQ(meta.status().code(), StatusCode::kFailedPrecondition);
  meta = f.scheduler->BuildConnectorMeta(Step({Sched(view, 0, 1, two_groups)}));
  EXPECT_EQ(meta.status().code(), StatusCode::kInvalidArgument);
}

TEST(OffloadSchedulerApiTest, LoadJobMapsFreshBlocksPastTheGpuHitAndNullEntries) {
  // Factor 3 over 4-token GPU blocks; a GPU hit of 4 blocks (16 tokens) and a hit to 36 tokens:
  // the load starts at offloaded block 1 (GPU blocks 3..5), whose first sub-block is the hit's.
  Fixture f = MakeScheduler(
      {.groups = {{OffloadGroupKind::kFull, 4, 3, 0}, {OffloadGroupKind::kSlidingWindow, 4, 3, 12}},
       .hash_block_size = 4});
  f.manager->lookup = AllHit;
  std::vector<BlockHash> hashes = Hashes(10);
  const OffloadRequestView view{.id = 1, .num_tokens = 40, .block_hashes = hashes};
  ASSERT_EQ(f.scheduler->GetNumNewMatchedTokens(view, 16), 20u);
  // The window group skips its first 6 blocks (null), the full group hit 4.
  const std::vector<std::vector<GpuBlockId>> tables = {{11, 12, 13, 14, 21, 22, 23, 24, 25},
                                                       {0, 0, 0, 0, 0, 0, 31, 32, 33}};
  ASSERT_TRUE(f.scheduler->UpdateStateAfterAlloc(view, tables, 20).ok());
  auto meta = f.scheduler->BuildConnectorMeta({});
  ASSERT_TRUE(meta.ok());
  ASSERT_EQ(meta->load_jobs.size(), 1u);
  const TransferJob& job = meta->load_jobs[0];
  EXPECT_EQ(job.request, 1u);
  EXPECT_THAT(job.keys, ElementsAre(BlockKey{H(5), 0}, BlockKey{H(8), 0}, BlockKey{H(8), 1}));
  EXPECT_THAT(job.gpu_blocks, ElementsAre(21, 22, 23, 24, 25, 31, 32, 33));
  EXPECT_THAT(job.group_sizes, ElementsAre(5u, 3u));
  EXPECT_THAT(job.block_indices, ElementsAre(4u, 6u));
  EXPECT_THAT(f.manager->prepare_loads, ElementsAre(job.keys));
  // The hit prefix is not stored again.
  EXPECT_THAT(*f.scheduler->NextStoredBlocks(1), ElementsAre(3u, 3u));
  EXPECT_THAT(f.scheduler->FenceIndex(), IsEmpty());  // loads are never fenced
}

TEST(OffloadSchedulerApiTest, StoreSkipsBlocksEndingInANullBlockAndPlacesLeadingNulls) {
  // Factor 2; the window group's table starts with a null block: offloaded block 0's last GPU
  // block is real, so it is stored from its second sub-block on (block index 1); its block 1
  // ends in a null block and is skipped.
  Fixture f = MakeScheduler(
      {.groups = {{OffloadGroupKind::kFull, 4, 2, 0}, {OffloadGroupKind::kSlidingWindow, 4, 2, 8}},
       .hash_block_size = 4});
  std::vector<BlockHash> hashes = Hashes(6);
  const OffloadRequestView view{.id = 1, .num_tokens = 24, .block_hashes = hashes};
  ASSERT_EQ(f.scheduler->GetNumNewMatchedTokens(view, 0), 0u);
  auto meta = f.scheduler->BuildConnectorMeta(
      Step({Sched(view, 0, 24, {{1, 2, 3, 4, 5, 6}, {0, 7, 8, 0, 9, 10}})}));
  ASSERT_TRUE(meta.ok());
  ASSERT_EQ(f.manager->prepare_stores.size(), 1u);  // one call for both groups
  EXPECT_THAT(f.manager->prepare_stores[0],
              ElementsAre(BlockKey{H(1), 0}, BlockKey{H(3), 0}, BlockKey{H(5), 0},
                          BlockKey{H(1), 1}, BlockKey{H(5), 1}));
  ASSERT_EQ(meta->store_jobs.size(), 1u);
  const TransferJob& job = meta->store_jobs[0];
  EXPECT_THAT(job.keys, ElementsAreArray(f.manager->prepare_stores[0]));
  EXPECT_THAT(job.gpu_blocks, ElementsAre(1, 2, 3, 4, 5, 6, 7, 9, 10));
  EXPECT_THAT(job.group_sizes, ElementsAre(6u, 3u));
  EXPECT_THAT(job.block_indices, ElementsAre(0u, 1u));
  // Window sources are fenced at once, full-attention ones only when the request finishes.
  EXPECT_EQ(f.scheduler->FenceIndex(), (std::map<GpuBlockId, std::vector<JobId>>{
                                           {7, {job.id}}, {9, {job.id}}, {10, {job.id}}}));
  f.scheduler->RequestFinished(1);
  EXPECT_EQ(f.scheduler->FenceIndex().size(), 9u);
  ASSERT_TRUE(f.scheduler->UpdateConnectorOutput({{job.id, 1}}).ok());
  EXPECT_THAT(f.scheduler->FenceIndex(), IsEmpty());
  EXPECT_FALSE(f.scheduler->IsTracked(1));
}

TEST(OffloadSchedulerApiTest, StoresOnlyWhatTheManagerChoseAndAdvancesPastTheRest) {
  Fixture f = MakeScheduler({.groups = {{OffloadGroupKind::kFull, 4, 1, 0}}, .hash_block_size = 4});
  f.manager->prepare_store = [](std::span<const BlockKey> keys) {
    return std::optional<std::vector<BlockKey>>(std::vector<BlockKey>{keys[2], keys[0]});
  };
  std::vector<BlockHash> hashes = Hashes(4);
  OffloadRequestView view{.id = 1, .num_tokens = 17, .block_hashes = hashes};
  ASSERT_EQ(f.scheduler->GetNumNewMatchedTokens(view, 0), 0u);
  auto meta = f.scheduler->BuildConnectorMeta(Step({Sched(view, 0, 17, {{1, 2, 3, 4, 5}})}));
  ASSERT_TRUE(meta.ok());
  ASSERT_EQ(meta->store_jobs.size(), 1u);
  // In block order, whatever order the manager answered in.
  EXPECT_THAT(meta->store_jobs[0].keys, ElementsAre(BlockKey{H(0), 0}, BlockKey{H(2), 0}));
  EXPECT_THAT(meta->store_jobs[0].gpu_blocks, ElementsAre(1, 3));
  // Each block's parent is the request's block before it, stored or not.
  EXPECT_THAT(meta->store_jobs[0].metas, ElementsAre(FullMeta(std::nullopt, 4), FullMeta(H(1), 4)));
  EXPECT_THAT(*f.scheduler->NextStoredBlocks(1), ElementsAre(4u));
}

// What the nodes' KV events say of a stored block (docs/semantics.md §19): its group's previous
// key in the request, also across jobs, and the tokens of its group's offloaded block.
TEST(OffloadSchedulerApiTest, StoreJobsSayEachBlocksParentAndTokensPerGroup) {
  Fixture f = MakeScheduler(
      {.groups = {{OffloadGroupKind::kFull, 4, 1, 0}, {OffloadGroupKind::kFull, 8, 1, 0}},
       .hash_block_size = 4});
  std::vector<BlockHash> hashes = Hashes(6);
  const OffloadRequestView view{.id = 1, .num_tokens = 24, .block_hashes = hashes};
  ASSERT_EQ(f.scheduler->GetNumNewMatchedTokens(view, 0), 0u);
  // A prompt of 24 tokens computed in two steps of 12: group 0 keys H(i), group 1 H(2i + 1).
  auto first = f.scheduler->BuildConnectorMeta(Step({Sched(view, 0, 12, {{1, 2, 3}, {4, 5}})}));
  ASSERT_TRUE(first.ok());
  ASSERT_EQ(first->store_jobs.size(), 1u);
  EXPECT_THAT(first->store_jobs[0].keys, ElementsAre(BlockKey{H(0), 0}, BlockKey{H(1), 0},
                                                     BlockKey{H(2), 0}, BlockKey{H(1), 1}));
  EXPECT_THAT(first->store_jobs[0].metas,
              ElementsAre(FullMeta(std::nullopt, 4), FullMeta(H(0), 4), FullMeta(H(1), 4),
                          FullMeta(std::nullopt, 8)));
  auto second = f.scheduler->BuildConnectorMeta(Step({Sched(view, 12, 12, {{6, 7, 8}, {9}})}));
  ASSERT_TRUE(second.ok());
  ASSERT_EQ(second->store_jobs.size(), 1u);
  EXPECT_THAT(second->store_jobs[0].keys,
              ElementsAre(BlockKey{H(3), 0}, BlockKey{H(4), 0}, BlockKey{H(5), 0},
                          BlockKey{H(3), 1}, BlockKey{H(5), 1}));
  // A job's first block hangs from the last block of the job before.
  EXPECT_THAT(second->store_jobs[0].metas,
              ElementsAre(FullMeta(H(2), 4), FullMeta(H(3), 4), FullMeta(H(4), 4),
                          FullMeta(H(1), 8), FullMeta(H(3), 8)));
  // A load carries none.
  EXPECT_THAT(first->load_jobs, IsEmpty());
}

// What a node evicts by (docs/semantics.md §4b): each block's group kind and window, and
// whether a later hit may end within its window: a job's last window of blocks per group.
TEST(OffloadSchedulerApiTest, StoreJobsSayWhichWindowAndStateBlocksAHitEndNeeds) {
  Fixture f = MakeScheduler({.groups = {{OffloadGroupKind::kFull, 4, 1, 0},
                                        {OffloadGroupKind::kState, 4, 1, 0},
                                        {OffloadGroupKind::kSlidingWindow, 4, 1, 8}},
                             .hash_block_size = 4});
  std::vector<BlockHash> hashes = Hashes(4);
  const OffloadRequestView view{.id = 1, .num_tokens = 17, .block_hashes = hashes};
  ASSERT_EQ(f.scheduler->GetNumNewMatchedTokens(view, 0), 0u);
  auto meta = f.scheduler->BuildConnectorMeta(
      Step({Sched(view, 0, 17, {{1, 2, 3, 4, 5}, {6, 7, 8, 9, 10}, {11, 12, 13, 14, 15}})}));
  ASSERT_TRUE(meta.ok());
  ASSERT_EQ(meta->store_jobs.size(), 1u);
  const std::vector<BlockMeta>& metas = meta->store_jobs[0].metas;
  ASSERT_EQ(metas.size(), 12u);
  auto kind = [](const BlockMeta& m) { return m.kind; };
  auto window = [](const BlockMeta& m) { return m.window_blocks; };
  auto at_end = [](const BlockMeta& m) { return m.at_hit_end; };
  std::vector<BlockMeta::Kind> kinds;
  std::vector<uint32_t> windows;
  std::vector<bool> ends;
  for (const BlockMeta& m : metas) {
    kinds.push_back(kind(m));
    windows.push_back(window(m));
    ends.push_back(at_end(m));
  }
  using K = BlockMeta::Kind;
  EXPECT_THAT(kinds, ElementsAre(K::kFull, K::kFull, K::kFull, K::kFull, K::kState, K::kState,
                                 K::kState, K::kState, K::kSlidingWindow, K::kSlidingWindow,
                                 K::kSlidingWindow, K::kSlidingWindow));
  EXPECT_THAT(windows, ElementsAre(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2));
  // Full blocks are never spare; the state at the end, the window's last two blocks.
  EXPECT_THAT(ends, ElementsAre(false, false, false, false, false, false, false, true, false, false,
                                true, true));
  EXPECT_THAT(metas[4].spare(), ::testing::IsTrue());
  EXPECT_THAT(metas[0].spare(), ::testing::IsFalse());
  EXPECT_THAT(metas[7].spare(), ::testing::IsFalse());
}

// Request 1 stores from GPU block 1 and finishes before the store completes; request 3 keeps
// running so the step does not flush everything. A step that hands block 1 out again flushes
// the store: as a load destination (§7.5) and as a scheduled request's new block (§7.6).
class OffloadSchedulerFenceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    f_ = MakeScheduler({.groups = {{OffloadGroupKind::kFull, 4, 1, 0}}, .hash_block_size = 4});
    ASSERT_EQ(f_.scheduler->GetNumNewMatchedTokens(View(1), 0), 0u);
    ASSERT_EQ(f_.scheduler->GetNumNewMatchedTokens(View(3), 0), 0u);
    auto meta = f_.scheduler->BuildConnectorMeta(
        Step({Sched(View(1), 0, 4, {{1}}), Sched(View(3), 0, 4, {{2}})}));
    ASSERT_TRUE(meta.ok());
    ASSERT_EQ(meta->store_jobs.size(), 2u);
    store_ = meta->store_jobs[0].id;
    EXPECT_THAT(f_.scheduler->FenceIndex(), IsEmpty());  // running requests hold their blocks
    f_.scheduler->RequestFinished(1);
    EXPECT_EQ(f_.scheduler->FenceIndex(),
              (std::map<GpuBlockId, std::vector<JobId>>{{1, {store_}}}));
  }
  OffloadRequestView View(RequestId id) {
    return {.id = id, .num_tokens = 5, .block_hashes = std::span(hashes_).first(1)};
  }
  SchedulerStepView DecodeRequest3() { return Step({Sched(View(3), 4, 1)}); }

  Fixture f_;
  std::vector<BlockHash> hashes_ = Hashes(1);
  JobId store_ = 0;
};

TEST_F(OffloadSchedulerFenceTest, LoadIntoAFencedBlockFlushesTheStore) {
  f_.manager->lookup = AllHit;
  ASSERT_EQ(f_.scheduler->GetNumNewMatchedTokens(View(2), 0), 4u);
  const std::vector<std::vector<GpuBlockId>> tables = {{1}};
  ASSERT_TRUE(f_.scheduler->UpdateStateAfterAlloc(View(2), tables, 4).ok());
  auto meta = f_.scheduler->BuildConnectorMeta(DecodeRequest3());
  ASSERT_TRUE(meta.ok());
  EXPECT_THAT(meta->jobs_to_flush, ElementsAre(store_));
  ASSERT_TRUE(f_.scheduler->UpdateConnectorOutput({{store_, 1}}).ok());
  EXPECT_THAT(f_.scheduler->FenceIndex(), IsEmpty());
  EXPECT_FALSE(f_.scheduler->IsTracked(1));
}

TEST_F(OffloadSchedulerFenceTest, NewBlockOfAScheduledRequestFlushesTheStore) {
  f_.manager->lookup = [](const BlockKey&) { return LookupResult::kMiss; };
  ASSERT_EQ(f_.scheduler->GetNumNewMatchedTokens(View(2), 0), 0u);
  SchedulerStepView step = DecodeRequest3();
  step.scheduled.push_back(Sched(View(2), 0, 4, {{1}}));
  auto meta = f_.scheduler->BuildConnectorMeta(step);
  ASSERT_TRUE(meta.ok());
  EXPECT_THAT(meta->jobs_to_flush, ElementsAre(store_));
}

TEST_F(OffloadSchedulerFenceTest, OtherBlocksFlushNothingUntilNoRequestRuns) {
  auto meta = f_.scheduler->BuildConnectorMeta(DecodeRequest3());
  ASSERT_TRUE(meta.ok());
  EXPECT_THAT(meta->jobs_to_flush, IsEmpty());
  f_.scheduler->RequestFinished(3);
  meta = f_.scheduler->BuildConnectorMeta(Step({}, {3}));
  ASSERT_TRUE(meta.ok());
  EXPECT_EQ(meta->jobs_to_flush.size(), 2u);  // every request finished: flush all
}

TEST(OffloadSchedulerApiTest, RequestReportedScheduledAndFinishedStoresNothing) {
  Fixture f = MakeScheduler({.groups = {{OffloadGroupKind::kFull, 4, 1, 0}}, .hash_block_size = 4});
  std::vector<BlockHash> hashes = Hashes(1);
  const OffloadRequestView view{.id = 1, .num_tokens = 5, .block_hashes = hashes};
  ASSERT_EQ(f.scheduler->GetNumNewMatchedTokens(view, 0), 0u);
  auto meta = f.scheduler->BuildConnectorMeta(Step({Sched(view, 0, 4, {{1}})}, {1}));
  ASSERT_TRUE(meta.ok());
  EXPECT_THAT(meta->store_jobs, IsEmpty());
  EXPECT_FALSE(f.scheduler->IsTracked(1));
}

TEST(OffloadSchedulerApiTest, PreemptedRequestFlushesItsStoresAndDefersItsLookup) {
  StoredRequest s = StartStore(/*world_size=*/1);
  OffloadScheduler& scheduler = *s.f.scheduler;
  auto meta = scheduler.BuildConnectorMeta(Step({}, {}, {1}));
  ASSERT_TRUE(meta.ok());
  EXPECT_THAT(meta->jobs_to_flush, ElementsAre(s.job));
  const OffloadRequestView view{.id = 1, .num_tokens = 8, .block_hashes = s.hashes};
  // Back in the waiting queue, but its store is not acknowledged yet: ask again later.
  EXPECT_EQ(scheduler.GetNumNewMatchedTokens(view, 0), std::nullopt);
  ASSERT_TRUE(scheduler.UpdateConnectorOutput({{s.job, 1}}).ok());
  s.f.manager->lookup = AllHit;
  EXPECT_EQ(scheduler.GetNumNewMatchedTokens(view, 0), 8u);
}

TEST(OffloadSchedulerApiTest, WindowBlockReallocatedBeforeItsStoreIsNotStored) {
  // A window group frees blocks as the request runs. Request 1's store is refused; its window
  // group's block 3 is freed and given to request 2; retried, the store leaves that block out.
  Fixture f = MakeScheduler(
      {.groups = {{OffloadGroupKind::kFull, 4, 1, 0}, {OffloadGroupKind::kSlidingWindow, 4, 1, 4}},
       .hash_block_size = 4});
  f.manager->prepare_store = Refuse;
  std::vector<BlockHash> hashes = Hashes(2);
  const OffloadRequestView one{.id = 1, .num_tokens = 9, .block_hashes = hashes};
  const OffloadRequestView two{.id = 2, .num_tokens = 9, .block_hashes = hashes};
  ASSERT_EQ(f.scheduler->GetNumNewMatchedTokens(one, 0), 0u);
  auto meta = f.scheduler->BuildConnectorMeta(Step({Sched(one, 0, 8, {{1, 2}, {3, 4}})}));
  ASSERT_TRUE(meta.ok());
  EXPECT_THAT(meta->store_jobs, IsEmpty());
  f.manager->prepare_store = StoreAll;
  f.manager->ClearLog();
  ASSERT_EQ(f.scheduler->GetNumNewMatchedTokens(two, 0), 0u);
  meta = f.scheduler->BuildConnectorMeta(
      Step({Sched(one, 8, 1, {{5}, {6}}), Sched(two, 0, 8, {{7, 8}, {3, 9}})}));
  ASSERT_TRUE(meta.ok());
  ASSERT_EQ(meta->store_jobs.size(), 2u);
  const TransferJob& job = meta->store_jobs[0];
  EXPECT_EQ(job.request, 1u);
  EXPECT_THAT(job.keys, ElementsAre(BlockKey{H(0), 0}, BlockKey{H(1), 0}, BlockKey{H(1), 1}));
  EXPECT_THAT(job.gpu_blocks, ElementsAre(1, 2, 4));
  EXPECT_THAT(job.block_indices, ElementsAre(0u, 1u));
}

// ------------------------------------------------------------------------------------------
// §12.J: connector scenarios, driven by a minimal engine: one block pool shared by the groups
// (block 0 is the null block, blocks handed out from an LRU free queue, freed blocks keep their
// prefix-cache entry until reused), a GPU prefix cache, full and sliding-window groups, whole
// prefills, one token per decode step, preemption when out of blocks, and a worker that submits
// loads at once and stores one step late, as vLLM's does. Each Run() mirrors vLLM's test
// runner: the decoded tokens are sampled one per step by every running request.

constexpr uint32_t kEos = 0xE0;

struct EngineGroup {
  OffloadGroupKind kind = OffloadGroupKind::kFull;
  uint32_t block_size = 4;
  uint32_t window = 0;
};

struct EngineOptions {
  std::vector<EngineGroup> groups = {EngineGroup{}};
  uint32_t hash_block_size = 4;
  uint32_t block_size_factor = 1;
  size_t num_gpu_blocks = 100;  // the null block included
  uint32_t world_size = 1;
};

// A request-relative GPU block: (group, index in the request's table).
using GpuBlockRef = std::pair<uint32_t, size_t>;
using BlockRefs = std::set<GpuBlockRef>;

struct RunResult {
  BlockRefs stored;   // GPU blocks whose store completed during the run
  BlockRefs loaded;   // GPU blocks whose load completed
  BlockRefs flushed;  // source blocks of stores the workers were told to finish
};

std::vector<uint32_t> Tokens(size_t n, uint32_t value) { return std::vector<uint32_t>(n, value); }
std::vector<uint32_t> Concat(std::vector<uint32_t> a, const std::vector<uint32_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

class FakeEngine {
 public:
  explicit FakeEngine(EngineOptions options) : options_(std::move(options)) {
    OffloadSchedulerOptions connector_options{.groups = {},
                                              .hash_block_size = options_.hash_block_size,
                                              .world_size = options_.world_size};
    for (const EngineGroup& g : options_.groups) {
      connector_options.groups.push_back(
          {g.kind, g.block_size, options_.block_size_factor, g.window});
      lcm_ = std::lcm(lcm_, g.block_size);
    }
    Fixture f = MakeScheduler(std::move(connector_options));
    connector_ = std::move(f.scheduler);
    manager_ = f.manager;
    refs_.assign(options_.num_gpu_blocks, 0);
    for (GpuBlockId b = 1; b < options_.num_gpu_blocks; ++b) free_.push_back(b);
  }

  OffloadScheduler& connector() { return *connector_; }
  FakeManager& manager() { return *manager_; }

  RequestId AddRequest(std::vector<uint32_t> prompt, bool do_remote_decode = false) {
    Request& r = requests_[next_id_];
    r.id = next_id_;
    r.tokens = std::move(prompt);
    r.do_remote_decode = do_remote_decode;
    r.tables.resize(options_.groups.size());
    r.reported.assign(options_.groups.size(), 0);
    UpdateHashes(r);
    waiting_.push_back(r.id);
    return next_id_++;
  }
  void ResetPrefixCache() {
    cache_.clear();
    cached_key_.clear();
  }
  void set_out_of_blocks(bool out) { out_of_blocks_ = out; }
  size_t num_requests() const { return requests_.size(); }

  RunResult Run(const std::vector<uint32_t>& decoded, bool complete_transfers = true) {
    manager_->ClearLog();
    RunResult result;
    size_t next = 0;
    std::optional<uint32_t> token;
    if (next < decoded.size()) token = decoded[next++];
    for (int steps = 0;; ++steps) {
      if (steps == 1000) {
        ADD_FAILURE() << "run does not end";
        break;
      }
      if (requests_.empty() && connector_->InFlightJobs().empty()) break;
      const bool running = Step(token.value_or(0), complete_transfers, result);
      if (::testing::Test::HasFatalFailure()) break;
      const std::optional<uint32_t> prev = token;
      if (running) token = next < decoded.size() ? std::optional(decoded[next++]) : std::nullopt;
      // One more step after the end of the request, so that its last stores start.
      if (prev == kEos && token != prev &&
          (!requests_.empty() || !connector_->InFlightJobs().empty())) {
        continue;
      }
      if (!token.has_value()) break;
    }
    return result;
  }

 private:
  enum class State { kWaiting, kLoading, kRunning };
  struct Request {
    RequestId id = 0;
    std::vector<uint32_t> tokens;
    std::vector<BlockHash> hashes;
    size_t num_computed = 0;
    std::vector<std::vector<GpuBlockId>> tables;
    std::vector<size_t> reported;  // table entries already given to the connector
    State state = State::kWaiting;
    bool do_remote_decode = false;
    bool resumed = false;  // preempted; the next schedule reports its tables afresh
    size_t load_tokens = 0;
    std::optional<JobId> load_job;
    bool load_done = false;
  };
  struct Scheduled {
    RequestId id;
    size_t num_computed;
    size_t num_new;
  };

  OffloadRequestView View(const Request& r) const {
    return {.id = r.id,
            .num_tokens = r.tokens.size(),
            .block_hashes = r.hashes,
            .do_remote_decode = r.do_remote_decode};
  }
  void UpdateHashes(Request& r) {
    const size_t n = options_.hash_block_size;
    for (size_t i = r.hashes.size(); (i + 1) * n <= r.tokens.size(); ++i) {
      const BlockHash parent = i == 0 ? BlockHash{} : r.hashes[i - 1];
      r.hashes.push_back(ChainBlockHash(parent, std::span(r.tokens).subspan(i * n, n)));
    }
  }
  // Group g's i-th block hash: its last hash block's (as the engine keys its prefix cache).
  std::optional<BlockHash> GroupHash(const Request& r, size_t g, size_t i) const {
    const size_t k = options_.groups[g].block_size / options_.hash_block_size;
    if (i * k + k - 1 >= r.hashes.size()) return std::nullopt;
    return r.hashes[i * k + k - 1];
  }
  bool IsWindow(size_t g) const {
    return options_.groups[g].kind == OffloadGroupKind::kSlidingWindow;
  }
  // Blocks entirely before the window of the next token after `computed` tokens.
  size_t SkippedBlocks(size_t g, size_t computed) const {
    if (!IsWindow(g)) return 0;
    const size_t window = options_.groups[g].window;
    const size_t skipped = computed >= window ? computed - window + 1 : 0;
    return skipped / options_.groups[g].block_size;
  }

  void Free(GpuBlockId b) {
    if (b == kNullGpuBlock) return;
    if (--refs_[b] == 0) free_.push_back(b);  // the tail: reused last, its cache entry kept
  }
  void Take(GpuBlockId b) {
    if (refs_[b]++ == 0) free_.erase(std::find(free_.begin(), free_.end(), b));
  }
  GpuBlockId Pop() {
    const GpuBlockId b = free_.front();
    free_.pop_front();
    if (auto it = cached_key_.find(b); it != cached_key_.end()) {
      cache_.erase(it->second);
      cached_key_.erase(it);
    }
    refs_[b] = 1;
    return b;
  }
  void FreeTables(Request& r) {
    for (auto& table : r.tables) {
      for (auto it = table.rbegin(); it != table.rend(); ++it) Free(*it);
      table.clear();
    }
  }

  // Makes the tables cover `total` tokens, with what the groups skip at `computed` tokens
  // null. False, with nothing changed, when the pool is short.
  bool Allocate(Request& r, size_t total, size_t computed) {
    size_t needed = 0;
    for (size_t g = 0; g < options_.groups.size(); ++g) {
      const size_t bs = options_.groups[g].block_size;
      for (size_t i = r.tables[g].size(); i < (total + bs - 1) / bs; ++i) {
        if (i >= SkippedBlocks(g, computed)) ++needed;
      }
    }
    if (needed > 0 && (out_of_blocks_ || needed > free_.size())) return false;
    for (size_t g = 0; g < options_.groups.size(); ++g) {
      const size_t bs = options_.groups[g].block_size;
      std::vector<GpuBlockId>& table = r.tables[g];
      for (size_t i = 0; i < std::min(table.size(), SkippedBlocks(g, computed)); ++i) {
        Free(table[i]);
        table[i] = kNullGpuBlock;
      }
      while (table.size() < (total + bs - 1) / bs) {
        table.push_back(table.size() < SkippedBlocks(g, computed) ? kNullGpuBlock : Pop());
      }
    }
    return true;
  }

  // The longest GPU prefix-cache hit all groups accept, at most num_tokens - 1 tokens.
  size_t Hit(const Request& r, std::vector<std::vector<GpuBlockId>>& tables) const {
    const size_t max_length = r.tokens.size() - 1;
    auto cached = [&](size_t g, size_t i) -> std::optional<GpuBlockId> {
      const std::optional<BlockHash> hash = GroupHash(r, g, i);
      if (!hash.has_value()) return std::nullopt;
      auto it = cache_.find({static_cast<uint32_t>(g), *hash});
      if (it == cache_.end()) return std::nullopt;
      return it->second;
    };
    size_t length = max_length;
    for (size_t g = 0; g < options_.groups.size(); ++g) {
      if (IsWindow(g)) continue;
      const size_t bs = options_.groups[g].block_size;
      size_t n = 0;
      while ((n + 1) * bs <= max_length && cached(g, n).has_value()) ++n;
      length = std::min(length, n * bs);
    }
    for (length = length / lcm_ * lcm_; length > 0; length -= lcm_) {
      bool accepted = true;
      for (size_t g = 0; g < options_.groups.size() && accepted; ++g) {
        const size_t bs = options_.groups[g].block_size;
        for (size_t i = SkippedBlocks(g, length); i < length / bs && accepted; ++i) {
          accepted = cached(g, i).has_value();
        }
      }
      if (accepted) break;
    }
    tables.assign(options_.groups.size(), {});
    for (size_t g = 0; g < options_.groups.size(); ++g) {
      const size_t bs = options_.groups[g].block_size;
      for (size_t i = 0; i < length / bs; ++i) {
        tables[g].push_back(i < SkippedBlocks(g, length) ? kNullGpuBlock : *cached(g, i));
      }
    }
    return length;
  }

  // Enters the full blocks of the first `computed` tokens into the prefix cache (with several
  // groups only up to a multiple of every block size, as the hybrid cache does).
  void CacheBlocks(const Request& r, size_t computed) {
    if (options_.groups.size() > 1) computed = computed / lcm_ * lcm_;
    for (size_t g = 0; g < options_.groups.size(); ++g) {
      const size_t bs = options_.groups[g].block_size;
      for (size_t i = 0; i < computed / bs && i < r.tables[g].size(); ++i) {
        const GpuBlockId b = r.tables[g][i];
        const std::optional<BlockHash> hash = GroupHash(r, g, i);
        if (b == kNullGpuBlock || !hash.has_value() || cached_key_.contains(b)) continue;
        const std::pair<uint32_t, BlockHash> key{static_cast<uint32_t>(g), *hash};
        if (cache_.contains(key)) continue;
        cache_[key] = b;
        cached_key_[b] = key;
      }
    }
  }

  ScheduledRequestView Report(Request& r, size_t num_new, bool all) {
    ScheduledRequestView view = Sched(View(r), r.num_computed, num_new);
    view.resumed_from_preemption = r.resumed;
    r.resumed = false;
    view.new_block_ids.resize(options_.groups.size());
    for (size_t g = 0; g < options_.groups.size(); ++g) {
      const size_t from = all ? 0 : r.reported[g];
      view.new_block_ids[g].assign(r.tables[g].begin() + from, r.tables[g].end());
      r.reported[g] = r.tables[g].size();
    }
    return view;
  }

  // One engine step; whether a request was running after scheduling.
  bool Step(uint32_t token, bool complete_transfers, RunResult& result) {
    SchedulerStepView step;
    step.finished = std::move(finished_);
    finished_.clear();
    std::vector<Scheduled> scheduled;

    for (const RequestId id : std::vector<RequestId>(running_)) {
      Request& r = requests_.at(id);
      const size_t num_new = r.tokens.size() - r.num_computed;
      if (!Allocate(r, r.tokens.size(), r.num_computed)) {
        FreeTables(r);
        r.num_computed = 0;
        r.state = State::kWaiting;
        r.resumed = true;
        r.reported.assign(options_.groups.size(), 0);
        running_.erase(std::find(running_.begin(), running_.end(), id));
        waiting_.push_front(id);
        step.preempted.push_back(id);
        continue;
      }
      step.scheduled.push_back(Report(r, num_new, false));
      scheduled.push_back({id, r.num_computed, num_new});
    }
    // A step that preempts schedules no waiting request.
    std::vector<RequestId> waiting;
    if (step.preempted.empty()) waiting.assign(waiting_.begin(), waiting_.end());
    for (const RequestId id : waiting) {
      Request& r = requests_.at(id);
      if (r.state == State::kLoading) {
        if (!r.load_done) continue;
        r.num_computed = std::min(r.load_tokens, r.tokens.size() - 1);
        CacheBlocks(r, r.num_computed);
      } else {
        std::vector<std::vector<GpuBlockId>> tables;
        const size_t hit = Hit(r, tables);
        const std::optional<size_t> external = connector_->GetNumNewMatchedTokens(View(r), hit);
        if (!external.has_value()) continue;
        for (const auto& table : tables) {
          for (const GpuBlockId b : table) {
            if (b != kNullGpuBlock) Take(b);
          }
        }
        r.tables = std::move(tables);
        const size_t total = hit + *external;
        EXPECT_TRUE(Allocate(r, *external > 0 ? total : r.tokens.size(), total));
        EXPECT_TRUE(connector_->UpdateStateAfterAlloc(View(r), r.tables, *external).ok());
        r.num_computed = hit;
        if (*external > 0) {
          r.state = State::kLoading;
          r.load_tokens = total;
          r.load_done = false;
          continue;
        }
      }
      EXPECT_TRUE(Allocate(r, r.tokens.size(), r.num_computed));
      const size_t num_new = r.tokens.size() - r.num_computed;
      step.scheduled.push_back(Report(r, num_new, true));
      scheduled.push_back({id, r.num_computed, num_new});
      r.state = State::kRunning;
      waiting_.erase(std::find(waiting_.begin(), waiting_.end(), id));
      running_.push_back(id);
    }
    for (const auto& [id, r] : requests_) {
      for (size_t g = 0; g < r.tables.size(); ++g) {
        for (size_t i = 0; i < r.tables[g].size(); ++i) {
          if (r.tables[g][i] != kNullGpuBlock) {
            gpu_blocks_[r.tables[g][i]] = {static_cast<uint32_t>(g), i};
          }
        }
      }
    }

    Result<ConnectorMeta> meta = connector_->BuildConnectorMeta(step);
    EXPECT_TRUE(meta.ok()) << meta.status().ToString();
    if (!meta.ok()) return false;
    for (const TransferJob& job : meta->load_jobs) {
      jobs_[job.id] = {job, false};
      requests_.at(job.request).load_job = job.id;
    }
    for (const TransferJob& job : meta->store_jobs) jobs_[job.id] = {job, true};

    // The workers: stores from the last step are submitted, flushes waited for, this step's
    // loads submitted and its stores queued for the next step.
    std::vector<JobId> completed;
    for (const JobId id : deferred_stores_) submitted_.insert(id);
    deferred_stores_.clear();
    for (const JobId id : meta->jobs_to_flush) {
      if (jobs_.contains(id) && jobs_[id].second) {
        for (const GpuBlockId b : jobs_[id].first.gpu_blocks) result.flushed.insert(gpu_blocks_[b]);
      }
      if (submitted_.erase(id) > 0) completed.push_back(id);
    }
    for (const TransferJob& job : meta->load_jobs) submitted_.insert(job.id);
    for (const TransferJob& job : meta->store_jobs) deferred_stores_.push_back(job.id);
    if (complete_transfers) {
      completed.insert(completed.end(), submitted_.begin(), submitted_.end());
      submitted_.clear();
    }
    for (const JobId id : completed) Transfer(id, result);

    // The model: every scheduled request computes its tokens and samples `token` at the end.
    for (const Scheduled& s : scheduled) {
      Request& r = requests_.at(s.id);
      r.num_computed = s.num_computed + s.num_new;
      CacheBlocks(r, r.num_computed);
      if (r.num_computed < r.tokens.size()) continue;
      r.tokens.push_back(token);
      UpdateHashes(r);
      if (token != kEos) continue;
      connector_->RequestFinished(r.id);
      FreeTables(r);
      running_.erase(std::find(running_.begin(), running_.end(), r.id));
      finished_.push_back(r.id);
      requests_.erase(s.id);
    }
    std::vector<CompletedJobs> acks(options_.world_size);
    for (const JobId id : completed) {
      for (CompletedJobs& worker : acks) worker[id] = 1;
    }
    EXPECT_TRUE(connector_->UpdateConnectorOutput(AggregateCompletedJobs(acks)).ok());
    for (const JobId id : completed) {
      if (jobs_[id].second) continue;
      auto it = requests_.find(jobs_[id].first.request);
      if (it != requests_.end() && it->second.load_job == id) it->second.load_done = true;
    }
    return !running_.empty() || !scheduled.empty();
  }

  // Records a finished transfer and checks that a load reads back what the store of the same
  // offloaded sub-blocks wrote.
  void Transfer(JobId id, RunResult& result) {
    const auto& [job, is_store] = jobs_.at(id);
    const uint32_t f = options_.block_size_factor;
    size_t gpu = 0;
    size_t key = 0;
    for (size_t g = 0; g < job.group_sizes.size(); ++g) {
      // The group's offloaded sub-blocks from its first GPU block's position on.
      std::vector<std::pair<size_t, uint32_t>> addresses;
      for (; key < job.keys.size() && job.keys[key].group == g; ++key) {
        for (uint32_t s = 0; s < f; ++s) addresses.emplace_back(key, s);
      }
      const size_t skip = job.block_indices[g] % f;
      ASSERT_LE(skip + job.group_sizes[g], addresses.size());
      for (size_t i = 0; i < job.group_sizes[g]; ++i, ++gpu) {
        const GpuBlockRef ref = gpu_blocks_.at(job.gpu_blocks[gpu]);
        const auto [k, s] = addresses[skip + i];
        const std::pair<BlockKey, uint32_t> address{job.keys[k], s};
        if (is_store) {
          result.stored.insert(ref);
          offloaded_.insert_or_assign(address, ref);
        } else {
          result.loaded.insert(ref);
          auto it = offloaded_.find(address);
          ASSERT_NE(it, offloaded_.end()) << "loaded a sub-block never stored";
          EXPECT_EQ(it->second, ref);
        }
      }
    }
    EXPECT_EQ(gpu, job.gpu_blocks.size());
  }

  EngineOptions options_;
  uint32_t lcm_ = 1;
  std::unique_ptr<OffloadScheduler> connector_;
  FakeManager* manager_ = nullptr;
  RequestId next_id_ = 1;
  std::map<RequestId, Request> requests_;
  std::deque<RequestId> waiting_;
  std::vector<RequestId> running_;
  std::vector<RequestId> finished_;
  bool out_of_blocks_ = false;
  std::vector<int> refs_;
  std::deque<GpuBlockId> free_;
  std::map<std::pair<uint32_t, BlockHash>, GpuBlockId> cache_;
  std::map<GpuBlockId, std::pair<uint32_t, BlockHash>> cached_key_;
  std::map<GpuBlockId, GpuBlockRef> gpu_blocks_;
  std::map<JobId, std::pair<TransferJob, bool>> jobs_;  // is_store
  std::vector<JobId> deferred_stores_;
  std::set<JobId> submitted_;
  std::map<std::pair<BlockKey, uint32_t>, GpuBlockRef> offloaded_;
};

// Request offsets in every group (of `groups`).
BlockRefs Offsets(std::initializer_list<size_t> offsets, uint32_t groups = 1) {
  BlockRefs refs;
  for (const size_t offset : offsets) {
    for (uint32_t g = 0; g < groups; ++g) refs.insert({g, offset});
  }
  return refs;
}
BlockRefs Range(size_t from, size_t to, uint32_t groups = 1) {
  BlockRefs refs;
  for (size_t offset = from; offset <= to; ++offset) {
    for (uint32_t g = 0; g < groups; ++g) refs.insert({g, offset});
  }
  return refs;
}
std::vector<size_t> TouchSizes(const FakeManager& manager) {
  std::vector<size_t> sizes;
  for (const auto& touch : manager.touches) sizes.push_back(touch.size());
  return sizes;
}

// Gpu block 4, factor 3 (offloaded blocks of 12 tokens), 100 GPU blocks.
EngineOptions Factor3() { return {.block_size_factor = 3}; }

TEST(OffloadSchedulerScenarioTest, J1OffloadingConnector) {
  FakeEngine engine(Factor3());
  FakeManager& m = engine.manager();
  // 1. Three offloaded blocks; the manager keeps only the middle one.
  engine.AddRequest(Tokens(36, 0));
  m.prepare_store = [](std::span<const BlockKey> keys) {
    return std::optional<std::vector<BlockKey>>(std::vector<BlockKey>{keys[1]});
  };
  RunResult r = engine.Run({0});
  EXPECT_THAT(r.stored, IsEmpty());  // stores run one step late
  // 2. A block missing one token: nothing more to store, and no touch.
  r = engine.Run(Tokens(11, 0));
  EXPECT_EQ(r.stored, Offsets({3, 4, 5}));
  EXPECT_THAT(m.touches, IsEmpty());
  // 3. The block completes but the manager cannot store now.
  m.prepare_store = Refuse;
  r = engine.Run({0});
  EXPECT_EQ(m.prepare_stores.size(), 1u);
  EXPECT_THAT(r.stored, IsEmpty());
  // 4. Offered again and declined, then the next block too.
  m.prepare_store = StoreNone;
  r = engine.Run(Tokens(13, 0));
  EXPECT_EQ(m.prepare_stores.size(), 2u);
  EXPECT_THAT(r.stored, IsEmpty());
  // 5. The next block is stored; the touch covers all 6 keys.
  m.prepare_store = StoreAll;
  r = engine.Run(Tokens(13, 0));
  EXPECT_EQ(r.stored, Offsets({15, 16, 17}));
  ASSERT_FALSE(m.touches.empty());
  const std::vector<BlockKey> keys1 = m.touches.back();
  EXPECT_EQ(keys1.size(), 6u);
  // 6.
  r = engine.Run({kEos});
  EXPECT_THAT(r.stored, IsEmpty());
  EXPECT_THAT(r.flushed, IsEmpty());
  // 7. A request differing only in its last token.
  engine.AddRequest(Concat(Tokens(71, 0), {1}));
  r = engine.Run({0});
  ASSERT_FALSE(m.touches.empty());
  const std::vector<BlockKey> keys2 = m.touches.back();
  ASSERT_EQ(keys2.size(), 6u);
  EXPECT_TRUE(std::equal(keys1.begin(), keys1.begin() + 5, keys2.begin()));
  EXPECT_FALSE(keys1[5] == keys2[5]);
  r = engine.Run({kEos});
  EXPECT_EQ(r.stored, Range(0, 17));
  // 8. A GPU hit of 4 tokens leaves less than an offloaded block: no lookup.
  engine.AddRequest(Concat(Tokens(4, 0), Tokens(8, 1)));
  m.prepare_store = StoreNone;
  r = engine.Run({kEos});
  EXPECT_THAT(m.lookups, IsEmpty());
  // 9. One block, missed.
  engine.AddRequest(Tokens(12, 1));
  r = engine.Run({kEos});
  EXPECT_EQ(m.lookups.size(), 1u);
  EXPECT_THAT(r.loaded, IsEmpty());
  // 10. Without the GPU prefix cache, one block hit and loaded.
  engine.ResetPrefixCache();
  engine.AddRequest(Tokens(12, 0));
  r = engine.Run({kEos});
  EXPECT_EQ(r.loaded, Offsets({0, 1, 2}));
  // 11. The GPU cache hits block 0; the offloaded block 1 hits, block 2 misses.
  engine.AddRequest(Concat(Tokens(24, 0), Tokens(12, 1)));
  r = engine.Run({kEos});
  EXPECT_EQ(r.loaded, Offsets({3, 4, 5}));
  EXPECT_FALSE(engine.connector().IsTracked(1));
  EXPECT_EQ(engine.num_requests(), 0u);
}

TEST(OffloadSchedulerScenarioTest, J2RequestPreemption) {
  FakeEngine engine(Factor3());
  const RequestId id = engine.AddRequest(Tokens(24, 0));
  RunResult r = engine.Run({0}, /*complete_transfers=*/false);
  // Decoding two more offloaded blocks less a GPU block stores blocks 6..8 (not completed).
  r = engine.Run(Tokens(20, 0), false);
  EXPECT_THAT(r.stored, IsEmpty());
  EXPECT_EQ(engine.connector().InFlightJobs().size(), 2u);
  // Out of blocks: preempted; its stores are flushed before its blocks go back.
  engine.set_out_of_blocks(true);
  r = engine.Run({}, false);
  EXPECT_EQ(r.flushed, Range(0, 8));
  EXPECT_EQ(r.stored, Range(0, 8));
  // Back with a cold GPU cache: the three stored blocks are loaded.
  engine.set_out_of_blocks(false);
  engine.ResetPrefixCache();
  r = engine.Run(Tokens(4, 0));
  EXPECT_EQ(r.loaded, Range(0, 8));
  EXPECT_THAT(r.stored, IsEmpty());
  r = engine.Run({kEos});
  EXPECT_EQ(r.stored, Offsets({9, 10, 11}));
  EXPECT_THAT(r.flushed, IsEmpty());
  EXPECT_THAT(engine.connector().FenceIndex(), IsEmpty());
  EXPECT_FALSE(engine.connector().IsTracked(id));
}

TEST(OffloadSchedulerScenarioTest, J3ConcurrentLookupsOfTheSamePrefix) {
  FakeEngine engine(Factor3());
  FakeManager& m = engine.manager();
  engine.AddRequest(Tokens(12, 0));
  RunResult r = engine.Run({kEos});
  EXPECT_EQ(r.stored, Offsets({0, 1, 2}));
  EXPECT_EQ(r.flushed, Offsets({0, 1, 2}));  // no request left: the last store is flushed
  // Request A loads the block; the load stays in flight.
  engine.ResetPrefixCache();
  engine.AddRequest(Tokens(12, 0));
  r = engine.Run({}, false);
  ASSERT_EQ(m.prepare_loads.size(), 1u);
  EXPECT_EQ(engine.connector().BlocksBeingLoaded().size(), 1u);
  // Request B with the same prefix waits for it rather than load it again.
  engine.AddRequest(Tokens(12, 0));
  r = engine.Run({}, false);
  EXPECT_THAT(m.prepare_loads, IsEmpty());
  EXPECT_FALSE(m.lookups.empty());
  // Once A's load completes, B hits A's blocks in the GPU cache.
  m.prepare_store = StoreNone;
  r = engine.Run({kEos});
  EXPECT_EQ(r.loaded, Offsets({0, 1, 2}));
  EXPECT_THAT(m.prepare_loads, IsEmpty());
  EXPECT_THAT(engine.connector().BlocksBeingLoaded(), IsEmpty());
  EXPECT_THAT(engine.connector().FenceIndex(), IsEmpty());
  EXPECT_EQ(engine.num_requests(), 0u);
}

TEST(OffloadSchedulerScenarioTest, J5TwoGroupsFullAndSlidingWindow) {
  FakeEngine engine(
      {.groups = {{OffloadGroupKind::kFull, 4, 0}, {OffloadGroupKind::kSlidingWindow, 4, 8}}});
  FakeManager& m = engine.manager();
  std::vector<std::optional<uint32_t>> windows;
  for (const OffloadGroupInfo& g : engine.connector().groups()) windows.push_back(g.window_blocks);
  EXPECT_THAT(windows, ElementsAre(std::nullopt, 2u));
  engine.AddRequest(Tokens(12, 0));
  RunResult r = engine.Run({0});
  EXPECT_THAT(TouchSizes(m), ElementsAre(3u, 3u, 3u, 3u));  // lookup and store, per group
  r = engine.Run(Tokens(14, 0));
  EXPECT_EQ(r.stored, Range(0, 5, 2));
  EXPECT_EQ(m.touches.size(), 6u);  // three stores, two groups each
  r = engine.Run({kEos});
  // Every key hits: the full group loads 3 blocks, the window group its last 2 (its block 0 is
  // outside the window of token 12, so the engine gave it the null block).
  engine.ResetPrefixCache();
  m.lookup = AllHit;
  engine.AddRequest(Tokens(13, 0));
  r = engine.Run({kEos});
  EXPECT_EQ(r.loaded, (BlockRefs{{0, 0}, {0, 1}, {0, 2}, {1, 1}, {1, 2}}));
  EXPECT_THAT(TouchSizes(m), ElementsAre(3u, 2u));
  // The GPU cache hits 3 blocks; one more is loaded in each group.
  engine.AddRequest(Tokens(17, 0));
  r = engine.Run({kEos});
  EXPECT_EQ(r.loaded, (BlockRefs{{0, 3}, {1, 3}}));
  EXPECT_THAT(engine.connector().FenceIndex(), IsEmpty());
}

TEST(OffloadSchedulerScenarioTest, J6TwoGroupsDifferentBlockSizes) {
  FakeEngine engine({.groups = {{OffloadGroupKind::kFull, 12, 0}, {OffloadGroupKind::kFull, 16, 0}},
                     .hash_block_size = 4});
  FakeManager& m = engine.manager();
  EXPECT_EQ(engine.connector().groups()[0].offloaded_block_size, 12u);
  EXPECT_EQ(engine.connector().groups()[1].offloaded_block_size, 16u);
  engine.AddRequest(Tokens(25, 0));
  RunResult r = engine.Run({0});
  EXPECT_THAT(TouchSizes(m), ElementsAre(2u, 1u, 2u, 1u));
  r = engine.Run(Tokens(6, 0));  // 31 tokens
  EXPECT_EQ(r.stored, (BlockRefs{{0, 0}, {0, 1}, {1, 0}}));
  r = engine.Run({0});  // 32
  EXPECT_THAT(TouchSizes(m), ElementsAre(2u, 2u));
  r = engine.Run(Tokens(3, 0));  // 35
  EXPECT_EQ(r.stored, (BlockRefs{{1, 1}}));
  r = engine.Run({0});  // 36
  EXPECT_THAT(TouchSizes(m), ElementsAre(3u, 2u));
  r = engine.Run(Tokens(11, 0));  // 47
  EXPECT_EQ(r.stored, (BlockRefs{{0, 2}}));
  r = engine.Run({0});  // 48
  EXPECT_THAT(TouchSizes(m), ElementsAre(4u, 3u));
  r = engine.Run({0});
  EXPECT_EQ(r.stored, (BlockRefs{{0, 3}, {1, 2}}));
  r = engine.Run(Concat(Tokens(47, 0), {kEos}));  // 96
  EXPECT_EQ(r.stored, (BlockRefs{{0, 4}, {0, 5}, {0, 6}, {0, 7}, {1, 3}, {1, 4}, {1, 5}}));
  // 48 tokens: 4 blocks of group 0 and 3 of group 1.
  engine.ResetPrefixCache();
  m.lookup = AllHit;
  m.prepare_store = StoreNone;
  engine.AddRequest(Tokens(48, 0));
  r = engine.Run({0});
  EXPECT_EQ(r.loaded, (BlockRefs{{0, 0}, {0, 1}, {0, 2}, {0, 3}, {1, 0}, {1, 1}, {1, 2}}));
  r = engine.Run({kEos});
  // 85 tokens: the GPU cache hits 48; then 32 more (group 1's keys end at 80).
  engine.AddRequest(Tokens(85, 0));
  r = engine.Run({0});
  EXPECT_EQ(r.loaded, (BlockRefs{{0, 4}, {0, 5}, {0, 6}, {1, 3}, {1, 4}}));
  r = engine.Run({kEos});
  EXPECT_EQ(engine.num_requests(), 0u);
}

TEST(OffloadSchedulerScenarioTest, J7DoRemoteDecodeStoresAllBlocks) {
  FakeEngine engine(Factor3());
  engine.AddRequest(Tokens(12, 0));
  RunResult r = engine.Run({kEos});
  EXPECT_EQ(r.stored, Offsets({0, 1, 2}));
  engine.ResetPrefixCache();
  engine.AddRequest(Tokens(24, 0), /*do_remote_decode=*/true);
  r = engine.Run({});
  EXPECT_EQ(r.loaded, Offsets({0, 1, 2}));
  r = engine.Run({kEos});
  EXPECT_EQ(r.stored, Range(0, 5));  // the loaded prefix is stored again
  EXPECT_EQ(r.flushed, Range(0, 5));
}

TEST(OffloadSchedulerScenarioTest, J7LoadedPrefixIsNotStoredAgainByDefault) {
  FakeEngine engine(Factor3());
  engine.AddRequest(Tokens(12, 0));
  RunResult r = engine.Run({kEos});
  engine.ResetPrefixCache();
  engine.AddRequest(Tokens(24, 0));
  r = engine.Run({});
  EXPECT_EQ(r.loaded, Offsets({0, 1, 2}));
  r = engine.Run({kEos});
  EXPECT_EQ(r.stored, Offsets({3, 4, 5}));
}

TEST(OffloadSchedulerScenarioTest, J8LoadsDoNotPopulateTheFenceIndex) {
  FakeEngine engine(Factor3());
  engine.AddRequest(Tokens(12, 0));
  RunResult r = engine.Run({kEos});
  engine.ResetPrefixCache();
  engine.AddRequest(Tokens(12, 0));
  r = engine.Run({}, false);
  EXPECT_EQ(engine.connector().InFlightJobs().size(), 1u);
  EXPECT_THAT(engine.connector().FenceIndex(), IsEmpty());
}

TEST(OffloadSchedulerScenarioTest, J9FenceAtUpdateStateAfterAlloc) {
  // Two GPU blocks: the null block and one, so request 2 gets request 1's block.
  FakeEngine engine({.num_gpu_blocks = 2});
  engine.AddRequest(Tokens(4, 0));
  RunResult r = engine.Run({kEos});
  EXPECT_EQ(r.stored, Offsets({0}));
  EXPECT_EQ(r.flushed, Offsets({0}));
  engine.ResetPrefixCache();
  engine.AddRequest(Tokens(4, 0));
  r = engine.Run({});
  EXPECT_EQ(r.loaded, Offsets({0}));
  EXPECT_THAT(engine.connector().FenceIndex(), IsEmpty());
}

TEST(OffloadSchedulerScenarioTest, J10FenceAtBuildStoreJobs) {
  FakeEngine engine({.num_gpu_blocks = 2});
  engine.AddRequest(Tokens(4, 0));
  RunResult r = engine.Run({kEos});
  EXPECT_EQ(r.stored, Offsets({0}));
  EXPECT_EQ(r.flushed, Offsets({0}));
  engine.ResetPrefixCache();
  engine.manager().prepare_store = StoreNone;
  engine.AddRequest(Tokens(4, 1));
  r = engine.Run({kEos});
  EXPECT_THAT(r.stored, IsEmpty());
  EXPECT_THAT(engine.connector().FenceIndex(), IsEmpty());
}

TEST(OffloadSchedulerScenarioTest, J11CompleteStoreCalledPerJob) {
  FakeEngine engine(Factor3());
  FakeManager& m = engine.manager();
  engine.AddRequest(Tokens(12, 0));
  RunResult r = engine.Run({0, 0});
  EXPECT_EQ(r.stored, Offsets({0, 1, 2}));
  ASSERT_EQ(m.complete_stores.size(), 1u);
  const std::vector<BlockKey> first = m.complete_stores[0];
  EXPECT_EQ(first.size(), 1u);
  r = engine.Run(Tokens(13, 0));
  EXPECT_EQ(r.stored, Offsets({3, 4, 5}));
  ASSERT_EQ(m.complete_stores.size(), 1u);
  EXPECT_EQ(m.complete_stores[0].size(), 1u);
  EXPECT_NE(m.complete_stores[0], first);
  r = engine.Run({kEos});
  EXPECT_THAT(m.complete_stores, IsEmpty());
}

TEST(OffloadSchedulerScenarioTest, J12FlushAllJobsWhenNoRequestsRemain) {
  FakeEngine engine(EngineOptions{});
  FakeManager& m = engine.manager();
  engine.AddRequest(Tokens(4, 0));
  RunResult r = engine.Run({kEos}, false);
  EXPECT_EQ(r.stored, Offsets({0}));
  EXPECT_EQ(r.flushed, Offsets({0}));
  EXPECT_EQ(m.complete_stores.size(), 1u);
  EXPECT_THAT(engine.connector().InFlightJobs(), IsEmpty());
}

TEST(OffloadSchedulerScenarioTest, J13ResetCache) {
  FakeEngine engine(Factor3());
  FakeManager& m = engine.manager();
  engine.AddRequest(Tokens(12, 0));
  RunResult r = engine.Run({kEos});
  EXPECT_EQ(r.stored, Offsets({0, 1, 2}));
  engine.ResetPrefixCache();
  const RequestId id = engine.AddRequest(Tokens(12, 0));
  m.prepare_store = StoreNone;
  r = engine.Run({}, false);
  OffloadScheduler& connector = engine.connector();
  std::vector<JobId> loads;
  for (const InFlightJob& job : connector.InFlightJobs()) {
    if (!job.is_store) loads.push_back(job.id);
  }
  ASSERT_FALSE(loads.empty());
  const JobId counter = connector.job_counter();
  const std::optional<std::vector<size_t>> before = connector.NextStoredBlocks(id);
  ASSERT_TRUE(before.has_value());
  for (const size_t next : *before) EXPECT_GT(next, 0u);
  ASSERT_FALSE(connector.BlocksBeingLoaded().empty());

  connector.ResetCache();
  EXPECT_EQ(m.reset_calls, 1);
  EXPECT_THAT(connector.InFlightJobs(), IsEmpty());
  EXPECT_THAT(connector.FenceIndex(), IsEmpty());
  EXPECT_THAT(connector.BlocksBeingLoaded(), IsEmpty());
  EXPECT_EQ(connector.stale_job_threshold(), counter);
  const std::optional<std::vector<size_t>> after = connector.NextStoredBlocks(id);
  ASSERT_TRUE(after.has_value());
  for (const size_t next : *after) EXPECT_EQ(next, 0u);
  auto meta = connector.BuildConnectorMeta({});
  ASSERT_TRUE(meta.ok());
  for (const JobId load : loads) {
    EXPECT_TRUE(std::binary_search(meta->jobs_to_flush.begin(), meta->jobs_to_flush.end(), load));
  }
}

TEST(OffloadSchedulerScenarioTest, J4AbortedWhileLoadingIsKeptUntilTheLoadCompletes) {
  FakeEngine engine(Factor3());
  engine.AddRequest(Tokens(12, 0));
  RunResult r = engine.Run({kEos});
  engine.ResetPrefixCache();
  const RequestId id = engine.AddRequest(Tokens(12, 0));
  r = engine.Run({}, false);
  OffloadScheduler& connector = engine.connector();
  ASSERT_EQ(connector.InFlightJobs().size(), 1u);
  const JobId load = connector.InFlightJobs()[0].id;
  // The engine aborts it; a load needs no fence, and its state stays for the completion.
  connector.RequestFinished(id);
  EXPECT_TRUE(connector.IsTracked(id));
  EXPECT_THAT(connector.FenceIndex(), IsEmpty());
  auto meta = connector.BuildConnectorMeta(Step({}, {id}));
  ASSERT_TRUE(meta.ok());
  EXPECT_THAT(meta->jobs_to_flush, ElementsAre(load));  // nothing runs: flush everything
  ASSERT_TRUE(connector.UpdateConnectorOutput({{load, 1}}).ok());
  EXPECT_FALSE(connector.IsTracked(id));
  EXPECT_THAT(connector.BlocksBeingLoaded(), IsEmpty());
  EXPECT_EQ(engine.manager().complete_loads.size(), 1u);
}

TEST(OffloadSchedulerScenarioTest, AcknowledgementsFromEveryWorker) {
  FakeEngine engine({.block_size_factor = 3, .world_size = 2});
  engine.AddRequest(Tokens(24, 0));
  RunResult r = engine.Run(Tokens(2, 0));
  EXPECT_EQ(r.stored, Range(0, 5));
  EXPECT_EQ(engine.manager().complete_stores.size(), 1u);
}

}  // namespace
}  // namespace kvstash::connector
