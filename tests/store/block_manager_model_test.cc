// Randomized model test of BlockManager: every operation runs on the real manager and on a slow,
// obviously-correct model written from the specification (docs/semantics.md
// §1-§4a and §7.4, plus the kvstash rules listed below), and the two must agree after every step:
// return values, plans, slots, scan results, events and the full DebugState.
//
// AF-LRU (§4a) is kvstash's own: the model keeps every block's class and last-touch clock and
// picks each victim by scanning the three class lists, as the rule is written.
//
// kvstash rules the model follows on top of vLLM's (docs/semantics.md §10):
//  * ARC eviction: when T1 is skipped because vT1 < int(p) and T2 has no eligible block, fall
//    back to scanning T1 (vLLM would refuse); a block taken from T1 this way decrements vT1.
//  * PrepareStore de-duplicates keys (first occurrence wins); protected = every key of the call
//    that passed the reuse filter. A store that cannot make room is ResourceExhausted and
//    changes nothing.
//  * PrepareLoad of an absent or in-flight key, and CompleteLoad of a key that is absent or not
//    pinned as many times as it appears, are FailedPrecondition and change nothing.
//  * Lookups never change recency; with store_threshold >= 2 every per-key lookup (including
//    those inside the prefix/window scans) counts in the bounded reuse tracker.
//  * Slots: fresh ids first, then freed slots LIFO. Reset drops blocks, ghosts, p, the fresh
//    counter and the free stack, and keeps the tracker and undrained events.
//
// The model is deliberately naive: std::vector lists in recency order, linear scans.
//
// On a mismatch the test prints the seed, the op index, the tail of the op log and a shrunken
// op sequence that still reproduces a mismatch.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <iterator>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "ghost_ring.h"
#include "gtest/gtest.h"
#include "kvstash/common/block_key.h"
#include "kvstash/common/hash.h"
#include "kvstash/common/status.h"
#include "kvstash/store/block_manager.h"

namespace kvstash::store {
namespace {

// ------------------------------------------------------------------------------------------
// Keys and printing
// ------------------------------------------------------------------------------------------

using KeyId = uint64_t;

// Key i: small readable id in hash.lo, the rest spread so keys look like real hashes.
BlockKey MakeKey(KeyId id) {
  BlockKey key;
  key.hash.lo = id;
  key.hash.hi = Mix64(id + 0x1234);
  key.group = static_cast<uint32_t>(id % 3);
  key.namespace_id = 7;
  return key;
}

KeyId IdOf(const BlockKey& key) { return key.hash.lo; }

std::vector<BlockKey> MakeKeys(const std::vector<KeyId>& ids) {
  std::vector<BlockKey> keys;
  for (KeyId id : ids) keys.push_back(MakeKey(id));
  return keys;
}

// "[a,b,c]", each element printed as `show(element)` gives it.
template <typename T, typename Show>
std::string ListStr(const std::vector<T>& items, Show show) {
  std::ostringstream out;
  out << "[";
  for (size_t i = 0; i < items.size(); ++i) out << (i ? "," : "") << show(items[i]);
  out << "]";
  return out.str();
}

std::string IdsStr(const std::vector<KeyId>& ids) {
  return ListStr(ids, [](KeyId id) { return id; });
}

std::string KeysStr(const std::vector<BlockKey>& keys) {
  return ListStr(keys, [](const BlockKey& k) { return IdOf(k); });
}

std::string SlotsStr(const std::vector<SlotId>& slots) {
  return ListStr(slots, [](SlotId slot) { return slot; });
}

// (key,slot,ref) triples, least recent first.
std::string BlocksStr(const std::vector<BlockInfo>& blocks) {
  std::ostringstream out;
  out << "[";
  for (size_t i = 0; i < blocks.size(); ++i) {
    out << (i ? " " : "") << "(" << IdOf(blocks[i].key) << "," << blocks[i].slot << ","
        << blocks[i].ref_count << ")";
  }
  out << "]";
  return out.str();
}

std::string StateStr(const BlockManagerState& s) {
  std::ostringstream out;
  out.precision(17);
  if (s.policy == EvictionPolicy::kAfLru) {
    out << "AFLRU clock=" << s.af_clock;
    for (size_t k = 0; k < 3; ++k) {
      out << " c" << k + 1 << "=" << BlocksStr(s.af[k]) << "@"
          << ListStr(s.af_touched[k], [](uint64_t t) { return t; });
    }
    out << " ghosts=" << ListStr(s.af_ghosts, [](uint32_t g) { return g; })
        << " spare=" << BlocksStr(s.spare) << " free=" << SlotsStr(s.free_slots)
        << " fresh=" << s.fresh_slots_used;
    return out.str();
  }
  out << (s.policy == EvictionPolicy::kLru ? "LRU" : "ARC") << " lru=" << BlocksStr(s.lru)
      << " t1=" << BlocksStr(s.t1) << " t2=" << BlocksStr(s.t2) << " b1=" << KeysStr(s.b1)
      << " b2=" << KeysStr(s.b2) << " p=" << s.arc_target << " spare=" << BlocksStr(s.spare)
      << " free=" << SlotsStr(s.free_slots) << " fresh=" << s.fresh_slots_used;
  return out.str();
}

bool StatesEqual(const BlockManagerState& a, const BlockManagerState& b) {
  for (size_t k = 0; k < 3; ++k) {
    if (a.af[k] != b.af[k] || a.af_touched[k] != b.af_touched[k]) return false;
  }
  return a.policy == b.policy && a.lru == b.lru && a.t1 == b.t1 && a.t2 == b.t2 && a.b1 == b.b1 &&
         a.b2 == b.b2 && a.arc_target == b.arc_target && a.free_slots == b.free_slots &&
         a.fresh_slots_used == b.fresh_slots_used && a.af_clock == b.af_clock &&
         a.af_ghosts == b.af_ghosts && a.spare == b.spare;
}

std::string EventsStr(const std::vector<OffloadEvent>& events) {
  std::ostringstream out;
  out << "[";
  for (size_t i = 0; i < events.size(); ++i) {
    out << (i ? " " : "") << (events[i].kind == OffloadEvent::Kind::kStored ? "stored" : "removed")
        << KeysStr(events[i].keys);
  }
  out << "]";
  return out.str();
}

std::string LookupStr(LookupResult r) {
  switch (r) {
    case LookupResult::kMiss:
      return "MISS";
    case LookupResult::kHit:
      return "HIT";
    case LookupResult::kRetry:
      return "RETRY";
  }
  return "?";
}

std::string ScanStr(const ScanResult& r) { return r ? std::to_string(*r) : "retry"; }

std::string CodeStr(const Status& s) { return std::string(StatusCodeName(s.code())); }

std::string PlanStr(const StorePlan& plan) {
  return "store=" + KeysStr(plan.keys_to_store) + " slots=" + SlotsStr(plan.slots) +
         " evicted=" + KeysStr(plan.evicted);
}

// ------------------------------------------------------------------------------------------
// The model
// ------------------------------------------------------------------------------------------

// What a run exercised, counted by the model (to make sure the generator reaches the
// interesting cases; asserted at the end of the random tests).
struct Coverage {
  size_t evictions = 0;           // PrepareStore calls that evicted
  size_t refused_stores = 0;      // ResourceExhausted
  size_t arc_t2_evictions = 0;    // blocks evicted from T2
  size_t arc_t1_fallbacks = 0;    // kvstash's T1 fallback after T2 had nothing
  size_t arc_b1_hits = 0;         // Touch of a B1 ghost
  size_t arc_b2_hits = 0;         // Touch of a B2 ghost
  size_t ghost_trims = 0;         // ghosts dropped by the trim
  size_t ghost_reinserts = 0;     // stores of a ghost key
  size_t lifo_reuses = 0;         // slots popped from the free stack
  size_t dedup_stores = 0;        // PrepareStore calls with a repeated new key
  size_t failed_loads = 0;        // PrepareLoad/CompleteLoad FailedPrecondition
  size_t failed_store_frees = 0;  // blocks dropped by CompleteStore(false)
  size_t retries = 0;             // lookups answering RETRY
  size_t tracker_drops = 0;       // reuse-tracker entries dropped
  size_t filtered_keys = 0;       // keys the reuse filter removed
  size_t af_promotions = 0;       // AF-LRU: a use moved a block up a class
  size_t af_upper_evictions = 0;  // AF-LRU: victims of class 2 or 3
  size_t af_ghost_reinserts = 0;  // AF-LRU: stores that found their key's ghost
  size_t af_refreshes = 0;        // AF-LRU: resident keys touched without a use counted
  size_t spare_evictions = 0;     // spare blocks evicted
  size_t spare_uses = 0;          // spare blocks handed to the policy by a use

  void Add(const Coverage& o) {
    evictions += o.evictions;
    refused_stores += o.refused_stores;
    arc_t2_evictions += o.arc_t2_evictions;
    arc_t1_fallbacks += o.arc_t1_fallbacks;
    arc_b1_hits += o.arc_b1_hits;
    arc_b2_hits += o.arc_b2_hits;
    ghost_trims += o.ghost_trims;
    ghost_reinserts += o.ghost_reinserts;
    lifo_reuses += o.lifo_reuses;
    dedup_stores += o.dedup_stores;
    failed_loads += o.failed_loads;
    failed_store_frees += o.failed_store_frees;
    retries += o.retries;
    tracker_drops += o.tracker_drops;
    filtered_keys += o.filtered_keys;
    af_promotions += o.af_promotions;
    af_upper_evictions += o.af_upper_evictions;
    af_ghost_reinserts += o.af_ghost_reinserts;
    af_refreshes += o.af_refreshes;
    spare_evictions += o.spare_evictions;
    spare_uses += o.spare_uses;
  }
};

class Model {
 public:
  struct Block {
    BlockKey key;
    SlotId slot;
    int32_t ref;           // -1 being written, 0 idle, k > 0 pinned by k loads
    uint64_t touched = 0;  // AF-LRU: the clock at its last touch or store
  };
  // AF-LRU's memory of an evicted block: the fingerprint and class it left with, and which
  // push made it (the ring keeps what the last 2 x capacity pushes left).
  struct Ghost {
    uint64_t push;
    uint32_t fingerprint;
    uint32_t cls;
    BlockKey key;  // for the generator only: the manager keeps no keys
  };
  using List = std::vector<Block>;  // least recent first

  explicit Model(const BlockManagerOptions& options)
      : policy_(options.policy),
        capacity_(options.capacity_blocks),
        threshold_(options.store_threshold),
        tracker_max_(options.max_tracker_size),
        events_on_(options.enable_events) {}

  // ---- lookups ----

  LookupResult Lookup(const BlockKey& key) {
    Track(key);
    const Block* block = Find(key);
    if (block == nullptr) return LookupResult::kMiss;
    if (block->ref < 0) {
      ++coverage_.retries;
      return LookupResult::kRetry;
    }
    return LookupResult::kHit;
  }

  // §7.4 maximal_prefix: left to right; RETRY counts as a hit but defers; a miss stops.
  ScanResult LookupPrefix(const std::vector<BlockKey>& keys) {
    bool defer = false;
    size_t count = 0;
    for (const BlockKey& key : keys) {
      LookupResult r = Lookup(key);
      if (r == LookupResult::kMiss) break;
      if (r == LookupResult::kRetry) defer = true;
      ++count;
    }
    if (defer) return std::nullopt;
    return count;
  }

  // §7.4 sliding_window: right to left; RETRY defers and breaks the run; a full window returns
  // its exclusive end (nullopt if deferred); otherwise the run reaching index 0.
  ScanResult LookupWindow(const std::vector<BlockKey>& keys, size_t window) {
    if (window == 0) window = 1;
    bool defer = false;
    size_t run = 0;
    for (size_t idx = keys.size(); idx-- > 0;) {
      LookupResult r = Lookup(keys[idx]);
      if (r == LookupResult::kHit) {
        ++run;
        if (run == window) {
          if (defer) return std::nullopt;
          return idx + window;
        }
      } else {
        if (r == LookupResult::kRetry) defer = true;
        run = 0;
      }
    }
    if (defer) return std::nullopt;
    return run;
  }

  // ---- loads ----

  Status PrepareLoad(const std::vector<BlockKey>& keys, std::vector<SlotId>* slots) {
    for (const BlockKey& key : keys) {
      const Block* block = Find(key);
      if (block == nullptr || block->ref < 0) {
        ++coverage_.failed_loads;
        return Status(StatusCode::kFailedPrecondition, "model: not loadable");
      }
    }
    slots->clear();
    for (const BlockKey& key : keys) {
      Block* block = Find(key);
      block->ref += 1;
      slots->push_back(block->slot);
    }
    return Status::OK();
  }

  Status CompleteLoad(const std::vector<BlockKey>& keys) {
    for (const BlockKey& key : keys) {
      const Block* block = Find(key);
      int32_t needed = static_cast<int32_t>(std::count(keys.begin(), keys.end(), key));
      if (block == nullptr || block->ref < needed) {
        ++coverage_.failed_loads;
        return Status(StatusCode::kFailedPrecondition, "model: not pinned");
      }
    }
    for (const BlockKey& key : keys) Find(key)->ref -= 1;
    return Status::OK();
  }

  // ---- touch ----

  void Touch(const std::vector<BlockKey>& keys, TouchKind kind) {
    for (size_t i = keys.size(); i-- > 0;) {
      const BlockKey& key = keys[i];
      // §4b: a spare block is the policy's only once used; any other touch keeps it spare.
      if (std::optional<size_t> at = IndexIn(spare_, key)) {
        Block block = spare_[*at];
        spare_.erase(spare_.begin() + static_cast<std::ptrdiff_t>(*at));
        if (kind == TouchKind::kUse && block.ref >= 0) {
          ++coverage_.spare_uses;
          PolicyInsert(block);
        } else {
          spare_.push_back(block);
        }
        continue;
      }
      if (policy_ == EvictionPolicy::kAfLru) {
        // §4a: every key advances the clock; a held key moves to the MRU end of its class,
        // one class up (at most 3) for a use of a block that is not being written.
        ++clock_;
        for (size_t k = 0; k < 3; ++k) {
          std::optional<size_t> at = IndexIn(af_[k], key);
          if (!at) continue;
          Block block = af_[k][*at];
          af_[k].erase(af_[k].begin() + static_cast<std::ptrdiff_t>(*at));
          block.touched = clock_;
          const bool use = kind == TouchKind::kUse && block.ref >= 0 && k < 2;
          if (use) {
            ++coverage_.af_promotions;
          } else if (kind == TouchKind::kRefresh) {
            ++coverage_.af_refreshes;
          }
          af_[use ? k + 1 : k].push_back(block);
          break;
        }
        continue;
      }
      if (policy_ == EvictionPolicy::kLru) {
        // §3: a present key moves to MRU; absent keys are ignored.
        std::optional<size_t> at = IndexIn(lru_, key);
        if (at) MoveToBack(lru_, *at);
        continue;
      }
      // §4 touch.
      if (std::optional<size_t> at = IndexIn(t1_, key)) {
        Block block = t1_[*at];
        t1_.erase(t1_.begin() + static_cast<std::ptrdiff_t>(*at));
        if (block.ref < 0) {
          t1_.push_back(block);  // not ready: not a real second access
        } else {
          t2_.push_back(block);  // promotion
        }
      } else if (std::optional<size_t> at2 = IndexIn(t2_, key)) {
        MoveToBack(t2_, *at2);
      } else if (std::optional<size_t> g1 = GhostIndex(b1_, key)) {
        double delta =
            std::max(1.0, static_cast<double>(b2_.size()) / static_cast<double>(b1_.size()));
        p_ = std::min(p_ + delta, static_cast<double>(capacity_));
        ++coverage_.arc_b1_hits;
        BlockKey ghost = b1_[*g1];
        b1_.erase(b1_.begin() + static_cast<std::ptrdiff_t>(*g1));
        b1_.push_back(ghost);
      } else if (std::optional<size_t> g2 = GhostIndex(b2_, key)) {
        double delta =
            std::max(1.0, static_cast<double>(b1_.size()) / static_cast<double>(b2_.size()));
        p_ = std::max(p_ - delta, 0.0);
        ++coverage_.arc_b2_hits;
        BlockKey ghost = b2_[*g2];
        b2_.erase(b2_.begin() + static_cast<std::ptrdiff_t>(*g2));
        b2_.push_back(ghost);
      }
    }
  }

  // ---- stores ----

  // The keys of a PrepareStore call that pass the reuse filter (all of them when it is off).
  std::vector<BlockKey> Filtered(const std::vector<BlockKey>& keys) const {
    if (threshold_ < 2) return keys;
    std::vector<BlockKey> out;
    for (const BlockKey& key : keys) {
      if (TrackerCount(key) >= threshold_) out.push_back(key);
    }
    return out;
  }

  Status PrepareStore(const std::vector<BlockKey>& keys, StorePlan* plan,
                      const std::vector<bool>& spare_hints) {
    // 1. reuse filter; 2. keys neither stored nor in flight, once each, in call order, each
    // with the hint given with its first occurrence.
    std::vector<BlockKey> filtered = Filtered(keys);
    std::vector<BlockKey> to_store;
    std::vector<bool> spare;
    for (const BlockKey& key : filtered) {
      if (Find(key) != nullptr) continue;
      if (std::find(to_store.begin(), to_store.end(), key) != to_store.end()) {
        ++coverage_.dedup_stores;
        continue;
      }
      to_store.push_back(key);
      const size_t at =
          static_cast<size_t>(std::find(keys.begin(), keys.end(), key) - keys.begin());
      spare.push_back(at < spare_hints.size() && spare_hints[at]);
    }
    coverage_.filtered_keys += keys.size() - filtered.size();
    *plan = StorePlan{};
    // 3. nothing to store: no eviction.
    if (to_store.empty()) return Status::OK();
    // 4. evict what does not fit.
    size_t free_count = free_slots_.size() + (capacity_ - fresh_used_);
    std::vector<BlockKey> evicted;
    if (to_store.size() > free_count) {
      size_t need = to_store.size() - free_count;
      std::set<BlockKey> protected_keys(filtered.begin(), filtered.end());
      // §4b: spare blocks first, least recent first; then the policy for the rest. All or
      // nothing: a policy that cannot find the rest undoes the spare victims.
      const List spare_before = spare_;
      const std::vector<SlotId> free_before = free_slots_;
      std::vector<BlockKey> spare_victims;
      while (spare_victims.size() < need) {
        std::optional<size_t> at = ScanEligible(spare_, protected_keys, {});
        if (!at) break;
        spare_victims.push_back(spare_[*at].key);
        free_slots_.push_back(spare_[*at].slot);
        spare_.erase(spare_.begin() + static_cast<std::ptrdiff_t>(*at));
      }
      const size_t rest = need - spare_victims.size();
      std::optional<std::vector<BlockKey>> victims =
          rest == 0                         ? std::vector<BlockKey>()
          : policy_ == EvictionPolicy::kLru ? LruEvict(rest, protected_keys)
          : policy_ == EvictionPolicy::kArc ? ArcEvict(rest, protected_keys)
                                            : AfEvict(rest, protected_keys);
      if (!victims) {
        spare_ = spare_before;
        free_slots_ = free_before;
        ++coverage_.refused_stores;
        return Status(StatusCode::kResourceExhausted, "model: no room");
      }
      ++coverage_.evictions;
      coverage_.spare_evictions += spare_victims.size();
      evicted = spare_victims;
      evicted.insert(evicted.end(), victims->begin(), victims->end());
      if (events_on_) events_.push_back(OffloadEvent{OffloadEvent::Kind::kRemoved, evicted});
    }
    // 5. allocate (fresh first, then LIFO) and insert at MRU (ARC: T1, leaving the ghosts; a
    // spare block: the spare list, which the policy does not see).
    for (size_t i = 0; i < to_store.size(); ++i) {
      const BlockKey& key = to_store[i];
      SlotId slot;
      if (fresh_used_ < capacity_) {
        slot = static_cast<SlotId>(fresh_used_++);
      } else {
        slot = free_slots_.back();
        free_slots_.pop_back();
        ++coverage_.lifo_reuses;
      }
      Block block{key, slot, -1};
      if (spare[i]) {
        spare_.push_back(block);
      } else {
        PolicyInsert(block);
      }
      plan->keys_to_store.push_back(key);
      plan->slots.push_back(slot);
    }
    plan->evicted = evicted;
    return Status::OK();
  }

  // A block enters the policy's order: new, or a spare block used (§4b).
  void PolicyInsert(Block block) {
    const BlockKey key = block.key;
    {
      if (policy_ == EvictionPolicy::kLru) {
        lru_.push_back(block);
      } else if (policy_ == EvictionPolicy::kAfLru) {
        // §4a: class 1, or one above the class its ghost remembers (at most 3).
        size_t cls = 1;
        const uint32_t fp = GhostRing::Fingerprint(key);
        for (size_t g = 0; g < ghosts_.size(); ++g) {
          if (ghosts_[g].fingerprint != fp) continue;
          cls = std::min<size_t>(3, ghosts_[g].cls + 1);
          ghosts_.erase(ghosts_.begin() + static_cast<std::ptrdiff_t>(g));
          ++coverage_.af_ghost_reinserts;
          break;
        }
        block.touched = ++clock_;
        af_[cls - 1].push_back(block);
      } else {
        t1_.push_back(block);
        if (GhostIndex(b1_, key) || GhostIndex(b2_, key)) ++coverage_.ghost_reinserts;
        EraseGhost(b1_, key);
        EraseGhost(b2_, key);
      }
    }
  }

  void CompleteStore(const std::vector<BlockKey>& keys, bool success) {
    if (success) {
      std::vector<BlockKey> stored;
      for (const BlockKey& key : keys) {
        Block* block = Find(key);
        if (block != nullptr && block->ref < 0) {
          block->ref = 0;
          stored.push_back(key);
        }
      }
      if (events_on_ && !stored.empty()) {
        events_.push_back(OffloadEvent{OffloadEvent::Kind::kStored, stored});
      }
      return;
    }
    for (const BlockKey& key : keys) {
      for (List* list : Lists()) {
        std::optional<size_t> at = IndexIn(*list, key);
        if (at && (*list)[*at].ref < 0) {
          free_slots_.push_back((*list)[*at].slot);
          list->erase(list->begin() + static_cast<std::ptrdiff_t>(*at));
          ++coverage_.failed_store_frees;
        }
      }
    }
  }

  std::vector<OffloadEvent> TakeEvents() {
    std::vector<OffloadEvent> out;
    out.swap(events_);
    return out;
  }

  void Reset() {
    spare_.clear();
    for (List& list : af_) list.clear();
    ghosts_.clear();
    clock_ = 0;
    lru_.clear();
    t1_.clear();
    t2_.clear();
    b1_.clear();
    b2_.clear();
    p_ = 0.0;
    free_slots_.clear();
    fresh_used_ = 0;
  }

  Status SetArcTarget(double target) {
    if (policy_ != EvictionPolicy::kArc) {
      return Status(StatusCode::kFailedPrecondition, "model: not ARC");
    }
    if (!(target >= 0.0 && target <= static_cast<double>(capacity_))) {
      return Status(StatusCode::kInvalidArgument, "model: out of range");
    }
    p_ = target;
    return Status::OK();
  }

  BlockManagerState State() const {
    BlockManagerState s;
    s.policy = policy_;
    if (policy_ == EvictionPolicy::kLru) {
      s.lru = Infos(lru_);
    } else if (policy_ == EvictionPolicy::kAfLru) {
      for (size_t k = 0; k < 3; ++k) {
        s.af[k] = Infos(af_[k]);
        for (const Block& b : af_[k]) s.af_touched[k].push_back(b.touched);
      }
      s.af_clock = clock_;
      for (const Ghost& g : ghosts_) s.af_ghosts.push_back(g.fingerprint << 2 | g.cls);
    } else {
      s.t1 = Infos(t1_);
      s.t2 = Infos(t2_);
      s.b1 = b1_;
      s.b2 = b2_;
      s.arc_target = p_;
    }
    s.spare = Infos(spare_);
    s.free_slots = free_slots_;
    s.fresh_slots_used = fresh_used_;
    return s;
  }

  // ---- read access for the generator ----

  const Block* Find(const BlockKey& key) const {
    for (const List* list : Lists()) {
      if (std::optional<size_t> at = IndexIn(*list, key)) return &(*list)[*at];
    }
    return nullptr;
  }

  std::vector<Block> AllBlocks() const {
    std::vector<Block> out;
    for (const List* list : Lists()) out.insert(out.end(), list->begin(), list->end());
    return out;
  }

  const Coverage& coverage() const { return coverage_; }

  std::vector<BlockKey> Ghosts() const {
    if (policy_ == EvictionPolicy::kAfLru) {
      std::vector<BlockKey> out;
      for (const Ghost& g : ghosts_) out.push_back(g.key);
      return out;
    }
    std::vector<BlockKey> out = b1_;
    out.insert(out.end(), b2_.begin(), b2_.end());
    return out;
  }

 private:
  static std::optional<size_t> IndexIn(const List& list, const BlockKey& key) {
    for (size_t i = 0; i < list.size(); ++i) {
      if (list[i].key == key) return i;
    }
    return std::nullopt;
  }

  static std::optional<size_t> GhostIndex(const std::vector<BlockKey>& ghosts,
                                          const BlockKey& key) {
    for (size_t i = 0; i < ghosts.size(); ++i) {
      if (ghosts[i] == key) return i;
    }
    return std::nullopt;
  }

  static void EraseGhost(std::vector<BlockKey>& ghosts, const BlockKey& key) {
    ghosts.erase(std::remove(ghosts.begin(), ghosts.end(), key), ghosts.end());
  }

  static void MoveToBack(List& list, size_t at) {
    Block block = list[at];
    list.erase(list.begin() + static_cast<std::ptrdiff_t>(at));
    list.push_back(block);
  }

  static std::vector<BlockInfo> Infos(const List& list) {
    std::vector<BlockInfo> out;
    for (const Block& b : list) out.push_back(BlockInfo{b.key, b.slot, b.ref});
    return out;
  }

  std::vector<List*> Lists() {
    if (policy_ == EvictionPolicy::kLru) return {&lru_, &spare_};
    if (policy_ == EvictionPolicy::kAfLru) return {&af_[0], &af_[1], &af_[2], &spare_};
    return {&t1_, &t2_, &spare_};
  }
  std::vector<const List*> Lists() const {
    if (policy_ == EvictionPolicy::kLru) return {&lru_, &spare_};
    if (policy_ == EvictionPolicy::kAfLru) return {&af_[0], &af_[1], &af_[2], &spare_};
    return {&t1_, &t2_, &spare_};
  }

  Block* Find(const BlockKey& key) {
    return const_cast<Block*>(static_cast<const Model*>(this)->Find(key));
  }

  // The first block of `list` from the LRU end that is idle, not protected, not yet chosen.
  static std::optional<size_t> ScanEligible(const List& list,
                                            const std::set<BlockKey>& protected_keys,
                                            const std::set<BlockKey>& selected) {
    for (size_t i = 0; i < list.size(); ++i) {
      const Block& b = list[i];
      if (b.ref != 0) continue;
      if (protected_keys.count(b.key) != 0) continue;
      if (selected.count(b.key) != 0) continue;
      return i;
    }
    return std::nullopt;
  }

  // §3 evict: scan from LRU, collect n eligible, all or nothing; frees their slots in order.
  std::optional<std::vector<BlockKey>> LruEvict(size_t n,
                                                const std::set<BlockKey>& protected_keys) {
    std::set<BlockKey> selected;
    std::vector<BlockKey> chosen;
    while (chosen.size() < n) {
      std::optional<size_t> at = ScanEligible(lru_, protected_keys, selected);
      if (!at) return std::nullopt;
      chosen.push_back(lru_[*at].key);
      selected.insert(lru_[*at].key);
    }
    for (const BlockKey& key : chosen) {
      size_t at = *IndexIn(lru_, key);
      free_slots_.push_back(lru_[at].slot);
      lru_.erase(lru_.begin() + static_cast<std::ptrdiff_t>(at));
    }
    return chosen;
  }

  // §4 evict with the kvstash T1 fallback; commit appends to the ghosts, then trims them.
  std::optional<std::vector<BlockKey>> ArcEvict(size_t n,
                                                const std::set<BlockKey>& protected_keys) {
    size_t virtual_t1 = t1_.size();
    const int64_t target = static_cast<int64_t>(p_);  // int(p): truncation toward zero
    std::set<BlockKey> selected;
    std::vector<std::pair<BlockKey, bool>> chosen;  // (key, from T1)
    size_t fallbacks = 0;
    for (size_t i = 0; i < n; ++i) {
      bool found = false;
      bool t1_skipped = static_cast<int64_t>(virtual_t1) < target;
      if (!t1_skipped) {
        if (std::optional<size_t> at = ScanEligible(t1_, protected_keys, selected)) {
          chosen.emplace_back(t1_[*at].key, true);
          selected.insert(t1_[*at].key);
          --virtual_t1;
          found = true;
        }
      }
      if (!found) {
        if (std::optional<size_t> at = ScanEligible(t2_, protected_keys, selected)) {
          chosen.emplace_back(t2_[*at].key, false);
          selected.insert(t2_[*at].key);
          found = true;
        }
      }
      if (!found && t1_skipped) {  // kvstash: T2 had nothing, fall back to T1
        if (std::optional<size_t> at = ScanEligible(t1_, protected_keys, selected)) {
          chosen.emplace_back(t1_[*at].key, true);
          selected.insert(t1_[*at].key);
          --virtual_t1;
          found = true;
          ++fallbacks;
        }
      }
      if (!found) return std::nullopt;
    }
    coverage_.arc_t1_fallbacks += fallbacks;
    std::vector<BlockKey> out;
    for (const auto& [key, from_t1] : chosen) {
      if (!from_t1) ++coverage_.arc_t2_evictions;
      List& list = from_t1 ? t1_ : t2_;
      size_t at = *IndexIn(list, key);
      free_slots_.push_back(list[at].slot);
      list.erase(list.begin() + static_cast<std::ptrdiff_t>(at));
      (from_t1 ? b1_ : b2_).push_back(key);
      out.push_back(key);
    }
    while (b1_.size() > capacity_) {
      b1_.erase(b1_.begin());
      ++coverage_.ghost_trims;
    }
    while (b2_.size() > capacity_) {
      b2_.erase(b2_.begin());
      ++coverage_.ghost_trims;
    }
    return out;
  }

  // §4a evict: each victim is the idle, unprotected block with the largest age x (6 / W[class]),
  // W = {1, 2, 3}, ties to the lower class (within a class the least recent is the oldest);
  // all or nothing; the victims become ghosts in choice order, each push dropping what the
  // ring's position held 2 x capacity pushes ago and any older ghost of its fingerprint.
  std::optional<std::vector<BlockKey>> AfEvict(size_t n, const std::set<BlockKey>& protected_keys) {
    static constexpr uint64_t kWeight[3] = {6, 3, 2};
    std::set<BlockKey> selected;
    std::vector<std::pair<BlockKey, size_t>> chosen;  // (key, class - 1)
    while (chosen.size() < n) {
      std::optional<std::pair<size_t, size_t>> best;  // (class - 1, index)
      uint64_t best_score = 0;
      for (size_t k = 0; k < 3; ++k) {
        for (size_t i = 0; i < af_[k].size(); ++i) {
          const Block& b = af_[k][i];
          if (b.ref != 0 || protected_keys.count(b.key) != 0 || selected.count(b.key) != 0) {
            continue;
          }
          const uint64_t score = (clock_ - b.touched) * kWeight[k];
          if (!best || score > best_score) {
            best = std::make_pair(k, i);
            best_score = score;
          }
        }
      }
      if (!best) return std::nullopt;
      const BlockKey key = af_[best->first][best->second].key;
      chosen.emplace_back(key, best->first);
      selected.insert(key);
    }
    std::vector<BlockKey> out;
    const uint64_t ring = 2 * capacity_;
    for (const auto& [key, k] : chosen) {
      if (k > 0) ++coverage_.af_upper_evictions;
      const size_t at = *IndexIn(af_[k], key);
      free_slots_.push_back(af_[k][at].slot);
      af_[k].erase(af_[k].begin() + static_cast<std::ptrdiff_t>(at));
      const uint32_t fp = GhostRing::Fingerprint(key);
      std::erase_if(ghosts_, [fp](const Ghost& g) { return g.fingerprint == fp; });
      ghosts_.push_back(Ghost{ghost_pushes_++, fp, static_cast<uint32_t>(k + 1), key});
      std::erase_if(ghosts_, [&](const Ghost& g) { return g.push + ring < ghost_pushes_; });
      out.push_back(key);
    }
    return out;
  }

  // ---- reuse tracker (§2 lookup step 1) ----

  void Track(const BlockKey& key) {
    if (threshold_ < 2) return;
    for (size_t i = 0; i < tracker_.size(); ++i) {
      if (tracker_[i].first == key) {
        auto entry = tracker_[i];
        entry.second += 1;
        tracker_.erase(tracker_.begin() + static_cast<std::ptrdiff_t>(i));
        tracker_.push_back(entry);
        return;
      }
    }
    if (tracker_.size() >= tracker_max_) {
      tracker_.erase(tracker_.begin());
      ++coverage_.tracker_drops;
    }
    tracker_.emplace_back(key, 1);
  }

  uint32_t TrackerCount(const BlockKey& key) const {
    for (const auto& [k, count] : tracker_) {
      if (k == key) return count;
    }
    return 0;
  }

  EvictionPolicy policy_;
  size_t capacity_;
  uint32_t threshold_;
  size_t tracker_max_;
  bool events_on_;

  List lru_;
  List t1_, t2_;
  List af_[3];  // AF-LRU: class k + 1, least recent first
  List spare_;  // §4b: blocks stored as StoreHint::kSpare, least recent first
  uint64_t clock_ = 0;
  std::vector<Ghost> ghosts_;  // oldest first
  uint64_t ghost_pushes_ = 0;
  std::vector<BlockKey> b1_, b2_;  // oldest first
  double p_ = 0.0;
  std::vector<SlotId> free_slots_;  // top of the stack at the back
  size_t fresh_used_ = 0;
  std::vector<std::pair<BlockKey, uint32_t>> tracker_;  // least recent first
  std::vector<OffloadEvent> events_;
  Coverage coverage_;
};

// ------------------------------------------------------------------------------------------
// Operations
// ------------------------------------------------------------------------------------------

enum class OpKind : uint8_t {
  kLookup,
  kLookupBatch,
  kLookupPrefix,
  kLookupWindow,
  kPrepareStore,
  kCompleteStore,
  kPrepareLoad,
  kCompleteLoad,
  kTouch,
  kReset,
  kSetArcTarget,
  kTakeEvents,
};

struct Op {
  OpKind kind = OpKind::kLookup;
  std::vector<KeyId> keys;
  bool success = true;      // CompleteStore
  size_t window = 1;        // LookupWindow
  double target = 0.0;      // SetArcTarget
  bool refresh = false;     // Touch: TouchKind::kRefresh
  std::vector<bool> spare;  // PrepareStore: none, or StoreHint::kSpare per key
};

std::string OpStr(const Op& op) {
  std::ostringstream out;
  out.precision(17);
  switch (op.kind) {
    case OpKind::kLookup:
      out << "Lookup(" << IdsStr(op.keys) << ")";
      break;
    case OpKind::kLookupBatch:
      out << "LookupBatch(" << IdsStr(op.keys) << ")";
      break;
    case OpKind::kLookupPrefix:
      out << "LookupPrefix(" << IdsStr(op.keys) << ")";
      break;
    case OpKind::kLookupWindow:
      out << "LookupWindow(" << IdsStr(op.keys) << ", window=" << op.window << ")";
      break;
    case OpKind::kPrepareStore:
      out << "PrepareStore(" << IdsStr(op.keys);
      if (!op.spare.empty()) {
        out << ", spare=" << ListStr(op.spare, [](bool spare) { return spare ? 1 : 0; });
      }
      out << ")";
      break;
    case OpKind::kCompleteStore:
      out << "CompleteStore(" << IdsStr(op.keys) << ", " << (op.success ? "true" : "false") << ")";
      break;
    case OpKind::kPrepareLoad:
      out << "PrepareLoad(" << IdsStr(op.keys) << ")";
      break;
    case OpKind::kCompleteLoad:
      out << "CompleteLoad(" << IdsStr(op.keys) << ")";
      break;
    case OpKind::kTouch:
      out << (op.refresh ? "Refresh(" : "Touch(") << IdsStr(op.keys) << ")";
      break;
    case OpKind::kReset:
      out << "Reset()";
      break;
    case OpKind::kSetArcTarget:
      out << "SetArcTargetForTesting(" << op.target << ")";
      break;
    case OpKind::kTakeEvents:
      out << "TakeEvents()";
      break;
  }
  return out.str();
}

struct Config {
  EvictionPolicy policy = EvictionPolicy::kLru;
  size_t capacity = 4;
  size_t num_keys = 8;
  uint32_t store_threshold = 0;
  size_t max_tracker_size = 64000;
  bool enable_events = true;
  uint32_t first_recency_stamp = 0;

  BlockManagerOptions Options() const {
    BlockManagerOptions o;
    o.capacity_blocks = capacity;
    o.policy = policy;
    o.store_threshold = store_threshold;
    o.max_tracker_size = max_tracker_size;
    o.enable_events = enable_events;
    o.first_recency_stamp = first_recency_stamp;
    return o;
  }

  std::string ToString() const {
    std::ostringstream out;
    out << "{policy=" << EvictionPolicyName(policy) << " capacity=" << capacity
        << " num_keys=" << num_keys << " store_threshold=" << store_threshold
        << " max_tracker_size=" << max_tracker_size
        << " enable_events=" << (enable_events ? "true" : "false")
        << " first_recency_stamp=" << first_recency_stamp << "}";
    return out.str();
  }
};

// ------------------------------------------------------------------------------------------
// Harness: runs each op on the manager and on the model, compares, checks invariants.
// ------------------------------------------------------------------------------------------

// Properties of any state, checked without the model.
std::optional<std::string> CheckStateInvariants(const BlockManagerState& s, size_t capacity,
                                                size_t resident_blocks) {
  std::vector<BlockInfo> blocks = s.lru;
  blocks.insert(blocks.end(), s.t1.begin(), s.t1.end());
  blocks.insert(blocks.end(), s.t2.begin(), s.t2.end());
  for (const std::vector<BlockInfo>& cls : s.af) {
    blocks.insert(blocks.end(), cls.begin(), cls.end());
  }
  // A spare block's key may still be one of ARC's ghosts: the policy does not see it (§4b).
  std::set<BlockKey> seen_by_policy;
  for (const BlockInfo& b : blocks) seen_by_policy.insert(b.key);
  blocks.insert(blocks.end(), s.spare.begin(), s.spare.end());
  if (blocks.size() > capacity) return "more resident blocks than capacity";
  if (blocks.size() != resident_blocks) return "resident_blocks() disagrees with DebugState";
  if (s.fresh_slots_used > capacity) return "fresh_slots_used above capacity";
  std::set<SlotId> slots;
  std::set<BlockKey> keys;
  for (const BlockInfo& b : blocks) {
    if (b.slot >= capacity) return "resident slot out of range";
    if (b.slot >= s.fresh_slots_used) return "resident slot was never handed out";
    if (!slots.insert(b.slot).second) return "two resident blocks share a slot";
    if (!keys.insert(b.key).second) return "a key is resident twice";
    if (b.ref_count < -1) return "ref_count below -1";
  }
  for (SlotId slot : s.free_slots) {
    if (slot >= s.fresh_slots_used) return "free slot was never handed out";
    if (!slots.insert(slot).second) return "free slot is also resident or free twice";
  }
  if (slots.size() != s.fresh_slots_used) return "a handed-out slot is neither resident nor free";
  if (s.b1.size() > capacity || s.b2.size() > capacity) return "ghost list above capacity";
  std::set<BlockKey> ghosts;
  for (const BlockKey& k : s.b1) {
    if (!ghosts.insert(k).second) return "duplicate ghost";
  }
  for (const BlockKey& k : s.b2) {
    if (!ghosts.insert(k).second) return "duplicate ghost";
  }
  for (const BlockKey& k : ghosts) {
    if (seen_by_policy.count(k) != 0) return "a resident key is also a ghost";
  }
  if (!(s.arc_target >= 0.0 && s.arc_target <= static_cast<double>(capacity))) {
    return "arc_target outside [0, capacity]";
  }
  return std::nullopt;
}

const BlockInfo* FindInfo(const BlockManagerState& s, const BlockKey& key) {
  for (const std::vector<BlockInfo>* list :
       {&s.lru, &s.t1, &s.t2, &s.af[0], &s.af[1], &s.af[2], &s.spare}) {
    for (const BlockInfo& b : *list) {
      if (b.key == key) return &b;
    }
  }
  return nullptr;
}

class Harness {
 public:
  explicit Harness(const Config& config) : config_(config), model_(config.Options()) {
    Result<std::unique_ptr<BlockManager>> created = BlockManager::Create(config.Options());
    if (created.ok()) impl_ = std::move(created).value();
  }

  bool created() const { return impl_ != nullptr; }
  const Model& model() const { return model_; }

  // Runs `op` on both sides. Returns a description of the first difference or broken invariant.
  std::optional<std::string> Step(const Op& op) {
    std::ostringstream diff;
    BlockManagerState before = impl_->DebugState();
    std::vector<BlockKey> keys = MakeKeys(op.keys);
    bool state_must_not_change = false;
    switch (op.kind) {
      case OpKind::kLookup: {
        LookupResult got = impl_->Lookup(keys.at(0));
        LookupResult want = model_.Lookup(keys.at(0));
        if (got != want) diff << "Lookup: got " << LookupStr(got) << ", want " << LookupStr(want);
        state_must_not_change = true;
        break;
      }
      case OpKind::kLookupBatch: {
        std::vector<LookupResult> got(keys.size(), LookupResult::kRetry);
        impl_->Lookup(std::span<const BlockKey>(keys), std::span<LookupResult>(got));
        for (size_t i = 0; i < keys.size(); ++i) {
          LookupResult want = model_.Lookup(keys[i]);
          if (got[i] != want) {
            diff << "LookupBatch[" << i << "]: got " << LookupStr(got[i]) << ", want "
                 << LookupStr(want) << "; ";
          }
        }
        state_must_not_change = true;
        break;
      }
      case OpKind::kLookupPrefix: {
        ScanResult got = impl_->LookupPrefix(keys);
        ScanResult want = model_.LookupPrefix(keys);
        if (got != want) {
          diff << "LookupPrefix: got " << ScanStr(got) << ", want " << ScanStr(want);
        }
        state_must_not_change = true;
        break;
      }
      case OpKind::kLookupWindow: {
        ScanResult got = impl_->LookupWindow(keys, op.window);
        ScanResult want = model_.LookupWindow(keys, op.window);
        if (got != want) {
          diff << "LookupWindow: got " << ScanStr(got) << ", want " << ScanStr(want);
        }
        state_must_not_change = true;
        break;
      }
      case OpKind::kPrepareStore: {
        std::vector<BlockKey> protected_keys = model_.Filtered(keys);
        std::vector<StoreHint> hints;
        for (bool spare : op.spare) hints.push_back(spare ? StoreHint::kSpare : StoreHint::kNormal);
        StorePlan got_plan;
        Status got = impl_->PrepareStore(keys, &got_plan, hints);
        StorePlan want_plan;
        Status want = model_.PrepareStore(keys, &want_plan, op.spare);
        if (got.code() != want.code()) {
          diff << "PrepareStore: got " << CodeStr(got) << ", want " << CodeStr(want);
          if (got.ok()) diff << " (got plan " << PlanStr(got_plan) << ")";
          if (want.ok()) diff << " (want plan " << PlanStr(want_plan) << ")";
        } else if (got.ok() &&
                   (got_plan.keys_to_store != want_plan.keys_to_store ||
                    got_plan.slots != want_plan.slots || got_plan.evicted != want_plan.evicted)) {
          diff << "PrepareStore plan: got " << PlanStr(got_plan) << ", want " << PlanStr(want_plan);
        }
        if (!got.ok()) {
          state_must_not_change = true;
        } else {
          if (got_plan.slots.size() != got_plan.keys_to_store.size()) {
            diff << " invariant: plan has " << got_plan.slots.size() << " slots for "
                 << got_plan.keys_to_store.size() << " keys;";
          }
          for (const BlockKey& victim : got_plan.evicted) {
            const BlockInfo* was = FindInfo(before, victim);
            if (was == nullptr) {
              diff << " invariant: evicted " << IdOf(victim) << " was not resident;";
            } else if (was->ref_count != 0) {
              diff << " invariant: evicted " << IdOf(victim) << " with ref_count " << was->ref_count
                   << ";";
            }
            if (std::find(protected_keys.begin(), protected_keys.end(), victim) !=
                protected_keys.end()) {
              diff << " invariant: evicted protected key " << IdOf(victim) << ";";
            }
          }
        }
        break;
      }
      case OpKind::kCompleteStore:
        impl_->CompleteStore(keys, op.success);
        model_.CompleteStore(keys, op.success);
        break;
      case OpKind::kPrepareLoad: {
        std::vector<SlotId> got_slots = {12345};  // "sets" the vector: junk must go
        Status got = impl_->PrepareLoad(keys, &got_slots);
        std::vector<SlotId> want_slots;
        Status want = model_.PrepareLoad(keys, &want_slots);
        if (got.code() != want.code()) {
          diff << "PrepareLoad: got " << CodeStr(got) << ", want " << CodeStr(want);
        } else if (got.ok() && got_slots != want_slots) {
          diff << "PrepareLoad slots: got " << SlotsStr(got_slots) << ", want "
               << SlotsStr(want_slots);
        }
        if (!got.ok()) state_must_not_change = true;
        break;
      }
      case OpKind::kCompleteLoad: {
        Status got = impl_->CompleteLoad(keys);
        Status want = model_.CompleteLoad(keys);
        if (got.code() != want.code()) {
          diff << "CompleteLoad: got " << CodeStr(got) << ", want " << CodeStr(want);
        }
        if (!got.ok()) state_must_not_change = true;
        break;
      }
      case OpKind::kTouch: {
        const TouchKind kind = op.refresh ? TouchKind::kRefresh : TouchKind::kUse;
        impl_->Touch(keys, kind);
        model_.Touch(keys, kind);
        break;
      }
      case OpKind::kReset:
        impl_->Reset();
        model_.Reset();
        break;
      case OpKind::kSetArcTarget: {
        Status got = impl_->SetArcTargetForTesting(op.target);
        Status want = model_.SetArcTarget(op.target);
        if (got.code() != want.code()) {
          diff << "SetArcTargetForTesting: got " << CodeStr(got) << ", want " << CodeStr(want);
        }
        if (!got.ok()) state_must_not_change = true;
        break;
      }
      case OpKind::kTakeEvents: {
        std::vector<OffloadEvent> got = impl_->TakeEvents();
        std::vector<OffloadEvent> want = model_.TakeEvents();
        if (got != want) {
          diff << "TakeEvents: got " << EventsStr(got) << ", want " << EventsStr(want);
        }
        break;
      }
    }

    BlockManagerState after = impl_->DebugState();
    BlockManagerState want_state = model_.State();
    if (!StatesEqual(after, want_state)) {
      diff << "\n  state: got  " << StateStr(after) << "\n         want " << StateStr(want_state);
    }
    if (state_must_not_change && !StatesEqual(before, after)) {
      diff << "\n  invariant: a refused or read-only call changed the state\n    before "
           << StateStr(before) << "\n    after  " << StateStr(after);
    }
    if (std::optional<std::string> broken =
            CheckStateInvariants(after, config_.capacity, impl_->resident_blocks())) {
      diff << "\n  invariant: " << *broken << " in " << StateStr(after);
    }
    if (impl_->capacity() != config_.capacity) diff << "\n  capacity() differs";
    std::string text = diff.str();
    if (text.empty()) return std::nullopt;
    return text;
  }

 private:
  Config config_;
  Model model_;
  std::unique_ptr<BlockManager> impl_;
};

// Replays `ops`; returns the index and description of the first mismatch, if any.
std::optional<std::pair<size_t, std::string>> Replay(const Config& config,
                                                     const std::vector<Op>& ops) {
  Harness h(config);
  for (size_t i = 0; i < ops.size(); ++i) {
    if (std::optional<std::string> diff = h.Step(ops[i])) return std::make_pair(i, *diff);
  }
  return std::nullopt;
}

// Greedy delta debugging: drops chunks of ops, then single keys, while some mismatch remains.
std::vector<Op> Shrink(const Config& config, std::vector<Op> ops) {
  auto fails = [&](const std::vector<Op>& candidate) {
    return Replay(config, candidate).has_value();
  };
  auto truncate = [&](std::vector<Op>& v) {
    if (auto failure = Replay(config, v)) v.resize(failure->first + 1);
  };
  truncate(ops);
  bool progress = true;
  for (int round = 0; progress && round < 8; ++round) {
    progress = false;
    for (size_t chunk = std::max<size_t>(1, ops.size() / 2);; chunk /= 2) {
      for (size_t i = 0; i + chunk <= ops.size();) {
        std::vector<Op> candidate = ops;
        candidate.erase(candidate.begin() + static_cast<std::ptrdiff_t>(i),
                        candidate.begin() + static_cast<std::ptrdiff_t>(i + chunk));
        if (fails(candidate)) {
          ops = std::move(candidate);
          truncate(ops);
          progress = true;
        } else {
          i += chunk;
        }
      }
      if (chunk <= 1) break;
    }
    for (size_t i = 0; i < ops.size(); ++i) {
      size_t min_keys = (ops[i].kind == OpKind::kLookup) ? 1 : 0;
      for (size_t j = 0; j < ops[i].keys.size() && ops[i].keys.size() > min_keys;) {
        std::vector<Op> candidate = ops;
        candidate[i].keys.erase(candidate[i].keys.begin() + static_cast<std::ptrdiff_t>(j));
        if (fails(candidate)) {
          ops = std::move(candidate);
          progress = true;
        } else {
          ++j;
        }
      }
    }
    truncate(ops);
  }
  return ops;
}

std::string OpsStr(const std::vector<Op>& ops, size_t from = 0) {
  std::ostringstream out;
  for (size_t i = from; i < ops.size(); ++i) out << "    #" << i << " " << OpStr(ops[i]) << "\n";
  return out.str();
}

// ------------------------------------------------------------------------------------------
// Random operation generator
// ------------------------------------------------------------------------------------------

class Generator {
 public:
  Generator(uint64_t seed, const Config& config) : rng_(seed), config_(config) {}

  Op Next(const Model& m) {
    std::vector<Model::Block> blocks = m.AllBlocks();
    std::vector<KeyId> resident, ready, in_flight, ghosts;
    std::vector<KeyId> pinned;  // one entry per pin
    for (const Model::Block& b : blocks) {
      resident.push_back(IdOf(b.key));
      if (b.ref < 0) in_flight.push_back(IdOf(b.key));
      if (b.ref >= 0) ready.push_back(IdOf(b.key));
      for (int32_t i = 0; i < b.ref; ++i) pinned.push_back(IdOf(b.key));
    }
    for (const BlockKey& k : m.Ghosts()) ghosts.push_back(IdOf(k));

    Op op;
    const bool arc = config_.policy == EvictionPolicy::kArc;
    // Weights, in per mille.
    int roll = Uniform(0, 999);
    auto take = [&roll](int weight) {
      bool hit = roll < weight;
      roll -= weight;
      return hit;
    };
    if (take(90)) {
      op.kind = OpKind::kLookup;
      op.keys = {MixedKey(resident, in_flight, ghosts)};
    } else if (take(30)) {
      op.kind = OpKind::kLookupBatch;
      op.keys = KeyRun(Uniform(0, 6), resident, in_flight, ghosts);
    } else if (take(60)) {
      op.kind = OpKind::kLookupPrefix;
      op.keys = KeyRun(Uniform(0, 8), resident, in_flight, ghosts);
    } else if (take(60)) {
      op.kind = OpKind::kLookupWindow;
      op.keys = KeyRun(Uniform(0, 8), resident, in_flight, ghosts);
      op.window = Chance(5) ? 0 : static_cast<size_t>(Uniform(1, 4));
    } else if (take(200)) {
      op.kind = OpKind::kPrepareStore;
      op.keys = KeyRun(Chance(3) ? 0 : Uniform(1, 6), resident, in_flight, ghosts);
      if (!op.keys.empty() && Chance(20)) Duplicate(op.keys);
      if (Chance(40)) {
        for (size_t i = 0; i < op.keys.size(); ++i) op.spare.push_back(Chance(50));
      }
    } else if (take(130)) {
      op.kind = OpKind::kCompleteStore;
      op.success = Chance(75);
      for (KeyId k : in_flight) {
        if (Chance(60)) op.keys.push_back(k);
      }
      for (int i = Uniform(0, 2); i > 0; --i) op.keys.push_back(MixedKey(resident, {}, ghosts));
      if (in_flight.empty() && op.keys.empty()) op.keys.push_back(RandomKey());
      Shuffle(op.keys);
      if (!op.keys.empty() && Chance(10)) Duplicate(op.keys);
    } else if (take(90)) {
      op.kind = OpKind::kPrepareLoad;
      int n = Uniform(0, 4);
      bool valid = Chance(70) && !ready.empty();
      for (int i = 0; i < n; ++i) {
        if (valid || (!ready.empty() && Chance(50))) {
          op.keys.push_back(Pick(ready));
        } else {
          op.keys.push_back(MixedKey(resident, in_flight, ghosts));
        }
      }
    } else if (take(90)) {
      op.kind = OpKind::kCompleteLoad;
      if (Chance(75) && !pinned.empty()) {
        std::vector<KeyId> pool = pinned;
        Shuffle(pool);
        pool.resize(static_cast<size_t>(Uniform(1, static_cast<int>(pool.size()))));
        op.keys = pool;
      } else {
        for (int i = Uniform(1, 3); i > 0; --i) {
          op.keys.push_back(!pinned.empty() && Chance(50) ? Pick(pinned)
                                                          : MixedKey(resident, in_flight, ghosts));
        }
      }
    } else if (take(130)) {
      op.kind = OpKind::kTouch;
      for (int i = Uniform(0, 6); i > 0; --i) {
        int r = Uniform(0, 99);
        if (r < 40 && !resident.empty()) {
          op.keys.push_back(Pick(resident));
        } else if (r < 70 && !ghosts.empty()) {
          op.keys.push_back(Pick(ghosts));
        } else {
          op.keys.push_back(RandomKey());
        }
      }
      if (Chance(30)) op.keys = KeyRun(Uniform(1, 6), resident, in_flight, ghosts);
      if (!op.keys.empty() && Chance(10)) Duplicate(op.keys);
      op.refresh = Chance(30);
    } else if (take(4)) {
      op.kind = OpKind::kReset;
    } else if (take(arc ? 30 : 3)) {
      op.kind = OpKind::kSetArcTarget;
      const double cap = static_cast<double>(config_.capacity);
      int r = Uniform(0, 99);
      if (r < 60) {
        op.target = std::uniform_real_distribution<double>(0.0, cap)(rng_);
      } else if (r < 85) {
        op.target = static_cast<double>(Uniform(0, static_cast<int>(config_.capacity)));
      } else if (r < 92) {
        op.target = cap;
      } else if (r < 96) {
        op.target = -0.5;
      } else {
        op.target = cap + 0.25;
      }
    } else {
      op.kind = OpKind::kTakeEvents;
    }
    return op;
  }

 private:
  int Uniform(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng_); }
  bool Chance(int percent) { return Uniform(0, 99) < percent; }
  KeyId RandomKey() {
    return static_cast<KeyId>(Uniform(0, static_cast<int>(config_.num_keys) - 1));
  }
  KeyId Pick(const std::vector<KeyId>& from) {
    return from[static_cast<size_t>(Uniform(0, static_cast<int>(from.size()) - 1))];
  }
  void Shuffle(std::vector<KeyId>& v) { std::shuffle(v.begin(), v.end(), rng_); }
  void Duplicate(std::vector<KeyId>& v) {
    KeyId k = Pick(v);
    v.insert(v.begin() + Uniform(0, static_cast<int>(v.size())), k);
  }

  // A random key, biased towards interesting ones.
  KeyId MixedKey(const std::vector<KeyId>& resident, const std::vector<KeyId>& in_flight,
                 const std::vector<KeyId>& ghosts) {
    int r = Uniform(0, 99);
    if (r < 30 && !resident.empty()) return Pick(resident);
    if (r < 42 && !in_flight.empty()) return Pick(in_flight);
    if (r < 52 && !ghosts.empty()) return Pick(ghosts);
    return RandomKey();
  }

  // `n` keys: often a run of consecutive ids (like the blocks of one prefix), else mixed keys.
  std::vector<KeyId> KeyRun(int n, const std::vector<KeyId>& resident,
                            const std::vector<KeyId>& in_flight, const std::vector<KeyId>& ghosts) {
    std::vector<KeyId> keys;
    if (Chance(50)) {
      KeyId base = !resident.empty() && Chance(60) ? Pick(resident) : RandomKey();
      if (Chance(50) && base >= static_cast<KeyId>(n / 2)) base -= static_cast<KeyId>(n / 2);
      for (int i = 0; i < n; ++i) keys.push_back((base + static_cast<KeyId>(i)) % config_.num_keys);
    } else {
      for (int i = 0; i < n; ++i) keys.push_back(MixedKey(resident, in_flight, ghosts));
    }
    return keys;
  }

  std::mt19937_64 rng_;
  Config config_;
};

// ------------------------------------------------------------------------------------------
// Test driver
// ------------------------------------------------------------------------------------------

struct RunOutcome {
  bool ok = true;
  std::string report;
  Coverage coverage;
};

// Generates and runs `num_ops` random ops for `seed`; stops at the first mismatch.
RunOutcome RunSeed(const Config& config, uint64_t seed, size_t num_ops, bool shrink) {
  RunOutcome outcome;
  Harness h(config);
  if (!h.created()) {
    outcome.ok = false;
    outcome.report = "BlockManager::Create failed for " + config.ToString();
    return outcome;
  }
  Generator gen(seed, config);
  std::vector<Op> ops;
  for (size_t i = 0; i <= num_ops; ++i) {
    // The last op always drains the events, so undrained ones are compared too.
    Op op = i == num_ops ? Op{OpKind::kTakeEvents, {}, true, 1, 0.0} : gen.Next(h.model());
    ops.push_back(op);
    std::optional<std::string> diff = h.Step(op);
    outcome.coverage = h.model().coverage();
    if (!diff) continue;
    std::ostringstream out;
    out << "seed=" << seed << " config=" << config.ToString() << "\n  mismatch at op #" << i << " "
        << OpStr(op) << ":\n  " << *diff << "\n  op log (last 40):\n"
        << OpsStr(ops, ops.size() > 40 ? ops.size() - 40 : 0);
    if (shrink) {
      std::vector<Op> small = Shrink(config, ops);
      std::optional<std::pair<size_t, std::string>> failure = Replay(config, small);
      out << "  shrunk repro (" << small.size() << " ops):\n" << OpsStr(small);
      if (failure) {
        out << "  which fails at its op #" << failure->first << ":\n  " << failure->second;
      }
      out << "\n";
    }
    outcome.ok = false;
    outcome.report = out.str();
    return outcome;
  }
  return outcome;
}

std::string CoverageStr(const Coverage& c) {
  std::ostringstream out;
  out << "evictions=" << c.evictions << " refused_stores=" << c.refused_stores
      << " arc_t2_evictions=" << c.arc_t2_evictions << " arc_t1_fallbacks=" << c.arc_t1_fallbacks
      << " arc_b1_hits=" << c.arc_b1_hits << " arc_b2_hits=" << c.arc_b2_hits
      << " ghost_trims=" << c.ghost_trims << " ghost_reinserts=" << c.ghost_reinserts
      << " lifo_reuses=" << c.lifo_reuses << " dedup_stores=" << c.dedup_stores
      << " failed_loads=" << c.failed_loads << " failed_store_frees=" << c.failed_store_frees
      << " retries=" << c.retries << " tracker_drops=" << c.tracker_drops
      << " filtered_keys=" << c.filtered_keys << " af_promotions=" << c.af_promotions
      << " af_upper_evictions=" << c.af_upper_evictions
      << " af_ghost_reinserts=" << c.af_ghost_reinserts << " af_refreshes=" << c.af_refreshes
      << " spare_evictions=" << c.spare_evictions << " spare_uses=" << c.spare_uses;
  return out.str();
}

// Runs every seed; reports the first few failures (shrunk) and the count. Returns what the runs
// exercised.
Coverage RunSeeds(const std::vector<std::pair<Config, uint64_t>>& runs, size_t num_ops_small,
                  size_t num_ops_large) {
  size_t failures = 0;
  Coverage total;
  for (const auto& [config, seed] : runs) {
    size_t num_ops = config.capacity > 16 ? num_ops_large : num_ops_small;
    RunOutcome outcome = RunSeed(config, seed, num_ops, /*shrink=*/failures < 3);
    total.Add(outcome.coverage);
    if (outcome.ok) continue;
    if (failures < 3) ADD_FAILURE() << outcome.report;
    ++failures;
  }
  EXPECT_EQ(failures, 0u) << "of " << runs.size() << " seeded runs";
  ::testing::Test::RecordProperty("coverage", CoverageStr(total));
  if (std::getenv("KVSTASH_MODEL_COVERAGE") != nullptr) {
    std::printf("coverage: %s\n", CoverageStr(total).c_str());
  }
  return total;
}

size_t KeysFor(size_t capacity, std::mt19937_64& rng) {
  // 1.5x to 3x the capacity, at least 2.
  double factor = std::uniform_real_distribution<double>(1.5, 3.0)(rng);
  return std::max<size_t>(2, static_cast<size_t>(static_cast<double>(capacity) * factor + 0.5));
}

class BlockManagerModelTest : public ::testing::TestWithParam<EvictionPolicy> {};

// The main property: 200 seeds x 400 ops (1500 for the large capacity) over capacities 1..8,
// 16 and 64, events mostly on.
TEST_P(BlockManagerModelTest, RandomOpsMatchModel) {
  static constexpr size_t kCapacities[] = {1, 2, 3, 4, 5, 6, 7, 8, 16, 64};
  std::vector<std::pair<Config, uint64_t>> runs;
  for (uint64_t seed = 1; seed <= 200; ++seed) {
    std::mt19937_64 rng(seed * 7919);
    Config config;
    config.policy = GetParam();
    config.capacity = kCapacities[seed % std::size(kCapacities)];
    config.num_keys = KeysFor(config.capacity, rng);
    config.enable_events = seed % 5 != 0;
    runs.emplace_back(config, seed);
  }
  Coverage c = RunSeeds(runs, 400, 1500);
  // The generator must reach the interesting cases, or agreement proves little.
  EXPECT_GT(c.evictions, 1000u);
  EXPECT_GT(c.refused_stores, 100u);
  EXPECT_GT(c.lifo_reuses, 1000u);
  EXPECT_GT(c.dedup_stores, 100u);
  EXPECT_GT(c.failed_loads, 100u);
  EXPECT_GT(c.failed_store_frees, 100u);
  EXPECT_GT(c.retries, 100u);
  EXPECT_GT(c.spare_evictions, 100u);
  EXPECT_GT(c.spare_uses, 100u);
  if (GetParam() == EvictionPolicy::kArc) {
    EXPECT_GT(c.arc_t2_evictions, 100u);
    EXPECT_GT(c.arc_t1_fallbacks, 20u);
    EXPECT_GT(c.arc_b1_hits, 100u);
    EXPECT_GT(c.arc_b2_hits, 100u);
    EXPECT_GT(c.ghost_trims, 20u);
    EXPECT_GT(c.ghost_reinserts, 100u);
  }
  if (GetParam() == EvictionPolicy::kAfLru) {
    EXPECT_GT(c.af_promotions, 1000u);
    EXPECT_GT(c.af_upper_evictions, 100u);
    EXPECT_GT(c.af_ghost_reinserts, 100u);
    EXPECT_GT(c.af_refreshes, 100u);
  }
}

// The reuse filter: store_threshold 2 or 3 with tiny trackers, so tracker evictions matter.
TEST_P(BlockManagerModelTest, ReuseFilterMatchesModel) {
  std::vector<std::pair<Config, uint64_t>> runs;
  for (uint64_t seed = 1001; seed <= 1080; ++seed) {
    std::mt19937_64 rng(seed * 104729);
    Config config;
    config.policy = GetParam();
    config.capacity = 1 + seed % 6;
    config.num_keys = KeysFor(config.capacity, rng);
    config.store_threshold = seed % 4 == 0 ? 3 : 2;
    config.max_tracker_size = 1 + seed % 4;
    if (seed % 8 == 1) config.max_tracker_size = 2 * config.num_keys;  // tracker never full
    config.enable_events = true;
    runs.emplace_back(config, seed);
  }
  Coverage c = RunSeeds(runs, 400, 400);
  EXPECT_GT(c.evictions, 50u);
  EXPECT_GT(c.tracker_drops, 1000u);
  EXPECT_GT(c.filtered_keys, 1000u);
}

// Recency stamps start 50 below 2^32, so the manager renumbers them mid-run; nothing observable
// may change.
TEST_P(BlockManagerModelTest, StampRenumberingMatchesModel) {
  static constexpr size_t kCapacities[] = {1, 2, 3, 4, 6, 8, 64};
  std::vector<std::pair<Config, uint64_t>> runs;
  for (uint64_t seed = 2001; seed <= 2060; ++seed) {
    std::mt19937_64 rng(seed * 15485863);
    Config config;
    config.policy = GetParam();
    config.capacity = kCapacities[seed % std::size(kCapacities)];
    config.num_keys = KeysFor(config.capacity, rng);
    config.first_recency_stamp = std::numeric_limits<uint32_t>::max() - 50;
    if (seed % 3 == 0) {
      config.store_threshold = 2;
      config.max_tracker_size = 1 + seed % 4;
    }
    runs.emplace_back(config, seed);
  }
  Coverage c = RunSeeds(runs, 400, 1500);
  EXPECT_GT(c.evictions, 200u);
}

// The same seed gives the same observable run whatever the first recency stamp.
TEST_P(BlockManagerModelTest, FirstStampDoesNotChangeResults) {
  for (uint64_t seed = 3001; seed <= 3010; ++seed) {
    Config low;
    low.policy = GetParam();
    low.capacity = 1 + seed % 8;
    low.num_keys = 2 * low.capacity + 1;
    Config high = low;
    high.first_recency_stamp = std::numeric_limits<uint32_t>::max() - 50;
    // Generate from the low run's model, then replay the same ops on the high configuration.
    Harness h(low);
    ASSERT_TRUE(h.created());
    Generator gen(seed, low);
    std::vector<Op> ops;
    for (int i = 0; i < 400; ++i) {
      ops.push_back(gen.Next(h.model()));
      ASSERT_FALSE(h.Step(ops.back()).has_value()) << "seed " << seed << " op #" << i;
    }
    std::optional<std::pair<size_t, std::string>> failure = Replay(high, ops);
    EXPECT_FALSE(failure.has_value()) << "seed " << seed << " op #" << failure->first << ":\n"
                                      << failure->second;
  }
}

// Sanity checks of the harness itself on hand-made sequences from the vectors of docs/semantics.md
// §12 (A3 steps 1-8 for LRU, B5 with the kvstash fallback and B10 for ARC): they must pass, so a
// failure of the random tests is not a broken model.
TEST(BlockManagerModelSelfTest, ReferenceVectorsThroughHarness) {
  auto ps = [](std::vector<KeyId> keys) { return Op{OpKind::kPrepareStore, keys, true, 1, 0}; };
  auto cs = [](std::vector<KeyId> keys, bool ok = true) {
    return Op{OpKind::kCompleteStore, keys, ok, 1, 0};
  };
  auto touch = [](std::vector<KeyId> keys) { return Op{OpKind::kTouch, keys, true, 1, 0}; };
  auto pl = [](std::vector<KeyId> keys) { return Op{OpKind::kPrepareLoad, keys, true, 1, 0}; };
  auto target = [](double p) { return Op{OpKind::kSetArcTarget, {}, true, 1, p}; };
  Op events{OpKind::kTakeEvents, {}, true, 1, 0};

  Config lru;
  lru.capacity = 4;
  std::vector<Op> a3 = {ps({1, 2}), cs({1, 2}), ps({2, 3, 4, 5}), ps({1, 6}), events};
  EXPECT_FALSE(Replay(lru, a3).has_value());

  Config arc;
  arc.policy = EvictionPolicy::kArc;
  arc.capacity = 2;
  std::vector<Op> b5 = {ps({1, 2}), cs({1, 2}), touch({2}), pl({2}), target(2.0), ps({3}), events};
  EXPECT_FALSE(Replay(arc, b5).has_value());
  Harness h(arc);
  for (const Op& op : b5) ASSERT_FALSE(h.Step(op).has_value());
  BlockManagerState s = h.model().State();
  EXPECT_EQ(StateStr(s),
            "ARC lru=[] t1=[(3,0,-1)] t2=[(2,1,1)] b1=[1] b2=[] p=2 spare=[] free=[] fresh=2");

  std::vector<Op> b10 = {ps({1, 2}), cs({1, 2}), ps({3}), cs({3}),    ps({4}),
                         cs({4}),    ps({5}),    cs({5}), touch({3}), ps({3})};
  Harness h10(arc);
  for (const Op& op : b10) ASSERT_FALSE(h10.Step(op).has_value());
  EXPECT_EQ(StateStr(h10.model().State()),
            "ARC lru=[] t1=[(5,0,0) (3,1,-1)] t2=[] b1=[4] b2=[] p=1 spare=[] free=[] fresh=2");
}

INSTANTIATE_TEST_SUITE_P(Policies, BlockManagerModelTest,
                         ::testing::Values(EvictionPolicy::kLru, EvictionPolicy::kArc,
                                           EvictionPolicy::kAfLru),
                         [](const ::testing::TestParamInfo<EvictionPolicy>& param_info) {
                           switch (param_info.param) {
                             case EvictionPolicy::kArc:
                               return "Arc";
                             case EvictionPolicy::kAfLru:
                               return "AfLru";
                             case EvictionPolicy::kLru:
                               break;
                           }
                           return "Lru";
                         });

}  // namespace
}  // namespace kvstash::store
