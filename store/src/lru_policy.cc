// LRU (docs/semantics.md §3): one list; a touch moves keys to the MRU end, first key last; eviction
// takes the least recent idle blocks.
#include "policy.h"
#include "recency_list.h"

namespace kvstash::store {
namespace {

class LruPolicy final : public ReplacementPolicy {
 public:
  LruPolicy(Entry* entries, size_t capacity, uint32_t first_stamp)
      : entries_(entries), list_(entries, capacity, capacity, 0, first_stamp) {}

  void Insert(uint32_t id, uint64_t /*hash*/) override { list_.PushMru(id); }
  void Remove(uint32_t id) override { list_.Remove(id); }
  void Touch(const BlockKey& /*key*/, uint64_t /*hash*/, uint32_t id, TouchKind /*kind*/) override {
    if (id != kNoId) list_.MoveToMru(id);
  }
  void OnEvictable(uint32_t id) override { list_.OnEvictable(id); }

  bool Evict(size_t n, std::vector<uint32_t>* victims) override {
    const size_t first = victims->size();
    list_.BeginScan();
    for (size_t i = 0; i < n; ++i) {
      const uint32_t id = list_.TakeVictim();
      if (id == kNoId) {
        list_.EndScan(false);
        victims->resize(first);
        return false;
      }
      victims->push_back(id);
    }
    list_.EndScan(true);
    return true;
  }

  void EvictChosen(std::span<const uint32_t> ids) override {
    for (uint32_t id : ids) list_.Remove(id);
  }

  void Clear() override { list_.Clear(); }

  void Describe(BlockManagerState* state) const override {
    std::vector<uint32_t> ids;
    list_.AppendInOrder(&ids);
    for (uint32_t id : ids) state->lru.push_back({entries_[id].key, id, entries_[id].ref});
  }

  PolicySizes Sizes() const override { return {list_.size(), 0, 0, 0, 0.0}; }

  size_t MemoryBytes() const override { return sizeof(*this) + list_.MemoryBytes(); }

  Status SetTarget(double /*target*/) override {
    return FailedPreconditionError("the LRU policy has no target size to set");
  }

 private:
  Entry* const entries_;
  RecencyList list_;
};

}  // namespace

std::unique_ptr<ReplacementPolicy> MakeLruPolicy(Entry* entries, size_t capacity,
                                                 uint32_t first_stamp) {
  return std::make_unique<LruPolicy>(entries, capacity, first_stamp);
}

}  // namespace kvstash::store
