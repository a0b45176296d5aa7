// Discovery: a router's workers and nodes found in etcd (kvstash-router --etcd), kept in its set
// as they register and leave: workers that run `kvstash-engine serve --register`, nodes that
// publish their KV events endpoints in their records (kvstashd --etcd --kv-events).
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "kvstash/common/mutex.h"
#include "kvstash/common/status.h"
#include "kvstash/membership/membership.h"
#include "kvstash/router/router.h"

namespace kvstash::router {

struct DiscoveryOptions {
  membership::EtcdOptions etcd;
  std::string cluster;
  // How often the sets are checked again besides their changes: a worker that could not join
  // (not answering yet, another model) is tried again this often.
  std::chrono::milliseconds retry{1000};
};

// Counters since Create. Monotonic but for the sizes.
struct DiscoveryStats {
  size_t workers = 0;     // workers it added that are members now
  size_t nodes = 0;       // nodes it follows now
  uint64_t joins = 0;     // workers and nodes added
  uint64_t leaves = 0;    // workers and nodes removed after they left etcd
  uint64_t refusals = 0;  // tries to add a worker that failed (each retried)
};

// Owns two membership watchers (workers, nodes) and, once Follow is called, a thread that keeps
// a router's set equal to what is registered. Thread-safe.
class Discovery {
 public:
  // Reads both sets once: Unavailable when etcd does not answer (naming its endpoints),
  // InvalidArgument for bad options.
  static Result<std::unique_ptr<Discovery>> Create(DiscoveryOptions options);
  ~Discovery();  // stops its thread; `router` must outlive the Discovery
  Discovery(const Discovery&) = delete;
  Discovery& operator=(const Discovery&) = delete;

  // The workers registered now (address and role), sorted by address.
  std::vector<membership::NodeRecord> workers() const;

  // Keeps `router`'s set from now on: adds every registered worker (as prefill when its record
  // says so, else decode) and every node that names its events, and removes those it added once
  // they leave etcd. Addresses in `fixed` (given on the command line) are never added or
  // removed. Call once.
  void Follow(Router* router, std::set<std::string> fixed);

  DiscoveryStats stats() const;

 private:
  Discovery(DiscoveryOptions options, std::unique_ptr<membership::MembershipWatcher> workers,
            std::unique_ptr<membership::MembershipWatcher> nodes);
  void Run();
  // One pass: joins what is registered and not in, removes what it added and is no longer
  // registered.
  void Reconcile();
  void Wake();

  const DiscoveryOptions options_;
  std::unique_ptr<membership::MembershipWatcher> workers_;
  std::unique_ptr<membership::MembershipWatcher> nodes_;
  Router* router_ = nullptr;  // set by Follow, before the thread starts
  std::set<std::string> fixed_;
  // The thread's: what it added (worker address → prefill; node events endpoint).
  std::map<std::string, bool> joined_workers_;
  std::set<std::string> joined_nodes_;
  std::set<std::string> refused_;  // workers whose refusal was logged (once each)

  mutable Mutex mu_;
  CondVar cv_;
  bool stopping_ GUARDED_BY(mu_) = false;
  bool changed_ GUARDED_BY(mu_) = false;
  DiscoveryStats stats_ GUARDED_BY(mu_);
  std::thread thread_;
};

}  // namespace kvstash::router
