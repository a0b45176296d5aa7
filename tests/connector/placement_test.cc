// Rendezvous placement alone, against an obviously correct model (sort every member by score):
// the same places for every client, replicas on distinct members, and a member that joins or
// leaves moves only its own share of the keys.

#include "cluster/placement.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <random>
#include <vector>

namespace kvstash::connector {
namespace {

std::vector<uint32_t> Model(const std::vector<uint64_t>& hashes, const BlockKey& key,
                            size_t replicas) {
  std::vector<uint32_t> order(hashes.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](uint32_t a, uint32_t b) {
    return RendezvousScore(key, hashes[a]) > RendezvousScore(key, hashes[b]);
  });
  order.resize(std::min(replicas, order.size()));
  return order;
}

std::vector<uint32_t> Places(const std::vector<uint64_t>& hashes, const BlockKey& key,
                             size_t replicas) {
  const Placement p = Place(
      hashes.size(), [&](size_t i) { return hashes[i]; }, key, replicas);
  return std::vector<uint32_t>(p.nodes.begin(), p.nodes.begin() + p.count);
}

BlockKey KeyOf(std::mt19937_64& random) {
  BlockKey key;
  key.hash.lo = random();
  key.hash.hi = random();
  key.group = static_cast<uint32_t>(random() % 4);
  return key;
}

TEST(PlacementTest, MatchesSortingEveryMemberByScore) {
  std::mt19937_64 random(1);
  for (int round = 0; round < 2000; ++round) {
    std::vector<uint64_t> hashes(random() % 12);
    for (auto& h : hashes) h = random();
    const size_t replicas = 1 + random() % kMaxReplicas;
    const BlockKey key = KeyOf(random);
    EXPECT_EQ(Places(hashes, key, replicas), Model(hashes, key, replicas)) << "round " << round;
  }
}

TEST(PlacementTest, AMemberThatJoinsOrLeavesMovesOnlyItsOwnShare) {
  std::mt19937_64 random(2);
  std::vector<uint64_t> hashes(8);
  for (auto& h : hashes) h = random();
  std::vector<uint64_t> joined = hashes;
  joined.push_back(random());
  int moved = 0;
  for (int k = 0; k < 20000; ++k) {
    const BlockKey key = KeyOf(random);
    const uint32_t before = Places(hashes, key, 1)[0];
    const uint32_t after = Places(joined, key, 1)[0];
    if (after != before) {
      EXPECT_EQ(after, 8u) << "a key moved between two members that stayed";
      ++moved;
    }
    // Member 3 leaves: only its keys move.
    std::vector<uint64_t> left = hashes;
    left.erase(left.begin() + 3);
    const uint32_t without = Places(left, key, 1)[0];
    if (before != 3) EXPECT_EQ(hashes[before], left[without]);
  }
  // About 1/9 of the keys move to the new member.
  EXPECT_GT(moved, 20000 / 9 / 2);
  EXPECT_LT(moved, 20000 / 9 * 2);
}

// Zones: the model sorts every member by score, takes the best member of each zone not yet
// used in that order, then fills up with the best of the rest.
std::vector<uint32_t> ZoneModel(const std::vector<uint64_t>& hashes,
                                const std::vector<uint64_t>& zones, const BlockKey& key,
                                size_t replicas) {
  std::vector<uint32_t> order = Model(hashes, key, hashes.size());
  const size_t want = std::min(replicas, hashes.size());
  std::vector<uint32_t> out;
  std::vector<uint64_t> used;
  for (uint32_t i : order) {
    if (out.size() == want) break;
    if (zones[i] != 0 && std::find(used.begin(), used.end(), zones[i]) != used.end()) continue;
    out.push_back(i);
    used.push_back(zones[i]);
  }
  for (uint32_t i : order) {
    if (out.size() == want) break;
    if (std::find(out.begin(), out.end(), i) == out.end()) out.push_back(i);
  }
  return out;
}

std::vector<uint32_t> ZonePlaces(const std::vector<uint64_t>& hashes,
                                 const std::vector<uint64_t>& zones, const BlockKey& key,
                                 size_t replicas) {
  const Placement p = PlaceInZones(
      hashes.size(), [&](size_t i) { return hashes[i]; }, [&](size_t i) { return zones[i]; }, key,
      replicas);
  return std::vector<uint32_t>(p.nodes.begin(), p.nodes.begin() + p.count);
}

TEST(PlacementTest, ReplicasGoToDistinctZonesWhileThereAreEnough) {
  std::mt19937_64 random(3);
  for (int round = 0; round < 2000; ++round) {
    std::vector<uint64_t> hashes(1 + random() % 12);
    std::vector<uint64_t> zones(hashes.size());
    const uint64_t zone_count = 1 + random() % 4;
    for (size_t i = 0; i < hashes.size(); ++i) {
      hashes[i] = random();
      zones[i] = random() % 5 == 0 ? 0 : 1 + random() % zone_count;  // some state none
    }
    const size_t replicas = 1 + random() % 4;
    const BlockKey key = KeyOf(random);
    const std::vector<uint32_t> places = ZonePlaces(hashes, zones, key, replicas);
    ASSERT_EQ(places, ZoneModel(hashes, zones, key, replicas)) << "round " << round;
    // The first place is always the best-ranked member: one replica places as without zones.
    EXPECT_EQ(places[0], Model(hashes, key, 1)[0]);
    // Distinct zones: as many as there are (a member of no zone is one of its own).
    std::vector<uint64_t> distinct;
    for (size_t i = 0; i < hashes.size(); ++i) {
      if (zones[i] == 0 ||
          std::find(distinct.begin(), distinct.end(), zones[i]) == distinct.end()) {
        distinct.push_back(zones[i] == 0 ? (1ull << 63) + i : zones[i]);
      }
    }
    std::vector<uint64_t> got;
    for (uint32_t i : places) {
      const uint64_t z = zones[i] == 0 ? (1ull << 63) + i : zones[i];
      if (std::find(got.begin(), got.end(), z) == got.end()) got.push_back(z);
    }
    EXPECT_EQ(got.size(), std::min(places.size(), distinct.size())) << "round " << round;
  }
}

TEST(PlacementTest, WithoutZonesPlacesAsBefore) {
  std::mt19937_64 random(4);
  for (int round = 0; round < 500; ++round) {
    std::vector<uint64_t> hashes(random() % 12);
    for (auto& h : hashes) h = random();
    const std::vector<uint64_t> zones(hashes.size(), 0);
    const size_t replicas = 1 + random() % kMaxReplicas;
    const BlockKey key = KeyOf(random);
    EXPECT_EQ(ZonePlaces(hashes, zones, key, replicas), Model(hashes, key, replicas));
  }
}

}  // namespace
}  // namespace kvstash::connector
