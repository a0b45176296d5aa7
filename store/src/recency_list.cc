#include "recency_list.h"

#include <algorithm>
#include <bit>
#include <utility>

namespace kvstash::store {

RecencyList::RecencyList(Entry* entries, size_t entry_count, size_t max_members, uint32_t list_id,
                         uint32_t first_stamp)
    : entries_(entries),
      entry_count_(entry_count),
      list_id_(list_id),
      first_stamp_(first_stamp),
      // At least 1.25x the members (a power of two, for a mask instead of a division), so the
      // window fills, moving one member to the heap, at most once per max_members/4 pushes.
      ring_(std::bit_ceil(max_members + max_members / 4 + 64)),
      ring_mask_(ring_.size() - 1),
      head_stamp_(first_stamp),
      next_stamp_(first_stamp) {}

void RecencyList::PushMru(uint32_t id) {
  if (next_stamp_ == UINT32_MAX) Renumber();
  // Keep the window within the ring: move the head past stale positions, and a member at the
  // head out to the heap.
  while (next_stamp_ - head_stamp_ >= ring_.size()) {
    const uint32_t head_id = RingAt(head_stamp_);
    if (LiveAt(head_stamp_, head_id)) EvictHeadToHeap(head_id);
    ++head_stamp_;
  }
  Entry& e = entries_[id];
  e.stamp = next_stamp_;
  e.list = list_id_;
  e.set_where(Place::kActive);
  ring_[next_stamp_ & ring_mask_] = id;
  ++next_stamp_;
  ++size_;
}

void RecencyList::Remove(uint32_t id) {
  Entry& e = entries_[id];
  if (e.where() == Place::kFree) return;
  if (e.where() == Place::kReturned) HeapErase(e.heap_pos);
  // A ring position goes stale by itself once the entry stops being kActive.
  e.set_where(Place::kFree);
  --size_;
}

void RecencyList::OnEvictable(uint32_t id) {
  if (entries_[id].where() == Place::kParked) HeapPush(id);
}

void RecencyList::EvictHeadToHeap(uint32_t id) {
  if (entries_[id].ref != 0) {
    Park(id);
  } else {
    HeapPush(id);
  }
}

void RecencyList::Clear() {
  head_stamp_ = next_stamp_ = first_stamp_;
  heap_.clear();
  size_ = 0;
}

void RecencyList::CollectMembers(std::vector<uint32_t>* ids) const {
  for (uint32_t s = head_stamp_; s != next_stamp_; ++s) {
    const uint32_t id = RingAt(s);
    if (LiveAt(s, id)) ids->push_back(id);
  }
  ids->insert(ids->end(), heap_.begin(), heap_.end());
  for (size_t id = 0; id < entry_count_; ++id) {
    const Entry& e = entries_[id];
    if (e.where() == Place::kParked && e.list == list_id_) {
      ids->push_back(static_cast<uint32_t>(id));
    }
  }
}

void RecencyList::AppendInOrder(std::vector<uint32_t>* ids) const {
  const size_t first = ids->size();
  CollectMembers(ids);
  std::sort(ids->begin() + static_cast<ptrdiff_t>(first), ids->end(),
            [this](uint32_t a, uint32_t b) { return Older(a, b); });
}

void RecencyList::Renumber() {
  std::vector<uint32_t> ids;
  ids.reserve(size_);
  AppendInOrder(&ids);
  // A monotone relabelling: the heap stays a heap; the ring is rewritten for its members.
  uint32_t stamp = 0;
  for (uint32_t id : ids) {
    Entry& e = entries_[id];
    e.stamp = stamp;
    if (e.where() == Place::kActive) ring_[stamp & ring_mask_] = id;
    ++stamp;
  }
  head_stamp_ = 0;
  next_stamp_ = stamp;
}

// ---- heap of returned entries (position kept in Entry::heap_pos) -------------------------------

void RecencyList::HeapSet(size_t pos, uint32_t id) {
  heap_[pos] = id;
  entries_[id].heap_pos = static_cast<uint32_t>(pos);
}

void RecencyList::HeapPush(uint32_t id) {
  entries_[id].set_where(Place::kReturned);
  heap_.push_back(id);
  HeapSet(heap_.size() - 1, id);
  SiftUp(heap_.size() - 1);
}

void RecencyList::HeapErase(size_t pos) {
  const uint32_t last = heap_.back();
  heap_.pop_back();
  if (pos == heap_.size()) return;
  HeapSet(pos, last);
  SiftDown(pos);
  SiftUp(pos);
}

void RecencyList::SiftUp(size_t pos) {
  const uint32_t id = heap_[pos];
  while (pos > 0) {
    const size_t parent = (pos - 1) / 2;
    if (!Older(id, heap_[parent])) break;
    HeapSet(pos, heap_[parent]);
    pos = parent;
  }
  HeapSet(pos, id);
}

void RecencyList::SiftDown(size_t pos) {
  const uint32_t id = heap_[pos];
  const size_t n = heap_.size();
  for (;;) {
    size_t child = 2 * pos + 1;
    if (child >= n) break;
    if (child + 1 < n && Older(heap_[child + 1], heap_[child])) ++child;
    if (!Older(heap_[child], id)) break;
    HeapSet(pos, heap_[child]);
    pos = child;
  }
  HeapSet(pos, id);
}

// ---- victim scan ---------------------------------------------------------------------------

void RecencyList::BeginScan() {
  cursor_ = head_stamp_;
  // The first candidates are independent loads: start them all now. TakeVictim keeps the
  // prefetch kPrefetchAhead positions ahead from here on.
  for (uint32_t s = head_stamp_; s != next_stamp_ && s - head_stamp_ < kPrefetchAhead; ++s) {
    __builtin_prefetch(&entries_[RingAt(s)]);
  }
  taken_ring_.clear();
  taken_heap_.clear();
  set_aside_.clear();
}

uint32_t RecencyList::TakeVictim() {
  // The oldest candidate in the ring. Positions at the head that hold nothing takeable leave
  // the window for good: stale ones are dropped, members not evictable are parked, marked
  // ones move to the heap (where the scan sets them aside). Positions after a taken entry
  // must stay until the scan commits, so there the cursor only steps over them.
  uint32_t ring_id = kNoId;
  while (cursor_ != next_stamp_) {
    if (next_stamp_ - cursor_ > kPrefetchAhead) {
      __builtin_prefetch(&entries_[RingAt(cursor_ + kPrefetchAhead)]);
    }
    const uint32_t id = RingAt(cursor_);
    if (LiveAt(cursor_, id)) {
      const Entry& e = entries_[id];
      if (e.ref == 0 && !e.marked) {
        ring_id = id;
        break;
      }
      if (e.ref != 0) {
        Park(id);  // its position is stale from now on
      } else if (cursor_ == head_stamp_) {
        HeapPush(id);  // marked: out of the head's way, set aside below
      }
    }
    if (cursor_ == head_stamp_) ++head_stamp_;
    ++cursor_;
  }
  // The oldest candidate among returned entries.
  while (!heap_.empty()) {
    const uint32_t top = heap_[0];
    const Entry& e = entries_[top];
    if (e.ref == 0 && !e.marked) break;
    HeapErase(0);
    if (e.ref != 0) {
      Park(top);
    } else {
      set_aside_.push_back(top);
    }
  }
  if (ring_id != kNoId && (heap_.empty() || Older(ring_id, heap_[0]))) {
    taken_ring_.push_back(ring_id);
    ++cursor_;
    return ring_id;
  }
  if (!heap_.empty()) {
    const uint32_t id = heap_[0];
    HeapErase(0);
    taken_heap_.push_back(id);
    return id;
  }
  return kNoId;
}

void RecencyList::UntakeLast(uint32_t id) {
  if (!taken_ring_.empty() && taken_ring_.back() == id) {
    // Taken at the cursor's position, which then moved one past it.
    taken_ring_.pop_back();
    cursor_ = entries_[id].stamp;
    return;
  }
  taken_heap_.pop_back();
  HeapPush(id);
}

void RecencyList::EndScan(bool commit) {
  if (commit) {
    for (uint32_t id : taken_ring_) entries_[id].set_where(Place::kFree);
    for (uint32_t id : taken_heap_) entries_[id].set_where(Place::kFree);
    size_ -= taken_ring_.size() + taken_heap_.size();
  } else {
    // Taken ring entries go to the heap (same stamps, same order), so that they do not hold
    // the head back and a run of refused stores never re-walks the stale positions behind them.
    for (uint32_t id : taken_ring_) HeapPush(id);
    for (uint32_t id : taken_heap_) HeapPush(id);
  }
  for (uint32_t id : set_aside_) HeapPush(id);
  taken_ring_.clear();
  taken_heap_.clear();
  set_aside_.clear();
}

size_t RecencyList::MemoryBytes() const {
  return ring_.MemoryBytes() + (heap_.capacity() + taken_ring_.capacity() + taken_heap_.capacity() +
                                set_aside_.capacity()) *
                                   sizeof(uint32_t);
}

}  // namespace kvstash::store
