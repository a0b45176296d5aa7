#include "block_meta_table.h"

#include <algorithm>

namespace kvstash::node {

BlockMetaTable::BlockMetaTable(size_t capacity) : capacity_(std::max<size_t>(capacity, 1)) {
  MutexLock lock(&mu_);
  // Sized once, so that a Record never rehashes the table under its lock; the ring grows to its
  // bound with the first Records only (a node whose clients send no metadata allocates none).
  entries_.reserve(capacity_);
}

void BlockMetaTable::EraseLocked(std::unordered_map<BlockKey, Entry>::iterator it) {
  entries_.erase(it);
  size_.store(entries_.size(), std::memory_order_release);
}

void BlockMetaTable::Record(const BlockKey& key, const BlockMeta& meta) {
  MutexLock lock(&mu_);
  const uint64_t seq = next_seq_++;
  const size_t slot = static_cast<size_t>(seq % capacity_);
  if (order_.size() < capacity_) {
    order_.push_back({key, seq});
  } else {
    const Slot oldest = order_[slot];
    auto it = entries_.find(oldest.key);
    if (it != entries_.end() && it->second.seq == oldest.seq) {
      EraseLocked(it);
      dropped_.fetch_add(1, std::memory_order_relaxed);
    }
    order_[slot] = {key, seq};
  }
  entries_.insert_or_assign(key, Entry{meta, seq});
  size_.store(entries_.size(), std::memory_order_release);
}

void BlockMetaTable::Erase(const BlockKey& key) {
  MutexLock lock(&mu_);
  if (auto it = entries_.find(key); it != entries_.end()) EraseLocked(it);
}

std::optional<BlockMeta> BlockMetaTable::Take(const BlockKey& key) {
  MutexLock lock(&mu_);
  auto it = entries_.find(key);
  if (it == entries_.end()) return std::nullopt;
  const BlockMeta meta = it->second.meta;
  EraseLocked(it);
  return meta;
}

}  // namespace kvstash::node
