#include "flat_index.h"

#include <algorithm>

namespace kvstash::store {

FlatIndex::FlatIndex(size_t max_entries)
    : buckets_(std::max<size_t>(16, max_entries + max_entries * 3 / 5 + 1)) {}

void FlatIndex::Insert(uint32_t id, uint64_t hash) {
  const uint32_t tag = Tag(hash);
  size_t i = Home(tag);
  while (buckets_[i].id_plus_one != 0) i = Next(i);
  buckets_[i] = Bucket{id + 1, tag};
  ++size_;
}

void FlatIndex::Erase(uint32_t id, uint64_t hash) {
  size_t hole = Home(Tag(hash));
  while (buckets_[hole].id_plus_one != id + 1) hole = Next(hole);
  // Backward shift: move later members of the cluster into the hole unless their home lies
  // cyclically in (hole, j], where they must stay to remain reachable.
  for (size_t j = Next(hole);; j = Next(j)) {
    const Bucket b = buckets_[j];
    if (b.id_plus_one == 0) break;
    const size_t home = Home(b.tag);
    const bool stays = hole <= j ? (hole < home && home <= j) : (hole < home || home <= j);
    if (stays) continue;
    buckets_[hole] = b;
    hole = j;
  }
  buckets_[hole] = Bucket{0, 0};
  --size_;
}

void FlatIndex::Clear() {
  buckets_.Zero();
  size_ = 0;
}

}  // namespace kvstash::store
