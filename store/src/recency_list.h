// RecencyList: one recency-ordered list of a replacement policy (LRU's list, ARC's T1 or T2).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "entry.h"

namespace kvstash::store {

// Entries in recency order (least recent first) in which finding the least recent *evictable*
// entry costs amortized O(1), however many pinned or in-flight entries sit at the old end.
//
// Every push to the MRU end stamps the entry with an increasing number, so the list is sorted
// by stamp. A victim scan that meets an entry which is not evictable (pinned, or being written)
// unlinks it into an unordered "parked" set, so no later scan walks past it again. When the entry
// becomes evictable again it enters a min-heap keyed by its stamp: it keeps its place in the
// recency order, and scans merge the active list and the heap by stamp. A touch moves it back to
// the active list's MRU end. An entry is parked at most once per pin or write, so a scan costs
// O(victims + entries the caller protects) plus O(log n) per victim taken from the heap.
//
// Works on the caller's entry array, which must outlive the list and never move. Stamps are 32
// bits; when they run out the list renumbers its members (O(n log n), once per 2^32 pushes).
// Not thread-safe.
class RecencyList {
 public:
  RecencyList(Entry* entries, uint32_t list_id, uint32_t first_stamp);

  size_t size() const { return size_; }

  // Links entry `id` (in no list) at the MRU end.
  void PushMru(uint32_t id);
  // Unlinks entry `id` (a member) from wherever it is held.
  void Remove(uint32_t id);
  void MoveToMru(uint32_t id) {
    Remove(id);
    PushMru(id);
  }
  // Entry `id` (a member) just became evictable (ref count reached 0).
  void OnEvictable(uint32_t id);
  // Forgets every member (the caller resets the entries).
  void Clear();
  // Appends the members' ids, least recent first. O(n log n): for state dumps, not hot paths.
  void AppendInOrder(std::vector<uint32_t>* ids) const;

  // Victim scan, in recency order over evictable, unmarked members. Between BeginScan and
  // EndScan the list may only be scanned. TakeVictim returns kNoId when none is left.
  // EndScan(true) removes the taken entries from the list; EndScan(false) leaves it as it was
  // (apart from parking, which changes no observable order).
  void BeginScan();
  uint32_t TakeVictim();
  void EndScan(bool commit);

  size_t MemoryBytes() const;

  // Tests: the stamp the next push will use.
  uint32_t next_stamp() const { return next_stamp_; }

 private:
  bool Older(uint32_t a, uint32_t b) const { return entries_[a].stamp < entries_[b].stamp; }

  void LinkTail(uint32_t id);
  void Unlink(uint32_t id);
  void Park(uint32_t id);
  void Unpark(uint32_t id);
  void HeapPush(uint32_t id);
  void HeapErase(size_t pos);
  void SiftUp(size_t pos);
  void SiftDown(size_t pos);
  void HeapSet(size_t pos, uint32_t id);
  void Renumber();
  void CollectMembers(std::vector<uint32_t>* ids) const;

  Entry* const entries_;
  const uint32_t list_id_;
  const uint32_t first_stamp_;
  uint32_t next_stamp_;
  size_t size_ = 0;

  uint32_t head_ = kNoId;  // least recent active member
  uint32_t tail_ = kNoId;  // most recent active member
  uint32_t parked_head_ = kNoId;
  std::vector<uint32_t> heap_;  // kReturned members, min-heap by stamp

  // Scan state.
  uint32_t cursor_ = kNoId;
  std::vector<uint32_t> taken_active_;
  std::vector<uint32_t> taken_heap_;
  std::vector<uint32_t> set_aside_;  // popped from the heap because marked
};

}  // namespace kvstash::store
