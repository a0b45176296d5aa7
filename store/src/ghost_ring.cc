#include "ghost_ring.h"

#include <algorithm>
#include <bit>

namespace kvstash::store {

GhostRing::GhostRing(size_t capacity) : ring_(capacity, 0) {
  // At most 3/4 full, a power of two for a mask.
  const size_t slots = std::bit_ceil(std::max<size_t>(16, capacity + capacity / 3 + 1));
  index_.assign(slots, 0);
  mask_ = slots - 1;
  shift_ = 32 - static_cast<unsigned>(std::countr_zero(slots));
}

size_t GhostRing::FindSlot(uint32_t fingerprint, uint32_t pos) const {
  for (size_t slot = Bucket(fingerprint);; slot = (slot + 1) & mask_) {
    if (index_[slot] == pos + 1) return slot;
  }
}

void GhostRing::EraseSlot(size_t slot) {
  size_t hole = slot;
  for (size_t next = (hole + 1) & mask_; index_[next] != 0; next = (next + 1) & mask_) {
    const size_t home = Bucket(ring_[index_[next] - 1] >> 2);
    // The entry at `next` may fill the hole when its home is not in (hole, next].
    const bool stays = hole <= next ? (home > hole && home <= next) : (home > hole || home <= next);
    if (!stays) {
      index_[hole] = index_[next];
      hole = next;
    }
  }
  index_[hole] = 0;
}

void GhostRing::Push(uint32_t fingerprint, uint32_t frequency_class) {
  if (ring_.empty()) return;
  Take(fingerprint);
  const auto pos = static_cast<uint32_t>(next_);
  if (ring_[pos] != 0) {
    EraseSlot(FindSlot(ring_[pos] >> 2, pos));
    --size_;
  }
  ring_[pos] = fingerprint << 2 | frequency_class;
  size_t slot = Bucket(fingerprint);
  while (index_[slot] != 0) slot = (slot + 1) & mask_;
  index_[slot] = pos + 1;
  ++size_;
  next_ = next_ + 1 == ring_.size() ? 0 : next_ + 1;
}

uint32_t GhostRing::Take(uint32_t fingerprint) {
  if (ring_.empty()) return 0;
  for (size_t slot = Bucket(fingerprint); index_[slot] != 0; slot = (slot + 1) & mask_) {
    const uint32_t pos = index_[slot] - 1;
    if (ring_[pos] >> 2 != fingerprint) continue;
    const uint32_t frequency_class = ring_[pos] & 3;
    ring_[pos] = 0;
    EraseSlot(slot);
    --size_;
    return frequency_class;
  }
  return 0;
}

void GhostRing::Clear() {
  std::fill(ring_.begin(), ring_.end(), 0);
  std::fill(index_.begin(), index_.end(), 0);
  next_ = 0;
  size_ = 0;
}

void GhostRing::AppendInOrder(std::vector<uint32_t>* ghosts) const {
  for (size_t i = 0; i < ring_.size(); ++i) {
    const uint32_t ghost = ring_[(next_ + i) % ring_.size()];
    if (ghost != 0) ghosts->push_back(ghost);
  }
}

size_t GhostRing::MemoryBytes() const {
  return (ring_.capacity() + index_.capacity()) * sizeof(uint32_t);
}

}  // namespace kvstash::store
