#pragma once

// NodeClient::Impl, the cluster client behind the NodeClient facade (docs/architecture.md, "the
// cluster client"), wires its parts:
//
//   members.h     where the nodes come from, and the immutable snapshot a call works with;
//   placement.h   which members hold a key (rendezvous, replicas in distinct zones), and
//   placer.h      the keys of a batch placed on a snapshot's members;
//   node_health.h each member's health as the calls find it (suspect nodes skipped, probed);
//   node_calls.h  the calls on each member's channel, its limits, probes, asynchronous calls;
//   call_watch.h  waiting for calls to several nodes without waiting on one that is gone;
//   lookup.h, store.h, read.h, keys.h: the operations, each fanning out per node with its
//                 own deadline and using each node's answer as it comes (semantics §14);
//   repair.h      read repair: keys a lookup found missing on a replica, copied by their read.

#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "cluster/accounting.h"
#include "cluster/call_watch.h"
#include "cluster/keys.h"
#include "cluster/lookup.h"
#include "cluster/members.h"
#include "cluster/node_calls.h"
#include "cluster/placer.h"
#include "cluster/read.h"
#include "cluster/repair.h"
#include "cluster/store.h"
#include "kvstash/connector/node_client.h"

namespace kvstash::connector {

// Owns the options, the counters, the members and each part of the client, and wires them:
// every part borrows what it needs of the others, all of which it outlives. The options change
// only in Init (a worker made when none was given), before any call. Thread-safe, as its parts
// are.
class NodeClient::Impl {
 public:
  explicit Impl(NodeClientOptions options);
  // The members stop first (an etcd watcher's callback changes them); then the asynchronous
  // calls still out are waited for (each ends by its deadline): their callbacks use the parts.
  ~Impl();
  Status Init();

  std::vector<NodeAddress> nodes() const;
  size_t replicas() const { return options_.replicas; }
  std::vector<NodeAddress> PlacesOf(const BlockKey& key) const;
  BlockStoreCounters counters() const { return accounting_->counters(); }

  // NotFound when `address` is not a member now.
  Result<NodeLimits> Limits(const NodeAddress& address);
  Result<std::map<std::string, uint64_t>> Stats(const NodeAddress& address);

  std::vector<LookupResult> Lookup(std::span<const BlockKey> keys, Status* refusal) {
    return lookup_.Lookup(keys, refusal);
  }
  Status Put(std::span<const BlockKey> keys, std::span<const transport::Bytes> blocks,
             std::span<const BlockMeta> metas) {
    return store_.Put(keys, blocks, metas);
  }
  std::vector<Result<size_t>> Get(std::span<const BlockKey> keys,
                                  std::span<const transport::MutableBytes> outs) {
    return read_.Get(keys, outs);
  }
  void Pin(std::span<const BlockKey> keys) { keys_.Pin(keys); }
  void Unpin(std::span<const BlockKey> keys) { keys_.Unpin(keys); }
  void Touch(std::span<const BlockKey> keys, bool refresh = false) { keys_.Touch(keys, refresh); }
  Status TouchSync(std::span<const BlockKey> keys) { return keys_.TouchSync(keys); }
  // Waits for the asynchronous calls (touches, pins, releases, probes) still out.
  void WaitForTouches() { calls_.WaitForAsync(); }

 private:
  NodeClientOptions options_;
  // Shared with the callbacks of calls that outlive their caller (a lookup's late answers).
  const std::shared_ptr<Accounting> accounting_ = std::make_shared<Accounting>();
  MemberSet members_;
  const Placer placer_;
  NodeCalls calls_;
  CallWatch watch_;
  ReadRepair repair_;
  ClusterLookup lookup_;
  ClusterStore store_;
  ClusterRead read_;
  KeyCalls keys_;
};

}  // namespace kvstash::connector
