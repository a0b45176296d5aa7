// Offload keys: what a node stores a block under.
#pragma once

#include <cstdint>
#include <string>

#include "kvstash/common/hash.h"

namespace kvstash::store {

// A node-local id for a namespace (model + KV layout fingerprint: dtype, heads, head size, block
// size, TP rank). The node interns namespace names to ids, so incompatible layouts never mix.
using NamespaceId = uint32_t;

// (namespace, group, block hash): one block of one KV-cache group of one prefix. The block hash
// is chained, so the key commits to the whole prefix. A value type, 24 bytes.
struct OffloadKey {
  BlockHash hash;
  uint32_t group = 0;
  NamespaceId namespace_id = 0;

  friend bool operator==(const OffloadKey&, const OffloadKey&) = default;
  friend auto operator<=>(const OffloadKey&, const OffloadKey&) = default;

  // "ns0/g1/0x2a": the hash in hex without leading zeros.
  std::string ToString() const;
};

// The hash that in-memory tables use for a key (not stable across versions; never persist it).
inline uint64_t KeyHash(const OffloadKey& key) {
  const uint64_t tag = ((uint64_t{key.namespace_id} << 32) | key.group) * 0x9e3779b97f4a7c15ULL;
  return Mix64(key.hash.lo ^ Mix64(key.hash.hi ^ tag));
}

}  // namespace kvstash::store
