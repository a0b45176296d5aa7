// BlockMetaTable: what clients said of the blocks they store (wire.BlockMeta: the block before it
// in its request, its tokens), kept from the put until the node's KV events publish the block's
// BlockStored (docs/semantics.md §19). A side table rather than a field of the store's blocks:
// only the put's own event carries it, so a block's metadata lives milliseconds, and a node
// whose clients send none (or that publishes no events) keeps nothing.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <unordered_map>
#include <vector>

#include "kvstash/common/block_key.h"
#include "kvstash/common/hash.h"
#include "kvstash/common/mutex.h"

namespace kvstash::node {

// The most tokens a client may say one block holds (a larger number is refused, not clamped).
inline constexpr uint32_t kMaxBlockMetaTokens = uint32_t{1} << 20;

// Metadata by block key (kvstash::BlockMeta, checked: tokens 1..kMaxBlockMetaTokens, the parent
// of the key's group), at most `capacity` entries: past it, the oldest entry goes first
// (counted in dropped()), so a put whose event never came (its store failed before it could be
// erased, or the store dropped its events) costs one entry until newer puts push it out. The
// data path records (O(1), under this table's own lock, never the store's); the KV event pump
// takes what its round publishes. Thread-safe.
class BlockMetaTable {
 public:
  static constexpr size_t kDefaultCapacity = 65536;

  explicit BlockMetaTable(size_t capacity = kDefaultCapacity);
  BlockMetaTable(const BlockMetaTable&) = delete;
  BlockMetaTable& operator=(const BlockMetaTable&) = delete;

  // Records `meta` for `key`, replacing what the table held for it; the oldest entry goes when
  // the table is full.
  void Record(const BlockKey& key, const BlockMeta& meta) EXCLUDES(mu_);
  // Forgets `key`'s entry, if any (its put failed).
  void Erase(const BlockKey& key) EXCLUDES(mu_);
  // `key`'s entry, taken out of the table; none when it has none.
  std::optional<BlockMeta> Take(const BlockKey& key) EXCLUDES(mu_);

  // Whether it holds no entry (a hint without the lock, exact once the writers are done).
  bool empty() const { return size_.load(std::memory_order_acquire) == 0; }
  // Entries pushed out by newer ones before they were taken, since start.
  uint64_t dropped() const { return dropped_.load(std::memory_order_relaxed); }
  size_t capacity() const { return capacity_; }

 private:
  struct Entry {
    BlockMeta meta;
    uint64_t seq;  // when recorded: its slot in `order_` is seq % capacity
  };
  struct Slot {
    BlockKey key;
    uint64_t seq;
  };

  void EraseLocked(std::unordered_map<BlockKey, Entry>::iterator it) REQUIRES(mu_);

  const size_t capacity_;
  Mutex mu_;
  std::unordered_map<BlockKey, Entry> entries_ GUARDED_BY(mu_);
  // Every Record in order, a ring of `capacity_` slots: the slot a Record reuses names the
  // oldest entry, which goes unless it was taken, erased or recorded again since (its seq then
  // differs), so the ring never holds more than the table's bound.
  std::vector<Slot> order_ GUARDED_BY(mu_);
  uint64_t next_seq_ GUARDED_BY(mu_) = 0;
  std::atomic<size_t> size_{0};
  std::atomic<uint64_t> dropped_{0};
};

}  // namespace kvstash::node
