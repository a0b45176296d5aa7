// AF-LRU, age over frequency (docs/semantics.md §4a): evict the idle block with the largest
// age / W[class], W = {1, 2, 3}, where a block's class is how many requests used it (1, 2, 3 or
// more) and its age the keys touched or stored since its last touch. Three recency lists, one
// per class, so each list's least recent evictable block is its best candidate and a victim
// costs O(1); a ghost ring of 2 x capacity fingerprints gives a block stored again the class it
// was evicted with, plus one.
#include <algorithm>
#include <array>

#include "ghost_ring.h"
#include "huge_array.h"
#include "policy.h"
#include "recency_list.h"

namespace kvstash::store {
namespace {

constexpr uint32_t kClasses = 3;
// age x kWeight[k] compares age / W[k] in integers: 6 / {1, 2, 3}.
constexpr std::array<uint64_t, kClasses> kWeight = {6, 3, 2};
// The ghost ring's index addresses positions with 32 bits.
constexpr size_t kMaxGhosts = (size_t{1} << 31) - 1;

class AfLruPolicy final : public ReplacementPolicy {
 public:
  AfLruPolicy(Entry* entries, size_t capacity, uint32_t first_stamp)
      : entries_(entries),
        lists_{RecencyList(entries, capacity, capacity, 0, first_stamp),
               RecencyList(entries, capacity, capacity, 1, first_stamp),
               RecencyList(entries, capacity, capacity, 2, first_stamp)},
        touched_(capacity),
        ghosts_(std::min(2 * capacity, kMaxGhosts)) {}

  void Insert(uint32_t id, uint64_t /*hash*/) override {
    const uint32_t ghost = ghosts_.Take(GhostRing::Fingerprint(entries_[id].key));
    const uint32_t cls = ghost == 0 ? 1 : std::min(kClasses, ghost + 1);
    touched_[id] = ++clock_;
    lists_[cls - 1].PushMru(id);
  }

  void Remove(uint32_t id) override { lists_[entries_[id].list].Remove(id); }

  void Touch(const BlockKey& /*key*/, uint64_t /*hash*/, uint32_t id, TouchKind kind) override {
    ++clock_;
    if (id == kNoId) return;
    const Entry& e = entries_[id];
    const uint32_t list = e.list;
    // A block being written is not used yet (as ARC's touch): the request storing it counts.
    if (kind == TouchKind::kUse && e.ref >= 0 && list + 1 < kClasses) {
      lists_[list].Remove(id);
      lists_[list + 1].PushMru(id);
    } else {
      lists_[list].MoveToMru(id);
    }
    touched_[id] = clock_;
  }

  void OnEvictable(uint32_t id) override { lists_[entries_[id].list].OnEvictable(id); }

  bool Evict(size_t n, std::vector<uint32_t>* victims) override {
    const size_t first = victims->size();
    std::array<uint32_t, kClasses> next;  // each list's next candidate, taken from its scan
    std::array<bool, kClasses> empty{};
    for (uint32_t k = 0; k < kClasses; ++k) {
      lists_[k].BeginScan();
      next[k] = kNoId;
    }
    for (size_t i = 0; i < n; ++i) {
      uint32_t best = kClasses;
      uint64_t best_score = 0;
      for (uint32_t k = 0; k < kClasses; ++k) {
        if (next[k] == kNoId && !empty[k]) {
          next[k] = lists_[k].TakeVictim();
          empty[k] = next[k] == kNoId;
        }
        if (next[k] == kNoId) continue;
        const uint64_t score = (clock_ - touched_[next[k]]) * kWeight[k];
        if (best == kClasses || score > best_score) {  // ties: the lower class
          best = k;
          best_score = score;
        }
      }
      if (best == kClasses) {
        for (RecencyList& list : lists_) list.EndScan(false);
        victims->resize(first);
        return false;
      }
      victims->push_back(next[best]);
      next[best] = kNoId;
    }
    for (uint32_t k = 0; k < kClasses; ++k) {
      if (next[k] != kNoId) lists_[k].UntakeLast(next[k]);
    }
    MakeGhosts(std::span<const uint32_t>(*victims).subspan(first));
    for (RecencyList& list : lists_) list.EndScan(true);
    return true;
  }

  void EvictChosen(std::span<const uint32_t> ids) override {
    MakeGhosts(ids);
    for (uint32_t id : ids) lists_[entries_[id].list].Remove(id);
  }

  void Clear() override {
    for (RecencyList& list : lists_) list.Clear();
    ghosts_.Clear();
    clock_ = 0;
  }

  void Describe(BlockManagerState* state) const override {
    std::vector<uint32_t> ids;
    for (uint32_t k = 0; k < kClasses; ++k) {
      ids.clear();
      lists_[k].AppendInOrder(&ids);
      for (uint32_t id : ids) {
        state->af[k].push_back({entries_[id].key, id, entries_[id].ref});
        state->af_touched[k].push_back(touched_[id]);
      }
    }
    state->af_clock = clock_;
    ghosts_.AppendInOrder(&state->af_ghosts);
  }

  PolicySizes Sizes() const override {
    PolicySizes sizes;
    sizes.t1 = lists_[0].size();
    sizes.t2 = lists_[1].size();
    sizes.t3 = lists_[2].size();
    sizes.b1 = ghosts_.size();
    return sizes;
  }

  size_t MemoryBytes() const override {
    size_t bytes = sizeof(*this) + touched_.MemoryBytes() + ghosts_.MemoryBytes();
    for (const RecencyList& list : lists_) bytes += list.MemoryBytes();
    return bytes;
  }

  Status SetTarget(double /*target*/) override {
    return FailedPreconditionError("the AF-LRU policy has no target size to set");
  }

 private:
  // Evicted blocks become ghosts, in choice order, with their class.
  void MakeGhosts(std::span<const uint32_t> victims) {
    for (uint32_t id : victims) {
      const Entry& e = entries_[id];
      ghosts_.Push(GhostRing::Fingerprint(e.key), e.list + 1);
    }
  }

  Entry* const entries_;
  std::array<RecencyList, kClasses> lists_;  // list k: class k + 1
  HugeArray<uint64_t> touched_;              // by entry: the clock at its last touch or store
  GhostRing ghosts_;
  uint64_t clock_ = 0;  // advanced by every key touched and every block stored
};

}  // namespace

std::unique_ptr<ReplacementPolicy> MakeAfLruPolicy(Entry* entries, size_t capacity,
                                                   uint32_t first_stamp) {
  return std::make_unique<AfLruPolicy>(entries, capacity, first_stamp);
}

}  // namespace kvstash::store
