#include "kvstash/engine/block_pool.h"

#include <numeric>
#include <utility>

namespace kvstash::engine {

FreeBlockQueue::FreeBlockQueue(size_t capacity, std::span<const BlockId> order)
    : prev_(capacity, kNone), next_(capacity, kNone), linked_(capacity, false) {
  AppendN(order);
}

Result<BlockId> FreeBlockQueue::PopLeft() {
  if (head_ == kNone) return ResourceExhaustedError("No free blocks available");
  const BlockId block = head_;
  Remove(block);
  return block;
}

Result<std::vector<BlockId>> FreeBlockQueue::PopLeftN(size_t n) {
  if (n > size_) {
    return ResourceExhaustedError("No free blocks available: {} wanted, {} free", n, size_);
  }
  std::vector<BlockId> out;
  out.reserve(n);
  for (size_t i = 0; i < n; ++i) out.push_back(*PopLeft());
  return out;
}

void FreeBlockQueue::Remove(BlockId block) {
  const BlockId p = prev_[block], n = next_[block];
  (p == kNone ? head_ : next_[p]) = n;
  (n == kNone ? tail_ : prev_[n]) = p;
  prev_[block] = next_[block] = kNone;
  linked_[block] = false;
  --size_;
}

void FreeBlockQueue::Append(BlockId block) {
  prev_[block] = tail_;
  next_[block] = kNone;
  (tail_ == kNone ? head_ : next_[tail_]) = block;
  tail_ = block;
  linked_[block] = true;
  ++size_;
}

void FreeBlockQueue::AppendN(std::span<const BlockId> blocks) {
  for (BlockId block : blocks) Append(block);
}

std::vector<BlockId> FreeBlockQueue::All() const {
  std::vector<BlockId> out;
  out.reserve(size_);
  for (BlockId b = head_; b != kNone; b = next_[b]) out.push_back(b);
  return out;
}

namespace {
std::vector<BlockId> AllIds(size_t n) {
  std::vector<BlockId> ids(n);
  std::iota(ids.begin(), ids.end(), BlockId{0});
  return ids;
}
}  // namespace

BlockPool::BlockPool(size_t num_blocks, bool prefix_caching, bool record_events)
    : prefix_caching_(prefix_caching),
      record_events_(record_events),
      ref_(num_blocks, 0),
      keys_(num_blocks),
      free_(num_blocks, AllIds(num_blocks)) {
  // The null block is taken at once and never counted or freed.
  (void)free_.PopLeft();
}

std::optional<CachedKey> BlockPool::key_of(BlockId block) const { return keys_[block]; }

std::optional<std::vector<BlockId>> BlockPool::GetCachedBlock(
    const Hash128& hash, std::span<const uint32_t> groups) const {
  std::vector<BlockId> blocks;
  for (uint32_t group : groups) {
    auto it = cached_.find(CachedKey{hash, group});
    if (it == cached_.end()) return std::nullopt;
    blocks.push_back(it->second);
  }
  return blocks;
}

Result<std::vector<BlockId>> BlockPool::GetNewBlocks(size_t n) {
  KVSTASH_ASSIGN_OR_RETURN(std::vector<BlockId> blocks, free_.PopLeftN(n));
  for (BlockId block : blocks) {
    if (keys_[block].has_value()) {
      cached_.erase(*keys_[block]);
      if (record_events_) events_.push_back({CacheEvent::Kind::kRemoved, *keys_[block], {}});
      keys_[block].reset();
    }
    ref_[block] = 1;
  }
  return blocks;
}

void BlockPool::CacheBlock(BlockId block, const CachedKey& key, std::optional<Hash128> parent) {
  if (!prefix_caching_ || block == kNullBlock || keys_[block].has_value()) return;
  if (cached_.try_emplace(key, block).second) {
    keys_[block] = key;
    if (record_events_) events_.push_back({CacheEvent::Kind::kStored, key, parent});
  }
}

void BlockPool::Touch(std::span<const BlockId> blocks) {
  for (BlockId block : blocks) {
    if (block == kNullBlock) continue;
    if (ref_[block] == 0 && free_.contains(block)) free_.Remove(block);
    ++ref_[block];
  }
}

void BlockPool::FreeBlocks(std::span<const BlockId> ordered) {
  for (BlockId block : ordered) {
    if (block == kNullBlock || ref_[block] == 0) continue;  // a double free changes nothing
    if (--ref_[block] == 0) free_.Append(block);
  }
}

bool BlockPool::EvictCachedHash(const CachedKey& key) {
  auto it = cached_.find(key);
  if (it == cached_.end()) return false;
  keys_[it->second].reset();
  cached_.erase(it);
  if (record_events_) events_.push_back({CacheEvent::Kind::kRemoved, key, {}});
  return true;
}

std::vector<CacheEvent> BlockPool::TakeEvents() { return std::exchange(events_, {}); }

std::vector<CachedKey> BlockPool::TakeRemoved() {
  std::vector<CachedKey> removed;
  for (const CacheEvent& e : TakeEvents()) {
    if (e.kind == CacheEvent::Kind::kRemoved) removed.push_back(e.key);
  }
  return removed;
}

}  // namespace kvstash::engine
