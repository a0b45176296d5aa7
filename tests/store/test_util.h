// Helpers shared by the store tests: keys from small integers (k(i) of docs/semantics.md §12),
// managers, and printable state.
#pragma once

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "kvstash/store/block_manager.h"

namespace kvstash::store::testing {

// k(i) of docs/semantics.md §12: block hash i, group 0, namespace 0.
inline BlockKey Key(uint64_t i, uint32_t group = 0) { return BlockKey{BlockHash{i, 0}, group, 0}; }

inline std::vector<BlockKey> Keys(std::initializer_list<uint64_t> ids) {
  std::vector<BlockKey> keys;
  for (uint64_t i : ids) keys.push_back(Key(i));
  return keys;
}

// Key i of namespace `ns` (group 0).
inline BlockKey NsKey(NamespaceId ns, uint64_t i) { return BlockKey{BlockHash{i, 0}, 0, ns}; }

inline std::vector<BlockKey> NsKeys(NamespaceId ns, std::initializer_list<uint64_t> ids) {
  std::vector<BlockKey> keys;
  for (uint64_t i : ids) keys.push_back(NsKey(ns, i));
  return keys;
}

struct ManagerSpec {
  size_t capacity = 4;
  EvictionPolicy policy = EvictionPolicy::kLru;
  uint32_t store_threshold = 0;
  size_t max_tracker_size = 64000;
  bool events = true;
  NamespaceQuotas quotas = {};
  bool count_namespaces = false;
  size_t max_pending_event_keys = 0;
};

inline std::unique_ptr<BlockManager> MakeManager(const ManagerSpec& spec) {
  BlockManagerOptions options;
  options.capacity_blocks = spec.capacity;
  options.max_pending_event_keys = spec.max_pending_event_keys;
  options.policy = spec.policy;
  options.store_threshold = spec.store_threshold;
  options.max_tracker_size = spec.max_tracker_size;
  options.enable_events = spec.events;
  options.quotas = spec.quotas;
  options.count_namespaces = spec.count_namespaces;
  auto manager = BlockManager::Create(options);
  EXPECT_TRUE(manager.ok()) << manager.status().ToString();
  return std::move(manager).value();
}

inline StorePlan PrepareStore(BlockManager& manager, const std::vector<BlockKey>& keys) {
  StorePlan plan;
  Status status = manager.PrepareStore(keys, &plan);
  EXPECT_TRUE(status.ok()) << status.ToString();
  return plan;
}

inline void StoreAndCommit(BlockManager& manager, const std::vector<BlockKey>& keys) {
  PrepareStore(manager, keys);
  manager.CompleteStore(keys, true);
}

inline std::vector<SlotId> PrepareLoad(BlockManager& manager, const std::vector<BlockKey>& keys) {
  std::vector<SlotId> slots;
  Status status = manager.PrepareLoad(keys, &slots);
  EXPECT_TRUE(status.ok()) << status.ToString();
  return slots;
}

// Blocks as (key, slot, ref) triples, for EXPECT_THAT on state lists.
inline BlockInfo Block(uint64_t key, SlotId slot, int32_t ref = 0) {
  return BlockInfo{Key(key), slot, ref};
}

inline OffloadEvent Stored(std::initializer_list<uint64_t> ids) {
  return {OffloadEvent::Kind::kStored, Keys(ids)};
}
inline OffloadEvent Removed(std::initializer_list<uint64_t> ids) {
  return {OffloadEvent::Kind::kRemoved, Keys(ids)};
}
inline OffloadEvent Lost() { return {OffloadEvent::Kind::kLost, {}}; }

}  // namespace kvstash::store::testing

namespace kvstash::store {
// gtest finds these by argument-dependent lookup.
inline void PrintTo(const BlockKey& key, std::ostream* os) { *os << key.ToString(); }
inline void PrintTo(const BlockInfo& b, std::ostream* os) {
  *os << "(" << b.key.ToString() << " slot " << b.slot << " ref " << b.ref_count << ")";
}
inline void PrintTo(const NamespaceUsage& u, std::ostream* os) {
  *os << "(ns " << u.id << ": " << u.blocks << " blocks, quota "
      << (u.quota_blocks ? std::to_string(*u.quota_blocks) : "none") << ")";
}
inline void PrintTo(const OffloadEvent& e, std::ostream* os) {
  *os << (e.kind == OffloadEvent::Kind::kStored    ? "stored{"
          : e.kind == OffloadEvent::Kind::kRemoved ? "removed{"
                                                   : "lost{");
  for (const auto& k : e.keys) *os << k.ToString() << " ";
  *os << "}";
}

}  // namespace kvstash::store
