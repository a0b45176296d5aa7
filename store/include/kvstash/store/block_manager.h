// BlockManager: the block index of one offload node tier (vLLM's CPUOffloadingManager, §1-§4 of
// docs/semantics.md), with LRU, ARC and AF-LRU replacement.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

#include "kvstash/common/block_key.h"
#include "kvstash/common/status.h"

namespace kvstash::store {

// The index of a block slot in a tier (the CPU slab's slot, or an SSD record id).
using SlotId = uint32_t;

// kAfLru: age over frequency (docs/semantics.md §4a), kvstash's own; LRU and ARC are vLLM's.
enum class EvictionPolicy : uint8_t { kLru, kArc, kAfLru };

// Whether a touch is a new use of the keys or refreshes a use already counted (the same
// request's second touch, after its stores). Only AF-LRU tells them apart: LRU and ARC treat
// both as vLLM's touch.
enum class TouchKind : uint8_t { kUse, kRefresh };

// What a block being stored is for, as its client states it (docs/semantics.md §4b).
// kSpare: a hybrid model's sliding-window or state block that no hit ending where a later
// request's hit is expected to end needs (outside its window's reach of those ends): stored,
// but kept apart from the policy's order and evicted before any other block until a use (a
// touch of kind kUse) admits it like a new block.
enum class StoreHint : uint8_t { kNormal, kSpare };

// What a tier stores (docs/semantics.md §2a): every block offered, a block on its second lookup
// (the reuse filter, store_threshold 2), or the filter switched on and off by the tier itself.
enum class Admission : uint8_t { kAll, kFilter, kAdaptive };

// "all", "filter" or "adaptive"; InvalidArgument otherwise.
Result<Admission> ParseAdmission(std::string_view name);
std::string_view AdmissionName(Admission admission);

// "lru", "arc" or "aflru" (case-sensitive); InvalidArgument otherwise.
Result<EvictionPolicy> ParseEvictionPolicy(std::string_view name);
std::string_view EvictionPolicyName(EvictionPolicy policy);

// Ceilings on the blocks each namespace may hold in one tier, counting blocks being written; by
// namespace id (docs/semantics.md §18).
// A ceiling reserves nothing: namespaces under theirs, and those without one, compete for the
// rest of the tier through the policy as usual.
struct NamespaceQuotas {
  std::map<NamespaceId, size_t> blocks = {};  // the named namespaces' ceilings
  std::optional<size_t> default_blocks = {};  // every other namespace's ceiling; none: no ceiling

  bool empty() const { return blocks.empty() && !default_blocks; }
};

struct BlockManagerOptions {
  // Number of block slots; 1 to 2^31.
  size_t capacity_blocks = 0;
  EvictionPolicy policy = EvictionPolicy::kLru;
  // Reuse filter: when >= 2, PrepareStore only stores keys that Lookup has seen at least this
  // many times (counted in a tracker of at most `max_tracker_size` keys, least recent dropped).
  uint32_t store_threshold = 0;
  size_t max_tracker_size = 64000;
  // With the reuse filter: let the manager switch it on and off by itself, by which of two
  // sampled shadow caches (one with the filter, one without) hits more (docs/semantics.md §2a).
  bool adaptive_admission = false;
  // Record stored/removed events for TakeEvents. Off by default: nothing drains them.
  bool enable_events = false;
  // The most keys undrained events may name; past it they are all dropped for one kLost event.
  // 0: no bound.
  size_t max_pending_event_keys = 0;
  // Tests only: the first recency stamp, set near 2^32 to exercise stamp renumbering.
  uint32_t first_recency_stamp = 0;
  // Per-namespace ceilings (see PrepareStore). Each ceiling is 1 to capacity_blocks.
  NamespaceQuotas quotas;
  // Count the blocks of every namespace (NamespaceUsages) even without quotas: a hash-map
  // update per block stored or dropped. Always on with quotas.
  bool count_namespaces = false;
};

// Sets `options`' reuse filter (store_threshold, adaptive_admission) for `admission`.
void ApplyAdmission(Admission admission, BlockManagerOptions* options);

// The blocks one namespace holds in a tier.
struct NamespaceUsage {
  NamespaceId id = 0;
  size_t blocks = 0;                   // readable or being written
  std::optional<size_t> quota_blocks;  // its ceiling, if any

  friend bool operator==(const NamespaceUsage&, const NamespaceUsage&) = default;
};

// What PrepareStore decided.
struct StorePlan {
  std::vector<BlockKey> keys_to_store;  // the keys to write, in call order
  std::vector<SlotId> slots;            // slots[i] receives keys_to_store[i]
  std::vector<BlockKey> evicted;        // keys evicted to make room, in eviction order
  std::vector<SlotId> evicted_slots;    // the slot each evicted key held (its bytes are still
                                        // there until the new key is written)
  // Set when PrepareStore refused the call for a namespace quota: that namespace, and the new
  // blocks of it the call asked for. 0 otherwise.
  NamespaceId quota_namespace = 0;
  size_t quota_refused = 0;
  // Keys the reuse filter turned away (not held, looked up too few times): not stored.
  size_t filtered = 0;
};

struct OffloadEvent {
  // kLost: events were dropped here (BlockManagerOptions::max_pending_event_keys); what the
  // tier holds is known again only from the events after it. No keys.
  enum class Kind : uint8_t { kStored, kRemoved, kLost };
  Kind kind;
  std::vector<BlockKey> keys;  // stored: in commit order; removed: in eviction order

  friend bool operator==(const OffloadEvent&, const OffloadEvent&) = default;
};

// Events as the manager records them, flat: `runs[i]` names the next `runs[i].second` keys of
// `keys` (a kLost run names none). What a drain that must not allocate swaps out
// (TakeEvents(OffloadEventLog*)).
struct OffloadEventLog {
  std::vector<BlockKey> keys;
  std::vector<std::pair<OffloadEvent::Kind, size_t>> runs;

  bool empty() const { return runs.empty(); }
  void clear() {
    keys.clear();
    runs.clear();
  }
};

// One resident block as state dumps show it.
struct BlockInfo {
  BlockKey key;
  SlotId slot;
  int32_t ref_count;  // -1 while being written, else the number of loads pinning it

  friend bool operator==(const BlockInfo&, const BlockInfo&) = default;
};

// A full dump of the manager's order-relevant state (tests, `kvstash trace`). O(n log n).
struct BlockManagerState {
  EvictionPolicy policy = EvictionPolicy::kLru;
  std::vector<BlockInfo> lru;     // LRU: every block, least recent first
  std::vector<BlockInfo> t1, t2;  // ARC: recency and frequency lists, least recent first
  std::vector<BlockKey> b1, b2;   // ARC: ghost lists, oldest first
  double arc_target = 0.0;        // ARC: p, the target size of T1
  std::vector<BlockInfo> spare;   // blocks stored as StoreHint::kSpare, least recent first
  // AF-LRU: the blocks of each frequency class (used by 1, 2, 3+ requests), least recent first,
  // with the clock of each one's last touch; the clock; the ghosts, oldest first, each its
  // fingerprint << 2 | its class.
  std::vector<BlockInfo> af[3];
  std::vector<uint64_t> af_touched[3];
  uint64_t af_clock = 0;
  std::vector<uint32_t> af_ghosts;
  std::vector<SlotId> free_slots;  // freed slots; the last is reused first
  size_t fresh_slots_used = 0;     // slots 0..n-1 have been handed out at least once
};

// The sizes of the policy's lists, read in O(1) (metrics). LRU has one list, counted in t1.
struct PolicySizes {
  size_t t1 = 0;            // LRU: every block; ARC: blocks seen once (recency list); AF-LRU:
                            // blocks used by one request
  size_t t2 = 0;            // ARC: blocks used again since they were stored (frequency list);
                            // AF-LRU: blocks used by two requests
  size_t b1 = 0, b2 = 0;    // ARC: ghost keys of blocks evicted from T1 and T2; AF-LRU: ghosts in
                            // b1
  double arc_target = 0.0;  // ARC: p, the target size of T1
  size_t t3 = 0;            // AF-LRU: blocks used by three requests or more
  size_t spare = 0;         // blocks stored as StoreHint::kSpare and not used since
};

// The reuse filter's regime (docs/semantics.md §2a).
struct AdmissionState {
  bool adaptive = false;   // the manager switches the filter by itself
  bool filter_on = false;  // stores keep only keys looked up store_threshold times or more
  // Adaptive: the decayed hits of the sampled shadow with the filter and without it (the
  // filter is on while the first is higher), how many times it switched, and the share of
  // keys sampled (one in sample_rate).
  uint64_t shadow_hits_filter = 0, shadow_hits_all = 0, switches = 0;
  size_t sample_rate = 0;
};

// Answers lookups for the blocks of one tier and decides where new blocks go and what is evicted.
// It holds metadata only (keys, slots, ref counts, recency); block bytes live in the tier.
//
// A block is written in two phases: PrepareStore reserves a slot (lookups answer RETRY), the
// caller writes the bytes, CompleteStore publishes (HIT) or drops it. Loads pin blocks
// (PrepareLoad .. CompleteLoad) so that eviction skips them. Every operation costs O(keys in
// the call) (plus O(log n) per block that was pinned while it reached the old end); nothing
// scans the cache.
//
// Namespace quotas: a namespace with a ceiling of q blocks never holds more than q. A store
// that would take it past q first evicts that namespace's own least recently used idle blocks
// (its own recency order: stores and touches of its keys, whatever the policy), and is refused
// when too few of them are idle; the tier's policy chooses every other eviction, among all
// namespaces. Finding a namespace's own victims costs O(victims + its pinned or in-flight
// blocks older than them). Without quotas none of this runs.
//
// Thread-safe: every method takes one internal lock.
class BlockManager {
 public:
  // InvalidArgument for a capacity of 0 or above 2^31, or a tracker size of 0 with a threshold.
  static Result<std::unique_ptr<BlockManager>> Create(const BlockManagerOptions& options);
  virtual ~BlockManager() = default;

  // HIT if stored and readable, RETRY while it is being written, else MISS. Never changes
  // recency; counts the key in the reuse tracker when the filter is on.
  virtual LookupResult Lookup(const BlockKey& key) = 0;
  // Lookup of each key, in order, under one lock. `results.size()` must equal `keys.size()`.
  virtual void Lookup(std::span<const BlockKey> keys, std::span<LookupResult> results) = 0;
  // The maximal-prefix and sliding-window scans of lookup.h over `keys`, under one lock; the
  // per-key lookups they make are exactly those the scans define (the tracker counts them).
  virtual ScanResult LookupPrefix(std::span<const BlockKey> keys) = 0;
  virtual ScanResult LookupWindow(std::span<const BlockKey> keys, size_t window) = 0;

  // Pins every key for reading and sets `slots` to their slots in key order. FailedPrecondition
  // (and no change) if any key is not stored or still being written; ResourceExhausted if a pin
  // count would overflow.
  virtual Status PrepareLoad(std::span<const BlockKey> keys, std::vector<SlotId>* slots) = 0;
  // Unpins keys pinned by PrepareLoad. FailedPrecondition (and no change) if any key is not
  // stored or not pinned (as many times as it appears).
  virtual Status CompleteLoad(std::span<const BlockKey> keys) = 0;
  // Marks the stored keys as recently used, the first key most recent. Absent keys are
  // ignored (ARC: a key in a ghost list adapts the T1 target). `kind`: AF-LRU counts a kUse as
  // one more request using each key and a kRefresh as none.
  virtual void Touch(std::span<const BlockKey> keys, TouchKind kind) = 0;
  void Touch(std::span<const BlockKey> keys) { Touch(keys, TouchKind::kUse); }

  // Reserves slots for the keys that are neither stored nor being written (duplicates once),
  // evicting idle blocks if needed; never evicts a key of this call (that passed the reuse
  // filter), a pinned block or one being written. ResourceExhausted, with no change at all, if it
  // cannot make room. With the reuse filter on, keys seen fewer than `store_threshold` times are
  // dropped first. With quotas, a namespace the new keys would take past its ceiling makes room
  // by evicting its own least recently used idle blocks first (listed in `evicted` after the
  // policy's victims); when too few are idle the whole call is refused, like a full tier
  // (ResourceExhausted, no change, plan->quota_namespace and quota_refused set).
  // `hints`: none (every key kNormal), or one per key; a key stored as kSpare waits apart and
  // is evicted first (StoreHint).
  virtual Status PrepareStore(std::span<const BlockKey> keys, StorePlan* plan,
                              std::span<const StoreHint> hints) = 0;
  Status PrepareStore(std::span<const BlockKey> keys, StorePlan* plan) {
    return PrepareStore(keys, plan, {});
  }
  // success: keys being written become readable (one stored event for them). Failure: keys
  // being written are dropped and their slots freed. Keys already readable, or absent, are
  // ignored either way.
  virtual void CompleteStore(std::span<const BlockKey> keys, bool success) = 0;

  // Drops the keys that are stored, readable and not pinned (a corrupt record, an explicit
  // delete) and frees their slots; no ghost is kept. Absent, pinned and being-written keys are
  // skipped. Returns how many were dropped (one removed event for them) and, when `removed` is
  // given, appends them to it.
  virtual size_t Remove(std::span<const BlockKey> keys,
                        std::vector<BlockKey>* removed = nullptr) = 0;
  // Rebuilds the index of a persistent tier after a restart: on a manager that has not stored
  // anything since it was created or Reset, inserts each block as readable and idle at the
  // given slot, the first least recent. InvalidArgument, and no change, for a slot outside the
  // capacity, a slot or key given twice, or a manager already in use. No events. A namespace
  // restored past its quota keeps its blocks; its next store evicts it down to the quota.
  virtual Status Restore(std::span<const BlockInfo> blocks) = 0;

  // Drains the events recorded since the last call (empty when events are disabled).
  virtual std::vector<OffloadEvent> TakeEvents() = 0;
  // The same into `log`, whose old contents are dropped and whose memory the manager keeps
  // for the next events: a drain that allocates nothing once the buffers have grown.
  virtual void TakeEvents(OffloadEventLog* log) = 0;
  // Drops every block, whatever its state, and every ghost; slots are handed out from 0 again.
  // The reuse tracker and undrained events are kept.
  virtual void Reset() = 0;

  virtual size_t capacity() const = 0;
  virtual size_t resident_blocks() const = 0;
  // With quotas or count_namespaces: every namespace that holds blocks or has a named quota, by
  // id. Empty otherwise. O(namespaces).
  virtual std::vector<NamespaceUsage> NamespaceUsages() const = 0;
  // Bytes of memory held by the manager's own structures.
  virtual size_t MetadataBytes() const = 0;
  virtual BlockManagerState DebugState() const = 0;
  virtual EvictionPolicy policy() const = 0;
  virtual PolicySizes policy_sizes() const = 0;
  virtual AdmissionState admission() const = 0;
  // Tests: sets ARC's p. FailedPrecondition under LRU, InvalidArgument outside [0, capacity].
  virtual Status SetArcTargetForTesting(double target) = 0;
};

}  // namespace kvstash::store
