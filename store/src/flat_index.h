// FlatIndex: maps keys to 32-bit ids of a table the caller owns.
#pragma once

#include <cstddef>
#include <cstdint>

#include "huge_array.h"
#include "kvstash/common/block_key.h"

namespace kvstash::store {

// Open addressing with linear probing and backward-shift deletion (no tombstones), sized once
// for a bounded number of entries at a load factor of at most 0.625 (short clusters keep both
// misses and deletions to a few buckets). A bucket is 8 bytes: id + 1 (0 = empty, so fresh
// zeroed memory is an empty table) and the top 32 bits of the key's hash, which both pick the
// home bucket and filter comparisons, so a probe reads the caller's table only on a likely
// match. Not thread-safe.
class FlatIndex {
 public:
  static constexpr uint32_t kNone = UINT32_MAX;

  explicit FlatIndex(size_t max_entries);

  // The id whose key equals `key`, or kNone. `key_at(id)` returns the key stored under id.
  template <typename KeyAt>
  uint32_t Find(const BlockKey& key, uint64_t hash, const KeyAt& key_at) const {
    const uint32_t tag = Tag(hash);
    for (size_t i = Home(tag);; i = Next(i)) {
      const Bucket& b = buckets_[i];
      if (b.id_plus_one == 0) return kNone;
      if (b.tag == tag && key_at(b.id_plus_one - 1) == key) return b.id_plus_one - 1;
    }
  }

  // The first id stored under `hash`'s tag, without comparing keys (a prefetch hint), or kNone.
  uint32_t FirstCandidate(uint64_t hash) const {
    const uint32_t tag = Tag(hash);
    for (size_t i = Home(tag);; i = Next(i)) {
      const Bucket& b = buckets_[i];
      if (b.id_plus_one == 0) return kNone;
      if (b.tag == tag) return b.id_plus_one - 1;
    }
  }

  // Adds `id` under `hash`. Precondition: its key is not present and size() < max_entries.
  void Insert(uint32_t id, uint64_t hash);
  // Removes `id`, which must be present under `hash`.
  void Erase(uint32_t id, uint64_t hash);
  void Clear();

  // Starts loading the home bucket of `hash` into cache (for batched lookups).
  void Prefetch(uint64_t hash) const { __builtin_prefetch(&buckets_[Home(Tag(hash))]); }

  size_t size() const { return size_; }
  size_t MemoryBytes() const { return buckets_.MemoryBytes(); }

 private:
  struct Bucket {
    uint32_t id_plus_one;
    uint32_t tag;
  };
  static uint32_t Tag(uint64_t hash) { return static_cast<uint32_t>(hash >> 32); }
  // Maps a tag onto [0, buckets) by multiply-shift, so the bucket count need not be a power of 2.
  size_t Home(uint32_t tag) const { return (uint64_t{tag} * buckets_.size()) >> 32; }
  size_t Next(size_t i) const { return i + 1 == buckets_.size() ? 0 : i + 1; }

  HugeArray<Bucket> buckets_;
  size_t size_ = 0;
};

}  // namespace kvstash::store
