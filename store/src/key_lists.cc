#include "key_lists.h"

namespace kvstash::store {

KeyLists::KeyLists(size_t per_list, uint32_t lists)
    : per_list_(per_list), nodes_(per_list * lists), index_(per_list * lists) {
  for (uint32_t l = 0; l < lists; ++l) {
    lists_[l] = std::make_unique<RecencyList>(nodes_.data(), nodes_.size(), per_list, l, 0);
  }
}

uint32_t KeyLists::PushMru(uint32_t list, const BlockKey& key, uint64_t hash, uint32_t value) {
  uint32_t node;
  if (free_head_ != kNoId) {
    node = free_head_;
    free_head_ = nodes_[node].aux;
  } else {
    node = fresh_used_++;
  }
  Entry& n = nodes_[node];
  n.key = key;
  n.aux = value & kMaxValue;
  lists_[list]->PushMru(node);
  index_.Insert(node, hash);
  return node;
}

void KeyLists::Erase(uint32_t node, uint64_t hash) {
  lists_[nodes_[node].list]->Remove(node);
  index_.Erase(node, hash);
  nodes_[node].aux = free_head_;
  free_head_ = node;
}

void KeyLists::PopLru(uint32_t list, size_t n) {
  RecencyList& l = *lists_[list];
  popped_.clear();
  l.BeginScan();
  for (size_t i = 0; i < n; ++i) popped_.push_back(l.TakeVictim());
  l.EndScan(true);
  popped_hashes_.clear();
  for (uint32_t node : popped_) {
    popped_hashes_.push_back(KeyHash(nodes_[node].key));
    index_.Prefetch(popped_hashes_.back());
  }
  for (size_t i = 0; i < popped_.size(); ++i) {
    index_.Erase(popped_[i], popped_hashes_[i]);
    nodes_[popped_[i]].aux = free_head_;
    free_head_ = popped_[i];
  }
}

void KeyLists::Clear() {
  for (auto& l : lists_) {
    if (l) l->Clear();
  }
  nodes_.Zero();
  index_.Clear();
  fresh_used_ = 0;
  free_head_ = kNoId;
}

void KeyLists::AppendKeys(uint32_t list, std::vector<BlockKey>* keys) const {
  std::vector<uint32_t> ids;
  lists_[list]->AppendInOrder(&ids);
  for (uint32_t id : ids) keys->push_back(nodes_[id].key);
}

size_t KeyLists::MemoryBytes() const {
  size_t bytes = nodes_.MemoryBytes() + index_.MemoryBytes() +
                 popped_.capacity() * sizeof(uint32_t) +
                 popped_hashes_.capacity() * sizeof(uint64_t);
  for (const auto& l : lists_) {
    if (l) bytes += l->MemoryBytes();
  }
  return bytes;
}

}  // namespace kvstash::store
