// White-box tests of RecencyList: the merge of the active list and the heap of returned
// entries yields exact recency order, scans are atomic, and renumbering preserves order.
#include "recency_list.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <vector>

namespace kvstash::store {
namespace {

using ::testing::ElementsAre;

class RecencyListTest : public ::testing::Test {
 protected:
  explicit RecencyListTest(uint32_t first_stamp = 0)
      : entries_(64), list_(entries_.data(), 64, 64, 0, first_stamp) {}

  std::vector<uint32_t> Order() const {
    std::vector<uint32_t> ids;
    list_.AppendInOrder(&ids);
    return ids;
  }
  // Scans n victims; commits when all were found.
  std::vector<uint32_t> Evict(size_t n) {
    std::vector<uint32_t> out;
    list_.BeginScan();
    for (size_t i = 0; i < n; ++i) {
      uint32_t id = list_.TakeVictim();
      if (id == kNoId) {
        list_.EndScan(false);
        return {};
      }
      out.push_back(id);
    }
    list_.EndScan(true);
    return out;
  }

  std::vector<Entry> entries_;
  RecencyList list_;
};

TEST_F(RecencyListTest, EvictsOldestIdleFirstAndSkipsPinned) {
  for (uint32_t id = 0; id < 6; ++id) list_.PushMru(id);
  entries_[0].ref = 1;
  entries_[1].ref = -1;
  EXPECT_THAT(Evict(2), ElementsAre(2, 3));
  EXPECT_EQ(entries_[0].where(), Place::kParked);
  EXPECT_EQ(entries_[1].where(), Place::kParked);
  EXPECT_EQ(list_.size(), 4u);
  // Back to idle: they rejoin in their old place, ahead of 4 and 5.
  entries_[1].ref = 0;
  list_.OnEvictable(1);
  entries_[0].ref = 0;
  list_.OnEvictable(0);
  EXPECT_THAT(Order(), ElementsAre(0, 1, 4, 5));
  EXPECT_THAT(Evict(3), ElementsAre(0, 1, 4));
}

TEST_F(RecencyListTest, AbortedScanChangesNothingAndMarkedEntriesAreSkipped) {
  for (uint32_t id = 0; id < 4; ++id) list_.PushMru(id);
  entries_[0].ref = 1;
  EXPECT_THAT(Evict(1), ElementsAre(1));  // parks 0
  entries_[0].ref = 0;
  list_.OnEvictable(0);  // 0 is now in the heap
  entries_[0].marked = 1;
  entries_[2].marked = 1;
  EXPECT_THAT(Evict(2), ElementsAre());  // only 3 is a candidate
  EXPECT_THAT(Order(), ElementsAre(0, 2, 3));
  entries_[0].marked = 0;
  entries_[2].marked = 0;
  EXPECT_THAT(Evict(3), ElementsAre(0, 2, 3));
  EXPECT_EQ(list_.size(), 0u);
}

TEST_F(RecencyListTest, RemoveAndMoveWorkFromEveryPlace) {
  for (uint32_t id = 0; id < 5; ++id) list_.PushMru(id);
  entries_[0].ref = 1;
  entries_[1].ref = 1;
  EXPECT_THAT(Evict(1), ElementsAre(2));  // parks 0 and 1
  entries_[1].ref = 0;
  list_.OnEvictable(1);  // 1 returned (heap); 0 still parked
  list_.MoveToMru(1);
  list_.MoveToMru(0);
  EXPECT_THAT(Order(), ElementsAre(3, 4, 1, 0));
  list_.Remove(4);
  list_.Remove(0);
  EXPECT_THAT(Order(), ElementsAre(3, 1));
  EXPECT_EQ(list_.size(), 2u);
}

// Random pins, unpins, touches and evictions against a plain vector in recency order.
TEST_F(RecencyListTest, MatchesNaiveScanUnderRandomOperations) {
  std::mt19937 rng(11);
  std::vector<uint32_t> naive;  // least recent first
  std::vector<uint32_t> free_ids;
  for (uint32_t id = 0; id < 64; ++id) free_ids.push_back(id);
  for (int step = 0; step < 20000; ++step) {
    const int op = rng() % 6;
    if (op == 0 && !free_ids.empty()) {
      uint32_t id = free_ids.back();
      free_ids.pop_back();
      entries_[id].ref = (rng() % 4 == 0) ? -1 : 0;
      list_.PushMru(id);
      naive.push_back(id);
    } else if (!naive.empty()) {
      uint32_t id = naive[rng() % naive.size()];
      Entry& e = entries_[id];
      if (op == 1) {  // pin, or finish a write
        e.ref = e.ref < 0 ? 0 : e.ref + 1;
        if (e.ref == 0) list_.OnEvictable(id);
      } else if (op == 2 && e.ref > 0) {  // unpin
        if (--e.ref == 0) list_.OnEvictable(id);
      } else if (op == 3) {  // touch
        list_.MoveToMru(id);
        naive.erase(std::find(naive.begin(), naive.end(), id));
        naive.push_back(id);
      } else if (op == 4) {  // evict 1..3 unless too few candidates
        const size_t n = 1 + rng() % 3;
        std::vector<uint32_t> expected;
        for (uint32_t c : naive) {
          if (expected.size() < n && entries_[c].ref == 0) expected.push_back(c);
        }
        if (expected.size() < n) expected.clear();
        ASSERT_EQ(Evict(n), expected) << "step " << step;
        for (uint32_t v : expected) {
          naive.erase(std::find(naive.begin(), naive.end(), v));
          free_ids.push_back(v);
        }
      } else if (op == 5 && rng() % 8 == 0) {  // remove (failed store)
        list_.Remove(id);
        naive.erase(std::find(naive.begin(), naive.end(), id));
        e.ref = 0;
        free_ids.push_back(id);
      }
    }
    ASSERT_EQ(list_.size(), naive.size());
    if (step % 97 == 0) {
      ASSERT_EQ(Order(), naive) << "step " << step;
    }
  }
}

class RecencyListNearStampLimitTest : public RecencyListTest {
 protected:
  RecencyListNearStampLimitTest() : RecencyListTest(UINT32_MAX - 4) {}
};

TEST_F(RecencyListNearStampLimitTest, RenumbersWithoutChangingOrder) {
  for (uint32_t id = 0; id < 4; ++id) list_.PushMru(id);
  entries_[0].ref = 1;
  EXPECT_THAT(Evict(1), ElementsAre(1));  // parks 0
  entries_[0].ref = 0;
  list_.OnEvictable(0);                                   // heap
  for (uint32_t id = 4; id < 8; ++id) list_.PushMru(id);  // crosses the limit
  EXPECT_LT(list_.next_stamp(), 100u);
  EXPECT_THAT(Order(), ElementsAre(0, 2, 3, 4, 5, 6, 7));
  EXPECT_THAT(Evict(3), ElementsAre(0, 2, 3));
}

}  // namespace
}  // namespace kvstash::store
