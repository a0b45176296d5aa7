// KeyLists: small ordered sets of keys without blocks (ARC's ghost lists, the reuse tracker).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "entry.h"
#include "flat_index.h"
#include "huge_array.h"
#include "recency_list.h"

namespace kvstash::store {

// One or two ordered lists of keys (least recent first) sharing one index; a key is in at most
// one list, and each list holds at most `per_list` keys. Each key carries a 31-bit value (the
// reuse tracker's count). Nodes are Entry records (ref count always 0) ordered by a
// RecencyList, so dropping the oldest keys walks memory sequentially. Node memory is reserved
// up front; its pages are committed as nodes are first used. Not thread-safe.
class KeyLists {
 public:
  KeyLists(size_t per_list, uint32_t lists);

  // The node holding `key`, or kNoId. `hash` is KeyHash(key).
  uint32_t Find(const BlockKey& key, uint64_t hash) const {
    return index_.Find(key, hash,
                       [this](uint32_t id) -> const BlockKey& { return nodes_[id].key; });
  }
  // Starts loading the index bucket of `hash` (before a Find, PushMru or Erase of that key).
  void Prefetch(uint64_t hash) const { index_.Prefetch(hash); }
  uint32_t list_of(uint32_t node) const { return nodes_[node].list; }
  uint32_t value(uint32_t node) const { return nodes_[node].aux; }
  void set_value(uint32_t node, uint32_t value) { nodes_[node].aux = value & kMaxValue; }
  const BlockKey& key(uint32_t node) const { return nodes_[node].key; }
  size_t size(uint32_t list) const { return lists_[list]->size(); }
  size_t per_list() const { return per_list_; }

  // Adds `key` (absent) at the MRU end of `list`. Precondition: size(list) < per_list().
  uint32_t PushMru(uint32_t list, const BlockKey& key, uint64_t hash, uint32_t value);
  void MoveToMru(uint32_t node) { lists_[nodes_[node].list]->MoveToMru(node); }
  void Erase(uint32_t node, uint64_t hash);
  // Removes the `n` least recent keys of `list` (which holds at least n), oldest first. Their
  // index buckets are loaded together, so a batch costs about one cache miss, not n.
  void PopLru(uint32_t list, size_t n = 1);
  void Clear();
  void AppendKeys(uint32_t list, std::vector<BlockKey>* keys) const;

  size_t MemoryBytes() const;

  static constexpr uint32_t kMaxValue = (1u << 31) - 1;

 private:
  const size_t per_list_;
  HugeArray<Entry> nodes_;
  FlatIndex index_;
  std::unique_ptr<RecencyList> lists_[2];
  uint32_t fresh_used_ = 0;
  uint32_t free_head_ = kNoId;    // free nodes, linked through Entry::aux
  std::vector<uint32_t> popped_;  // scratch
  std::vector<uint64_t> popped_hashes_;
};

}  // namespace kvstash::store
