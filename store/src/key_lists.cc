#include "key_lists.h"

namespace kvstash::store {

KeyLists::KeyLists(size_t capacity) : capacity_(capacity), index_(capacity) {}

uint32_t KeyLists::PushMru(uint32_t list, const OffloadKey& key, uint64_t hash, uint32_t value) {
  uint32_t node;
  if (free_head_ != kNoId) {
    node = free_head_;
    free_head_ = nodes_[node].next;
  } else {
    node = static_cast<uint32_t>(nodes_.size());
    nodes_.emplace_back();
  }
  Node& n = nodes_[node];
  n.key = key;
  n.list = list;
  n.value = value & kMaxValue;
  Link(node);
  index_.Insert(node, hash);
  return node;
}

void KeyLists::MoveToMru(uint32_t node) {
  Unlink(node);
  Link(node);
}

void KeyLists::Erase(uint32_t node) {
  Unlink(node);
  index_.Erase(node, KeyHash(nodes_[node].key));
  nodes_[node].next = free_head_;
  free_head_ = node;
}

void KeyLists::Clear() {
  nodes_.clear();
  index_.Clear();
  free_head_ = kNoId;
  head_[0] = head_[1] = tail_[0] = tail_[1] = kNoId;
  size_[0] = size_[1] = 0;
}

void KeyLists::AppendKeys(uint32_t list, std::vector<OffloadKey>* keys) const {
  for (uint32_t n = head_[list]; n != kNoId; n = nodes_[n].next) keys->push_back(nodes_[n].key);
}

void KeyLists::Link(uint32_t node) {
  Node& n = nodes_[node];
  const uint32_t list = n.list;
  n.prev = tail_[list];
  n.next = kNoId;
  if (tail_[list] != kNoId) {
    nodes_[tail_[list]].next = node;
  } else {
    head_[list] = node;
  }
  tail_[list] = node;
  ++size_[list];
}

void KeyLists::Unlink(uint32_t node) {
  Node& n = nodes_[node];
  const uint32_t list = n.list;
  if (n.prev != kNoId) {
    nodes_[n.prev].next = n.next;
  } else {
    head_[list] = n.next;
  }
  if (n.next != kNoId) {
    nodes_[n.next].prev = n.prev;
  } else {
    tail_[list] = n.prev;
  }
  --size_[list];
}

}  // namespace kvstash::store
