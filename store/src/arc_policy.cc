// ARC as vLLM implements it (docs/semantics.md §4): T1 (seen once) and T2 (touched again), ghost
// lists B1 and B2 of evicted keys, and a target size p for T1 adapted by touches of ghost keys.
// kvstash differs in one place on purpose: when eviction skips T1 because |T1| < int(p) and T2
// has no evictable block, it falls back to T1 instead of refusing (docs/semantics.md §4, vector
// B5).
#include <algorithm>

#include "key_lists.h"
#include "policy.h"
#include "recency_list.h"

namespace kvstash::store {
namespace {

constexpr uint32_t kT1 = 0;
constexpr uint32_t kT2 = 1;
constexpr uint32_t kB1 = 0;
constexpr uint32_t kB2 = 1;

class ArcPolicy final : public ReplacementPolicy {
 public:
  ArcPolicy(Entry* entries, size_t capacity, uint32_t first_stamp)
      : entries_(entries),
        capacity_(capacity),
        t1_(entries, capacity, capacity, kT1, first_stamp),
        t2_(entries, capacity, capacity, kT2, first_stamp),
        ghosts_(capacity, 2) {}

  void Insert(uint32_t id, uint64_t hash) override {
    t1_.PushMru(id);
    // No adaptation on insert; the key simply stops being a ghost.
    const uint32_t ghost = ghosts_.Find(entries_[id].key, hash);
    if (ghost != kNoId) ghosts_.Erase(ghost, hash);
  }

  void Remove(uint32_t id) override { List(id).Remove(id); }

  void Touch(const BlockKey& key, uint64_t hash, uint32_t id, TouchKind /*kind*/) override {
    if (id != kNoId) {
      Entry& e = entries_[id];
      if (e.list == kT2) {
        t2_.MoveToMru(id);
      } else if (e.ref < 0) {
        t1_.MoveToMru(id);  // just prepared for store: not a second access
      } else {
        t1_.Remove(id);
        t2_.PushMru(id);
      }
      return;
    }
    const uint32_t ghost = ghosts_.Find(key, hash);
    if (ghost == kNoId) return;
    const double b1 = static_cast<double>(ghosts_.size(kB1));
    const double b2 = static_cast<double>(ghosts_.size(kB2));
    if (ghosts_.list_of(ghost) == kB1) {
      target_ = std::min(target_ + std::max(1.0, b2 / b1), static_cast<double>(capacity_));
    } else {
      target_ = std::max(target_ - std::max(1.0, b1 / b2), 0.0);
    }
    ghosts_.MoveToMru(ghost);
  }

  void OnEvictable(uint32_t id) override { List(id).OnEvictable(id); }

  void Prefetch(uint64_t hash) const override { ghosts_.Prefetch(hash); }

  bool Evict(size_t n, std::vector<uint32_t>* victims) override {
    const size_t first = victims->size();
    const size_t target = static_cast<size_t>(target_);  // int(p): truncation toward zero
    size_t virtual_t1 = t1_.size();
    t1_.BeginScan();
    t2_.BeginScan();
    for (size_t i = 0; i < n; ++i) {
      uint32_t id = kNoId;
      if (virtual_t1 >= target) id = t1_.TakeVictim();
      if (id == kNoId) id = t2_.TakeVictim();
      if (id == kNoId && virtual_t1 < target) id = t1_.TakeVictim();  // kvstash's fallback
      if (id == kNoId) {
        t1_.EndScan(false);
        t2_.EndScan(false);
        victims->resize(first);
        return false;
      }
      if (entries_[id].list == kT1) --virtual_t1;
      victims->push_back(id);
    }
    MakeGhosts(std::span<const uint32_t>(*victims).subspan(first));
    t1_.EndScan(true);
    t2_.EndScan(true);
    return true;
  }

  void EvictChosen(std::span<const uint32_t> ids) override {
    MakeGhosts(ids);
    for (uint32_t id : ids) List(id).Remove(id);
  }

  void Clear() override {
    t1_.Clear();
    t2_.Clear();
    ghosts_.Clear();
    target_ = 0.0;
  }

  void Describe(BlockManagerState* state) const override {
    std::vector<uint32_t> ids;
    t1_.AppendInOrder(&ids);
    for (uint32_t id : ids) state->t1.push_back({entries_[id].key, id, entries_[id].ref});
    ids.clear();
    t2_.AppendInOrder(&ids);
    for (uint32_t id : ids) state->t2.push_back({entries_[id].key, id, entries_[id].ref});
    ghosts_.AppendKeys(kB1, &state->b1);
    ghosts_.AppendKeys(kB2, &state->b2);
    state->arc_target = target_;
  }

  PolicySizes Sizes() const override {
    return {t1_.size(), t2_.size(), ghosts_.size(kB1), ghosts_.size(kB2), target_};
  }

  size_t MemoryBytes() const override {
    return sizeof(*this) + t1_.MemoryBytes() + t2_.MemoryBytes() + ghosts_.MemoryBytes() +
           hashes_.capacity() * sizeof(uint64_t);
  }

  Status SetTarget(double target) override {
    if (!(target >= 0.0 && target <= static_cast<double>(capacity_))) {
      return InvalidArgumentError("ARC target {} is outside [0, {}]", target, capacity_);
    }
    target_ = target;
    return Status::OK();
  }

 private:
  RecencyList& List(uint32_t id) { return entries_[id].list == kT1 ? t1_ : t2_; }

  // Evicted keys become ghosts, in choice order; each ghost list keeps its newest `capacity`
  // keys, trimmed before the manager inserts the new keys (as vLLM does). No call evicts more
  // than `capacity` blocks, so the keys trimmed are all old ghosts and can go first, together.
  void MakeGhosts(std::span<const uint32_t> victims) {
    size_t pushes[2] = {0, 0};
    hashes_.clear();
    for (uint32_t id : victims) {
      const Entry& e = entries_[id];
      ++pushes[e.list == kT1 ? kB1 : kB2];
      hashes_.push_back(KeyHash(e.key));
      ghosts_.Prefetch(hashes_.back());
    }
    for (uint32_t list : {kB1, kB2}) {
      const size_t size = ghosts_.size(list);
      if (size + pushes[list] > capacity_) ghosts_.PopLru(list, size + pushes[list] - capacity_);
    }
    for (size_t i = 0; i < victims.size(); ++i) {
      const Entry& e = entries_[victims[i]];
      ghosts_.PushMru(e.list == kT1 ? kB1 : kB2, e.key, hashes_[i], 0);
    }
  }

  Entry* const entries_;
  const size_t capacity_;
  RecencyList t1_;
  RecencyList t2_;
  KeyLists ghosts_;  // list kB1 and kB2
  double target_ = 0.0;
  std::vector<uint64_t> hashes_;  // scratch
};

}  // namespace

std::unique_ptr<ReplacementPolicy> MakeArcPolicy(Entry* entries, size_t capacity,
                                                 uint32_t first_stamp) {
  return std::make_unique<ArcPolicy>(entries, capacity, first_stamp);
}

}  // namespace kvstash::store
