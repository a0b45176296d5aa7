#pragma once

// Where the cluster client's calls go: each key's replicas among the members of a snapshot
// (placement.h: rendezvous, replicas in distinct zones), and a batch's keys grouped by member.

#include <cstddef>
#include <span>
#include <vector>

#include "cluster/members.h"
#include "cluster/placement.h"
#include "kvstash/common/block_key.h"

namespace kvstash::connector {

// Places keys on `replicas` members of a snapshot. Every client with the same members places a
// key on the same ones, best-ranked first. Immutable; thread-safe.
class Placer {
 public:
  explicit Placer(size_t replicas) : replicas_(replicas) {}

  size_t replicas() const { return replicas_; }

  // The places of `key` among `members`: `replicas` of them, best-ranked first, in distinct
  // zones while there are enough (fewer when fewer are live).
  Placement Place(const Members& members, const BlockKey& key) const {
    return PlaceInZones(
        members.size(), [&](size_t i) { return members[i]->hash; },
        [&](size_t i) { return members[i]->zone; }, key, replicas_);
  }

  // The keys of `keys` by member (each key at each of its replicas), in key order within each
  // member; which members have any; with `places`, each key's places.
  void ByNode(const Members& members, std::span<const BlockKey> keys,
              std::vector<std::vector<size_t>>* by_node, std::vector<bool>* wanted,
              std::vector<Placement>* places = nullptr) const {
    by_node->assign(members.size(), {});
    wanted->assign(members.size(), false);
    if (places != nullptr) places->resize(keys.size());
    for (size_t i = 0; i < keys.size(); ++i) {
      const Placement p = Place(members, keys[i]);
      if (places != nullptr) (*places)[i] = p;
      for (uint32_t r = 0; r < p.count; ++r) {
        (*by_node)[p.nodes[r]].push_back(i);
        (*wanted)[p.nodes[r]] = true;
      }
    }
  }

 private:
  const size_t replicas_;  // 1..kMaxReplicas (NodeClient::Create checks)
};

}  // namespace kvstash::connector
