#include "kvstash/router/discovery.h"

#include <utility>

#include "kvstash/common/logging.h"

namespace kvstash::router {

Result<std::unique_ptr<Discovery>> Discovery::Create(DiscoveryOptions options) {
  if (options.retry.count() <= 0) return InvalidArgumentError("discovery: retry must be > 0");
  // The watchers' changes wake the thread (set once it runs; a change before that is read by
  // its first pass anyway).
  auto self = std::unique_ptr<Discovery>(new Discovery(std::move(options), nullptr, nullptr));
  Discovery* const raw = self.get();
  for (const membership::MemberKind kind :
       {membership::MemberKind::kWorker, membership::MemberKind::kNode}) {
    membership::WatcherOptions w;
    w.etcd = raw->options_.etcd;
    w.cluster = raw->options_.cluster;
    w.kind = kind;
    KVSTASH_ASSIGN_OR_RETURN(
        auto watcher, membership::MembershipWatcher::Create(
                          w, [raw](const std::vector<membership::NodeRecord>&) { raw->Wake(); }));
    (kind == membership::MemberKind::kWorker ? raw->workers_ : raw->nodes_) = std::move(watcher);
  }
  return self;
}

Discovery::Discovery(DiscoveryOptions options,
                     std::unique_ptr<membership::MembershipWatcher> workers,
                     std::unique_ptr<membership::MembershipWatcher> nodes)
    : options_(std::move(options)), workers_(std::move(workers)), nodes_(std::move(nodes)) {}

Discovery::~Discovery() {
  {
    MutexLock lock(&mu_);
    stopping_ = true;
    cv_.SignalAll();
  }
  if (thread_.joinable()) thread_.join();
  // The watchers stop before the rest of this goes (their callbacks call Wake).
  workers_.reset();
  nodes_.reset();
}

std::vector<membership::NodeRecord> Discovery::workers() const { return workers_->members(); }

void Discovery::Follow(Router* router, std::set<std::string> fixed) {
  router_ = router;
  fixed_ = std::move(fixed);
  thread_ = std::thread([this] { Run(); });
}

DiscoveryStats Discovery::stats() const {
  MutexLock lock(&mu_);
  return stats_;
}

void Discovery::Wake() {
  MutexLock lock(&mu_);
  changed_ = true;
  cv_.SignalAll();
}

void Discovery::Run() {
  while (true) {
    Reconcile();
    MutexLock lock(&mu_);
    if (!stopping_ && !changed_) cv_.WaitFor(&mu_, options_.retry);
    if (stopping_) return;
    changed_ = false;
  }
}

void Discovery::Reconcile() {
  uint64_t joins = 0, leaves = 0, refusals = 0;
  // Workers: as registered, by address; the role their record gives.
  std::map<std::string, bool> wanted;
  for (const membership::NodeRecord& r : workers_->members()) {
    if (fixed_.count(r.address) == 0) wanted[r.address] = r.role == "prefill";
  }
  for (auto it = joined_workers_.begin(); it != joined_workers_.end();) {
    auto w = wanted.find(it->first);
    if (w != wanted.end() && w->second == it->second) {
      ++it;
      continue;
    }
    router_->RemoveWorker(it->first);  // left etcd, or registered again with another role
    ++leaves;
    it = joined_workers_.erase(it);
  }
  for (const auto& [address, prefill] : wanted) {
    if (joined_workers_.count(address) > 0) continue;
    const Status added = router_->AddWorker(address, prefill);
    if (added.ok()) {
      joined_workers_[address] = prefill;
      refused_.erase(address);
      ++joins;
      KVSTASH_LOG_INFO("etcd: {} worker {} joined the router's set", prefill ? "prefill" : "decode",
                       address);
      continue;
    }
    ++refusals;
    if (refused_.insert(address).second) {
      KVSTASH_LOG_WARN("etcd: worker {} cannot join the router's set (tried again every {} ms): {}",
                       address, options_.retry.count(), added.ToString());
    }
  }
  // Nodes: those that name their events.
  std::map<std::string, NodeEvents> nodes;
  for (const membership::NodeRecord& r : nodes_->members()) {
    if (r.kv_events.empty()) continue;
    NodeEvents e;
    e.endpoint = ReachableEndpoint(r.kv_events, r.address);
    if (!r.kv_events_replay.empty()) e.replay = ReachableEndpoint(r.kv_events_replay, r.address);
    if (fixed_.count(e.endpoint) == 0) nodes[e.endpoint] = e;
  }
  for (auto it = joined_nodes_.begin(); it != joined_nodes_.end();) {
    if (nodes.count(*it) > 0) {
      ++it;
      continue;
    }
    router_->RemoveNode(*it);
    ++leaves;
    it = joined_nodes_.erase(it);
  }
  for (const auto& [endpoint, node] : nodes) {
    if (joined_nodes_.count(endpoint) > 0) continue;
    if (Status added = router_->AddNode(node); !added.ok()) {
      ++refusals;
      KVSTASH_LOG_WARN("etcd: cannot follow the events of a node at {}: {}", endpoint,
                       added.ToString());
      continue;
    }
    joined_nodes_.insert(endpoint);
    ++joins;
    KVSTASH_LOG_INFO("etcd: following the node events at {}", endpoint);
  }
  MutexLock lock(&mu_);
  stats_.joins += joins;
  stats_.leaves += leaves;
  stats_.refusals += refusals;
  stats_.workers = joined_workers_.size();
  stats_.nodes = joined_nodes_.size();
}

}  // namespace kvstash::router
