#pragma once

// A kvstash cluster's membership in etcd. Each node keeps a key under the cluster's prefix,
// "/kvstash/<cluster>/nodes/<address>", holding its NodeRecord as JSON and bound to a lease it
// keeps alive (Registration), so a node that dies leaves the set once its lease expires.
// Clients read the prefix and watch it (MembershipWatcher). etcd does the consensus. The rules
// a client and a node follow: docs/semantics.md §15. Engine workers that register
// (kvstash-engine serve --register) keep theirs under "/kvstash/<cluster>/workers/<address>"
// the same way, for routers to find (§20).

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "kvstash/common/mutex.h"
#include "kvstash/common/status.h"
#include "kvstash/membership/etcd_client.h"

namespace kvstash::membership {

// InvalidArgument unless `cluster` is 1..64 of [A-Za-z0-9._-].
Status ValidateClusterName(std::string_view cluster);
// Who keeps keys in a cluster: offload nodes, or engine workers.
enum class MemberKind : uint8_t { kNode, kWorker };

// The HOST:PORT a member publishes: `advertise` (HOST, or HOST:PORT) when given, else the
// address it listens on with `port`. InvalidArgument, naming the flag's value, for a bad port or
// no host, and when neither names an address others can reach (listening on every address).
Result<std::string> AdvertisedAddress(std::string_view advertise, std::string_view listen,
                                      uint16_t port);

// "/kvstash/<cluster>/nodes/", or ".../workers/".
std::string MembersPrefix(std::string_view cluster, MemberKind kind = MemberKind::kNode);

// What a node publishes of itself.
struct NodeRecord {
  // HOST:PORT clients connect to; its text is the member's identity and placement hash
  // (docs/semantics.md §15, §16).
  std::string address;
  uint64_t block_bytes = 0;
  uint64_t cpu_bytes = 0;
  uint64_t ssd_bytes = 0;  // 0: no SSD tier
  std::string policy;      // "lru", "arc" or "aflru"
  std::string zone;        // failure domain (kvstashd --zone; docs/semantics.md §16); empty: none
  // A node's KV events (kvstashd --kv-events, --kv-events-replay) as it bound them, for a router
  // to follow (a wildcard host is reached at the address's host); empty: it publishes none.
  std::string kv_events;
  std::string kv_events_replay;
  // A worker's role ("prefill", "decode", "both"); empty for a node. A worker's record has no
  // block size or tiers: a router reads its model and events from its /v1/models.
  std::string role;

  std::string ToJson() const;
  // InvalidArgument for JSON that is not a record, or one without an address.
  static Result<NodeRecord> FromJson(std::string_view json);
  bool operator==(const NodeRecord&) const = default;
};

struct RegistrationOptions {
  EtcdOptions etcd;
  std::string cluster;
  MemberKind kind = MemberKind::kNode;
  NodeRecord record;
  int64_t ttl_s = 10;  // the lease's TTL; it is refreshed every third of it
};

struct RegistrationStats {
  bool registered = false;     // the key is in etcd, as far as this node knows
  uint64_t registrations = 0;  // times the key was written (again after a lost lease)
  uint64_t errors = 0;         // failed calls to etcd
  std::string last_error;      // of the last failed call; empty once one succeeds
};

// Keeps one node registered: grants a lease, writes the node's key bound to it, refreshes the
// lease, and writes the key again under a new lease if the old one was lost (etcd down for
// longer than the TTL). While etcd cannot be reached it retries every second and logs the
// failure once. Owns a thread. Thread-safe.
class Registration {
 public:
  // Starts registering in the background; fails only on bad options.
  static Result<std::unique_ptr<Registration>> Create(RegistrationOptions options);
  ~Registration();  // Stop()
  Registration(const Registration&) = delete;
  Registration& operator=(const Registration&) = delete;

  // Deletes the key and revokes the lease (each bounded by the etcd timeout), then stops.
  // Idempotent.
  void Stop();
  RegistrationStats stats() const;
  const std::string& key() const { return key_; }

 private:
  explicit Registration(RegistrationOptions options, std::unique_ptr<EtcdClient> etcd);
  void Run();
  // Waits `for` or until Stop(): false when stopping.
  bool Sleep(std::chrono::milliseconds duration);
  void Failed(const Status& status, std::string_view what);

  const RegistrationOptions options_;
  const std::string key_;
  const std::unique_ptr<EtcdClient> etcd_;
  mutable Mutex mu_;
  CondVar cv_;
  bool stopping_ GUARDED_BY(mu_) = false;
  RegistrationStats stats_ GUARDED_BY(mu_);
  int64_t lease_ GUARDED_BY(mu_) = 0;
  std::thread thread_;
};

struct WatcherOptions {
  EtcdOptions etcd;
  std::string cluster;
  MemberKind kind = MemberKind::kNode;  // the members it follows
  // How long Create waits for the first read of the members.
  std::chrono::milliseconds first_read_timeout{5000};
};

struct WatcherStats {
  bool connected = false;  // the watch is open
  uint64_t changes = 0;    // members that joined or left, as seen here
  uint64_t errors = 0;     // reads or watches that failed
};

// Follows a cluster's members: reads them, then watches the prefix. While etcd cannot be
// reached it keeps the last set it knew and retries every second. `on_change` runs with the
// whole new set (sorted by address) after every change, on the watcher's thread; keep it short.
// Owns a thread. Thread-safe.
class MembershipWatcher {
 public:
  using OnChange = std::function<void(const std::vector<NodeRecord>& members)>;
  // Reads the members once before it returns: Unavailable (naming etcd's endpoints) when etcd
  // does not answer within first_read_timeout, InvalidArgument for bad options. `on_change`
  // runs for later changes only; members() has the first set.
  static Result<std::unique_ptr<MembershipWatcher>> Create(WatcherOptions options,
                                                           OnChange on_change);
  ~MembershipWatcher();
  MembershipWatcher(const MembershipWatcher&) = delete;
  MembershipWatcher& operator=(const MembershipWatcher&) = delete;

  std::vector<NodeRecord> members() const;
  WatcherStats stats() const;

 private:
  MembershipWatcher(WatcherOptions options, std::unique_ptr<EtcdClient> etcd, OnChange on_change);
  void Run(int64_t revision);
  // Reads the whole set: its revision.
  Result<int64_t> ReadAll();
  // Replaces the set (by key), logging who joined and left; runs on_change when it changed.
  void Apply(std::map<std::string, NodeRecord> next);

  const WatcherOptions options_;
  const std::string prefix_;
  const std::unique_ptr<EtcdClient> etcd_;
  const OnChange on_change_;
  mutable Mutex mu_;
  CondVar cv_;
  bool stopping_ GUARDED_BY(mu_) = false;
  std::map<std::string, NodeRecord> members_ GUARDED_BY(mu_);  // by key
  WatcherStats stats_ GUARDED_BY(mu_);
  std::atomic<bool> notify_{false};  // on_change runs: set once the first read is done
  std::atomic<bool> done_{false};
  std::thread thread_;
};

}  // namespace kvstash::membership
