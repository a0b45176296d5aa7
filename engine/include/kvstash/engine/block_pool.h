#pragma once

// The paged KV cache's block pool, as vLLM's BlockPool and FreeKVCacheBlockQueue
// (docs/semantics.md §9.2, vectors §12.N): block 0 is the null block;
// free blocks wait in a queue, least recently freed first, and keep their cached hash until a
// new allocation takes them, so a freed block is still a prefix-cache hit until then.

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <unordered_map>
#include <vector>

#include "kvstash/common/hash.h"
#include "kvstash/common/status.h"
#include "kvstash/engine/cache_hit.h"

namespace kvstash::engine {

// Free blocks in eviction order: a doubly-linked list threaded through per-block links, so
// removing any block is O(1). Blocks are ids below `capacity`.
class FreeBlockQueue {
 public:
  // The queue holds `order`, first to be taken first.
  FreeBlockQueue(size_t capacity, std::span<const BlockId> order);

  size_t size() const { return size_; }
  bool contains(BlockId block) const { return linked_[block]; }
  // Takes the first block; ResourceExhausted "No free blocks available" when empty.
  Result<BlockId> PopLeft();
  // Takes the first n blocks (all or none; ResourceExhausted when fewer are free).
  Result<std::vector<BlockId>> PopLeftN(size_t n);
  // Takes `block` out from anywhere (it must be in the queue).
  void Remove(BlockId block);
  void Append(BlockId block);
  void AppendN(std::span<const BlockId> blocks);
  // Every free block, first to be taken first.
  std::vector<BlockId> All() const;

 private:
  static constexpr BlockId kNone = UINT32_MAX;
  std::vector<BlockId> prev_, next_;
  std::vector<bool> linked_;
  BlockId head_ = kNone, tail_ = kNone;
  size_t size_ = 0;
};

// A block's cache key: its hash and the KV-cache group it belongs to.
struct CachedKey {
  Hash128 hash;
  uint32_t group = 0;
  friend bool operator==(const CachedKey&, const CachedKey&) = default;
};

// What the prefix cache gained or lost, in order: a hash cached (with its parent in the
// request's chain, none for a request's first block) or dropped.
struct CacheEvent {
  enum class Kind : uint8_t { kStored, kRemoved };
  Kind kind = Kind::kStored;
  CachedKey key;
  std::optional<Hash128> parent;  // kStored only

  friend bool operator==(const CacheEvent&, const CacheEvent&) = default;
};

class BlockPool {
 public:
  // `num_blocks` blocks including the null block 0; `prefix_caching` keeps hashes of full
  // blocks so later requests can reuse them; `record_events` records every hash cached and
  // dropped for TakeEvents (whoever turns it on drains them: nothing bounds the log).
  BlockPool(size_t num_blocks, bool prefix_caching, bool record_events = false);

  size_t num_blocks() const { return ref_.size(); }
  size_t num_free() const { return free_.size(); }
  uint32_t ref_count(BlockId block) const { return ref_[block]; }
  // The free blocks in eviction order (for tests and diagnostics).
  const FreeBlockQueue& free_queue() const { return free_; }
  std::optional<CachedKey> key_of(BlockId block) const;

  // The cached blocks of `hash`, one per group of `groups`; nullopt if any group misses.
  std::optional<std::vector<BlockId>> GetCachedBlock(const Hash128& hash,
                                                     std::span<const uint32_t> groups) const;
  // n blocks from the front of the free queue, each with ref count 1; a block that carried a
  // cached hash loses it (a removed event). ResourceExhausted, with no change, when fewer are
  // free.
  Result<std::vector<BlockId>> GetNewBlocks(size_t n);
  // Records that `block` (full, computed) holds `key`, whose parent in the request's chain is
  // `parent` (a stored event when new). A key already cached keeps its first block (the newer
  // one stays uncached, as vLLM does).
  void CacheBlock(BlockId block, const CachedKey& key,
                  std::optional<Hash128> parent = std::nullopt);
  // Blocks reused by a request: out of the free queue when unreferenced, ref count + 1.
  void Touch(std::span<const BlockId> blocks);
  // Ref count - 1 each; blocks that reach 0 join the free queue in the given order (callers
  // pass eviction priority: a request's blocks in reverse, so its tail goes first).
  void FreeBlocks(std::span<const BlockId> ordered);
  // Drops `key` from the prefix cache as an eviction would, recording a removed event; its
  // block stays where it is (referenced or free) without a hash. False when `key` is not cached.
  // For callers that learn a block's content is stale, and for tests of partial hits.
  bool EvictCachedHash(const CachedKey& key);
  // With record_events: what was cached and dropped since the last call, in order.
  std::vector<CacheEvent> TakeEvents();
  // The same, the dropped hashes only (the other events are dropped too).
  std::vector<CachedKey> TakeRemoved();

 private:
  struct KeyHash {
    size_t operator()(const CachedKey& k) const { return k.hash.lo ^ (k.hash.hi * 31) ^ k.group; }
  };
  bool prefix_caching_;
  bool record_events_;
  std::vector<uint32_t> ref_;
  std::vector<std::optional<CachedKey>> keys_;
  std::unordered_map<CachedKey, BlockId, KeyHash> cached_;
  FreeBlockQueue free_;
  std::vector<CacheEvent> events_;
};

}  // namespace kvstash::engine
