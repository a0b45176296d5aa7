#include "kvstash/common/hash.h"

#include <gtest/gtest.h>

#include <cstring>
#include <set>
#include <vector>

#include "kvstash/common/logging.h"

namespace kvstash {
namespace {

std::span<const std::byte> Bytes(const char* s) {
  return std::as_bytes(std::span(s, std::strlen(s)));
}

TEST(HashTest, Xxh3KnownValues) {
  // Reference values of XXH3 (xxhsum -H3 / -H2 on the empty input, seed 0).
  EXPECT_EQ(Xxh3Hash64({}), 0x2d06800538d394c2ULL);
  Hash128 empty = Xxh3Hash128({});
  EXPECT_EQ(empty.ToHex(), "99aa06d3014798d86001c324468d497f");
  EXPECT_NE(Xxh3Hash64(Bytes("a")), Xxh3Hash64(Bytes("a"), 1));
}

TEST(HashTest, ChainedBlockHashCommitsToPrefixAndSplit) {
  std::vector<uint32_t> a = {1, 2, 3};
  std::vector<uint32_t> b = {1, 2, 4};
  BlockHash root{};
  BlockHash h_a = ChainBlockHash(root, a);
  EXPECT_EQ(h_a, ChainBlockHash(root, a));
  EXPECT_NE(h_a, ChainBlockHash(root, b));
  // Same tokens under different parents differ.
  EXPECT_NE(ChainBlockHash(h_a, a), ChainBlockHash(root, a));
  // Extra keys (LoRA, cache salt, ...) change the hash; token/extra boundaries are unambiguous.
  EXPECT_NE(ChainBlockHash(root, a, Bytes("salt")), h_a);
  std::vector<uint32_t> t1 = {1};
  std::vector<uint32_t> empty;
  uint32_t one = 1;
  EXPECT_NE(ChainBlockHash(root, t1),
            ChainBlockHash(root, empty, std::as_bytes(std::span(&one, 1))));
}

TEST(HashTest, Mix64SpreadsSmallIntegers) {
  std::set<uint64_t> top_bytes;
  for (uint64_t i = 0; i < 256; ++i) top_bytes.insert(Mix64(i) >> 56);
  EXPECT_GT(top_bytes.size(), 140u);  // ~162 expected for random values
}

TEST(LoggingTest, LevelNamesAreChecked) {
  EXPECT_TRUE(SetLogLevel("debug").ok());
  EXPECT_TRUE(SetLogLevel("off").ok());
  EXPECT_EQ(SetLogLevel("loud").code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(SetLogLevel("info").ok());
}

}  // namespace
}  // namespace kvstash
