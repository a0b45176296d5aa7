// RecencyList: one recency-ordered list of a replacement policy (LRU's list, ARC's T1 or T2).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "entry.h"
#include "huge_array.h"

namespace kvstash::store {

// Entries in recency order (least recent first) where taking the least recent *evictable*
// entries costs amortized O(1) each, however many pinned or in-flight entries sit at the old
// end, and where those victims can be found without chasing pointers through cold memory.
//
// Every push to the MRU end gives the entry the next stamp s and records its id in a ring,
// ring[s mod L]. The ring is the list: its window [head, next) holds every member in stamp
// order, plus stale positions (entries since touched, removed or parked) that are recognised
// because the entry no longer carries that stamp. A victim scan walks the ring sequentially
// and prefetches the entries a few positions ahead.
//
// An entry found not evictable (pinned, being written) is parked: it leaves the ring for good,
// so no later scan walks past it. When it becomes evictable again it enters a min-heap keyed by
// its stamp, keeping its place in the recency order; scans merge ring and heap by stamp. An
// entry that holds the head back (skipped because the caller protects it, or still present when
// the window would exceed the ring) moves to that heap too, so each stale position is passed
// O(1) times. Costs: O(victims + protected keys) per scan plus O(log n) per heap operation.
//
// Works on the caller's entry array, which must outlive the list and never move. Stamps are 32
// bits; when they run out the list renumbers its members (O(n log n), once per 2^32 pushes).
// Not thread-safe.
class RecencyList {
 public:
  // `max_members`: the most entries the list can hold. `entry_count`: entries in the array.
  RecencyList(Entry* entries, size_t entry_count, size_t max_members, uint32_t list_id,
              uint32_t first_stamp);

  size_t size() const { return size_; }

  // Puts entry `id` (in no list) at the MRU end.
  void PushMru(uint32_t id);
  // Takes entry `id` (a member) out of the list.
  void Remove(uint32_t id);
  void MoveToMru(uint32_t id) {
    Remove(id);
    PushMru(id);
  }
  // Entry `id` (a member) just became evictable (ref count reached 0).
  void OnEvictable(uint32_t id);
  // Forgets every member (the caller resets the entries).
  void Clear();
  // Appends the members' ids, least recent first. O(entry_count): for state dumps only.
  void AppendInOrder(std::vector<uint32_t>* ids) const;

  // Victim scan, in recency order over evictable, unmarked members. Between BeginScan and
  // EndScan the list may only be scanned. TakeVictim returns kNoId when none is left.
  // EndScan(true) removes the taken entries from the list; EndScan(false) leaves its order as
  // it was (what a scan moves between ring, heap and parked set changes no observable order).
  void BeginScan();
  uint32_t TakeVictim();
  // Gives back `id`, the entry the last TakeVictim returned, as if it had not been taken: the
  // next TakeVictim returns it again (AF-LRU looks at the next victim of each of its lists and
  // takes one of them).
  void UntakeLast(uint32_t id);
  void EndScan(bool commit);

  size_t MemoryBytes() const;

  // Tests: the stamp the next push will use.
  uint32_t next_stamp() const { return next_stamp_; }

 private:
  static constexpr size_t kPrefetchAhead = 8;

  bool Older(uint32_t a, uint32_t b) const { return entries_[a].stamp < entries_[b].stamp; }
  uint32_t RingAt(uint32_t stamp) const { return ring_[stamp & ring_mask_]; }
  // Whether the ring position of `stamp` holds a member (else it is stale).
  bool LiveAt(uint32_t stamp, uint32_t id) const {
    const Entry& e = entries_[id];
    return e.where() == Place::kActive && e.list == list_id_ && e.stamp == stamp;
  }
  // Moves the member at the head of the window (live, not taken) out of the ring: parked if
  // not evictable, else into the heap.
  void EvictHeadToHeap(uint32_t id);
  void Park(uint32_t id) { entries_[id].set_where(Place::kParked); }
  void HeapPush(uint32_t id);
  void HeapErase(size_t pos);
  void SiftUp(size_t pos);
  void SiftDown(size_t pos);
  void HeapSet(size_t pos, uint32_t id);
  void Renumber();
  void CollectMembers(std::vector<uint32_t>* ids) const;

  Entry* const entries_;
  const size_t entry_count_;
  const uint32_t list_id_;
  const uint32_t first_stamp_;
  HugeArray<uint32_t> ring_;
  const uint32_t ring_mask_;
  uint32_t head_stamp_;  // no member of the ring has a smaller stamp
  uint32_t next_stamp_;
  size_t size_ = 0;
  std::vector<uint32_t> heap_;  // kReturned members, min-heap by stamp

  // Scan state.
  uint32_t cursor_ = 0;  // next ring stamp to examine
  std::vector<uint32_t> taken_ring_;
  std::vector<uint32_t> taken_heap_;
  std::vector<uint32_t> set_aside_;  // popped from the heap because marked
};

}  // namespace kvstash::store
