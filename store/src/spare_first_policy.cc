// Spare blocks first (docs/semantics.md §4b): blocks stored as StoreHint::kSpare wait in a list
// of their own, outside the wrapped policy's order, and are evicted before any of its blocks,
// least recent first. The policy does not see a spare block (nor its touches) until a use (a
// touch of kind kUse of a readable spare block) hands it over as if it were stored now; any
// other touch moves it to the spare list's recent end.
#include "policy.h"
#include "recency_list.h"

namespace kvstash::store {
namespace {

// Entry::list of a spare block; the policies use 0 to 2.
constexpr uint32_t kSpareList = 3;

class SpareFirstPolicy final : public ReplacementPolicy {
 public:
  SpareFirstPolicy(std::unique_ptr<ReplacementPolicy> policy, Entry* entries, size_t capacity,
                   uint32_t first_stamp)
      : policy_(std::move(policy)),
        entries_(entries),
        spare_(entries, capacity, capacity, kSpareList, first_stamp) {}

  void Insert(uint32_t id, uint64_t hash) override { policy_->Insert(id, hash); }
  void InsertSpare(uint32_t id, uint64_t /*hash*/) override { spare_.PushMru(id); }

  void Remove(uint32_t id) override {
    if (IsSpare(id)) {
      spare_.Remove(id);
    } else {
      policy_->Remove(id);
    }
  }

  void Touch(const BlockKey& key, uint64_t hash, uint32_t id, TouchKind kind) override {
    if (id == kNoId || !IsSpare(id)) {
      policy_->Touch(key, hash, id, kind);
      return;
    }
    if (kind == TouchKind::kUse && entries_[id].ref >= 0) {
      spare_.Remove(id);
      policy_->Insert(id, hash);
      if (entries_[id].ref == 0) policy_->OnEvictable(id);
      return;
    }
    spare_.MoveToMru(id);  // the policy does not see a spare block until it is used
  }

  void OnEvictable(uint32_t id) override {
    if (IsSpare(id)) {
      spare_.OnEvictable(id);
    } else {
      policy_->OnEvictable(id);
    }
  }

  void Prefetch(uint64_t hash) const override { policy_->Prefetch(hash); }

  bool Evict(size_t n, std::vector<uint32_t>* victims) override {
    const size_t first = victims->size();
    spare_.BeginScan();
    size_t taken = 0;
    for (uint32_t id; taken < n && (id = spare_.TakeVictim()) != kNoId; ++taken) {
      victims->push_back(id);
    }
    if (taken < n && !policy_->Evict(n - taken, victims)) {
      spare_.EndScan(false);
      victims->resize(first);
      return false;
    }
    spare_.EndScan(true);
    return true;
  }

  void EvictChosen(std::span<const uint32_t> ids) override {
    chosen_.clear();
    for (uint32_t id : ids) {
      if (IsSpare(id)) {
        spare_.Remove(id);
      } else {
        chosen_.push_back(id);
      }
    }
    if (!chosen_.empty()) policy_->EvictChosen(chosen_);
  }

  void Clear() override {
    spare_.Clear();
    policy_->Clear();
  }

  void Describe(BlockManagerState* state) const override {
    policy_->Describe(state);
    std::vector<uint32_t> ids;
    spare_.AppendInOrder(&ids);
    for (uint32_t id : ids) state->spare.push_back({entries_[id].key, id, entries_[id].ref});
  }

  PolicySizes Sizes() const override {
    PolicySizes sizes = policy_->Sizes();
    sizes.spare = spare_.size();
    return sizes;
  }

  size_t MemoryBytes() const override {
    return sizeof(*this) + policy_->MemoryBytes() + spare_.MemoryBytes() +
           chosen_.capacity() * sizeof(uint32_t);
  }

  Status SetTarget(double target) override { return policy_->SetTarget(target); }

 private:
  bool IsSpare(uint32_t id) const { return entries_[id].list == kSpareList; }

  const std::unique_ptr<ReplacementPolicy> policy_;
  Entry* const entries_;
  RecencyList spare_;
  std::vector<uint32_t> chosen_;  // scratch
};

}  // namespace

std::unique_ptr<ReplacementPolicy> MakeSpareFirstPolicy(std::unique_ptr<ReplacementPolicy> policy,
                                                        Entry* entries, size_t capacity,
                                                        uint32_t first_stamp) {
  return std::make_unique<SpareFirstPolicy>(std::move(policy), entries, capacity, first_stamp);
}

}  // namespace kvstash::store
