// GhostRing against a plain list of the last `capacity` pushes: random fingerprints from small
// ranges, so that fingerprints repeat, probe runs collide and wrap, and deletions shift entries.
#include "ghost_ring.h"

#include <cstdint>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace kvstash::store {
namespace {

struct Ghost {
  uint64_t push;
  uint32_t fingerprint;
  uint32_t cls;
};

// The rule as written: a push forgets the same fingerprint and whatever was pushed `capacity`
// pushes ago; a take forgets what it returns.
class PlainRing {
 public:
  explicit PlainRing(size_t capacity) : capacity_(capacity) {}

  void Push(uint32_t fingerprint, uint32_t cls) {
    if (capacity_ == 0) return;
    std::erase_if(ghosts_, [&](const Ghost& g) { return g.fingerprint == fingerprint; });
    ghosts_.push_back({pushes_++, fingerprint, cls});
    std::erase_if(ghosts_, [&](const Ghost& g) { return g.push + capacity_ < pushes_; });
  }
  uint32_t Take(uint32_t fingerprint) {
    for (size_t i = 0; i < ghosts_.size(); ++i) {
      if (ghosts_[i].fingerprint != fingerprint) continue;
      const uint32_t cls = ghosts_[i].cls;
      ghosts_.erase(ghosts_.begin() + static_cast<std::ptrdiff_t>(i));
      return cls;
    }
    return 0;
  }
  std::vector<uint32_t> InOrder() const {
    std::vector<uint32_t> out;
    for (const Ghost& g : ghosts_) out.push_back(g.fingerprint << 2 | g.cls);
    return out;
  }

 private:
  size_t capacity_;
  uint64_t pushes_ = 0;
  std::vector<Ghost> ghosts_;
};

TEST(GhostRingTest, MatchesThePlainRuleOverRandomPushesAndTakes) {
  for (size_t capacity : {0, 1, 2, 3, 7, 64, 1000}) {
    for (uint32_t range : {4u, 50u, 5000u}) {
      std::mt19937_64 rng(capacity * 131 + range);
      GhostRing ring(capacity);
      PlainRing plain(capacity);
      std::uniform_int_distribution<uint32_t> fingerprint(1, range);
      size_t hits = 0;
      for (int op = 0; op < 20000; ++op) {
        const uint32_t fp = fingerprint(rng);
        if (rng() % 3 == 0) {
          const uint32_t got = ring.Take(fp);
          ASSERT_EQ(got, plain.Take(fp)) << "capacity " << capacity << " op " << op;
          hits += got != 0;
        } else {
          const auto cls = static_cast<uint32_t>(1 + rng() % 3);
          ring.Push(fp, cls);
          plain.Push(fp, cls);
        }
        if (op % 97 == 0) {
          std::vector<uint32_t> got;
          ring.AppendInOrder(&got);
          ASSERT_EQ(got, plain.InOrder()) << "capacity " << capacity << " op " << op;
          ASSERT_EQ(ring.size(), got.size());
        }
      }
      // Where the ring holds a good share of the fingerprints, takes must find some.
      if (capacity >= 7 && 4 * capacity >= range) EXPECT_GT(hits, 100u) << capacity << " " << range;
    }
  }
}

TEST(GhostRingTest, ClearForgetsEverything) {
  GhostRing ring(8);
  for (uint32_t fp = 1; fp <= 5; ++fp) ring.Push(fp, 2);
  ring.Clear();
  EXPECT_EQ(ring.size(), 0u);
  for (uint32_t fp = 1; fp <= 5; ++fp) EXPECT_EQ(ring.Take(fp), 0u);
  ring.Push(3, 1);
  EXPECT_EQ(ring.Take(3), 1u);
}

TEST(GhostRingTest, FingerprintsAreOfTheHashAndGroupNotTheNamespace) {
  BlockKey a{BlockHash{1, 2}, 0, 0};
  BlockKey other_namespace = a;
  other_namespace.namespace_id = 9;
  BlockKey other_group = a;
  other_group.group = 1;
  EXPECT_EQ(GhostRing::Fingerprint(a), GhostRing::Fingerprint(other_namespace));
  EXPECT_NE(GhostRing::Fingerprint(a), GhostRing::Fingerprint(other_group));
  EXPECT_LT(GhostRing::Fingerprint(a), uint32_t{1} << 30);
  EXPECT_NE(GhostRing::Fingerprint(a), 0u);
}

}  // namespace
}  // namespace kvstash::store
