// The hybrid KV-cache manager against the vectors of docs/semantics.md §12.K5-K7, §12.L1-L9,
// §12.M), with xxh3 chained hashes where vLLM uses sha256, and the sliding-window freeing schedule
// of chunked prefill.

#include "kvstash/engine/kv_cache_manager.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <utility>

namespace kvstash::engine {
namespace {

using Kind = AttentionSpec::Kind;
using Tables = std::vector<std::vector<BlockId>>;
using ::testing::ElementsAre;
using ::testing::ElementsAreArray;

constexpr BlockId N = kNullBlock;

AttentionSpec Full(uint32_t bs = 16) { return {Kind::kFull, bs}; }
AttentionSpec Sliding(uint32_t window, uint32_t bs = 16) {
  return {Kind::kSlidingWindow, bs, window};
}
AttentionSpec Chunked(uint32_t chunk, uint32_t bs) { return {Kind::kChunkedLocal, bs, 0, chunk}; }
AttentionSpec State(uint32_t bs = 16) { return {Kind::kState, bs}; }

KvCacheManager Manager(std::vector<AttentionSpec> groups, size_t num_blocks, bool eagle = false,
                       bool prefix_caching = true) {
  return KvCacheManager(KvCacheManagerOptions{.groups = std::move(groups),
                                              .num_blocks = num_blocks,
                                              .prefix_caching = prefix_caching,
                                              .eagle = eagle,
                                              .record_events = true});
}

// `blocks` blocks of `bs` tokens, block i all token i (vLLM's common prefix), then `tail`.
std::vector<uint32_t> Prompt(size_t blocks, uint32_t bs, const std::vector<uint32_t>& tail = {}) {
  std::vector<uint32_t> tokens;
  for (size_t i = 0; i < blocks; ++i) tokens.insert(tokens.end(), bs, static_cast<uint32_t>(i));
  tokens.insert(tokens.end(), tail.begin(), tail.end());
  return tokens;
}
std::vector<uint32_t> Repeat(uint32_t token, size_t n) { return std::vector<uint32_t>(n, token); }
std::vector<uint32_t> Concat(std::vector<uint32_t> a, const std::vector<uint32_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

std::vector<BlockHash> Hashes(std::span<const uint32_t> tokens, uint32_t bs,
                              std::string salt = {}) {
  RequestHasher hasher(bs, std::move(salt));
  hasher.Update(tokens);
  return hasher.hashes();
}

ComputedBlocks Lookup(const KvCacheManager& m, const std::vector<uint32_t>& tokens) {
  return m.GetComputedBlocks(Hashes(tokens, m.hash_block_size()), tokens.size());
}

// A request's first allocation as the scheduler makes it: the prefix-cache hit, then slots for
// `num_new` more tokens (all the rest by default). Returns the hit.
ComputedBlocks Admit(KvCacheManager& m, RequestId id, const std::vector<uint32_t>& tokens,
                     std::optional<size_t> num_new = std::nullopt) {
  const auto hashes = Hashes(tokens, m.hash_block_size());
  ComputedBlocks hit = m.GetComputedBlocks(hashes, tokens.size());
  const size_t n = num_new.value_or(tokens.size() - hit.tokens);
  EXPECT_TRUE(m.AllocateSlots(id, hashes, tokens.size(), 0, n, &hit)) << "request " << id;
  return hit;
}

// ---------------------------------------------------------------------------------------------
// §12.M-style hashing properties of RequestHasher.

TEST(RequestHasherTest, ChainsFullBlocksOnly) {
  const auto tokens = Prompt(2, 16, Repeat(7, 5));
  const auto hashes = Hashes(tokens, 16);
  ASSERT_EQ(hashes.size(), 2u);  // the 5-token tail is not a full block
  const BlockHash h0 = ChainBlockHash({}, std::span(tokens).subspan(0, 16));
  EXPECT_EQ(hashes[0], h0);
  EXPECT_EQ(hashes[1], ChainBlockHash(h0, std::span(tokens).subspan(16, 16)));
}

TEST(RequestHasherTest, ChangingAnEarlierTokenChangesEveryLaterHash) {
  const auto tokens = Prompt(3, 4);
  const auto base = Hashes(tokens, 4);
  auto first = tokens;
  first[1] = 99;  // in block 0: every hash changes
  const auto h_first = Hashes(first, 4);
  for (size_t i = 0; i < 3; ++i) EXPECT_NE(h_first[i], base[i]) << i;
  auto second = tokens;
  second[5] = 99;  // in block 1: block 0 keeps its hash, 1 and 2 change
  const auto h_second = Hashes(second, 4);
  EXPECT_EQ(h_second[0], base[0]);
  EXPECT_NE(h_second[1], base[1]);
  EXPECT_NE(h_second[2], base[2]);
}

TEST(RequestHasherTest, SaltGoesIntoTheFirstBlockOnly) {
  const auto tokens = Prompt(2, 4);
  const auto salted = Hashes(tokens, 4, "salt");
  const std::string salt = "salt";
  const BlockHash h0 = ChainBlockHash({}, std::span(tokens).subspan(0, 4),
                                      std::as_bytes(std::span(salt.data(), salt.size())));
  EXPECT_EQ(salted[0], h0);
  // Block 1 has no extra keys of its own; the salt reaches it through the chain only.
  EXPECT_EQ(salted[1], ChainBlockHash(h0, std::span(tokens).subspan(4, 4)));
  const auto plain = Hashes(tokens, 4);
  EXPECT_NE(salted[0], plain[0]);
  EXPECT_NE(salted[1], plain[1]);
  EXPECT_NE(Hashes(tokens, 4, "pepper")[0], salted[0]);
}

TEST(RequestHasherTest, IncrementalUpdatesEqualOneShot) {
  std::mt19937 random(11);
  std::vector<uint32_t> tokens(203);
  for (uint32_t& t : tokens) t = random() % 1000;
  const auto one_shot = Hashes(tokens, 16, "s");
  RequestHasher hasher(16, "s");
  size_t end = 0;
  while (end < tokens.size()) {
    end = std::min(tokens.size(), end + 1 + random() % 37);
    hasher.Update(std::span(tokens).first(end));
    EXPECT_EQ(hasher.hashes().size(), end / 16);
  }
  hasher.Update(tokens);  // nothing new: no change
  EXPECT_EQ(hasher.hashes(), one_shot);
}

// ---------------------------------------------------------------------------------------------
// §12.K: the per-type block counts.

// §12.K5: 10 real cached blocks (unreferenced, so each costs a free block), num_tokens 40, bs 2
// -> 20; 5 null + 5 real -> 15. As in vLLM's test the computed length is 0, so nothing is
// skipped; the window and chunk do not matter.
TEST(KvCacheManagerTest, K5NumBlocksToAllocate) {
  for (const AttentionSpec& spec : {Sliding(4, 2), Chunked(4, 2)}) {
    const auto m = Manager({spec}, 100);
    ComputedBlocks real{{{1, 2, 3, 4, 5, 6, 7, 8, 9, 10}}, 0};
    EXPECT_EQ(m.NumBlocksToAllocate(1, 0, 40, &real), 20u);
    ComputedBlocks half{{{N, N, N, N, N, 1, 2, 3, 4, 5}}, 0};
    EXPECT_EQ(m.NumBlocksToAllocate(2, 0, 40, &half), 15u);
  }
}

// §12.K6: a hit block sitting unreferenced in the free queue counts against the free blocks,
// but only the truly new block is allocated.
// The blocks any schedule holds while computing a position are a fresh allocation of that one
// position (nothing before it skipped is held), for every attention type; the peak over a
// range, looked up over one period, is the peak of every position in it.
TEST(KvCacheManagerTest, MinBlocksHeldAtAndItsPeakOverARange) {
  const std::vector<std::vector<AttentionSpec>> models = {
      {Full()},
      {Sliding(32)},
      {Full(), Sliding(40, 8), Chunked(48, 16)},
      {Full(), State(), Sliding(17, 4)},
      {Chunked(64, 16), Sliding(100, 16)},
  };
  for (size_t m = 0; m < models.size(); ++m) {
    const KvCacheManager manager = Manager(models[m], 100000);
    std::vector<size_t> held;
    for (size_t p = 0; p < 600; ++p) {
      held.push_back(manager.MinBlocksHeldAt(p));
      ASSERT_EQ(held[p], manager.NumBlocksToAllocate(7, p, 1, nullptr))
          << "model " << m << " position " << p;
    }
    for (size_t first = 0; first < 250; first += 7) {
      for (size_t last = first; last < held.size(); last += 5) {
        ASSERT_EQ(manager.MinBlocksToCompute(first, last),
                  *std::max_element(held.begin() + first, held.begin() + last + 1))
            << "model " << m << " positions " << first << ".." << last;
      }
    }
  }
}

TEST(KvCacheManagerTest, K6EvictableHitBlockIsNotAllocatedTwice) {
  auto m = Manager({Sliding(4, 2)}, 100);
  ComputedBlocks hit{{{1}}, 2};
  ASSERT_EQ(m.pool().ref_count(1), 0u);
  EXPECT_EQ(m.NumBlocksToAllocate(7, 0, 2, &hit), 2u);
  const size_t free_before = m.num_free_blocks();
  ASSERT_TRUE(m.AllocateSlots(7, {}, 4, 0, 2, &hit));
  EXPECT_EQ(m.BlockTables(7), (Tables{{1, 2}}));  // the hit, then one new block
  EXPECT_EQ(m.num_free_blocks(), free_before - 2);
  EXPECT_EQ(m.pool().ref_count(1), 1u);
}

// §12.K7 (vLLM's test_predictor_matches_allocator_blocks_calculation_with_admission_cap):
// sliding window 8, bs 2, caching off, 4 tokens a step. vLLM builds the manager with a
// per-request admission cap of window / bs = 4 blocks, but that cap only clamps the
// whole-sequence admission gate (apply_admission_cap); the per-step prediction is uncapped and
// must equal what the allocation pulls, also once the window frees blocks (from 12 computed
// tokens on). kvstash has no admission gate, so the cap has nothing to clamp here.
TEST(KvCacheManagerTest, K7PredictionEqualsAllocationStepByStep) {
  auto m = Manager({Sliding(8, 2)}, 100, /*eagle=*/false, /*prefix_caching=*/false);
  size_t computed = 0;
  for (size_t num_tokens : {4, 8, 12, 16}) {
    const size_t predicted = m.NumBlocksToAllocate(1, computed, num_tokens - computed, nullptr);
    const size_t held = m.BlockTables(1)[0].size();
    ASSERT_TRUE(m.AllocateSlots(1, {}, num_tokens, computed, num_tokens - computed));
    const size_t pulled = m.BlockTables(1)[0].size() - held;
    EXPECT_EQ(predicted, pulled) << "num_tokens " << num_tokens;
    EXPECT_EQ(pulled, 2u) << "num_tokens " << num_tokens;
    computed = num_tokens;
  }
  // At 12 computed tokens, tokens 0-4 left the window: blocks 0 and 1 went back.
  EXPECT_EQ(m.BlockTables(1), (Tables{{N, N, 3, 4, 5, 6, 7, 8}}));
}

// Positions a group skips at the computed length of a first allocation take the null block:
// neither a new block nor the hit block there (vLLM's add_local_computed_blocks), which stays
// free. Sliding window 4, bs 2: at 20 computed tokens 17 are outside, blocks 0-7.
TEST(KvCacheManagerTest, FirstAllocationTakesNullBlocksForSkippedPositions) {
  auto m = Manager({Sliding(4, 2)}, 100);
  ComputedBlocks hit{{{1, 2, 3, 4, 5, 6, 7, 8, 9, 10}}, 20};
  // 10 new blocks for tokens 20-39, and hit blocks 9 and 10 out of the free queue.
  EXPECT_EQ(m.NumBlocksToAllocate(1, 0, 20, &hit), 12u);
  ASSERT_TRUE(m.AllocateSlots(1, {}, 40, 0, 20, &hit));
  EXPECT_EQ(m.BlockTables(1),
            (Tables{{N, N, N, N, N, N, N, N, 9, 10, 1, 2, 3, 4, 5, 6, 7, 8, 11, 12}}));
  EXPECT_EQ(m.num_free_blocks(), 99u - 12);

  // The same without a hit: a request first allocated at 12 computed tokens (window 8).
  auto m2 = Manager({Sliding(8, 2)}, 100);
  EXPECT_EQ(m2.NumBlocksToAllocate(1, 12, 4, nullptr), 6u);
  ASSERT_TRUE(m2.AllocateSlots(1, {}, 16, 12, 4));
  EXPECT_EQ(m2.BlockTables(1), (Tables{{N, N, 1, 2, 3, 4, 5, 6}}));
}

// ---------------------------------------------------------------------------------------------
// §12.L: prefix cache and hybrid coordinator (bs 16).

// §12.L1 test_prefill: one full-attention group, 11 blocks.
TEST(KvCacheManagerTest, L1Prefill) {
  auto m = Manager({Full()}, 11);
  const auto common = Prompt(3, 16);
  const auto t0 = Concat(common, Repeat(3, 7));
  const ComputedBlocks hit0 = Admit(m, 0, t0);
  EXPECT_EQ(hit0.tokens, 0u);
  EXPECT_TRUE(hit0.blocks[0].empty());
  EXPECT_EQ(m.BlockTables(0), (Tables{{1, 2, 3, 4}}));
  BlockHash parent{};
  for (BlockId b : {1, 2, 3}) {
    const BlockHash h = ChainBlockHash(parent, std::span(t0).subspan((b - 1) * 16, 16));
    ASSERT_TRUE(m.pool().key_of(b).has_value()) << b;
    EXPECT_EQ(*m.pool().key_of(b), (CachedKey{h, 0})) << b;
    EXPECT_EQ(m.pool().ref_count(b), 1u);
    parent = h;
  }
  EXPECT_FALSE(m.pool().key_of(4).has_value());  // the partial block has no hash
  EXPECT_EQ(m.pool().ref_count(4), 1u);

  // req1 while req0 still holds the prefix.
  const ComputedBlocks hit1 = Admit(m, 1, Concat(common, Repeat(3, 5)));
  EXPECT_THAT(hit1.blocks[0], ElementsAre(1, 2, 3));
  EXPECT_EQ(hit1.tokens, 48u);
  EXPECT_EQ(m.BlockTables(1), (Tables{{1, 2, 3, 5}}));
  for (BlockId b : {1, 2, 3}) EXPECT_EQ(m.pool().ref_count(b), 2u);
  EXPECT_EQ(m.num_free_blocks(), 5u);

  m.Free(0);
  m.Free(1);
  EXPECT_EQ(m.num_free_blocks(), 10u);
  // Unallocated, req0's tail, req1's tail, then the shared prefix from its end.
  EXPECT_THAT(m.pool().free_queue().All(), ElementsAre(6, 7, 8, 9, 10, 4, 5, 3, 2, 1));

  // req2 after both are gone: the freed blocks kept their hashes.
  const ComputedBlocks hit2 = Admit(m, 2, Concat(common, Repeat(3, 6)));
  EXPECT_THAT(hit2.blocks[0], ElementsAre(1, 2, 3));
  EXPECT_EQ(m.BlockTables(2), (Tables{{1, 2, 3, 6}}));
  EXPECT_EQ(m.num_free_blocks(), 6u);
  m.Free(2);

  // req3 misses and evicts in free-queue order; the prefix's hashes go last.
  (void)m.TakeRemovedEvents();
  const ComputedBlocks hit3 = Admit(m, 3, Repeat(99, 160));
  EXPECT_EQ(hit3.tokens, 0u);
  EXPECT_EQ(m.BlockTables(3), (Tables{{7, 8, 9, 10, 4, 5, 6, 3, 2, 1}}));
  EXPECT_EQ(m.num_free_blocks(), 0u);
  const auto h = Hashes(t0, 16);
  EXPECT_THAT(m.TakeRemovedEvents(),
              ElementsAre(CachedKey{h[2], 0}, CachedKey{h[1], 0}, CachedKey{h[0], 0}));
  EXPECT_EQ(Lookup(m, Concat(common, Repeat(3, 5))).tokens, 0u);
}

// Evicts (hash index, group) pairs from the cache, looks `tokens` up, puts the hashes back, and
// returns the hit in blocks (every group's table must be that long).
size_t HitWithout(KvCacheManager& m, const std::vector<uint32_t>& tokens,
                  std::vector<std::pair<size_t, uint32_t>> evict) {
  const auto hashes = Hashes(tokens, 16);
  std::vector<std::pair<BlockId, CachedKey>> evicted;
  for (auto [i, group] : evict) {
    const CachedKey key{hashes[i], group};
    const auto block = m.pool().GetCachedBlock(key.hash, std::span(&group, 1));
    EXPECT_TRUE(block.has_value()) << "hash " << i << " group " << group;
    if (!block.has_value()) continue;
    EXPECT_TRUE(m.pool().EvictCachedHash(key));
    evicted.emplace_back((*block)[0], key);
  }
  const ComputedBlocks hit = m.GetComputedBlocks(hashes, tokens.size());
  for (const auto& blocks : hit.blocks) EXPECT_EQ(blocks.size() * 16, hit.tokens);
  for (const auto& [block, key] : evicted) m.pool().CacheBlock(block, key);
  (void)m.TakeRemovedEvents();
  return hit.tokens / 16;
}

// §12.L2 test_prefill_hybrid_model: full, sliding window 32, sliding window 32; 21 blocks.
TEST(KvCacheManagerTest, L2PrefillHybridModel) {
  auto m = Manager({Full(), Sliding(32), Sliding(32)}, 21);
  const auto common = Prompt(3, 16);
  const auto t0 = Concat(common, Repeat(3, 7));
  Admit(m, 0, t0);
  EXPECT_EQ(m.BlockTables(0), (Tables{{1, 2, 3, 4}, {5, 6, 7, 8}, {9, 10, 11, 12}}));
  const auto h = Hashes(t0, 16);
  for (size_t i = 0; i < 3; ++i) {
    for (uint32_t g = 0; g < 3; ++g) {
      const BlockId b = m.BlockTables(0)[g][i];
      EXPECT_EQ(m.pool().key_of(b), (CachedKey{h[i], g})) << i << " " << g;
      EXPECT_EQ(m.pool().ref_count(b), 1u);
    }
  }
  for (BlockId b : {4, 8, 12}) EXPECT_FALSE(m.pool().key_of(b).has_value()) << b;

  const auto t1 = Concat(common, Repeat(3, 5));
  const ComputedBlocks hit = Admit(m, 1, t1);
  EXPECT_EQ(hit.blocks, (Tables{{1, 2, 3}, {N, 6, 7}, {N, 10, 11}}));
  EXPECT_EQ(hit.tokens, 48u);
  EXPECT_EQ(m.BlockTables(1), (Tables{{1, 2, 3, 13}, {N, 6, 7, 14}, {N, 10, 11, 15}}));
  for (BlockId b : {1, 2, 3, 6, 7, 10, 11}) EXPECT_EQ(m.pool().ref_count(b), 2u) << b;
  m.Free(0);
  m.Free(1);

  // The partial-hit table.
  EXPECT_EQ(HitWithout(m, t1, {{0, 1}, {0, 2}}), 3u);  // outside the window: no effect
  EXPECT_EQ(HitWithout(m, t1, {{0, 0}}), 0u);
  EXPECT_EQ(HitWithout(m, t1, {{2, 0}, {2, 1}, {2, 2}}), 2u);
  EXPECT_EQ(HitWithout(m, t1, {{2, 0}}), 2u);
  EXPECT_EQ(HitWithout(m, t1, {{2, 1}}), 2u);
  EXPECT_EQ(HitWithout(m, t1, {{2, 2}}), 2u);
  // Full attention hits 2 blocks; the windows would then need blocks 0-1: a miss.
  EXPECT_EQ(HitWithout(m, t1, {{2, 0}, {0, 1}, {0, 2}}), 0u);
  EXPECT_EQ(HitWithout(m, t1, {}), 3u);  // everything restored
}

// §12.L3 test_prefill_hybrid_model_eagle: sliding window 48 (3 blocks), 6 full blocks, eagle.
TEST(KvCacheManagerTest, L3PrefillHybridModelEagle) {
  auto m = Manager({Full(), Sliding(48), Sliding(48)}, 31, /*eagle=*/true);
  const auto common = Prompt(6, 16);
  Admit(m, 0, Concat(common, Repeat(6, 7)));
  EXPECT_EQ(
      m.BlockTables(0),
      (Tables{{1, 2, 3, 4, 5, 6, 7}, {8, 9, 10, 11, 12, 13, 14}, {15, 16, 17, 18, 19, 20, 21}}));
  for (BlockId b : {7, 14, 21}) EXPECT_FALSE(m.pool().key_of(b).has_value()) << b;

  const auto t1 = Concat(common, Repeat(6, 5));
  const ComputedBlocks hit = Admit(m, 1, t1);
  EXPECT_EQ(hit.blocks, (Tables{{1, 2, 3, 4, 5}, {N, N, 10, 11, 12}, {N, N, 17, 18, 19}}));
  EXPECT_EQ(hit.tokens, 80u);
  EXPECT_EQ(
      m.BlockTables(1),
      (Tables{{1, 2, 3, 4, 5, 22, 23}, {N, N, 10, 11, 12, 24, 25}, {N, N, 17, 18, 19, 26, 27}}));
  for (BlockId b : {1, 2, 3, 4, 5, 10, 11, 12, 17, 18, 19}) {
    EXPECT_EQ(m.pool().ref_count(b), 2u) << b;
  }
  m.Free(0);
  m.Free(1);

  EXPECT_EQ(HitWithout(m, t1, {{0, 1}, {0, 2}}), 5u);
  EXPECT_EQ(HitWithout(m, t1, {{0, 0}}), 0u);
  EXPECT_EQ(HitWithout(m, t1, {{5, 0}, {5, 1}, {5, 2}}), 4u);
  EXPECT_EQ(HitWithout(m, t1, {{5, 0}}), 4u);
  // Full attention drops its last block for eagle; the window's second-to-last block is gone.
  EXPECT_EQ(HitWithout(m, t1, {{4, 1}}), 3u);
  EXPECT_EQ(HitWithout(m, t1, {{4, 2}}), 3u);
  EXPECT_EQ(HitWithout(m, t1, {{5, 0}, {0, 1}, {0, 2}}), 4u);
}

// §12.L4: 3 cached blocks and a 5-token suffix hit 48 tokens in every combination (sw = window
// 32, sw_large = window 64).
TEST(KvCacheManagerTest, L4HybridCombinations) {
  const AttentionSpec full = Full(), sw = Sliding(32), sw_large = Sliding(64), mamba = State();
  const std::vector<std::vector<AttentionSpec>> combos = {
      {full, sw},
      {full, mamba},
      {sw, mamba},
      {sw, sw_large},
      {full, sw, sw},
      {full, mamba, mamba},
      {full, sw, mamba},
      {full, sw, sw_large},
      {full, full, sw},
      {full, full, mamba},
      {full, sw, full, sw_large},
      {full, mamba, full, mamba},
      {full, sw, full, sw_large},  // vLLM's "4g-interleaved-full+sw_mixed"
      {sw, mamba, sw_large, mamba},
      {full, full, sw, mamba},
  };
  ASSERT_EQ(combos.size(), 15u);
  for (const auto& specs : combos) {
    SCOPED_TRACE(::testing::Message()
                 << specs.size() << " groups, first kind " << static_cast<int>(specs[0].kind));
    auto m = Manager(specs, 10 * specs.size());
    const auto common = Prompt(3, 16);
    EXPECT_EQ(Admit(m, 0, Concat(common, Repeat(3, 7))).tokens, 0u);
    const ComputedBlocks hit = Admit(m, 1, Concat(common, Repeat(4, 5)));
    EXPECT_EQ(hit.tokens, 48u);
    ASSERT_EQ(hit.blocks.size(), specs.size());
    for (size_t g = 0; g < specs.size(); ++g) {
      ASSERT_EQ(hit.blocks[g].size(), 3u) << g;
      EXPECT_EQ(hit.blocks[g].back(), m.BlockTables(0)[g][2]) << g;  // req0's third block
      EXPECT_EQ(m.BlockTables(1)[g].size(), 4u) << g;
    }
    m.Free(0);
    m.Free(1);
    EXPECT_EQ(m.num_free_blocks(), 10 * specs.size() - 1);
  }
}

// §12.L5: eagle, full + sliding window 32, 4 cached blocks -> 3 blocks per group.
TEST(KvCacheManagerTest, L5EagleFullAndSlidingWindow) {
  auto m = Manager({Full(), Sliding(32)}, 20, /*eagle=*/true);
  const auto common = Prompt(4, 16);
  Admit(m, 0, Concat(common, Repeat(4, 7)));
  const ComputedBlocks hit = Admit(m, 1, Concat(common, Repeat(6, 5)));
  EXPECT_EQ(hit.tokens, 48u);
  for (const auto& blocks : hit.blocks) EXPECT_EQ(blocks.size(), 3u);
  EXPECT_EQ(hit.blocks[1][0], N);  // outside the window at 48 tokens
  m.Free(0);
  m.Free(1);
}

// §12.L6 test_different_block_size: full attention bs 32, sliding window bs 16 (window 32),
// hashes at 16.
TEST(KvCacheManagerTest, L6DifferentBlockSizes) {
  auto m = Manager({Full(32), Sliding(32, 16)}, 100);
  EXPECT_EQ(m.hash_block_size(), 16u);
  EXPECT_EQ(m.lcm_block_size(), 32u);
  const auto tokens = Prompt(10, 16);
  Admit(m, 0, tokens, /*num_new=*/7 * 16);
  EXPECT_EQ(m.BlockTables(0), (Tables{{1, 2, 3, 4}, {5, 6, 7, 8, 9, 10, 11}}));

  const std::vector<uint32_t> t1(tokens.begin(), tokens.begin() + 7 * 16 + 1);
  ComputedBlocks hit = Lookup(m, t1);
  EXPECT_EQ(hit.blocks, (Tables{{1, 2, 3}, {N, N, N, N, 9, 10}}));
  EXPECT_EQ(hit.tokens, 96u);
  const std::vector<uint32_t> t2(tokens.begin(), tokens.begin() + 6 * 16 + 1);
  hit = Lookup(m, t2);
  EXPECT_EQ(hit.blocks[0].size(), 3u);
  EXPECT_EQ(hit.blocks[1].size(), 6u);
  EXPECT_EQ(hit.tokens, 96u);

  // Without window hashes 5 and 6 the window hits 5 blocks (80 tokens), but a hit must be a
  // multiple of 32: 64 tokens.
  const auto h = Hashes(t1, 16);
  EXPECT_FALSE(m.pool().EvictCachedHash({h[6], 1}));  // never cached (§12.L8)
  EXPECT_TRUE(m.pool().EvictCachedHash({h[5], 1}));
  hit = Lookup(m, t1);
  EXPECT_EQ(hit.blocks[0].size(), 2u);
  EXPECT_EQ(hit.blocks[1].size(), 4u);
  EXPECT_EQ(hit.tokens, 64u);
}

// §12.L7: full attention bs 32, sliding window bs 8 (window 8), 64 tokens: a hit ends on a
// 32-token boundary and needs only the block before it, so the window caches hashes 3 and 7.
TEST(KvCacheManagerTest, L7SlidingWindowCachesOnlyEachSegmentsTail) {
  auto m = Manager({Full(32), Sliding(8, 8)}, 100);
  EXPECT_EQ(m.hash_block_size(), 8u);
  const auto tokens = Prompt(8, 8);
  Admit(m, 0, tokens);
  const auto h = Hashes(tokens, 8);
  ASSERT_EQ(h.size(), 8u);
  const uint32_t sw = 1, full = 0;
  std::vector<size_t> cached;
  for (size_t i = 0; i < h.size(); ++i) {
    if (m.pool().GetCachedBlock(h[i], std::span(&sw, 1))) cached.push_back(i);
  }
  EXPECT_THAT(cached, ElementsAre(3, 7));
  // Full attention's 32-token blocks are keyed by the last of their four hashes.
  std::vector<size_t> full_cached;
  for (size_t i = 0; i < h.size(); ++i) {
    if (m.pool().GetCachedBlock(h[i], std::span(&full, 1))) full_cached.push_back(i);
  }
  EXPECT_THAT(full_cached, ElementsAre(3, 7));
  m.Free(0);
  // And those two blocks are enough for the whole hit.
  const ComputedBlocks hit = Lookup(m, Concat(tokens, Repeat(5, 3)));
  EXPECT_EQ(hit.tokens, 64u);
  EXPECT_THAT(hit.blocks[1], ElementsAre(N, N, N, N, N, N, N,
                                         m.pool().GetCachedBlock(h[7], std::span(&sw, 1))->at(0)));
}

// §12.L8: full attention bs 32, sliding window bs 16 (window 32), 112 tokens: cached up to 96
// (the last multiple of 32), so window hashes 0-5 are cached and 6 is not.
TEST(KvCacheManagerTest, L8CachingClampsToTheLcm) {
  auto m = Manager({Full(32), Sliding(32, 16)}, 100);
  const auto tokens = Prompt(7, 16);
  Admit(m, 0, tokens);
  const auto h = Hashes(tokens, 16);
  const uint32_t sw = 1;
  for (size_t i = 0; i < 7; ++i) {
    EXPECT_EQ(m.pool().GetCachedBlock(h[i], std::span(&sw, 1)).has_value(), i < 6) << i;
  }
  EXPECT_FALSE(m.pool().key_of(m.BlockTables(0)[1][6]).has_value());
}

// §12.L9: eagle with a single group.
TEST(KvCacheManagerTest, L9EagleSingleGroup) {
  {
    auto m = Manager({Full()}, 20, /*eagle=*/true);
    const auto tokens = Prompt(3, 16);
    Admit(m, 0, tokens);
    const ComputedBlocks hit = Lookup(m, tokens);  // 2 blocks below 47 tokens, less the last
    EXPECT_EQ(hit.tokens, 16u);
    EXPECT_THAT(hit.blocks[0], ElementsAre(1));
  }
  {
    auto m = Manager({Full()}, 20, /*eagle=*/true);
    const auto tokens = Prompt(2, 16, Repeat(9, 5));
    Admit(m, 0, tokens);
    EXPECT_EQ(Lookup(m, tokens).tokens, 16u);
  }
  {
    auto m = Manager({Sliding(16)}, 20, /*eagle=*/true);
    const auto tokens = Prompt(2, 16, Repeat(9, 5));
    Admit(m, 0, tokens);
    const ComputedBlocks hit = Lookup(m, tokens);
    EXPECT_EQ(hit.tokens, 16u);
    EXPECT_THAT(hit.blocks[0], ElementsAre(1));
    EXPECT_TRUE(m.pool().EvictCachedHash({Hashes(tokens, 16)[0], 0}));
    EXPECT_EQ(Lookup(m, tokens).tokens, 0u);
  }
}

// ---------------------------------------------------------------------------------------------
// Sliding-window freeing under chunked prefill, and the allocation's refusal.

// vLLM's design doc (window 1k, chunk 2k, prompt 4k), scaled down by 128: window 8, 16 tokens a
// step, a 32-token prompt, bs 1. A step first frees what left the window at its computed length
// (skipped = computed - 8 + 1), then allocates.
TEST(KvCacheManagerTest, SlidingWindowFreesBehindTheWindowUnderChunkedPrefill) {
  auto m = Manager({Sliding(8, 1)}, 41);
  std::vector<uint32_t> tokens(32);
  for (uint32_t i = 0; i < 32; ++i) tokens[i] = 100 + i;
  const auto hashes = Hashes(tokens, 1);
  auto range = [](BlockId first, BlockId last) {
    std::vector<BlockId> ids;
    for (BlockId b = first; b <= last; ++b) ids.push_back(b);
    return ids;
  };
  auto nulls_then = [](size_t nulls, std::vector<BlockId> rest) {
    std::vector<BlockId> ids(nulls, N);
    ids.insert(ids.end(), rest.begin(), rest.end());
    return ids;
  };

  // Step 1: tokens [0, 16); nothing to free.
  EXPECT_EQ(m.NumBlocksToAllocate(1, 0, 16, nullptr), 16u);
  ASSERT_TRUE(m.AllocateSlots(1, hashes, 32, 0, 16));
  EXPECT_THAT(m.BlockTables(1)[0], ElementsAreArray(range(1, 16)));
  EXPECT_EQ(m.num_free_blocks(), 24u);

  // Step 2: 16 computed, 16 new. Tokens 0-8 left the window: blocks 0-8 are freed, the last
  // first, then 16 blocks are taken from the front of the queue.
  EXPECT_EQ(m.NumBlocksToAllocate(1, 16, 16, nullptr), 16u);
  ASSERT_TRUE(m.AllocateSlots(1, hashes, 32, 16, 16));
  EXPECT_THAT(m.BlockTables(1)[0],
              ElementsAreArray(nulls_then(9, Concat(range(10, 16), range(17, 32)))));
  EXPECT_EQ(m.num_free_blocks(), 24u + 9 - 16);
  EXPECT_THAT(m.pool().free_queue().All(),
              ElementsAreArray(Concat(range(33, 40), {9, 8, 7, 6, 5, 4, 3, 2, 1})));

  // Decode: 32 computed, 1 new. Blocks 9-24 are freed (25 tokens skipped), block 32's
  // successor is allocated.
  EXPECT_EQ(m.NumBlocksToAllocate(1, 32, 1, nullptr), 1u);
  ASSERT_TRUE(m.AllocateSlots(1, hashes, 33, 32, 1));
  EXPECT_THAT(m.BlockTables(1)[0], ElementsAreArray(nulls_then(25, Concat(range(26, 32), {33}))));
  EXPECT_EQ(m.num_free_blocks(), 17u + 16 - 1);
  std::vector<BlockId> freed_order;
  for (BlockId b = 25; b >= 10; --b) freed_order.push_back(b);
  EXPECT_THAT(
      m.pool().free_queue().All(),
      ElementsAreArray(Concat(Concat(range(34, 40), {9, 8, 7, 6, 5, 4, 3, 2, 1}), freed_order)));
  m.Free(1);
  EXPECT_EQ(m.num_free_blocks(), 40u);
}

// The fit check counts the blocks the step's freeing returns; a refusal changes nothing.
TEST(KvCacheManagerTest, RefusalChangesNothingAndCountsReturnedBlocks) {
  for (const size_t usable : {23u, 22u}) {
    auto m = Manager({Sliding(8, 1)}, usable + 1);
    std::vector<uint32_t> tokens(32, 5);
    const auto hashes = Hashes(tokens, 1);
    ASSERT_TRUE(m.AllocateSlots(1, hashes, 32, 0, 16));
    const Tables before = m.BlockTables(1);
    const size_t free_before = m.num_free_blocks();
    EXPECT_EQ(free_before, usable - 16);
    // 16 needed; the 9 blocks that leave the window make it fit with 23 blocks, not with 22.
    const bool fits = m.AllocateSlots(1, hashes, 32, 16, 16);
    EXPECT_EQ(fits, usable == 23) << usable;
    if (!fits) {
      EXPECT_EQ(m.BlockTables(1), before);
      EXPECT_EQ(m.num_free_blocks(), free_before);
    } else {
      EXPECT_EQ(m.num_free_blocks(), 0u);
    }
  }
  // A new request that does not fit leaves no trace.
  auto m = Manager({Full(), Sliding(32)}, 9);
  const auto tokens = Prompt(5, 16);
  EXPECT_EQ(m.NumBlocksToAllocate(3, 0, 80, nullptr), 10u);
  ComputedBlocks hit = Lookup(m, tokens);
  EXPECT_FALSE(m.AllocateSlots(3, Hashes(tokens, 16), 80, 0, 80, &hit));
  EXPECT_EQ(m.BlockTables(3), (Tables{{}, {}}));
  EXPECT_EQ(m.num_free_blocks(), 8u);
  m.Free(3);  // unknown: no-op
  EXPECT_EQ(m.num_free_blocks(), 8u);
}

// A full + sliding-window request prefilled in chunks frees the blocks that leave the window;
// those go first when the pool needs blocks, and the request, freed and asked again, still hits
// its whole prefix through the window blocks it kept to the end.
TEST(KvCacheManagerTest, HybridRequestHitsItsCachedWindowAfterFree) {
  auto m = Manager({Full(4), Sliding(8, 4)}, 21);
  std::vector<uint32_t> tokens(40);
  for (uint32_t i = 0; i < 40; ++i) tokens[i] = 1000 + i;
  const auto hashes = Hashes(tokens, 4);
  ASSERT_TRUE(m.AllocateSlots(1, hashes, 40, 0, 16));
  EXPECT_EQ(m.BlockTables(1), (Tables{{1, 2, 3, 4}, {5, 6, 7, 8}}));
  ASSERT_TRUE(m.AllocateSlots(1, hashes, 40, 16, 16));  // frees window blocks 1, 0
  EXPECT_EQ(m.BlockTables(1), (Tables{{1, 2, 3, 4, 9, 10, 11, 12}, {N, N, 7, 8, 13, 14, 15, 16}}));
  ASSERT_TRUE(m.AllocateSlots(1, hashes, 40, 32, 8));  // frees window blocks 5-2
  EXPECT_EQ(m.BlockTables(1),
            (Tables{{1, 2, 3, 4, 9, 10, 11, 12, 17, 18}, {N, N, N, N, N, N, 15, 16, 19, 20}}));
  m.Free(1);
  EXPECT_THAT(m.pool().free_queue().All(),
              ElementsAre(6, 5, 14, 13, 8, 7, 18, 17, 12, 11, 10, 9, 4, 3, 2, 1, 20, 19, 16, 15));

  // Another request takes the six blocks that left the window early, evicting their hashes.
  (void)m.TakeRemovedEvents();
  ASSERT_EQ(Admit(m, 2, Repeat(7, 12)).tokens, 0u);
  EXPECT_EQ(m.BlockTables(2), (Tables{{6, 5, 14}, {13, 8, 7}}));
  EXPECT_THAT(m.TakeRemovedEvents(), ElementsAre(CachedKey{hashes[1], 1}, CachedKey{hashes[0], 1},
                                                 CachedKey{hashes[5], 1}, CachedKey{hashes[4], 1},
                                                 CachedKey{hashes[3], 1}, CachedKey{hashes[2], 1}));

  // The same prompt again: 36 tokens (the last is recomputed), full attention's 9 blocks and
  // the window's last two before 36.
  const ComputedBlocks hit = Lookup(m, tokens);
  EXPECT_EQ(hit.tokens, 36u);
  EXPECT_EQ(hit.blocks, (Tables{{1, 2, 3, 4, 9, 10, 11, 12, 17}, {N, N, N, N, N, N, N, 16, 19}}));
  // All 11 hit blocks sit unreferenced in the free queue; one new block per group.
  EXPECT_EQ(m.NumBlocksToAllocate(3, 0, 4, &hit), 13u);
  ASSERT_TRUE(m.AllocateSlots(3, hashes, 40, 0, 4, &hit));
  // What is left of the queue after the hits are taken out: 18, 20, 15.
  EXPECT_EQ(m.BlockTables(3),
            (Tables{{1, 2, 3, 4, 9, 10, 11, 12, 17, 18}, {N, N, N, N, N, N, N, 16, 19, 20}}));
  EXPECT_EQ(m.pool().ref_count(16), 1u);
  EXPECT_EQ(m.num_free_blocks(), 20u - 6 - 13);
}

TEST(KvCacheManagerTest, PrefixCachingOffNeverHits) {
  auto m = Manager({Full(), Sliding(32)}, 40, /*eagle=*/false, /*prefix_caching=*/false);
  const auto tokens = Prompt(4, 16, Repeat(1, 3));
  Admit(m, 1, tokens);
  m.Free(1);
  const ComputedBlocks hit = Lookup(m, tokens);
  EXPECT_EQ(hit.tokens, 0u);
  EXPECT_EQ(hit.blocks, (Tables{{}, {}}));
  for (BlockId b = 1; b < 40; ++b) EXPECT_FALSE(m.pool().key_of(b).has_value()) << b;
}

TEST(KvCacheManagerTest, StateGroupKeepsOnlyTheLastSnapshot) {
  auto m = Manager({Full(), State()}, 40);
  const auto tokens = Prompt(4, 16, Repeat(9, 3));  // 67 tokens
  ASSERT_TRUE(m.AllocateSlots(1, Hashes(tokens, 16), 67, 0, 40));
  EXPECT_EQ(m.BlockTables(1), (Tables{{1, 2, 3}, {4, 5, 6}}));
  ASSERT_TRUE(m.AllocateSlots(1, Hashes(tokens, 16), 67, 40, 27));
  // At 40 computed tokens only the snapshot ending at 32 and later are needed: block 1 of the
  // state group (tokens 16-31) went, block 0 before it as well.
  EXPECT_EQ(m.BlockTables(1), (Tables{{1, 2, 3, 7, 8}, {N, N, 6, 9, 10}}));
  m.Free(1);
  // Every full block's snapshot was cached; the hit takes the last one before 66 tokens.
  const ComputedBlocks hit = Lookup(m, tokens);
  EXPECT_EQ(hit.tokens, 64u);
  EXPECT_EQ(hit.blocks, (Tables{{1, 2, 3, 7}, {N, N, N, 9}}));
}

// ---------------------------------------------------------------------------------------------
// Ring groups (AttentionSpec::ring): a sliding window whose KV lives outside the pool; its
// table takes pool blocks only for the blocks it caches, completed by the step's tokens.

AttentionSpec Ring(uint32_t window, uint32_t bs = 16) {
  AttentionSpec spec = Sliding(window, bs);
  spec.ring = true;
  return spec;
}

// Full attention and a ring window of 32 over 70 tokens in steps of 20, 30 and 20 tokens: the
// ring group takes a block only for each block the step completes (and caches), frees them as
// they leave the window, and a later request hits them as it would a sliding window's.
TEST(KvCacheManagerTest, RingGroupAllocatesOnlyTheBlocksItCaches) {
  auto m = Manager({Full(), Ring(32)}, 30);
  std::vector<uint32_t> tokens(70);
  for (uint32_t i = 0; i < 70; ++i) tokens[i] = 500 + i;
  const auto hashes = Hashes(tokens, 16);
  struct Step {
    size_t computed, n, predicted;
    Tables tables;
  };
  const Step steps[] = {
      // Ring block 0 is complete at 16; block 1 is not, so it is null.
      {0, 20, 2 + 1, {{1, 2}, {3, N}}},
      // Blocks 1 and 2 complete; nothing has left the window at 20 computed tokens.
      {20, 30, 2 + 2, {{1, 2, 4, 5}, {3, 6, 7, N}}},
      // Block 0 leaves the window at 50 (19 tokens skipped); block 3 completes.
      {50, 20, 1 + 1, {{1, 2, 4, 5, 8}, {N, 6, 7, 9, N}}},
  };
  for (const Step& s : steps) {
    const size_t free_before = m.num_free_blocks();
    EXPECT_EQ(m.NumBlocksToAllocate(1, s.computed, s.n, nullptr), s.predicted) << s.computed;
    ASSERT_TRUE(m.AllocateSlots(1, hashes, 70, s.computed, s.n));
    EXPECT_EQ(m.BlockTables(1), s.tables) << s.computed;
    const size_t returned = s.computed == 50 ? 1 : 0;
    EXPECT_EQ(m.num_free_blocks(), free_before + returned - s.predicted) << s.computed;
  }
  for (BlockId b : {3, 6, 7, 9}) EXPECT_TRUE(m.pool().key_of(b).has_value()) << b;
  m.Free(1);
  EXPECT_EQ(m.num_free_blocks(), 29u);
  // The same prompt hits 64 tokens: full attention's 4 blocks and the ring's last two.
  const ComputedBlocks hit = Lookup(m, tokens);
  EXPECT_EQ(hit.tokens, 64u);
  EXPECT_EQ(hit.blocks, (Tables{{1, 2, 4, 5}, {N, N, 7, 9}}));
  // Hit blocks are taken as a sliding window's; the 6 new tokens complete no block.
  EXPECT_EQ(m.NumBlocksToAllocate(2, 0, 6, &hit), 6u + 1);
  ASSERT_TRUE(m.AllocateSlots(2, hashes, 70, 0, 6, &hit));
  EXPECT_EQ(m.BlockTables(2)[1], (std::vector<BlockId>{N, N, 7, 9, N}));
}

// Without prefix caching a ring group holds no block at all, whatever the length.
TEST(KvCacheManagerTest, RingGroupWithoutPrefixCachingHoldsNoBlock) {
  auto m = Manager({Ring(32), Ring(32)}, 3, /*eagle=*/false, /*prefix_caching=*/false);
  for (size_t computed = 0; computed < 400; computed += 16) {
    EXPECT_EQ(m.NumBlocksToAllocate(1, computed, 16, nullptr), 0u);
    ASSERT_TRUE(m.AllocateSlots(1, {}, 400, computed, 16));
    EXPECT_EQ(m.num_free_blocks(), 2u);
  }
  EXPECT_EQ(m.BlockTables(1), (Tables{std::vector<BlockId>(25, N), std::vector<BlockId>(25, N)}));
  m.Free(1);
  EXPECT_EQ(m.num_free_blocks(), 2u);
}

// With a larger lcm the ring caches each segment's tail only (as L7), so its table has null
// entries between blocks: freeing walks past them rather than stopping at the first, and the
// counts stay exact step by step; a refusal changes nothing.
TEST(KvCacheManagerTest, RingGroupFreesPastNullEntriesAndCountsExactly) {
  auto m = Manager({Full(32), Ring(8, 8)}, 40);
  std::vector<uint32_t> tokens(80);
  for (uint32_t i = 0; i < 80; ++i) tokens[i] = 7 * i;
  const auto hashes = Hashes(tokens, 8);
  size_t computed = 0;
  for (size_t n : {30, 10, 12, 13, 1, 14}) {
    const size_t predicted = m.NumBlocksToAllocate(1, computed, n, nullptr);
    const Tables before = m.BlockTables(1);
    const size_t held_before = 39 - m.num_free_blocks();
    ASSERT_TRUE(m.AllocateSlots(1, hashes, 80, computed, n));
    size_t pulled = 0, freed = 0;
    const Tables& after = m.BlockTables(1);
    for (size_t g = 0; g < 2; ++g) {
      for (size_t i = 0; i < after[g].size(); ++i) {
        const BlockId old = i < before[g].size() ? before[g][i] : N;
        pulled += after[g][i] != N && after[g][i] != old;
        freed += old != N && after[g][i] == N;
      }
    }
    EXPECT_EQ(predicted, pulled) << computed;
    EXPECT_EQ(39 - m.num_free_blocks(), held_before + pulled - freed) << computed;
    computed += n;
  }
  // The ring cached blocks 3 and 7 (each ends a 32-token segment). At 66 computed tokens block
  // 3 has left the window, behind null entries 4-6; block 7 (tokens 56-63) has not.
  const auto& ring = m.BlockTables(1)[1];
  ASSERT_EQ(ring.size(), 10u);
  for (size_t i = 0; i < ring.size(); ++i) EXPECT_EQ(ring[i] != N, i == 7) << i;
  EXPECT_EQ(m.num_free_blocks(), 39u - 3 - 1);  // full attention's 3 blocks of 32, block 7
  m.Free(1);
  const ComputedBlocks hit = Lookup(m, tokens);
  EXPECT_EQ(hit.tokens, 64u);
  EXPECT_EQ(std::count(hit.blocks[1].begin(), hit.blocks[1].end(), N), 7);

  // A refusal leaves the tables and the pool as they were.
  auto tight = Manager({Full(16), Ring(32)}, 4);
  ASSERT_TRUE(tight.AllocateSlots(1, Hashes(tokens, 16), 80, 0, 20));  // 2 + 1 blocks
  const Tables before = tight.BlockTables(1);
  EXPECT_EQ(tight.NumBlocksToAllocate(1, 20, 30, nullptr), 2u + 2);
  EXPECT_FALSE(tight.AllocateSlots(1, Hashes(tokens, 16), 80, 20, 30));
  EXPECT_EQ(tight.BlockTables(1), before);
  EXPECT_EQ(tight.num_free_blocks(), 0u);
}

}  // namespace
}  // namespace kvstash::engine
