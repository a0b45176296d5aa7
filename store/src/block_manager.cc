#include "kvstash/store/block_manager.h"

#include <algorithm>
#include <bit>
#include <new>
#include <utility>

#include "entry.h"
#include "flat_index.h"
#include "huge_array.h"
#include "key_lists.h"
#include "kvstash/common/mutex.h"
#include "namespace_book.h"
#include "policy.h"

namespace kvstash::store {

Result<EvictionPolicy> ParseEvictionPolicy(std::string_view name) {
  if (name == "lru") return EvictionPolicy::kLru;
  if (name == "arc") return EvictionPolicy::kArc;
  if (name == "aflru") return EvictionPolicy::kAfLru;
  return InvalidArgumentError("unknown eviction policy '{}' (expected lru, arc or aflru)", name);
}

std::string_view EvictionPolicyName(EvictionPolicy policy) {
  switch (policy) {
    case EvictionPolicy::kArc:
      return "arc";
    case EvictionPolicy::kAfLru:
      return "aflru";
    case EvictionPolicy::kLru:
      break;
  }
  return "lru";
}

Result<Admission> ParseAdmission(std::string_view name) {
  if (name == "all") return Admission::kAll;
  if (name == "filter") return Admission::kFilter;
  if (name == "adaptive") return Admission::kAdaptive;
  return InvalidArgumentError("unknown admission '{}' (expected all, filter or adaptive)", name);
}

std::string_view AdmissionName(Admission admission) {
  switch (admission) {
    case Admission::kFilter:
      return "filter";
    case Admission::kAdaptive:
      return "adaptive";
    case Admission::kAll:
      break;
  }
  return "all";
}

void ApplyAdmission(Admission admission, BlockManagerOptions* options) {
  options->store_threshold = admission == Admission::kAll ? 0 : 2;
  options->adaptive_admission = admission == Admission::kAdaptive;
}

namespace {

constexpr size_t kMaxCapacity = size_t{1} << 31;

// Detects repeated keys within one call in O(keys): open addressing over indices into the
// call's key array, reused across calls. Not thread-safe.
class CallKeySet {
 public:
  void Reset(size_t max_keys) {
    size_t size = std::bit_ceil(std::max<size_t>(16, 2 * max_keys));
    if (table_.size() < size) table_.resize(size);
    mask_ = size - 1;
    std::fill(table_.begin(), table_.begin() + static_cast<ptrdiff_t>(size), kNoId);
  }
  // Records keys[index]; false if an equal key was recorded before.
  bool Insert(std::span<const BlockKey> keys, uint32_t index, uint64_t hash) {
    for (size_t i = hash & mask_;; i = (i + 1) & mask_) {
      if (table_[i] == kNoId) {
        table_[i] = index;
        return true;
      }
      if (keys[table_[i]] == keys[index]) return false;
    }
  }
  // Gives back a table grown for an unusually large call.
  void Trim() {
    if (table_.size() > kKeepEntries) std::vector<uint32_t>().swap(table_);
  }
  size_t MemoryBytes() const { return table_.capacity() * sizeof(uint32_t); }

 private:
  static constexpr size_t kKeepEntries = 4096;
  std::vector<uint32_t> table_;
  size_t mask_ = 0;
};

// Walks the keys of one call in scan order, hashing each key once and prefetching its index
// bucket kBucketAhead keys ahead and its likely entry kEntryAhead keys ahead, so that the cache
// misses of a batch overlap instead of queueing one after another. Not thread-safe.
class PrefetchingWalk {
 public:
  // `policy`: also give the policy its prefetch hint (keys about to be stored or touched).
  PrefetchingWalk(const FlatIndex& index, const Entry* entries, const ReplacementPolicy* policy,
                  std::span<const BlockKey> keys, bool reverse)
      : index_(index), entries_(entries), policy_(policy), keys_(keys), reverse_(reverse) {}

  // The hash of the key at the next scan position (0, 1, 2, ...).
  uint64_t Next() {
    const size_t n = keys_.size();
    const size_t want = std::min(n, next_ + kBucketAhead + 1);
    for (; hashed_ < want; ++hashed_) {
      const uint64_t hash = KeyHash(keys_[reverse_ ? n - 1 - hashed_ : hashed_]);
      ring_[hashed_ % kRing] = hash;
      index_.Prefetch(hash);
      if (policy_ != nullptr) policy_->Prefetch(hash);
    }
    if (entries_ != nullptr && next_ + kEntryAhead < hashed_) {  // a store's walk has none
      const uint32_t candidate = index_.FirstCandidate(ring_[(next_ + kEntryAhead) % kRing]);
      if (candidate != FlatIndex::kNone) __builtin_prefetch(&entries_[candidate]);
    }
    return ring_[next_++ % kRing];
  }

 private:
  static constexpr size_t kBucketAhead = 16;
  static constexpr size_t kEntryAhead = 6;
  static constexpr size_t kRing = 32;
  static_assert(kBucketAhead < kRing);

  const FlatIndex& index_;
  const Entry* const entries_;
  const ReplacementPolicy* const policy_;
  const std::span<const BlockKey> keys_;
  const bool reverse_;
  size_t next_ = 0;
  size_t hashed_ = 0;
  uint64_t ring_[kRing];
};

std::unique_ptr<ReplacementPolicy> MakePolicy(const BlockManagerOptions& options, Entry* entries) {
  const size_t capacity = options.capacity_blocks;
  const uint32_t stamp = options.first_recency_stamp;
  std::unique_ptr<ReplacementPolicy> policy;
  switch (options.policy) {
    case EvictionPolicy::kArc:
      policy = MakeArcPolicy(entries, capacity, stamp);
      break;
    case EvictionPolicy::kAfLru:
      policy = MakeAfLruPolicy(entries, capacity, stamp);
      break;
    case EvictionPolicy::kLru:
      policy = MakeLruPolicy(entries, capacity, stamp);
      break;
  }
  return MakeSpareFirstPolicy(std::move(policy), entries, capacity, stamp);
}

// Adaptive admission (docs/semantics.md §2a): two shadow managers of keys only, fed the
// operations on a sample of the keys (one in `rate_`, by a hash of the block hash and group),
// at capacity / rate, one storing every block, the other with the reuse filter. Every
// kHalfLife sampled lookups the filter is set on if the second hit more of them, with older
// windows counting half as much as each newer one. Not thread-safe: the owner's lock covers
// it.
class AdmissionShadows {
 public:
  static constexpr size_t kShadowBlocks = 2048;  // at most, each
  static constexpr uint64_t kHalfLife = 4096;    // sampled lookups

  explicit AdmissionShadows(const BlockManagerOptions& options)
      : rate_(std::max<size_t>(1, options.capacity_blocks / kShadowBlocks)) {
    BlockManagerOptions shadow;
    shadow.capacity_blocks = std::max<size_t>(1, options.capacity_blocks / rate_);
    shadow.policy = options.policy;
    off_ = BlockManager::Create(shadow).value();
    shadow.store_threshold = options.store_threshold;
    shadow.max_tracker_size = std::max<size_t>(16, options.max_tracker_size / rate_);
    on_ = BlockManager::Create(shadow).value();
  }

  bool filter_on() const { return filter_on_; }
  AdmissionState State() const { return {true, filter_on_, hits_on_, hits_off_, switches_, rate_}; }

  void Lookup(const BlockKey& key) {
    if (!Sampled(key)) return;
    hits_off_ += off_->Lookup(key) == LookupResult::kHit ? 1 : 0;
    hits_on_ += on_->Lookup(key) == LookupResult::kHit ? 1 : 0;
    if (++lookups_ % kHalfLife == 0) {
      const bool on = hits_on_ > hits_off_;
      if (on != filter_on_) ++switches_;
      filter_on_ = on;
      hits_on_ /= 2;
      hits_off_ /= 2;
    }
  }

  void Touch(std::span<const BlockKey> keys, TouchKind kind) {
    if (!Sample(keys)) return;
    off_->Touch(sampled_, kind);
    on_->Touch(sampled_, kind);
  }

  // The shadows store at once what is not filtered out (each its own way): they hold no bytes.
  void Store(std::span<const BlockKey> keys, std::span<const StoreHint> hints) {
    sampled_.clear();
    sampled_hints_.clear();
    for (size_t i = 0; i < keys.size(); ++i) {
      if (!Sampled(keys[i])) continue;
      sampled_.push_back(keys[i]);
      if (!hints.empty()) sampled_hints_.push_back(hints[i]);
    }
    if (sampled_.empty()) return;
    for (BlockManager* shadow : {off_.get(), on_.get()}) {
      StorePlan plan;
      if (shadow->PrepareStore(sampled_, &plan, sampled_hints_).ok()) {
        shadow->CompleteStore(plan.keys_to_store, true);
      }
    }
  }

  void Remove(std::span<const BlockKey> keys) {
    if (!Sample(keys)) return;
    off_->Remove(sampled_);
    on_->Remove(sampled_);
  }

  void Reset() {
    off_->Reset();
    on_->Reset();
  }

  size_t MemoryBytes() const {
    return sizeof(*this) + off_->MetadataBytes() + on_->MetadataBytes() +
           (sampled_.capacity() * sizeof(BlockKey)) + sampled_hints_.capacity();
  }

 private:
  bool Sampled(const BlockKey& key) const {
    if (rate_ == 1) return true;
    return NamespaceFreeHash(key) % rate_ == 0;
  }
  // The sampled keys of `keys` into sampled_, in order; false when there are none.
  bool Sample(std::span<const BlockKey> keys) {
    sampled_.clear();
    for (const BlockKey& key : keys) {
      if (Sampled(key)) sampled_.push_back(key);
    }
    return !sampled_.empty();
  }

  const size_t rate_;
  std::unique_ptr<BlockManager> off_, on_;
  uint64_t hits_on_ = 0, hits_off_ = 0, lookups_ = 0, switches_ = 0;
  bool filter_on_ = false;
  std::vector<BlockKey> sampled_;
  std::vector<StoreHint> sampled_hints_;
};

class BlockManagerImpl final : public BlockManager {
 public:
  explicit BlockManagerImpl(const BlockManagerOptions& options)
      : options_(options),
        capacity_(options.capacity_blocks),
        entries_(options.capacity_blocks),
        index_(options.capacity_blocks),
        policy_(MakePolicy(options, entries_.data())) {
    if (options.count_namespaces || !options.quotas.empty()) {
      book_ = std::make_unique<NamespaceBook>(options.quotas, options.capacity_blocks);
    }
    if (options.store_threshold >= 2) {
      tracker_ = std::make_unique<KeyLists>(options.max_tracker_size, 1);
    }
    if (options.adaptive_admission) shadows_ = std::make_unique<AdmissionShadows>(options);
  }

  LookupResult Lookup(const BlockKey& key) override {
    MutexLock lock(&mu_);
    return LookupLocked(key, KeyHash(key));
  }

  void Lookup(std::span<const BlockKey> keys, std::span<LookupResult> results) override {
    MutexLock lock(&mu_);
    const size_t n = std::min(keys.size(), results.size());
    PrefetchingWalk walk = Walk(keys.first(n));
    for (size_t i = 0; i < n; ++i) results[i] = LookupLocked(keys[i], walk.Next());
  }

  ScanResult LookupPrefix(std::span<const BlockKey> keys) override {
    MutexLock lock(&mu_);
    PrefetchingWalk walk = Walk(keys);
    return MaximalPrefix(keys.size(), [&](size_t i) {
      mu_.AssertHeld();
      return LookupLocked(keys[i], walk.Next());
    });
  }

  ScanResult LookupWindow(std::span<const BlockKey> keys, size_t window) override {
    MutexLock lock(&mu_);
    PrefetchingWalk walk = Walk(keys, /*reverse=*/true);
    return SlidingWindow(keys.size(), window, [&](size_t i) {
      mu_.AssertHeld();
      return LookupLocked(keys[i], walk.Next());
    });
  }

  Status PrepareLoad(std::span<const BlockKey> keys, std::vector<SlotId>* slots) override {
    MutexLock lock(&mu_);
    slots->clear();
    PrefetchingWalk walk = Walk(keys);
    for (size_t i = 0; i < keys.size(); ++i) {
      const uint32_t id = FindHashed(keys[i], walk.Next());
      if (id == kNoId || entries_[id].ref < 0) {
        slots->clear();
        return FailedPreconditionError("cannot load key {} ({} of {}): it is {}",
                                       keys[i].ToString(), i + 1, keys.size(),
                                       id == kNoId ? "not stored" : "still being written");
      }
      slots->push_back(id);
    }
    for (size_t i = 0; i < slots->size(); ++i) {
      Entry& e = entries_[(*slots)[i]];
      if (e.ref == Entry::kMaxRef) {
        for (size_t j = 0; j < i; ++j) entries_[(*slots)[j]].ref -= 1;
        slots->clear();
        return ResourceExhaustedError("cannot load key {}: it already has {} pins",
                                      keys[i].ToString(), Entry::kMaxRef);
      }
      e.ref += 1;
    }
    return Status::OK();
  }

  Status CompleteLoad(std::span<const BlockKey> keys) override {
    MutexLock lock(&mu_);
    scratch_ids_.clear();
    PrefetchingWalk walk = Walk(keys);
    for (size_t i = 0; i < keys.size(); ++i) {
      const uint32_t id = FindHashed(keys[i], walk.Next());
      if (id == kNoId || entries_[id].ref <= 0) {
        for (uint32_t done : scratch_ids_) entries_[done].ref += 1;  // roll back
        return FailedPreconditionError(
            "cannot unload key {} ({} of {}): it is {}", keys[i].ToString(), i + 1, keys.size(),
            id == kNoId ? "not stored" : (entries_[id].ref < 0 ? "being written" : "not pinned"));
      }
      entries_[id].ref -= 1;
      scratch_ids_.push_back(id);
    }
    for (uint32_t id : scratch_ids_) {
      if (entries_[id].ref == 0) policy_->OnEvictable(id);
    }
    return Status::OK();
  }

  using BlockManager::Touch;
  void Touch(std::span<const BlockKey> keys, TouchKind kind) override {
    MutexLock lock(&mu_);
    PrefetchingWalk walk = WalkForTouch(keys);
    const bool quotas = book_ && book_->has_quotas();
    for (size_t i = keys.size(); i-- > 0;) {
      const uint64_t hash = walk.Next();
      const uint32_t id = FindHashed(keys[i], hash);
      policy_->Touch(keys[i], hash, id, kind);
      if (quotas && id != kNoId) book_->Touch(id, keys[i].namespace_id);
    }
    if (shadows_) shadows_->Touch(keys, kind);
  }

  using BlockManager::PrepareStore;
  Status PrepareStore(std::span<const BlockKey> keys, StorePlan* plan,
                      std::span<const StoreHint> hints) override {
    MutexLock lock(&mu_);
    if (shadows_) shadows_->Store(keys, hints);
    plan->keys_to_store.clear();
    plan->slots.clear();
    plan->evicted.clear();
    plan->evicted_slots.clear();
    plan->quota_namespace = 0;
    plan->quota_refused = 0;
    plan->filtered = 0;

    // Keys to store (absent, once each) and keys to protect (every key of the call that passes
    // the reuse filter, stored or not).
    call_keys_.Reset(keys.size());
    scratch_ids_.clear();
    spare_.clear();
    PrefetchingWalk walk = WalkForStore(keys);
    for (size_t i = 0; i < keys.size(); ++i) {
      const uint64_t hash = walk.Next();
      if (tracker_ && FilterOn() && !PassesReuseFilter(keys[i], hash)) {
        if (FindHashed(keys[i], hash) == kNoId) ++plan->filtered;
        continue;
      }
      const uint32_t id = FindHashed(keys[i], hash);
      if (id != kNoId) {
        if (!entries_[id].marked) {
          entries_[id].marked = 1;
          scratch_ids_.push_back(id);
        }
      } else if (call_keys_.Insert(keys, static_cast<uint32_t>(i), hash)) {
        plan->keys_to_store.push_back(keys[i]);
        spare_.push_back(i < hints.size() && hints[i] == StoreHint::kSpare);
      }
    }
    // A namespace at its quota makes room among its own blocks first (marked, so that the
    // policy does not choose them too); they free slots for the call like any victim.
    own_victims_.clear();
    if (book_ && book_->has_quotas() && !plan->keys_to_store.empty()) {
      Status within = ChooseOwnVictims(plan);
      if (!within.ok()) {
        Unmark();
        plan->keys_to_store.clear();
        call_keys_.Trim();
        return within;
      }
    }
    const size_t free_slots = free_count_ + (capacity_ - fresh_used_) + own_victims_.size();
    const size_t to_store = plan->keys_to_store.size();
    victims_.clear();
    if (to_store > free_slots) {
      const bool ok = policy_->Evict(to_store - free_slots, &victims_);
      Unmark();
      if (!ok) {
        plan->keys_to_store.clear();
        return ResourceExhaustedError(
            "no room for {} new blocks: {} slots free and fewer than {} idle blocks to evict "
            "(the others are pinned, being written, or keys of this call)",
            to_store, free_slots, to_store - free_slots);
      }
    } else {
      Unmark();
    }
    if (!own_victims_.empty()) {
      policy_->EvictChosen(own_victims_);
      victims_.insert(victims_.end(), own_victims_.begin(), own_victims_.end());
    }
    if (!victims_.empty()) {
      hashes_.clear();
      for (uint32_t id : victims_) {
        hashes_.push_back(KeyHash(entries_[id].key));
        index_.Prefetch(hashes_.back());
      }
      for (size_t i = 0; i < victims_.size(); ++i) {
        const uint32_t id = victims_[i];
        plan->evicted.push_back(entries_[id].key);
        plan->evicted_slots.push_back(id);
        index_.Erase(id, hashes_[i]);
        FreeSlot(id);
      }
      if (options_.enable_events) RecordEvent(OffloadEvent::Kind::kRemoved, plan->evicted);
    }
    call_keys_.Trim();
    for (size_t i = 0; i < plan->keys_to_store.size(); ++i) {
      const BlockKey& key = plan->keys_to_store[i];
      const uint32_t id = AllocateSlot();
      Entry& e = entries_[id];
      e.key = key;
      e.ref = -1;
      e.marked = 0;
      const uint64_t hash = KeyHash(key);
      index_.Insert(id, hash);
      if (spare_[i]) {
        policy_->InsertSpare(id, hash);
      } else {
        policy_->Insert(id, hash);
      }
      if (book_) book_->Add(id, key.namespace_id);
      plan->slots.push_back(id);
    }
    return Status::OK();
  }

  void CompleteStore(std::span<const BlockKey> keys, bool success) override {
    MutexLock lock(&mu_);
    size_t stored = 0;  // keys appended to events_.keys
    PrefetchingWalk walk = Walk(keys);
    for (const BlockKey& key : keys) {
      const uint64_t hash = walk.Next();
      const uint32_t id = FindHashed(key, hash);
      if (id == kNoId || entries_[id].ref >= 0) continue;
      if (success) {
        entries_[id].ref = 0;
        policy_->OnEvictable(id);
        if (options_.enable_events) {
          events_.keys.push_back(key);
          ++stored;
        }
      } else {
        DropEntry(id, hash);
      }
    }
    if (stored > 0) CloseEventRun(OffloadEvent::Kind::kStored, stored);
  }

  size_t Remove(std::span<const BlockKey> keys, std::vector<BlockKey>* out) override {
    MutexLock lock(&mu_);
    if (shadows_) shadows_->Remove(keys);
    std::vector<BlockKey> removed;
    PrefetchingWalk walk = Walk(keys);
    for (const BlockKey& key : keys) {
      const uint64_t hash = walk.Next();
      const uint32_t id = FindHashed(key, hash);
      if (id == kNoId || entries_[id].ref != 0) continue;
      DropEntry(id, hash);
      removed.push_back(key);
    }
    const size_t count = removed.size();
    if (out != nullptr) out->insert(out->end(), removed.begin(), removed.end());
    if (options_.enable_events && count > 0) {
      RecordEvent(OffloadEvent::Kind::kRemoved, removed);
    }
    return count;
  }

  Status Restore(std::span<const BlockInfo> blocks) override {
    MutexLock lock(&mu_);
    if (fresh_used_ != 0) {
      return InvalidArgumentError("cannot restore {} blocks: the manager is already in use",
                                  blocks.size());
    }
    std::vector<bool> slot_used(capacity_, false);
    uint32_t end = 0;
    for (const BlockInfo& block : blocks) {
      if (block.slot >= capacity_) {
        return InvalidArgumentError("cannot restore key {} at slot {}: the capacity is {} blocks",
                                    block.key.ToString(), block.slot, capacity_);
      }
      if (slot_used[block.slot]) {
        return InvalidArgumentError("cannot restore key {}: slot {} is given twice",
                                    block.key.ToString(), block.slot);
      }
      slot_used[block.slot] = true;
      end = std::max(end, block.slot + 1);
    }
    size_t inserted = 0;
    for (const BlockInfo& block : blocks) {
      const uint64_t hash = KeyHash(block.key);
      if (FindHashed(block.key, hash) != kNoId) {
        for (size_t i = 0; i < inserted; ++i) {  // roll back
          const uint32_t id = blocks[i].slot;
          policy_->Remove(id);
          index_.Erase(id, KeyHash(blocks[i].key));
          entries_[id].set_where(Place::kFree);
        }
        resident_ = 0;
        if (book_) book_->Clear();
        return InvalidArgumentError("cannot restore key {}: it is given twice",
                                    block.key.ToString());
      }
      Entry& e = entries_[block.slot];
      e.key = block.key;
      e.ref = -1;
      e.marked = 0;
      index_.Insert(block.slot, hash);
      policy_->Insert(block.slot, hash);
      e.ref = 0;
      policy_->OnEvictable(block.slot);
      if (book_) book_->Add(block.slot, block.key.namespace_id);
      ++resident_;
      ++inserted;
    }
    // Slots below the highest restored one that hold nothing become free slots, reused (after
    // the fresh ones) lowest first.
    fresh_used_ = end;
    for (uint32_t id = end; id-- > 0;) {
      if (slot_used[id]) continue;
      entries_[id].set_where(Place::kFree);
      entries_[id].aux = free_head_;
      free_head_ = id;
      ++free_count_;
    }
    return Status::OK();
  }

  std::vector<OffloadEvent> TakeEvents() override {
    OffloadEventLog log;
    TakeEvents(&log);
    std::vector<OffloadEvent> out;
    out.reserve(log.runs.size());
    size_t at = 0;
    for (const auto& [kind, count] : log.runs) {
      out.push_back(
          {kind, std::vector<BlockKey>(log.keys.begin() + static_cast<ptrdiff_t>(at),
                                       log.keys.begin() + static_cast<ptrdiff_t>(at + count))});
      at += count;
    }
    return out;
  }

  void TakeEvents(OffloadEventLog* log) override {
    log->clear();
    MutexLock lock(&mu_);
    std::swap(*log, events_);
  }

  void Reset() override {
    MutexLock lock(&mu_);
    if (shadows_) shadows_->Reset();
    policy_->Clear();
    index_.Clear();
    entries_.Zero();
    fresh_used_ = 0;
    free_head_ = kNoId;
    free_count_ = 0;
    resident_ = 0;
    if (book_) book_->Clear();
  }

  size_t capacity() const override { return capacity_; }

  size_t resident_blocks() const override {
    MutexLock lock(&mu_);
    return resident_;
  }

  std::vector<NamespaceUsage> NamespaceUsages() const override {
    MutexLock lock(&mu_);
    return book_ ? book_->Usages() : std::vector<NamespaceUsage>();
  }

  size_t MetadataBytes() const override {
    MutexLock lock(&mu_);
    size_t bytes = sizeof(*this) + entries_.MemoryBytes() + index_.MemoryBytes() +
                   policy_->MemoryBytes() + call_keys_.MemoryBytes() +
                   (victims_.capacity() + scratch_ids_.capacity()) * sizeof(uint32_t) +
                   hashes_.capacity() * sizeof(uint64_t);
    if (tracker_) bytes += tracker_->MemoryBytes();
    if (shadows_) bytes += shadows_->MemoryBytes();
    if (book_) bytes += book_->MemoryBytes() + own_victims_.capacity() * sizeof(uint32_t);
    return bytes;
  }

  EvictionPolicy policy() const override { return options_.policy; }

  AdmissionState admission() const override {
    MutexLock lock(&mu_);
    if (shadows_) return shadows_->State();
    AdmissionState state;
    state.filter_on = tracker_ != nullptr;
    return state;
  }

  PolicySizes policy_sizes() const override {
    MutexLock lock(&mu_);
    return policy_->Sizes();
  }

  BlockManagerState DebugState() const override {
    MutexLock lock(&mu_);
    BlockManagerState state;
    state.policy = options_.policy;
    policy_->Describe(&state);
    for (uint32_t id = free_head_; id != kNoId; id = entries_[id].aux) {
      state.free_slots.push_back(id);
    }
    std::reverse(state.free_slots.begin(), state.free_slots.end());
    state.fresh_slots_used = fresh_used_;
    return state;
  }

  Status SetArcTargetForTesting(double target) override {
    MutexLock lock(&mu_);
    return policy_->SetTarget(target);
  }

 private:
  PrefetchingWalk Walk(std::span<const BlockKey> keys, bool reverse = false) const REQUIRES(mu_) {
    return PrefetchingWalk(index_, entries_.data(), nullptr, keys, reverse);
  }
  // For a store's keys, mostly absent: index buckets and the policy's hint, no entries.
  PrefetchingWalk WalkForStore(std::span<const BlockKey> keys) const REQUIRES(mu_) {
    return PrefetchingWalk(index_, nullptr, policy_.get(), keys, /*reverse=*/false);
  }
  // For a touch's keys, in reverse: entries and the policy's hint.
  PrefetchingWalk WalkForTouch(std::span<const BlockKey> keys) const REQUIRES(mu_) {
    return PrefetchingWalk(index_, entries_.data(), policy_.get(), keys, /*reverse=*/true);
  }

  uint32_t FindHashed(const BlockKey& key, uint64_t hash) const REQUIRES(mu_) {
    return index_.Find(key, hash, [this](uint32_t id) -> const BlockKey& {
      mu_.AssertHeld();
      return entries_[id].key;
    });
  }

  LookupResult LookupLocked(const BlockKey& key, uint64_t hash) REQUIRES(mu_) {
    if (tracker_) CountLookup(key, hash);
    if (shadows_) shadows_->Lookup(key);
    const uint32_t id = FindHashed(key, hash);
    if (id == kNoId) return LookupResult::kMiss;
    return entries_[id].ref < 0 ? LookupResult::kRetry : LookupResult::kHit;
  }

  void CountLookup(const BlockKey& key, uint64_t hash) REQUIRES(mu_) {
    const uint32_t node = tracker_->Find(key, hash);
    if (node != kNoId) {
      tracker_->MoveToMru(node);
      tracker_->set_value(node, std::min(tracker_->value(node) + 1, KeyLists::kMaxValue));
      return;
    }
    if (tracker_->size(0) >= tracker_->per_list()) tracker_->PopLru(0);
    tracker_->PushMru(0, key, hash, 1);
  }

  // Whether the reuse filter applies now: always when set, or as the shadows decide.
  bool FilterOn() const REQUIRES(mu_) { return !shadows_ || shadows_->filter_on(); }

  bool PassesReuseFilter(const BlockKey& key, uint64_t hash) const REQUIRES(mu_) {
    const uint32_t node = tracker_->Find(key, hash);
    return node != kNoId && tracker_->value(node) >= options_.store_threshold;
  }

  // For each namespace with a ceiling that the call's new keys would take past it, chooses (and
  // marks) its least recently used idle blocks, unmarked by this call, to evict into
  // own_victims_. ResourceExhausted, naming the namespace, when too few are idle.
  Status ChooseOwnVictims(StorePlan* plan) REQUIRES(mu_) {
    // New keys per namespace: one namespace per call is the rule (a node's session), so check
    // for that in one pass before sorting.
    const std::vector<BlockKey>& keys = plan->keys_to_store;
    new_per_ns_.clear();
    const NamespaceId first = keys[0].namespace_id;
    if (std::all_of(keys.begin(), keys.end(),
                    [first](const BlockKey& k) { return k.namespace_id == first; })) {
      new_per_ns_.emplace_back(first, keys.size());
    } else {
      for (const BlockKey& k : keys) new_per_ns_.emplace_back(k.namespace_id, 1);
      std::sort(new_per_ns_.begin(), new_per_ns_.end());
      size_t out = 0;
      for (size_t i = 0; i < new_per_ns_.size(); ++i) {
        if (out > 0 && new_per_ns_[out - 1].first == new_per_ns_[i].first) {
          ++new_per_ns_[out - 1].second;
        } else {
          new_per_ns_[out++] = new_per_ns_[i];
        }
      }
      new_per_ns_.resize(out);
    }
    for (const auto& [ns, fresh] : new_per_ns_) {
      const std::optional<size_t> quota = book_->quota(ns);
      if (!quota) continue;
      const size_t held = book_->blocks(ns);
      if (held + fresh <= *quota) continue;
      plan->quota_namespace = ns;
      plan->quota_refused = fresh;
      if (fresh > *quota) {
        return ResourceExhaustedError("{} new blocks of namespace {} exceed its quota of {}", fresh,
                                      ns, *quota);
      }
      // A namespace restored past its quota is brought back down to it.
      const size_t need = held + fresh - *quota;
      size_t found = 0;
      book_->ForOldest(ns, [&](uint32_t id) {
        mu_.AssertHeld();
        Entry& e = entries_[id];
        if (e.ref == 0 && !e.marked) {
          e.marked = 1;
          scratch_ids_.push_back(id);
          own_victims_.push_back(id);
          ++found;
        }
        return found < need;
      });
      if (found < need) {
        return ResourceExhaustedError(
            "namespace {} is at its quota of {} blocks: it holds {}, of which only {} are idle "
            "to make room for {} new ones (the others are pinned, being written, or keys of "
            "this call)",
            ns, *quota, held, found, fresh);
      }
      plan->quota_namespace = 0;
      plan->quota_refused = 0;
    }
    return Status::OK();
  }

  void Unmark() REQUIRES(mu_) {
    for (uint32_t id : scratch_ids_) entries_[id].marked = 0;
    scratch_ids_.clear();
  }

  // Fresh slots first, in increasing order; then freed slots, last freed first.
  // Appends an event; past max_pending_event_keys undrained keys, drops every undrained event
  // for one kLost marker, so that the memory events hold stays bounded when nothing drains
  // them for a while.
  void RecordEvent(OffloadEvent::Kind kind, std::span<const BlockKey> keys) REQUIRES(mu_) {
    events_.keys.insert(events_.keys.end(), keys.begin(), keys.end());
    CloseEventRun(kind, keys.size());
  }
  // The last `count` keys of events_.keys are one event.
  void CloseEventRun(OffloadEvent::Kind kind, size_t count) REQUIRES(mu_) {
    const size_t limit = options_.max_pending_event_keys;
    if (limit != 0 && events_.keys.size() > limit) {
      events_.clear();
      events_.runs.push_back({OffloadEvent::Kind::kLost, 0});
      return;
    }
    events_.runs.push_back({kind, count});
  }

  uint32_t AllocateSlot() REQUIRES(mu_) {
    ++resident_;
    if (fresh_used_ < capacity_) return fresh_used_++;
    const uint32_t id = free_head_;
    free_head_ = entries_[id].aux;
    --free_count_;
    return id;
  }

  // Takes entry `id` (key hash `hash`) out of the order and the index and frees its slot.
  void DropEntry(uint32_t id, uint64_t hash) REQUIRES(mu_) {
    policy_->Remove(id);
    index_.Erase(id, hash);
    FreeSlot(id);
  }

  void FreeSlot(uint32_t id) REQUIRES(mu_) {
    --resident_;
    if (book_) book_->Drop(id, entries_[id].key.namespace_id);
    entries_[id].set_where(Place::kFree);
    entries_[id].aux = free_head_;
    free_head_ = id;
    ++free_count_;
  }

  const BlockManagerOptions options_;
  const size_t capacity_;
  mutable Mutex mu_;
  HugeArray<Entry> entries_ GUARDED_BY(mu_);  // by slot; never moves (the policy points in)
  FlatIndex index_ GUARDED_BY(mu_);
  const std::unique_ptr<ReplacementPolicy> policy_ PT_GUARDED_BY(mu_);
  std::unique_ptr<KeyLists> tracker_ PT_GUARDED_BY(mu_);          // reuse filter, when on
  std::unique_ptr<AdmissionShadows> shadows_ PT_GUARDED_BY(mu_);  // adaptive admission
  // Per-namespace counts and quotas, when asked for; none: no per-namespace work at all.
  std::unique_ptr<NamespaceBook> book_ PT_GUARDED_BY(mu_);
  uint32_t fresh_used_ GUARDED_BY(mu_) = 0;
  uint32_t free_head_ GUARDED_BY(mu_) = kNoId;  // stack of freed slots through Entry::aux
  size_t free_count_ GUARDED_BY(mu_) = 0;
  size_t resident_ GUARDED_BY(mu_) = 0;
  OffloadEventLog events_ GUARDED_BY(mu_);
  // Scratch space reused across calls.
  CallKeySet call_keys_ GUARDED_BY(mu_);
  std::vector<uint32_t> victims_ GUARDED_BY(mu_);
  std::vector<uint32_t> own_victims_ GUARDED_BY(mu_);  // chosen within namespaces at quota
  std::vector<std::pair<NamespaceId, size_t>> new_per_ns_ GUARDED_BY(mu_);
  std::vector<uint32_t> scratch_ids_ GUARDED_BY(mu_);
  std::vector<uint64_t> hashes_ GUARDED_BY(mu_);
  std::vector<bool> spare_ GUARDED_BY(mu_);  // by keys_to_store: stored as StoreHint::kSpare
};

}  // namespace

Result<std::unique_ptr<BlockManager>> BlockManager::Create(const BlockManagerOptions& options) {
  if (options.capacity_blocks == 0 || options.capacity_blocks > kMaxCapacity) {
    return InvalidArgumentError("capacity of {} blocks is outside [1, {}]", options.capacity_blocks,
                                kMaxCapacity);
  }
  if (options.adaptive_admission && options.store_threshold < 2) {
    return InvalidArgumentError(
        "adaptive admission switches the reuse filter: it needs a store threshold of 2 or more, "
        "not {}",
        options.store_threshold);
  }
  if (options.store_threshold >= 2 &&
      (options.max_tracker_size == 0 || options.max_tracker_size > kMaxCapacity)) {
    return InvalidArgumentError("reuse tracker size {} is outside [1, {}]",
                                options.max_tracker_size, kMaxCapacity);
  }
  for (const auto& [ns, blocks] : options.quotas.blocks) {
    if (blocks == 0 || blocks > options.capacity_blocks) {
      return InvalidArgumentError("quota of {} blocks for namespace {} is outside [1, {}]", blocks,
                                  ns, options.capacity_blocks);
    }
  }
  if (options.quotas.default_blocks && (*options.quotas.default_blocks == 0 ||
                                        *options.quotas.default_blocks > options.capacity_blocks)) {
    return InvalidArgumentError("default namespace quota of {} blocks is outside [1, {}]",
                                *options.quotas.default_blocks, options.capacity_blocks);
  }
  try {
    return std::unique_ptr<BlockManager>(std::make_unique<BlockManagerImpl>(options));
  } catch (const std::bad_alloc&) {
    return ResourceExhaustedError("cannot allocate the metadata of {} blocks",
                                  options.capacity_blocks);
  }
}

}  // namespace kvstash::store
