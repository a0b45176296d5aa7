#include "flat_index.h"

#include <algorithm>

namespace kvstash::store {

FlatIndex::FlatIndex(size_t max_entries) {
  // At most 80% full; at least one bucket always empty so that every probe terminates.
  size_t buckets = std::max<size_t>(16, max_entries + max_entries / 4 + 1);
  buckets_.assign(buckets, Bucket{kNone, 0});
}

void FlatIndex::Insert(uint32_t id, uint64_t hash) {
  const uint32_t tag = Tag(hash);
  size_t i = Home(tag);
  while (buckets_[i].id != kNone) i = Next(i);
  buckets_[i] = Bucket{id, tag};
  ++size_;
}

void FlatIndex::Erase(uint32_t id, uint64_t hash) {
  size_t hole = Home(Tag(hash));
  while (buckets_[hole].id != id) hole = Next(hole);
  // Backward shift: move later members of the cluster into the hole unless their home lies
  // cyclically in (hole, j], where they must stay to remain reachable.
  for (size_t j = Next(hole);; j = Next(j)) {
    const Bucket& b = buckets_[j];
    if (b.id == kNone) break;
    const size_t home = Home(b.tag);
    const bool stays = hole <= j ? (hole < home && home <= j) : (hole < home || home <= j);
    if (stays) continue;
    buckets_[hole] = b;
    hole = j;
  }
  buckets_[hole] = Bucket{kNone, 0};
  --size_;
}

void FlatIndex::Clear() {
  std::fill(buckets_.begin(), buckets_.end(), Bucket{kNone, 0});
  size_ = 0;
}

}  // namespace kvstash::store
