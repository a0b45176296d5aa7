// The per-key scans of docs/semantics.md §7.4, with vectors §12.E (maximal prefix) and §12.F
// (sliding window): the result and the number of per-key lookups made.
#include <gtest/gtest.h>

#include <map>
#include <optional>
#include <vector>

#include "kvstash/common/block_key.h"
#include "test_util.h"

namespace kvstash::store {
namespace {

constexpr auto T = LookupResult::kHit;
constexpr auto N = LookupResult::kRetry;  // vLLM's None
constexpr auto F = LookupResult::kMiss;

struct Vector {
  std::map<int, LookupResult> results;  // absent keys miss
  std::vector<int> keys;
  size_t window;  // sliding window only
  ScanResult expected;
  size_t expected_calls;
};

// A lookup function over `v` that records the keys it is asked for.
struct Recorder {
  const Vector& v;
  std::vector<int> asked;
  LookupResult operator()(size_t i) {
    asked.push_back(v.keys[i]);
    auto it = v.results.find(v.keys[i]);
    return it == v.results.end() ? F : it->second;
  }
};

std::string Describe(const ScanResult& r) { return r ? std::to_string(*r) : "retry"; }

TEST(MaximalPrefixTest, ReferenceVectorsE) {
  const std::vector<Vector> vectors = {
      {{{1, T}, {2, T}}, {1, 2}, 0, 2, 2},
      {{}, {1, 2}, 0, 0, 1},
      {{{1, T}, {2, T}}, {1, 2, 3}, 0, 2, 3},
      {{{2, T}}, {1, 2}, 0, 0, 1},
      {{{1, T}}, {1}, 0, 1, 1},
      {{}, {}, 0, 0, 0},
      {{{1, N}, {2, T}}, {1, 2}, 0, std::nullopt, 2},
      {{{1, T}, {2, N}}, {1, 2}, 0, std::nullopt, 2},
      {{{1, N}, {2, F}, {3, T}}, {1, 2, 3}, 0, std::nullopt, 2},
  };
  for (size_t i = 0; i < vectors.size(); ++i) {
    SCOPED_TRACE("vector E" + std::to_string(i + 1));
    Recorder recorder{vectors[i], {}};
    ScanResult r = MaximalPrefix(vectors[i].keys.size(), recorder);
    EXPECT_EQ(Describe(r), Describe(vectors[i].expected));
    EXPECT_EQ(recorder.asked.size(), vectors[i].expected_calls);
    // Keys are asked left to right.
    for (size_t j = 0; j < recorder.asked.size(); ++j) {
      EXPECT_EQ(recorder.asked[j], vectors[i].keys[j]);
    }
  }
}

TEST(SlidingWindowTest, ReferenceVectorsF) {
  const std::vector<Vector> vectors = {
      // Quoted.
      {{{1, T}, {2, T}}, {1, 2}, 2, 2, 2},
      {{}, {1, 2, 3}, 1, 0, 3},
      {{{2, T}, {3, T}}, {1, 2, 3}, 2, 3, 2},
      {{{2, T}, {3, T}}, {1, 2, 3, 4}, 2, 3, 3},
      {{{1, T}, {2, T}}, {1, 2, 3}, 3, 2, 3},
      {{{2, T}, {3, T}}, {1, 2, 3}, 1, 3, 1},
      {{{2, T}, {3, T}, {4, T}}, {1, 2, 3, 0, 4}, 2, 3, 4},
      {{{1, T}, {2, T}, {4, T}, {5, T}}, {1, 2, 3, 4, 5}, 2, 5, 2},
      {{{2, T}, {3, T}, {4, T}, {5, T}}, {2, 1, 3, 4, 5}, 4, 1, 5},
      {{}, {}, 1, 0, 0},
      {{{1, T}, {2, N}}, {1, 2}, 2, std::nullopt, 2},
      {{{1, T}, {2, T}, {3, N}, {4, T}}, {1, 2, 3, 4}, 2, std::nullopt, 4},
      // Derived.
      {{{1, T}}, {1, 2, 3}, 2, 1, 3},
      {{{1, T}, {2, T}}, {1, 2, 3}, 2, 2, 3},
      {{{3, T}}, {1, 2, 3}, 2, 0, 3},
      {{{1, N}}, {1, 2, 3}, 2, std::nullopt, 3},
      {{{1, N}, {2, T}, {3, T}}, {1, 2, 3}, 2, 3, 2},
      {{{2, N}, {3, T}}, {1, 2, 3}, 1, 3, 1},
  };
  for (size_t i = 0; i < vectors.size(); ++i) {
    SCOPED_TRACE("vector F" + std::to_string(i + 1));
    Recorder recorder{vectors[i], {}};
    ScanResult r = SlidingWindow(vectors[i].keys.size(), vectors[i].window, recorder);
    EXPECT_EQ(Describe(r), Describe(vectors[i].expected));
    EXPECT_EQ(recorder.asked.size(), vectors[i].expected_calls);
    // Keys are asked right to left.
    for (size_t j = 0; j < recorder.asked.size(); ++j) {
      EXPECT_EQ(recorder.asked[j], vectors[i].keys[vectors[i].keys.size() - 1 - j]);
    }
  }
}

TEST(SlidingWindowTest, WindowOfZeroActsAsOne) {
  Vector v{{{2, T}}, {1, 2, 3}, 0, 2, 2};
  Recorder recorder{v, {}};
  EXPECT_EQ(SlidingWindow(v.keys.size(), 0, recorder), ScanResult(2));
}

// The manager's scans make exactly the scan's lookups (visible through the reuse tracker).
TEST(ManagerScanTest, PrefixAndWindowOverManager) {
  using testing::Key;
  using testing::Keys;
  auto m = testing::MakeManager({.capacity = 8});
  testing::StoreAndCommit(*m, Keys({1, 2, 3, 5, 6}));
  testing::PrepareStore(*m, Keys({7}));  // in flight
  EXPECT_EQ(m->LookupPrefix(Keys({1, 2, 3, 4, 5})), ScanResult(3));
  EXPECT_EQ(m->LookupPrefix(Keys({1, 7, 2})), std::nullopt);
  EXPECT_EQ(m->LookupPrefix(Keys({4, 1})), ScanResult(0));
  EXPECT_EQ(m->LookupPrefix({}), ScanResult(0));
  EXPECT_EQ(m->LookupWindow(Keys({1, 2, 3, 4, 5, 6}), 2), ScanResult(6));
  EXPECT_EQ(m->LookupWindow(Keys({1, 2, 3, 4, 5, 6}), 3), ScanResult(3));
  EXPECT_EQ(m->LookupWindow(Keys({1, 2, 4, 5, 7}), 2), std::nullopt);
  EXPECT_EQ(m->LookupWindow(Keys({1, 2, 4, 5, 6, 7}), 2), std::nullopt);
  EXPECT_EQ(m->LookupWindow(Keys({7, 5, 6}), 2), ScanResult(3));
}

TEST(ManagerScanTest, ScansCountTheirLookupsInTheReuseTracker) {
  using testing::Keys;
  auto m = testing::MakeManager({.capacity = 8, .store_threshold = 2});
  // Prefix stops at the first miss (key 2), so key 3 is never counted.
  EXPECT_EQ(m->LookupPrefix(Keys({2, 3})), ScanResult(0));
  EXPECT_EQ(m->LookupPrefix(Keys({2, 3})), ScanResult(0));
  EXPECT_EQ(testing::PrepareStore(*m, Keys({2, 3})).keys_to_store, Keys({2}));
  // A window scan goes right to left over every key without a full window.
  EXPECT_EQ(m->LookupWindow(Keys({4, 5}), 2), ScanResult(0));
  EXPECT_EQ(m->LookupWindow(Keys({4, 5}), 2), ScanResult(0));
  EXPECT_EQ(testing::PrepareStore(*m, Keys({4, 5})).keys_to_store, Keys({4, 5}));
}

TEST(ManagerScanTest, BatchedLookupAnswersEachKey) {
  using testing::Keys;
  auto m = testing::MakeManager({.capacity = 8});
  testing::StoreAndCommit(*m, Keys({1, 3}));
  testing::PrepareStore(*m, Keys({4}));
  std::vector<BlockKey> keys = Keys({1, 2, 3, 4});
  std::vector<LookupResult> results(keys.size());
  m->Lookup(keys, results);
  EXPECT_EQ(results, (std::vector<LookupResult>{T, F, T, N}));
}

}  // namespace
}  // namespace kvstash::store
