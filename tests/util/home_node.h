#pragma once

// Where a cluster client places a key, as an index into its live nodes: for tests that stop or
// kill "node 1" and check which keys that costs.

#include <cstddef>
#include <vector>

#include "kvstash/connector/node_client.h"

namespace kvstash::testing {

// The index in client.nodes() of `key`'s best-ranked node; nodes().size() when none is live.
inline size_t HomeIndex(const connector::NodeClient& client, const BlockKey& key) {
  const std::vector<connector::NodeAddress> nodes = client.nodes();
  const std::vector<connector::NodeAddress> places = client.PlacesOf(key);
  for (size_t n = 0; n < nodes.size() && !places.empty(); ++n) {
    if (nodes[n] == places.front()) return n;
  }
  return nodes.size();
}

}  // namespace kvstash::testing
