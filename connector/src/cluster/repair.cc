// Read repair: keys noted by lookups, copied by reads.

#include "cluster/repair.h"

#include <future>
#include <utility>

#include "kvstash/proto/convert.h"

namespace kvstash::connector {

void ReadRepair::Note(std::span<const BlockKey> keys, const std::vector<LookupResult>& states,
                      std::vector<std::vector<std::shared_ptr<Member>>>& missed_at) {
  MutexLock lock(&mu_);
  for (size_t i = 0; i < keys.size(); ++i) {
    if (states[i] != LookupResult::kHit || missed_at[i].empty()) continue;
    if (repairs_.size() >= kMaxRepairs && !repairs_.contains(keys[i])) continue;
    std::vector<std::weak_ptr<Member>>& to = repairs_[keys[i]];
    to.assign(missed_at[i].begin(), missed_at[i].end());
  }
  pending_.store(!repairs_.empty(), std::memory_order_relaxed);
}

void ReadRepair::Repair(std::span<const BlockKey> keys,
                        std::span<const transport::MutableBytes> outs,
                        const std::vector<Result<size_t>>& results) {
  if (!pending_.load(std::memory_order_relaxed)) return;
  std::vector<std::pair<size_t, std::shared_ptr<Member>>> todo;  // key index, replica
  {
    MutexLock lock(&mu_);
    for (size_t i = 0; i < keys.size(); ++i) {
      auto it = repairs_.find(keys[i]);
      if (it == repairs_.end()) continue;
      if (results[i].ok()) {
        for (const std::weak_ptr<Member>& weak : it->second) {
          if (std::shared_ptr<Member> member = weak.lock()) todo.emplace_back(i, member);
        }
      }
      repairs_.erase(it);
    }
    pending_.store(!repairs_.empty(), std::memory_order_relaxed);
  }
  if (todo.empty()) return;
  transport::CallGroup group;
  std::vector<std::future<Outcome>> calls;
  calls.reserve(todo.size());
  for (const auto& [i, member] : todo) {
    const transport::Bytes block = outs[i].first(*results[i]);
    calls.push_back(calls_.StartPut(group, *member, keys[i], block));
  }
  group.Wait();
  size_t repaired = 0;
  for (size_t k = 0; k < todo.size(); ++k) {
    const Status status = ParseReply(calls[k].get(), (wire::PutBlockReply*)nullptr);
    accounting_.Record(*todo[k].second->state, status);
    repaired += status.ok() ? 1 : 0;
  }
  accounting_.Repaired(repaired);
}

}  // namespace kvstash::connector
