// The prefix-cache hit search per attention type and across groups, against the vectors
// of docs/semantics.md §12.K and the rules of §9.3 and §9.4.

#include "kvstash/engine/cache_hit.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <random>

namespace kvstash::engine {
namespace {

using Kind = AttentionSpec::Kind;
using ::testing::ElementsAre;
using ::testing::ElementsAreArray;

AttentionSpec Spec(Kind kind, uint32_t bs, uint32_t window = 0, uint32_t chunk = 0) {
  return AttentionSpec{kind, bs, window, chunk};
}

// Hash i cached as block `base + i` where flags[i] is true.
CachedBlocks Cached(std::vector<bool> flags, BlockId base = 10) {
  const size_t n = flags.size();
  return CachedBlocks{n, [flags = std::move(flags), base](size_t i) -> std::optional<BlockId> {
                        if (i >= flags.size() || !flags[i]) return std::nullopt;
                        return base + static_cast<BlockId>(i);
                      }};
}

// §12.K1: chunked local, bs 2, chunk 4; max_length = blocks * 2 + tail.
TEST(CacheHitTest, K1ChunkedLocalFindLongestCacheHit) {
  const AttentionSpec spec = Spec(Kind::kChunkedLocal, 2, 0, 4);
  struct Case {
    std::vector<bool> flags;
    size_t tail;
    size_t expected;
  };
  std::vector<Case> cases = {
      {{true}, 0, 1},
      {{true}, 1, 1},
      {{true, false}, 0, 2},
      {{true, false}, 1, 2},
      {{true, true}, 0, 2},
      {{true, true}, 1, 2},
      {{true, true, false}, 0, 2},
      {{true, true, false}, 1, 2},
      {{true, true, true}, 0, 3},
      {{true, true, true}, 1, 3},
      {{true, true, true, false}, 0, 4},
      {{true, true, true, false}, 1, 4},
  };
  std::mt19937 random(7);
  for (const bool x : {false, true, static_cast<bool>(random() & 1)}) {
    auto with = [&](std::vector<bool> tail_flags) {
      std::vector<bool> flags(8, x);
      flags.insert(flags.end(), tail_flags.begin(), tail_flags.end());
      return flags;
    };
    cases.push_back({with({true}), 1, 9});
    cases.push_back({with({false}), 1, 8});
    cases.push_back({with({true, true}), 1, 10});
    for (size_t tail : {0, 1}) {
      cases.push_back({with({true, false}), tail, 10});
      cases.push_back({with({false, true}), tail, 10});
      cases.push_back({with({false, false}), tail, 10});
    }
  }
  for (const Case& c : cases) {
    const size_t max_length = c.flags.size() * 2 + c.tail;
    const auto blocks = FindLongestCacheHit(spec, Cached(c.flags), max_length, 2);
    ASSERT_EQ(blocks.size(), c.expected)
        << "flags " << ::testing::PrintToString(c.flags) << " tail " << c.tail;
    for (size_t i = 0; i < (blocks.size() - 1) / 2; ++i) EXPECT_EQ(blocks[i], kNullBlock) << i;
    // After the nulls, the cached blocks themselves.
    for (size_t i = 0; i < blocks.size(); ++i) {
      if (blocks[i] != kNullBlock) {
        EXPECT_EQ(blocks[i], 10 + i);
      }
    }
  }
}

// §12.K2: sliding window, bs 2, window 4 (two contiguous blocks); max_length = blocks * 2.
TEST(CacheHitTest, K2SlidingWindowFindLongestCacheHit) {
  const AttentionSpec spec = Spec(Kind::kSlidingWindow, 2, 4);
  const bool T = true, F = false;
  const std::vector<std::pair<std::vector<bool>, size_t>> cases = {
      {std::vector<bool>(10, F), 0},
      {{T}, 1},
      {{T, F}, 1},
      {{T, T}, 2},
      {{T, T, F}, 2},
      {{T, T, T}, 3},
      {{T, T, T, F}, 3},
      {{T, T, F, T, F, F, T, T, F, T, T, T}, 12},
      {{T, T, F, T, F, F, T, T, F, F, F}, 8},
      {{T, T, F, T, F, F, T, T, F, F, F, T}, 8},
  };
  for (const auto& [flags, expected] : cases) {
    const auto blocks = FindLongestCacheHit(spec, Cached(flags), flags.size() * 2, 2);
    ASSERT_EQ(blocks.size(), expected) << ::testing::PrintToString(flags);
    // The last (at most 2) entries are the real blocks; all before them are null.
    for (size_t j = 0; j < blocks.size(); ++j) {
      const size_t i = blocks.size() - 1 - j;
      if (j < 2) {
        EXPECT_EQ(blocks[i], i + 10) << ::testing::PrintToString(flags) << " at " << i;
      } else {
        EXPECT_EQ(blocks[i], kNullBlock) << ::testing::PrintToString(flags) << " at " << i;
      }
    }
  }
}

std::vector<BlockId> Table() {
  std::vector<BlockId> table;
  for (BlockId b = 1000; b <= 1010; ++b) table.push_back(b);
  return table;
}

// §12.K3: chunked local, bs 2, chunk 4, table 1000..1010 (each n on a fresh table).
TEST(CacheHitTest, K3ChunkedLocalRemoveSkippedBlocks) {
  const AttentionSpec spec = Spec(Kind::kChunkedLocal, 2, 0, 4);
  auto table = Table();
  EXPECT_TRUE(RemoveSkippedBlocks(spec, table, 0).empty());
  EXPECT_EQ(table, Table());
  EXPECT_THAT(RemoveSkippedBlocks(spec, table, 4), ElementsAre(1001, 1000));
  EXPECT_THAT(std::vector<BlockId>(table.begin(), table.begin() + 3),
              ElementsAre(kNullBlock, kNullBlock, 1002));
  EXPECT_TRUE(RemoveSkippedBlocks(spec, table, 6).empty());  // still the first chunk's two
  EXPECT_THAT(RemoveSkippedBlocks(spec, table, 12), ElementsAre(1005, 1004, 1003, 1002));
  for (size_t i = 0; i < 6; ++i) EXPECT_EQ(table[i], kNullBlock) << i;
  EXPECT_EQ(table[6], 1006u);
}

// §12.K4: sliding window, bs 2, window 4, the same table across the calls.
TEST(CacheHitTest, K4SlidingWindowRemoveSkippedBlocks) {
  const AttentionSpec spec = Spec(Kind::kSlidingWindow, 2, 4);
  auto table = Table();
  EXPECT_TRUE(RemoveSkippedBlocks(spec, table, 0).empty());
  EXPECT_TRUE(RemoveSkippedBlocks(spec, table, 4).empty());
  EXPECT_EQ(table, Table());
  EXPECT_THAT(RemoveSkippedBlocks(spec, table, 5), ElementsAre(1000));
  EXPECT_THAT(RemoveSkippedBlocks(spec, table, 6), ElementsAre());
  EXPECT_EQ(table[0], kNullBlock);
  EXPECT_EQ(table[1], 1001u);
  EXPECT_THAT(RemoveSkippedBlocks(spec, table, 7), ElementsAre(1001));
  EXPECT_EQ(table[2], 1002u);
  EXPECT_THAT(RemoveSkippedBlocks(spec, table, 11), ElementsAre(1003, 1002));
  EXPECT_THAT(std::vector<BlockId>(table.begin(), table.begin() + 5),
              ElementsAre(kNullBlock, kNullBlock, kNullBlock, kNullBlock, 1004));
}

TEST(CacheHitTest, SkippedTokensPerType) {
  EXPECT_EQ(NumSkippedTokens(Spec(Kind::kFull, 16), 1000), 0u);
  EXPECT_EQ(NumSkippedTokens(Spec(Kind::kSlidingWindow, 16, 128), 100), 0u);
  EXPECT_EQ(NumSkippedTokens(Spec(Kind::kSlidingWindow, 16, 128), 1000), 873u);
  EXPECT_EQ(NumSkippedTokens(Spec(Kind::kChunkedLocal, 16, 0, 64), 1000), 960u);
  EXPECT_EQ(NumSkippedTokens(Spec(Kind::kState, 16), 1000), 999u);
  EXPECT_EQ(NumSkippedTokens(Spec(Kind::kState, 16), 0), 0u);
}

TEST(CacheHitTest, FullAttentionStopsAtTheFirstMissAndAligns) {
  const AttentionSpec spec = Spec(Kind::kFull, 4);
  const auto cached = Cached({true, true, true, false, true});
  EXPECT_THAT(FindLongestCacheHit(spec, cached, 20, 4), ElementsAre(10, 11, 12));
  EXPECT_THAT(FindLongestCacheHit(spec, cached, 20, 8), ElementsAre(10, 11));  // aligned to 8
  EXPECT_THAT(FindLongestCacheHit(spec, cached, 9, 4), ElementsAre(10, 11));   // max_length
  EXPECT_THAT(FindLongestCacheHit(spec, cached, 20, 4, /*eagle=*/true), ElementsAre(10, 11));
}

TEST(CacheHitTest, StateTakesTheRightmostAlignedSnapshot) {
  const AttentionSpec spec = Spec(Kind::kState, 4);
  const auto cached = Cached({true, false, true, true, false});
  EXPECT_THAT(FindLongestCacheHit(spec, cached, 20, 4),
              ElementsAre(kNullBlock, kNullBlock, kNullBlock, 13));
  // Aligned to 8 tokens: block 3 ends at 16 (aligned), so the same; with max_length 12 only
  // block 2 (ends at 12, not aligned to 8) and block 0 (ends at 4) are candidates: none.
  EXPECT_THAT(FindLongestCacheHit(spec, cached, 12, 8), ElementsAre());
  EXPECT_THAT(FindLongestCacheHit(spec, cached, 12, 4), ElementsAre(kNullBlock, kNullBlock, 12));
}

// §9.4: three cached blocks (bs 16) and a 5-token suffix hit 48 tokens in every combination of
// §12.L4; a hole in one group shrinks the hit to what every type accepts.
TEST(CacheHitTest, HybridCombinationsHitTheCachedPrefix) {
  const AttentionSpec full = Spec(Kind::kFull, 16);
  const AttentionSpec sw = Spec(Kind::kSlidingWindow, 16, 32);
  const AttentionSpec sw_large = Spec(Kind::kSlidingWindow, 16, 64);
  const AttentionSpec mamba = Spec(Kind::kState, 16);
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
      {sw, mamba, sw_large, mamba},
      {full, full, sw, mamba},
  };
  for (const auto& specs : combos) {
    std::vector<CacheGroup> groups;
    for (size_t g = 0; g < specs.size(); ++g) {
      groups.push_back({specs[g], Cached({true, true, true}, 100 * (g + 1))});
    }
    const HybridCacheHit hit = FindLongestHybridCacheHit(groups, 3 * 16 + 5 - 1);
    EXPECT_EQ(hit.tokens, 48u) << groups.size();
    for (size_t g = 0; g < groups.size(); ++g) {
      ASSERT_EQ(hit.blocks[g].size(), 3u) << g;
      EXPECT_EQ(hit.blocks[g].back(), 100 * (g + 1) + 2) << g;  // the last block is real
    }
  }
}

TEST(CacheHitTest, HybridHitShrinksToWhatEveryGroupAccepts) {
  const AttentionSpec full = Spec(Kind::kFull, 16);
  const AttentionSpec sw = Spec(Kind::kSlidingWindow, 16, 32);
  // Shapes like §12.L2 (full + two sliding-window groups, window 32 = 2 blocks), with four
  // blocks cached and a max length of 4 blocks + 7 - 1 tokens.
  auto run = [&](std::vector<bool> g0, std::vector<bool> g1, std::vector<bool> g2) {
    std::vector<CacheGroup> groups = {
        {full, Cached(g0, 1)}, {sw, Cached(g1, 5)}, {sw, Cached(g2, 9)}};
    return FindLongestHybridCacheHit(groups, 4 * 16 + 7 - 1);
  };
  const bool T = true, F = false;
  EXPECT_EQ(run({T, T, T, T}, {T, T, T, T}, {T, T, T, T}).tokens, 64u);
  // (h0,g1),(h0,g2) evicted: the window only needs blocks 2-3: still 4 blocks.
  const auto partial = run({T, T, T, T}, {F, T, T, T}, {F, T, T, T});
  EXPECT_EQ(partial.tokens, 64u);
  EXPECT_THAT(partial.blocks[1], ElementsAre(kNullBlock, kNullBlock, 7, 8));
  // (h0,g0): full attention misses at once.
  EXPECT_EQ(run({F, T, T, T}, {T, T, T, T}, {T, T, T, T}).tokens, 0u);
  // (h2,g1): the windows agree only on the first two blocks.
  const auto hole = run({T, T, T, T}, {T, T, F, T}, {T, T, T, T});
  EXPECT_EQ(hole.tokens, 32u);
  EXPECT_THAT(hole.blocks[0], ElementsAre(1, 2));
  EXPECT_THAT(hole.blocks[1], ElementsAre(5, 6));
  EXPECT_THAT(hole.blocks[2], ElementsAre(9, 10));
  // (h2,g0),(h0,g1),(h0,g2): full stops at 2 blocks, the windows then need blocks 0-1.
  EXPECT_EQ(run({T, T, F, T}, {F, T, T, T}, {F, T, T, T}).tokens, 0u);
}

// §9.4 with eagle (vectors of §12.L3): an eagle group is looked up one block past the
// candidate and drops one block, once per candidate length.
TEST(CacheHitTest, HybridEagleDropsOnceForOneFullAndOneOther) {
  const std::vector<bool> all(6, true);
  const std::vector<CacheGroup> groups = {{Spec(Kind::kFull, 16), Cached(all, 1)},
                                          {Spec(Kind::kSlidingWindow, 16, 48), Cached(all, 8)}};
  const HybridCacheHit hit = FindLongestHybridCacheHit(groups, 6 * 16 + 5 - 1, /*eagle=*/true);
  EXPECT_EQ(hit.tokens, 80u);
  EXPECT_THAT(hit.blocks[0], ElementsAre(1, 2, 3, 4, 5));
  EXPECT_THAT(hit.blocks[1], ElementsAre(kNullBlock, kNullBlock, 10, 11, 12));
  EXPECT_EQ(FindLongestHybridCacheHit(groups, 6 * 16 + 5 - 1).tokens, 96u);
}

// Three attention groups take a second round; a group that already dropped for the candidate
// length does not drop again (vLLM issue 32802: the drops compounded down to no hit).
TEST(CacheHitTest, HybridEagleDoesNotCompoundOverRounds) {
  const std::vector<bool> all(6, true);
  const std::vector<CacheGroup> groups = {{Spec(Kind::kFull, 16), Cached(all, 1)},
                                          {Spec(Kind::kSlidingWindow, 16, 32), Cached(all, 10)},
                                          {Spec(Kind::kSlidingWindow, 16, 64), Cached(all, 20)}};
  const HybridCacheHit hit = FindLongestHybridCacheHit(groups, 100, /*eagle=*/true);
  EXPECT_EQ(hit.tokens, 80u);
  EXPECT_THAT(hit.blocks[0], ElementsAre(1, 2, 3, 4, 5));
  EXPECT_THAT(hit.blocks[1], ElementsAre(kNullBlock, kNullBlock, kNullBlock, 13, 14));
  EXPECT_THAT(hit.blocks[2], ElementsAre(kNullBlock, 21, 22, 23, 24));
  EXPECT_EQ(FindLongestHybridCacheHit(groups, 100).tokens, 96u);
}

// Chunked-local and state groups get no eagle treatment: no drop and no look-ahead block (which
// would let them hit past the candidate length).
TEST(CacheHitTest, HybridEagleLeavesChunkedLocalAndStateAlone) {
  const std::vector<bool> all(6, true);
  for (const AttentionSpec& other :
       {Spec(Kind::kChunkedLocal, 16, 0, 64), Spec(Kind::kState, 16)}) {
    const std::vector<CacheGroup> groups = {{Spec(Kind::kFull, 16), Cached(all, 1)},
                                            {other, Cached(all, 10)}};
    const HybridCacheHit hit = FindLongestHybridCacheHit(groups, 100, /*eagle=*/true);
    EXPECT_EQ(hit.tokens, 80u);
    ASSERT_EQ(hit.blocks[1].size(), 5u);
    EXPECT_EQ(hit.blocks[1].back(), 14u);
  }
}

}  // namespace
}  // namespace kvstash::engine
