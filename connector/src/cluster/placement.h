#pragma once

// Rendezvous placement (docs/semantics.md §16): a key lives on the `replicas` members that rank
// highest for it by a hash of the key and the member's hash (of its address). Every client computes
// the same places from the same members, and a member that joins or leaves moves only its own share
// of the keys. With failure domains (zones), a key's replicas go to distinct zones while there are
// enough. Pure functions; the cluster client's members are a snapshot (members.h).

#include <array>
#include <cstddef>
#include <cstdint>

#include "kvstash/common/block_key.h"
#include "kvstash/common/hash.h"
#include "kvstash/connector/node_client.h"

namespace kvstash::connector {

// The members of one key, best-ranked first (indices into the snapshot placed over).
struct Placement {
  std::array<uint32_t, kMaxReplicas> nodes{};
  uint32_t count = 0;
};

// Member `i`'s score for `key`: the higher, the better placed.
inline uint64_t RendezvousScore(const BlockKey& key, uint64_t member_hash) {
  return Mix64(key.hash.lo ^ Mix64(key.hash.hi ^ Mix64(key.group ^ member_hash)));
}

// The min(replicas, members) best-ranked of `members` members for `key`, best first; an earlier
// member wins a tie. `hash_of(i)` is member i's hash.
template <typename HashOf>
Placement Place(size_t members, HashOf&& hash_of, const BlockKey& key, size_t replicas) {
  Placement p;
  std::array<uint64_t, kMaxReplicas> scores{};
  const size_t want = replicas < members ? replicas : members;
  for (size_t i = 0; i < members; ++i) {
    const uint64_t score = RendezvousScore(key, hash_of(i));
    // Insertion into the top `want`, best first.
    size_t at = p.count;
    while (at > 0 && score > scores[at - 1]) --at;
    if (at >= want) continue;
    const size_t last = p.count < want - 1 ? p.count : want - 1;
    for (size_t j = last; j > at; --j) {
      scores[j] = scores[j - 1];
      p.nodes[j] = p.nodes[j - 1];
    }
    scores[at] = score;
    p.nodes[at] = static_cast<uint32_t>(i);
    p.count = static_cast<uint32_t>(p.count + 1 < want ? p.count + 1 : want);
  }
  return p;
}

// The same in failure domains: `zone_of(i)` is member i's zone (a hash of its name; 0: none,
// a zone of its own). The best-ranked member first, then each next place goes to the best-ranked
// member of a zone not used yet, while there is one; then to the best-ranked of the rest. With
// no zones (all 0) or one replica, the places are Place's.
template <typename HashOf, typename ZoneOf>
Placement PlaceInZones(size_t members, HashOf&& hash_of, ZoneOf&& zone_of, const BlockKey& key,
                       size_t replicas) {
  bool zoned = false;
  for (size_t i = 0; i < members && !zoned && replicas > 1; ++i) zoned = zone_of(i) != 0;
  if (!zoned) return Place(members, hash_of, key, replicas);
  Placement p;
  const size_t want = replicas < members ? replicas : members;
  std::array<uint64_t, kMaxReplicas> zones{};
  auto taken = [&](size_t i) {
    for (uint32_t r = 0; r < p.count; ++r) {
      if (p.nodes[r] == i) return true;
    }
    return false;
  };
  auto zone_used = [&](uint64_t zone) {
    if (zone == 0) return false;
    for (uint32_t r = 0; r < p.count; ++r) {
      if (zones[r] == zone) return true;
    }
    return false;
  };
  for (int pass = 0; pass < 2 && p.count < want; ++pass) {
    while (p.count < want) {
      size_t best = members;
      uint64_t best_score = 0;
      for (size_t i = 0; i < members; ++i) {
        if (taken(i) || (pass == 0 && zone_used(zone_of(i)))) continue;
        const uint64_t score = RendezvousScore(key, hash_of(i));
        if (best == members || score > best_score) {
          best = i;
          best_score = score;
        }
      }
      if (best == members) break;  // this pass has no more
      zones[p.count] = zone_of(best);
      p.nodes[p.count++] = static_cast<uint32_t>(best);
    }
  }
  return p;
}

}  // namespace kvstash::connector
