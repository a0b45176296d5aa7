// KeyLists: small ordered sets of keys without blocks (ARC's ghost lists, the reuse tracker).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "entry.h"
#include "flat_index.h"

namespace kvstash::store {

// One or two ordered lists of keys (least recent first) sharing a node pool of fixed capacity
// and one index; a key is in at most one list. Each node carries a 31-bit value (the reuse
// tracker's count). Nodes are allocated as they are first needed. Not thread-safe.
class KeyLists {
 public:
  explicit KeyLists(size_t capacity);

  // The node holding `key`, or kNoId. `hash` is KeyHash(key).
  uint32_t Find(const OffloadKey& key, uint64_t hash) const {
    return index_.Find(key, hash,
                       [this](uint32_t id) -> const OffloadKey& { return nodes_[id].key; });
  }
  uint32_t list_of(uint32_t node) const { return nodes_[node].list; }
  uint32_t value(uint32_t node) const { return nodes_[node].value; }
  void set_value(uint32_t node, uint32_t value) { nodes_[node].value = value & kMaxValue; }
  const OffloadKey& key(uint32_t node) const { return nodes_[node].key; }
  size_t size(uint32_t list) const { return size_[list]; }
  size_t total() const { return size_[0] + size_[1]; }
  size_t capacity() const { return capacity_; }

  // Adds `key` (absent) at the MRU end of `list`. Precondition: total() < capacity().
  uint32_t PushMru(uint32_t list, const OffloadKey& key, uint64_t hash, uint32_t value);
  void MoveToMru(uint32_t node);
  void Erase(uint32_t node);
  // Removes the least recent key of `list` (non-empty).
  void PopLru(uint32_t list) { Erase(head_[list]); }
  void Clear();
  void AppendKeys(uint32_t list, std::vector<OffloadKey>* keys) const;

  size_t MemoryBytes() const { return nodes_.capacity() * sizeof(Node) + index_.MemoryBytes(); }

  static constexpr uint32_t kMaxValue = (1u << 31) - 1;

 private:
  struct Node {
    OffloadKey key;
    uint32_t prev;
    uint32_t next;  // free-list link while unused
    uint32_t value : 31;
    uint32_t list : 1;
  };
  void Link(uint32_t node);
  void Unlink(uint32_t node);

  const size_t capacity_;
  std::vector<Node> nodes_;
  FlatIndex index_;
  uint32_t free_head_ = kNoId;
  uint32_t head_[2] = {kNoId, kNoId};
  uint32_t tail_[2] = {kNoId, kNoId};
  size_t size_[2] = {0, 0};
};

}  // namespace kvstash::store
