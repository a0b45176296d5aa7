#pragma once

// A member source of the cluster client that a test drives (NodeClientOptions::members): Set
// replaces the live set as an etcd watcher would, with no etcd. Thread-safe, but Set and the
// following client's destruction go on one thread (the test's).

#include <functional>
#include <vector>

#include "kvstash/common/mutex.h"
#include "kvstash/membership/membership.h"

namespace kvstash::connector {

class InMemoryMembers {
 public:
  using OnChange = std::function<void(const std::vector<membership::NodeRecord>&)>;
  // Replaces the set; the following client has applied it when Set returns.
  void Set(std::vector<membership::NodeRecord> records);
  std::vector<membership::NodeRecord> records() const;
  // Where Set goes: one follower (a client sets it at Create and clears it when it goes).
  void Follow(OnChange on_change);

 private:
  mutable Mutex mu_;
  std::vector<membership::NodeRecord> records_ GUARDED_BY(mu_);
  OnChange on_change_ GUARDED_BY(mu_);
};

}  // namespace kvstash::connector
