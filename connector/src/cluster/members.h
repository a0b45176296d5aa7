#pragma once

// The cluster client's members (docs/semantics.md §15; docs/architecture.md, "the cluster
// client"):
//
//   source    where the live nodes come from: a fixed list, a cluster in etcd (followed), or
//             an in-memory source that a test changes (MemberSource);
//   snapshot  the set one call works with: immutable, taken when the call begins (Snapshot);
//   member    one node: its address, rendezvous hash, health and channel (its connection,
//             opened by the first call).
//
// A set that changes keeps the members that stay (their connections, and the pins this client
// holds there); new ones connect at their first call; those gone are closed once no call uses
// them (the last snapshot that lists one holds it). A member refused at membership (its block
// size is not this client's) is left out of this set and of every later one. Thread-safe.

#include <functional>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "cluster/node_health.h"
#include "kvstash/common/mutex.h"
#include "kvstash/common/status.h"
#include "kvstash/connector/in_memory_members.h"
#include "kvstash/connector/node_client.h"
#include "kvstash/membership/membership.h"
#include "kvstash/transport/rpc.h"

namespace kvstash::connector {

// A live node: its address, its rendezvous hash and its connection (opened by the first call).
// Shared by the snapshots that list it; the last one to go closes the connection.
struct Member {
  NodeAddress address;
  uint64_t hash = 0;
  uint64_t zone = 0;  // a hash of its failure domain's name; 0: none stated
  std::shared_ptr<NodeHealth> state;
  std::unique_ptr<transport::Channel> channel;  // after state: its callbacks may use state
};
using Members = std::vector<std::shared_ptr<Member>>;

// The nodes one call works with: the live set when it began. Immutable.
struct Snapshot {
  Members members;
  // The member of `address`; null when it is not one.
  std::shared_ptr<Member> Find(const NodeAddress& address) const;
};

class MemberSet {
 public:
  // Counts of who joined and left after the first set.
  using OnChanged = std::function<void(size_t joined, size_t left)>;

  MemberSet(const NodeClientOptions& options, OnChanged on_changed);
  // Stops following (the watcher goes first: its callback changes the members).
  ~MemberSet();

  // Reads the first set from the options' source: every node of a fixed list must be usable;
  // a followed cluster's set is what etcd (or the in-memory source) says now, then followed.
  Status Start();

  // Stops following the source (an etcd watcher, in-memory members): no change comes after.
  void Stop();

  // The live set now. A member kept while its source no longer lists it (lingering) leaves
  // it here once it fails a call.
  std::shared_ptr<const Snapshot> snapshot() const;
  // Leaves `member` out from now on: the live set without it, and every later set too.
  void Exclude(const std::shared_ptr<Member>& member);

 private:
  Result<std::shared_ptr<Member>> MakeMember(const NodeAddress& address, const std::string& zone);
  void Follow(const std::vector<membership::NodeRecord>& records);
  std::shared_ptr<const Snapshot> Current() const;
  // Leaves out the lingering members that failed since.
  void DropFailedLingering() const;
  // Of `left` (members the new set no longer lists), those that answer an echo within the
  // probe timeout, all asked at once.
  Members StillAnswering(const Members& left) const;
  void ApplyLocked(const std::vector<membership::NodeRecord>& records) REQUIRES(apply_mu_);

  const NodeClientOptions& options_;
  const OnChanged on_changed_;
  mutable Mutex mu_;
  // Mutable: snapshot() leaves out the lingering members that failed.
  mutable std::shared_ptr<const Snapshot> snapshot_ GUARDED_BY(mu_);
  mutable Mutex apply_mu_;  // one change at a time, in the source's order
  std::set<std::string> excluded_ GUARDED_BY(apply_mu_);  // by address
  mutable std::atomic<size_t> lingering_{0};              // lingering members in the live set
  std::unique_ptr<membership::MembershipWatcher> watcher_;
  std::shared_ptr<InMemoryMembers> in_memory_;
};

}  // namespace kvstash::connector
