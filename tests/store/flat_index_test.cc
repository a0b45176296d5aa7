// White-box tests of the open-addressing index: lookups survive any order of inserts and
// backward-shift deletions, including clusters that wrap around the end of the table.
#include "flat_index.h"

#include <gtest/gtest.h>

#include <random>
#include <unordered_map>
#include <vector>

namespace kvstash::store {
namespace {

TEST(FlatIndexTest, MatchesAMapUnderRandomInsertsAndErases) {
  constexpr size_t kMax = 200;
  std::vector<BlockKey> keys(kMax);
  FlatIndex index(kMax);
  auto key_at = [&](uint32_t id) -> const BlockKey& { return keys[id]; };
  std::unordered_map<uint64_t, uint32_t> model;  // key number -> id
  std::vector<uint32_t> free_ids;
  for (uint32_t i = 0; i < kMax; ++i) free_ids.push_back(i);
  std::mt19937_64 rng(7);
  for (int step = 0; step < 20000; ++step) {
    const uint64_t k = rng() % 400;
    const BlockKey key{BlockHash{k, 0}, 0, 0};
    auto it = model.find(k);
    if (it == model.end() && !free_ids.empty() && rng() % 3 != 0) {
      const uint32_t id = free_ids.back();
      free_ids.pop_back();
      keys[id] = key;
      index.Insert(id, KeyHash(key));
      model[k] = id;
    } else if (it != model.end() && rng() % 2 == 0) {
      index.Erase(it->second, KeyHash(key));
      free_ids.push_back(it->second);
      model.erase(it);
    }
    ASSERT_EQ(index.size(), model.size());
    // Every present key is found, and a sample of absent ones is not.
    for (const auto& [num, id] : model) {
      ASSERT_EQ(index.Find(BlockKey{BlockHash{num, 0}, 0, 0}, KeyHash(keys[id]), key_at), id);
    }
    const BlockKey absent{BlockHash{1000 + k, 0}, 0, 0};
    ASSERT_EQ(index.Find(absent, KeyHash(absent), key_at), FlatIndex::kNone);
  }
}

TEST(FlatIndexTest, ClearEmptiesTheIndex) {
  std::vector<BlockKey> keys = {BlockKey{BlockHash{1, 0}, 0, 0}};
  FlatIndex index(1);
  index.Insert(0, KeyHash(keys[0]));
  index.Clear();
  EXPECT_EQ(index.size(), 0u);
  EXPECT_EQ(index.Find(keys[0], KeyHash(keys[0]),
                       [&](uint32_t id) -> const BlockKey& { return keys[id]; }),
            FlatIndex::kNone);
}

}  // namespace
}  // namespace kvstash::store
