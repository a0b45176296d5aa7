#include "recency_list.h"

#include <algorithm>
#include <utility>

namespace kvstash::store {

RecencyList::RecencyList(Entry* entries, uint32_t list_id, uint32_t first_stamp)
    : entries_(entries), list_id_(list_id), first_stamp_(first_stamp), next_stamp_(first_stamp) {}

void RecencyList::PushMru(uint32_t id) {
  if (next_stamp_ == UINT32_MAX) Renumber();
  Entry& e = entries_[id];
  e.stamp = next_stamp_++;
  e.list = list_id_;
  LinkTail(id);
  ++size_;
}

void RecencyList::Remove(uint32_t id) {
  Entry& e = entries_[id];
  switch (e.where()) {
    case Place::kActive:
      Unlink(id);
      break;
    case Place::kParked:
      Unpark(id);
      break;
    case Place::kReturned:
      HeapErase(e.prev);
      break;
    case Place::kFree:
      return;
  }
  e.set_where(Place::kFree);
  --size_;
}

void RecencyList::OnEvictable(uint32_t id) {
  if (entries_[id].where() != Place::kParked) return;  // still in the active list (or heap)
  Unpark(id);
  HeapPush(id);
}

void RecencyList::Clear() {
  head_ = tail_ = parked_head_ = kNoId;
  heap_.clear();
  size_ = 0;
  next_stamp_ = first_stamp_;
}

void RecencyList::CollectMembers(std::vector<uint32_t>* ids) const {
  for (uint32_t id = head_; id != kNoId; id = entries_[id].next) ids->push_back(id);
  for (uint32_t id = parked_head_; id != kNoId; id = entries_[id].next) ids->push_back(id);
  ids->insert(ids->end(), heap_.begin(), heap_.end());
}

void RecencyList::AppendInOrder(std::vector<uint32_t>* ids) const {
  const size_t first = ids->size();
  CollectMembers(ids);
  std::sort(ids->begin() + first, ids->end(),
            [this](uint32_t a, uint32_t b) { return Older(a, b); });
}

void RecencyList::Renumber() {
  std::vector<uint32_t> ids;
  ids.reserve(size_);
  AppendInOrder(&ids);
  // A monotone relabelling: the active list stays sorted and the heap stays a heap.
  uint32_t stamp = 0;
  for (uint32_t id : ids) entries_[id].stamp = stamp++;
  next_stamp_ = stamp;
}

// ---- active list --------------------------------------------------------------------------

void RecencyList::LinkTail(uint32_t id) {
  Entry& e = entries_[id];
  e.set_where(Place::kActive);
  e.prev = tail_;
  e.next = kNoId;
  if (tail_ != kNoId) {
    entries_[tail_].next = id;
  } else {
    head_ = id;
  }
  tail_ = id;
}

void RecencyList::Unlink(uint32_t id) {
  Entry& e = entries_[id];
  if (e.prev != kNoId) {
    entries_[e.prev].next = e.next;
  } else {
    head_ = e.next;
  }
  if (e.next != kNoId) {
    entries_[e.next].prev = e.prev;
  } else {
    tail_ = e.prev;
  }
}

// ---- parked set (unordered, doubly linked) ------------------------------------------------

void RecencyList::Park(uint32_t id) {
  Entry& e = entries_[id];
  e.set_where(Place::kParked);
  e.prev = kNoId;
  e.next = parked_head_;
  if (parked_head_ != kNoId) entries_[parked_head_].prev = id;
  parked_head_ = id;
}

void RecencyList::Unpark(uint32_t id) {
  Entry& e = entries_[id];
  if (e.prev != kNoId) {
    entries_[e.prev].next = e.next;
  } else {
    parked_head_ = e.next;
  }
  if (e.next != kNoId) entries_[e.next].prev = e.prev;
}

// ---- heap of returned entries (position kept in Entry::prev) -------------------------------

void RecencyList::HeapSet(size_t pos, uint32_t id) {
  heap_[pos] = id;
  entries_[id].prev = static_cast<uint32_t>(pos);
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
  cursor_ = head_;
  taken_active_.clear();
  taken_heap_.clear();
  set_aside_.clear();
}

uint32_t RecencyList::TakeVictim() {
  // The oldest candidate in the active list. Entries that are not evictable are parked for
  // good (until they become evictable); marked ones are stepped over and stay.
  while (cursor_ != kNoId) {
    Entry& e = entries_[cursor_];
    if (e.ref != 0) {
      const uint32_t id = cursor_;
      cursor_ = e.next;
      Unlink(id);
      Park(id);
      continue;
    }
    if (e.marked) {
      cursor_ = e.next;
      continue;
    }
    break;
  }
  // The oldest candidate among returned entries.
  while (!heap_.empty()) {
    const uint32_t top = heap_[0];
    Entry& e = entries_[top];
    if (e.ref == 0 && !e.marked) break;
    HeapErase(0);
    if (e.ref != 0) {
      Park(top);
    } else {
      set_aside_.push_back(top);
    }
  }
  if (cursor_ != kNoId && (heap_.empty() || Older(cursor_, heap_[0]))) {
    const uint32_t id = cursor_;
    cursor_ = entries_[id].next;
    taken_active_.push_back(id);
    return id;
  }
  if (!heap_.empty()) {
    const uint32_t id = heap_[0];
    HeapErase(0);
    taken_heap_.push_back(id);
    return id;
  }
  return kNoId;
}

void RecencyList::EndScan(bool commit) {
  if (commit) {
    for (uint32_t id : taken_active_) {
      Unlink(id);
      entries_[id].set_where(Place::kFree);
    }
    for (uint32_t id : taken_heap_) entries_[id].set_where(Place::kFree);
    size_ -= taken_active_.size() + taken_heap_.size();
  } else {
    for (uint32_t id : taken_heap_) HeapPush(id);
  }
  for (uint32_t id : set_aside_) HeapPush(id);
  cursor_ = kNoId;
  taken_active_.clear();
  taken_heap_.clear();
  set_aside_.clear();
}

size_t RecencyList::MemoryBytes() const {
  return (heap_.capacity() + taken_active_.capacity() + taken_heap_.capacity() +
          set_aside_.capacity()) *
         sizeof(uint32_t);
}

}  // namespace kvstash::store
