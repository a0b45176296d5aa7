// Entry: the metadata of one resident block, indexed by its slot id.
#pragma once

#include <cstdint>

#include "kvstash/common/block_key.h"

namespace kvstash::store {

inline constexpr uint32_t kNoId = UINT32_MAX;

// Where an entry is with respect to its recency list (see RecencyList).
enum class Place : uint8_t {
  kFree = 0,      // not in any list (a free slot, or a key being dropped)
  kActive = 1,    // in the list's ring, at the position of its stamp
  kParked = 2,    // known not evictable; out of the ring until it becomes evictable
  kReturned = 3,  // evictable again after being parked; in the list's stamp-ordered heap
};

// One block's metadata: 40 bytes, so a million resident blocks cost 40 MB here (plus about
// 13 B each in the index and 4-10 B in the recency ring). Plain data owned by BlockManagerImpl
// (or KeyLists) and the policy's lists; not thread-safe.
struct Entry {
  static constexpr int32_t kMaxRef = (1 << 23) - 1;

  BlockKey key;
  uint32_t stamp;       // recency within its list: larger is more recent
  uint32_t heap_pos;    // position in the list's heap while kReturned
  uint32_t aux;         // the owner's: free-stack link while the slot is free; KeyLists' value
  int32_t ref : 24;     // -1 being written, 0 idle (evictable), k > 0 pinned by k loads
  uint32_t place : 2;   // a Place
  uint32_t list : 2;    // which list of the policy (ARC: 0 = T1, 1 = T2; AF-LRU: class - 1)
  uint32_t marked : 1;  // protected from eviction by the current call

  Place where() const { return static_cast<Place>(place); }
  void set_where(Place p) { place = static_cast<uint32_t>(p); }
};
static_assert(sizeof(Entry) == 40, "keep the per-block metadata at 40 bytes");

}  // namespace kvstash::store
