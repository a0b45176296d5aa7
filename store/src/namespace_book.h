// NamespaceBook: per-namespace block counts, ceilings and recency order of one BlockManager.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <unordered_map>
#include <vector>

#include "entry.h"
#include "huge_array.h"
#include "kvstash/store/block_manager.h"

namespace kvstash::store {

// Counts the blocks (slots) each namespace holds and, for namespaces with a ceiling, keeps
// their blocks in a list of their own in recency order (stores and touches), so that a
// namespace at its ceiling finds its least recently used idle blocks among its own, without
// walking the policy's lists past every other namespace's blocks. The links live in an array
// by slot, allocated only when there are quotas.
//
// A namespace's record exists while it holds blocks, or for good when its quota is named, so
// the table holds at most min(namespaces, capacity) + named records. Owned by BlockManagerImpl
// and covered by its lock; not thread-safe.
class NamespaceBook {
 public:
  NamespaceBook(const NamespaceQuotas& quotas, size_t capacity);

  bool has_quotas() const { return has_quotas_; }

  // Slot `id` now holds a block of `ns` (stored or restored): counted, and the most recent of
  // its namespace's list.
  void Add(uint32_t id, NamespaceId ns);
  // Slot `id`, which held a block of `ns`, is freed.
  void Drop(uint32_t id, NamespaceId ns);
  // Slot `id` (a block of `ns`) was touched: the most recent of its namespace's list.
  void Touch(uint32_t id, NamespaceId ns);
  // Forgets every block (the named quotas stay).
  void Clear();

  size_t blocks(NamespaceId ns) const;
  // The ceiling of `ns`, if any.
  std::optional<size_t> quota(NamespaceId ns) const;
  // The blocks of `ns` (which has a ceiling) from its least recent, while `visit(id)` returns
  // true.
  template <typename Visit>
  void ForOldest(NamespaceId ns, Visit visit) const {
    auto it = records_.find(ns);
    if (it == records_.end()) return;
    for (uint32_t id = it->second.head; id != kNoId && visit(id); id = links_[id].next) {
    }
  }

  std::vector<NamespaceUsage> Usages() const;
  size_t MemoryBytes() const;

 private:
  static constexpr size_t kNoQuota = SIZE_MAX;

  struct Record {
    size_t blocks = 0;
    size_t quota = kNoQuota;
    uint32_t head = kNoId;  // least recent block (namespaces with a ceiling)
    uint32_t tail = kNoId;  // most recent
    bool named = false;     // its quota is named: the record stays when it holds nothing
  };
  struct Link {
    uint32_t prev;
    uint32_t next;
  };

  // The record of `ns`, created (with its ceiling) if absent. The last one found is cached:
  // a call's keys mostly share one namespace.
  Record& Get(NamespaceId ns);
  Record* Find(NamespaceId ns);
  void PushTail(Record& r, uint32_t id);
  void Unlink(Record& r, uint32_t id);

  const bool has_quotas_;
  const std::optional<size_t> default_quota_;
  std::unordered_map<NamespaceId, Record> records_;  // element addresses are stable
  NamespaceId cached_id_ = 0;
  Record* cached_ = nullptr;
  HugeArray<Link> links_;  // by slot; empty without quotas
};

}  // namespace kvstash::store
