#include "namespace_book.h"

#include <algorithm>

namespace kvstash::store {

NamespaceBook::NamespaceBook(const NamespaceQuotas& quotas, size_t capacity)
    : has_quotas_(!quotas.empty()),
      default_quota_(quotas.default_blocks),
      links_(quotas.empty() ? 0 : capacity) {
  for (const auto& [ns, blocks] : quotas.blocks) {
    Record& r = records_[ns];
    r.quota = blocks;
    r.named = true;
  }
}

NamespaceBook::Record* NamespaceBook::Find(NamespaceId ns) {
  if (cached_ != nullptr && cached_id_ == ns) return cached_;
  auto it = records_.find(ns);
  if (it == records_.end()) return nullptr;
  cached_id_ = ns;
  cached_ = &it->second;
  return cached_;
}

NamespaceBook::Record& NamespaceBook::Get(NamespaceId ns) {
  if (Record* r = Find(ns)) return *r;
  Record& r = records_[ns];
  if (default_quota_) r.quota = *default_quota_;
  cached_id_ = ns;
  cached_ = &r;
  return r;
}

void NamespaceBook::PushTail(Record& r, uint32_t id) {
  links_[id] = Link{r.tail, kNoId};
  if (r.tail != kNoId) {
    links_[r.tail].next = id;
  } else {
    r.head = id;
  }
  r.tail = id;
}

void NamespaceBook::Unlink(Record& r, uint32_t id) {
  const Link link = links_[id];
  if (link.prev != kNoId) {
    links_[link.prev].next = link.next;
  } else {
    r.head = link.next;
  }
  if (link.next != kNoId) {
    links_[link.next].prev = link.prev;
  } else {
    r.tail = link.prev;
  }
}

void NamespaceBook::Add(uint32_t id, NamespaceId ns) {
  Record& r = Get(ns);
  ++r.blocks;
  if (r.quota != kNoQuota) PushTail(r, id);
}

void NamespaceBook::Drop(uint32_t id, NamespaceId ns) {
  Record* r = Find(ns);
  if (r == nullptr) return;  // not counted (cannot happen: every held slot was added)
  --r->blocks;
  if (r->quota != kNoQuota) Unlink(*r, id);
  if (r->blocks == 0 && !r->named) {
    records_.erase(ns);
    cached_ = nullptr;
  }
}

void NamespaceBook::Touch(uint32_t id, NamespaceId ns) {
  Record* r = Find(ns);
  if (r == nullptr || r->quota == kNoQuota || r->tail == id) return;
  Unlink(*r, id);
  PushTail(*r, id);
}

void NamespaceBook::Clear() {
  std::erase_if(records_, [](const auto& kv) { return !kv.second.named; });
  for (auto& [ns, r] : records_) {
    r.blocks = 0;
    r.head = r.tail = kNoId;
  }
  cached_ = nullptr;
}

size_t NamespaceBook::blocks(NamespaceId ns) const {
  auto it = records_.find(ns);
  return it == records_.end() ? 0 : it->second.blocks;
}

std::optional<size_t> NamespaceBook::quota(NamespaceId ns) const {
  auto it = records_.find(ns);
  if (it != records_.end()) {
    if (it->second.quota == kNoQuota) return std::nullopt;
    return it->second.quota;
  }
  return default_quota_;
}

std::vector<NamespaceUsage> NamespaceBook::Usages() const {
  std::vector<NamespaceUsage> out;
  out.reserve(records_.size());
  for (const auto& [ns, r] : records_) {
    NamespaceUsage& u = out.emplace_back();
    u.id = ns;
    u.blocks = r.blocks;
    if (r.quota != kNoQuota) u.quota_blocks = r.quota;
  }
  std::sort(out.begin(), out.end(),
            [](const NamespaceUsage& a, const NamespaceUsage& b) { return a.id < b.id; });
  return out;
}

size_t NamespaceBook::MemoryBytes() const {
  // An unordered_map node holds the pair and a next pointer (and, in libstdc++, the hash is not
  // cached for integer keys); plus the bucket array.
  return sizeof(*this) + records_.size() * (sizeof(std::pair<NamespaceId, Record>) + 16) +
         records_.bucket_count() * sizeof(void*) + links_.MemoryBytes();
}

}  // namespace kvstash::store
