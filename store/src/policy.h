// ReplacementPolicy: the recency order and victim choice of a BlockManager.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "entry.h"
#include "kvstash/common/status.h"
#include "kvstash/store/block_manager.h"

namespace kvstash::store {

// Orders the resident entries of a BlockManager (its Entry array, indexed by slot) and chooses
// eviction victims. The manager owns the entries, their keys and ref counts, and the index; the
// policy owns the order. Not thread-safe (the manager's lock covers it).
class ReplacementPolicy {
 public:
  virtual ~ReplacementPolicy() = default;

  // Entry `id` was just created (being written): place it at the MRU end. `hash` is its KeyHash.
  virtual void Insert(uint32_t id, uint64_t hash) = 0;
  // The same for a block stored as StoreHint::kSpare. Only the spare-first wrapper keeps such
  // blocks apart; a policy alone inserts them as any block.
  virtual void InsertSpare(uint32_t id, uint64_t hash) { Insert(id, hash); }
  // Entry `id` is being dropped (failed store).
  virtual void Remove(uint32_t id) = 0;
  // One key of a Touch call; the manager calls these in reverse key order. `id` is the key's
  // entry, or kNoId when it is not resident.
  virtual void Touch(const BlockKey& key, uint64_t hash, uint32_t id, TouchKind kind) = 0;
  // Entry `id` just became evictable (its ref count reached 0).
  virtual void OnEvictable(uint32_t id) = 0;
  // A key with this hash is about to be inserted or touched: start loading what the policy
  // will look at (ARC: its ghost index). A hint; changes nothing.
  virtual void Prefetch(uint64_t /*hash*/) const {}
  // Chooses `n` victims among evictable, unmarked entries, removes them from the order and
  // appends them to `victims` in choice order. Returns false, changing nothing, when it cannot.
  virtual bool Evict(size_t n, std::vector<uint32_t>* victims) = 0;
  // Evicts entries the manager chose (evictable, in the order; a namespace at its quota evicts
  // its own blocks): removes them from the order as Evict would (ARC: they become ghosts).
  virtual void EvictChosen(std::span<const uint32_t> ids) = 0;
  virtual void Clear() = 0;
  virtual void Describe(BlockManagerState* state) const = 0;
  virtual PolicySizes Sizes() const = 0;
  virtual size_t MemoryBytes() const = 0;
  virtual Status SetTarget(double target) = 0;
};

std::unique_ptr<ReplacementPolicy> MakeLruPolicy(Entry* entries, size_t capacity,
                                                 uint32_t first_stamp);
std::unique_ptr<ReplacementPolicy> MakeArcPolicy(Entry* entries, size_t capacity,
                                                 uint32_t first_stamp);
std::unique_ptr<ReplacementPolicy> MakeAfLruPolicy(Entry* entries, size_t capacity,
                                                   uint32_t first_stamp);
// `policy` with a list of spare blocks (StoreHint::kSpare) kept apart from its order and
// evicted before its own victims (docs/semantics.md §4b).
std::unique_ptr<ReplacementPolicy> MakeSpareFirstPolicy(std::unique_ptr<ReplacementPolicy> policy,
                                                        Entry* entries, size_t capacity,
                                                        uint32_t first_stamp);

}  // namespace kvstash::store
