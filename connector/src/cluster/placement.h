#pragma once

// Rendezvous placement: a key lives on the `replicas` members that rank highest for it by a
// hash of the key and the member's hash (of its address). Every client computes the same
// places from the same members, and a member that joins or leaves moves only its own share of
// the keys. Pure functions; the cluster client's members are a snapshot (node_client.cc).

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

}  // namespace kvstash::connector
