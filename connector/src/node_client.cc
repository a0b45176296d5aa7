#include "kvstash/connector/node_client.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <charconv>
#include <deque>
#include <future>
#include <set>
#include <thread>

#include "cluster/node_health.h"
#include "cluster/placement.h"
#include "kvstash/common/logging.h"
#include "kvstash/common/mutex.h"
#include "kvstash/membership/membership.h"
#include "kvstash/proto/convert.h"
#include "kvstash/transport/call_group.h"

namespace kvstash::connector {
namespace {

using transport::Bytes;
using transport::CallOptions;
using transport::RpcClient;
using transport::ServerLimits;

// A call's outcome, copied out of the callback.
struct Outcome {
  Status status;
  std::vector<std::byte> reply;
  size_t payload_bytes = 0;
  transport::Clock::time_point ended;  // when the callback ran
};

template <typename Reply>
Status ParseReply(const Outcome& outcome, Reply* reply) {
  if (!outcome.status.ok()) return outcome.status;
  if (reply != nullptr &&
      !reply->ParseFromArray(outcome.reply.data(), static_cast<int>(outcome.reply.size()))) {
    return InternalError("unparseable reply of {} bytes", outcome.reply.size());
  }
  return Status::OK();
}

// A status naming the node it came from.
Status AtNode(const std::string& node, const Status& status) {
  return Status(status.code(), fmt::format("node {}: {}", node, status.message()));
}

// Indices of a node's keys in one call: [begin, end) of its list.
struct Chunk {
  size_t node = 0;
  size_t begin = 0, end = 0;
};

// Splits each node's key list into calls of at most `per_call[n]` keys. The chunks of a node
// come last chunk first, so that a node that applies them in arrival order (touches) applies
// the first keys last.
std::vector<Chunk> SplitLastFirst(const std::vector<std::vector<size_t>>& by_node,
                                  const std::vector<size_t>& per_call) {
  std::vector<Chunk> chunks;
  for (size_t n = 0; n < by_node.size(); ++n) {
    const size_t count = by_node[n].size();
    if (count == 0 || per_call[n] == 0) continue;
    const size_t calls = (count + per_call[n] - 1) / per_call[n];
    for (size_t c = calls; c-- > 0;) {
      chunks.push_back({n, c * per_call[n], std::min(count, (c + 1) * per_call[n])});
    }
  }
  return chunks;
}

}  // namespace

size_t KeysPerCall(const ServerLimits& limits) {
  // A node that states no key limit gets the daemon's default.
  size_t keys = limits.max_keys_per_request == 0 ? 4096 : limits.max_keys_per_request;
  if (limits.max_message_bytes != 0) {
    constexpr size_t kRequestOverhead = 64;  // the request's and the Lookup's own fields
    const size_t room = limits.max_message_bytes > kRequestOverhead
                            ? static_cast<size_t>(limits.max_message_bytes) - kRequestOverhead
                            : 0;
    keys = std::min(keys, room / kKeyWireBytes);
  }
  return std::max<size_t>(keys, 1);
}

Result<NodeAddress> ParseNodeAddress(std::string_view text) {
  const size_t colon = text.rfind(':');
  if (colon == std::string_view::npos || colon == 0) {
    return InvalidArgumentError("node '{}' is not HOST:PORT", text);
  }
  NodeAddress address;
  address.host = std::string(text.substr(0, colon));
  const std::string_view port = text.substr(colon + 1);
  unsigned value = 0;
  auto [end, ec] = std::from_chars(port.data(), port.data() + port.size(), value);
  if (port.empty() || ec != std::errc() || end != port.data() + port.size() || value == 0 ||
      value > 65535) {
    return InvalidArgumentError("node '{}' has no valid port (1..65535)", text);
  }
  address.port = static_cast<uint16_t>(value);
  return address;
}

Result<std::vector<NodeAddress>> ParseNodeAddresses(const std::vector<std::string>& texts) {
  std::vector<NodeAddress> out;
  out.reserve(texts.size());
  for (const std::string& text : texts) {
    KVSTASH_ASSIGN_OR_RETURN(NodeAddress address, ParseNodeAddress(text));
    out.push_back(std::move(address));
  }
  return out;
}

Status ApplyNodeSource(const NodeSource& source, NodeClientOptions* options) {
  const bool listed = !source.nodes.empty();
  if (listed && !source.etcd.empty()) {
    return InvalidArgumentError("give either --node(s) or --etcd with --cluster, not both");
  }
  if (source.etcd.empty() && !source.cluster.empty()) {
    return InvalidArgumentError("--cluster needs --etcd URL");
  }
  if (!listed && source.etcd.empty()) {
    return InvalidArgumentError(
        "no offload nodes: give --node(s) HOST:PORT, or --etcd URL with --cluster NAME");
  }
  if (!source.etcd.empty() && source.cluster.empty()) {
    return InvalidArgumentError("--etcd needs --cluster NAME (the nodes' kvstashd --cluster)");
  }
  if (source.replicas == 0 || source.replicas > kMaxReplicas) {
    return InvalidArgumentError("--replicas: {} is not within 1..{}", source.replicas,
                                kMaxReplicas);
  }
  options->nodes.clear();
  for (const std::string& item : source.nodes) {
    for (size_t begin = 0; begin <= item.size();) {
      const size_t comma = std::min(item.find(',', begin), item.size());
      KVSTASH_ASSIGN_OR_RETURN(
          NodeAddress node, ParseNodeAddress(std::string_view(item).substr(begin, comma - begin)));
      options->nodes.push_back(std::move(node));
      begin = comma + 1;
    }
  }
  if (!source.etcd.empty()) {
    if (auto endpoints = membership::ParseEtcdEndpoints(source.etcd); !endpoints.ok()) {
      return InvalidArgumentError("--etcd: {}", endpoints.status().message());
    }
    if (Status valid = membership::ValidateClusterName(source.cluster); !valid.ok()) {
      return InvalidArgumentError("--cluster: {}", valid.message());
    }
  }
  options->etcd = source.etcd;
  options->cluster = source.cluster;
  options->replicas = source.replicas;
  return Status::OK();
}

namespace {

// A live node: its address, its rendezvous hash and its connection (opened by the first call).
// Shared by the topologies that list it; the last one to go closes the connection.
struct Member {
  NodeAddress address;
  uint64_t hash = 0;
  std::shared_ptr<NodeHealth> state;
  std::unique_ptr<transport::Channel> channel;  // after state: its callbacks may use state
};
using Members = std::vector<std::shared_ptr<Member>>;

// The nodes one call works with: the live set when it began. Immutable.
struct Topology {
  Members members;
};

// Every call's outcome goes through Record: counters, and the logs that say when a node went
// down, came back, or refused something. Thread-safe.
class Accounting {
 public:
  void CallStarted() { calls_.fetch_add(1, std::memory_order_relaxed); }
  void Touched(size_t keys) { touched_keys_.fetch_add(keys, std::memory_order_relaxed); }
  void Pinned(size_t keys) { pinned_keys_.fetch_add(keys, std::memory_order_relaxed); }
  void Unserved(size_t keys) { unserved_.fetch_add(keys, std::memory_order_relaxed); }
  // A call not sent to a suspect node; a lookup's keys not answered within its budget.
  void Skipped() { skipped_.fetch_add(1, std::memory_order_relaxed); }
  void Probed() { probes_.fetch_add(1, std::memory_order_relaxed); }
  // A call to a replica given up (cancelled) once another answered.
  void Abandoned() { abandoned_.fetch_add(1, std::memory_order_relaxed); }
  void Late(size_t keys) { late_keys_.fetch_add(keys, std::memory_order_relaxed); }
  // A call refused here, before it went (what the node would refuse).
  void RefusedHere(NodeHealth& n, const Status& status) {
    refused_.fetch_add(1, std::memory_order_relaxed);
    n.RefusedHere(status);
  }
  void Repaired(size_t blocks) { repaired_.fetch_add(blocks, std::memory_order_relaxed); }
  void MembersChanged(size_t joined, size_t left) {
    joined_.fetch_add(joined, std::memory_order_relaxed);
    left_.fetch_add(left, std::memory_order_relaxed);
  }

  // Records the outcome of a call to a node (NodeHealth::Record: up, down, suspect, and the
  // logs): unreachable ones and refusals are counted.
  void Record(NodeHealth& n, const Status& status) {
    if (Unreachable(status)) unreachable_.fetch_add(1, std::memory_order_relaxed);
    if (n.Record(status)) refused_.fetch_add(1, std::memory_order_relaxed);
  }

  BlockStoreCounters counters() const {
    BlockStoreCounters c;
    c.calls = calls_.load(std::memory_order_relaxed);
    c.unreachable = unreachable_.load(std::memory_order_relaxed);
    c.refused = refused_.load(std::memory_order_relaxed);
    c.touched_keys = touched_keys_.load(std::memory_order_relaxed);
    c.pinned_keys = pinned_keys_.load(std::memory_order_relaxed);
    c.unserved_keys = unserved_.load(std::memory_order_relaxed);
    c.repaired_blocks = repaired_.load(std::memory_order_relaxed);
    c.members_joined = joined_.load(std::memory_order_relaxed);
    c.members_left = left_.load(std::memory_order_relaxed);
    c.skipped_calls = skipped_.load(std::memory_order_relaxed);
    c.late_keys = late_keys_.load(std::memory_order_relaxed);
    c.probes = probes_.load(std::memory_order_relaxed);
    c.abandoned_calls = abandoned_.load(std::memory_order_relaxed);
    return c;
  }

 private:
  std::atomic<uint64_t> calls_{0}, unreachable_{0}, refused_{0}, touched_keys_{0}, pinned_keys_{0},
      unserved_{0}, repaired_{0}, joined_{0}, left_{0}, skipped_{0}, late_keys_{0}, probes_{0},
      abandoned_{0};
};

// HIT over RETRY over MISS: the best of two replicas' answers.
LookupResult Better(LookupResult a, LookupResult b) {
  auto rank = [](LookupResult r) {
    return r == LookupResult::kHit ? 2 : r == LookupResult::kRetry ? 1 : 0;
  };
  return rank(b) > rank(a) ? b : a;
}

}  // namespace

class NodeClient::Impl {
 public:
  static constexpr std::chrono::microseconds kMaxPause{10000};

  explicit Impl(NodeClientOptions options) : options_(std::move(options)) {}

  // The watcher goes first (its callback changes the members); asynchronous calls in flight
  // end by their deadline, and their callbacks use this object.
  ~Impl() {
    watcher_.reset();
    WaitForTouches();
  }

  void WaitForTouches() {
    MutexLock lock(&async_mu_);
    while (async_in_flight_ != 0) async_cv_.Wait(&async_mu_);
  }

  Status Init() {
    const bool follow = !options_.etcd.empty() || !options_.cluster.empty();
    if (follow && !options_.nodes.empty()) {
      return InvalidArgumentError("give either nodes or an etcd cluster to follow, not both");
    }
    if (!follow && options_.nodes.empty()) return InvalidArgumentError("no nodes given");
    if (options_.replicas == 0 || options_.replicas > kMaxReplicas) {
      return InvalidArgumentError("replicas {} is not within 1..{}", options_.replicas,
                                  kMaxReplicas);
    }
    if (!options_.worker && !options_.connect) {
      KVSTASH_ASSIGN_OR_RETURN(options_.worker,
                               transport::ClientWorker::Create(options_.transport));
    }
    if (!follow) {
      // A fixed list: every node must be usable from the start.
      auto topology = std::make_shared<Topology>();
      for (const NodeAddress& address : options_.nodes) {
        KVSTASH_ASSIGN_OR_RETURN(std::shared_ptr<Member> member, MakeMember(address));
        topology->members.push_back(std::move(member));
      }
      MutexLock lock(&topology_mu_);
      topology_ = std::move(topology);
      return Status::OK();
    }
    if (options_.etcd.empty()) return InvalidArgumentError("a cluster to follow needs etcd");
    if (options_.cluster.empty()) return InvalidArgumentError("etcd needs a cluster name");
    membership::WatcherOptions watch;
    KVSTASH_ASSIGN_OR_RETURN(watch.etcd.endpoints, membership::ParseEtcdEndpoints(options_.etcd));
    watch.etcd.timeout = options_.etcd_timeout;
    watch.cluster = options_.cluster;
    watch.first_read_timeout = options_.etcd_first_read_timeout;
    KVSTASH_ASSIGN_OR_RETURN(watcher_,
                             membership::MembershipWatcher::Create(
                                 watch, [this](const std::vector<membership::NodeRecord>& members) {
                                   Follow(members);
                                 }));
    // Under apply_mu_, so that a change the watcher sees meanwhile is not overwritten by an
    // older set.
    MutexLock lock(&apply_mu_);
    ApplyLocked(watcher_->members());
    return Status::OK();
  }

  // Leaves `member` out of the members from now on (its block size is not this client's): the
  // live set without it, and every later set of the watcher too.
  void Exclude(const std::shared_ptr<Member>& member) {
    MutexLock apply(&apply_mu_);
    excluded_.insert(member->state->name());
    const std::shared_ptr<const Topology> current = Snapshot();
    auto next = std::make_shared<Topology>();
    for (const auto& m : current->members) {
      if (m != member) next->members.push_back(m);
    }
    if (next->members.size() == current->members.size()) return;  // already out
    MutexLock lock(&topology_mu_);
    topology_ = std::move(next);
  }

  // The watcher's set: applied in the order seen.
  void Follow(const std::vector<membership::NodeRecord>& records) {
    MutexLock lock(&apply_mu_);
    ApplyLocked(records);
  }

  // Makes `records` the live set: members still in it keep their connections (and the pins
  // this client holds there); new ones connect at their first call; those gone are closed once
  // no call uses them.
  void ApplyLocked(const std::vector<membership::NodeRecord>& records) REQUIRES(apply_mu_) {
    const std::shared_ptr<const Topology> current = Snapshot();
    std::map<std::string, std::shared_ptr<Member>> kept;
    if (current) {
      for (const auto& member : current->members) kept.emplace(member->state->name(), member);
    }
    auto next = std::make_shared<Topology>();
    size_t joined = 0;
    std::set<std::string> seen;
    for (const membership::NodeRecord& record : records) {
      if (!seen.insert(record.address).second) continue;
      if (excluded_.contains(record.address)) continue;  // another block size: never used
      if (auto it = kept.find(record.address); it != kept.end()) {
        next->members.push_back(it->second);
        kept.erase(it);
        continue;
      }
      Result<NodeAddress> address = ParseNodeAddress(record.address);
      Result<std::shared_ptr<Member>> member =
          address.ok() ? MakeMember(*address) : Result<std::shared_ptr<Member>>(address.status());
      if (!member.ok()) {
        KVSTASH_LOG_ERROR("cluster {}: node {} cannot be used, its keys go to the others: {}",
                          options_.cluster, record.address, member.status().ToString());
        continue;
      }
      next->members.push_back(*std::move(member));
      ++joined;
    }
    const size_t left = current ? kept.size() : 0;
    if (current) accounting_->MembersChanged(joined, left);
    if (next->members.empty()) {
      KVSTASH_LOG_WARN(
          "cluster {} has no live offload nodes: lookups miss and stores fail until one joins",
          options_.cluster);
    } else if (current) {
      KVSTASH_LOG_INFO("cluster {}: {} live node(s) ({} joined, {} left); keys move by rendezvous",
                       options_.cluster, next->members.size(), joined, left);
    }
    MutexLock lock(&topology_mu_);
    topology_ = std::move(next);
  }

  Result<std::shared_ptr<Member>> MakeMember(const NodeAddress& address) {
    transport::ClientOptions client;
    client.host = address.host;
    client.port = address.port;
    client.key_namespace = options_.key_namespace;
    client.auth_token = options_.auth_token;
    client.transport = options_.transport;
    client.connect_timeout = options_.connect_timeout;
    client.worker = options_.worker;
    auto member = std::make_shared<Member>();
    member->address = address;
    member->state = std::make_shared<NodeHealth>(
        address.ToString(), HealthOptions{options_.suspect_after, options_.probe_interval,
                                          options_.probe_timeout + options_.connect_timeout});
    member->hash = Xxh3Hash64(std::as_bytes(std::span(member->state->name())));
    if (options_.connect) {
      KVSTASH_ASSIGN_OR_RETURN(member->channel, options_.connect(client));
    } else {
      KVSTASH_ASSIGN_OR_RETURN(member->channel, RpcClient::Create(client));
    }
    return member;
  }

  std::shared_ptr<const Topology> Snapshot() const {
    MutexLock lock(&topology_mu_);
    return topology_;
  }

  std::vector<NodeAddress> nodes() const {
    std::vector<NodeAddress> out;
    for (const auto& member : Snapshot()->members) out.push_back(member->address);
    return out;
  }
  size_t node_count() const { return Snapshot()->members.size(); }
  // A member that left meanwhile reads as an empty address (never an exception).
  NodeAddress node(size_t i) const {
    const auto topology = Snapshot();
    return i < topology->members.size() ? topology->members[i]->address : NodeAddress{};
  }
  BlockStoreCounters counters() const { return accounting_->counters(); }
  size_t replicas() const { return options_.replicas; }

  // The `replicas` highest-ranked members of `members` for `key` (fewer when fewer are live).
  Placement Place(const Members& members, const BlockKey& key) const {
    return connector::Place(
        members.size(), [&](size_t i) { return members[i]->hash; }, key, options_.replicas);
  }

  std::optional<size_t> NodeOf(const BlockKey& key) const {
    const auto topology = Snapshot();
    const Placement p = Place(topology->members, key);
    if (p.count == 0) return std::nullopt;
    return p.nodes[0];
  }

  std::vector<NodeAddress> PlacesOf(const BlockKey& key) const {
    const auto topology = Snapshot();
    const Placement p = Place(topology->members, key);
    std::vector<NodeAddress> out;
    for (uint32_t r = 0; r < p.count; ++r) out.push_back(topology->members[p.nodes[r]]->address);
    return out;
  }

  std::vector<size_t> NodesOf(const BlockKey& key) const {
    const Placement p = Place(Snapshot()->members, key);
    return std::vector<size_t>(p.nodes.begin(), p.nodes.begin() + p.count);
  }

  // The limits of each member in `wanted` (by index), connecting to those not yet connected,
  // all at once (a first connection is waited for, at most connect_timeout, also by a lookup:
  // its budget counts from the calls). A suspect member that is not admitted (NodeHealth::Admit:
  // not its turn to be probed) gets Unavailable at once, unrecorded. A member that cannot be
  // connected gets its error (recorded here).
  std::vector<Result<ServerLimits>> LimitsOf(const Members& members,
                                             const std::vector<bool>& wanted) {
    std::vector<Result<ServerLimits>> limits(members.size(), Result<ServerLimits>(ServerLimits{}));
    std::vector<std::pair<size_t, std::future<Status>>> connecting;
    const auto now = NodeHealth::Clock::now();
    for (size_t n = 0; n < members.size(); ++n) {
      if (!wanted[n]) continue;
      NodeHealth& health = *members[n]->state;
      const NodeHealth::Admission admission = health.Admit(now);
      if (admission == NodeHealth::Admission::kProbe) StartProbe(members[n]);
      if (admission != NodeHealth::Admission::kGo) {
        accounting_->Skipped();
        limits[n] = UnavailableError(
            "node {} is suspect (it did not answer): skipped until it "
            "answers a probe",
            health.name());
        continue;
      }
      if (auto known = members[n]->channel->server_limits()) {
        limits[n] = *known;
        continue;
      }
      auto promise = std::make_shared<std::promise<Status>>();
      connecting.emplace_back(n, promise->get_future());
      members[n]->channel->ConnectAsync([promise](const Status& s) { promise->set_value(s); });
    }
    for (auto& [n, future] : connecting) {
      NodeHealth& health = *members[n]->state;
      const Status connected = future.get();
      std::optional<ServerLimits> known = members[n]->channel->server_limits();
      if (connected.ok() && known) {
        limits[n] = *known;
        if (options_.block_bytes != 0 && known->block_bytes != 0 &&
            known->block_bytes != options_.block_bytes) {
          limits[n] = FailedPreconditionError(
              "node {} stores blocks of {} bytes, this client's are {}: left out of the members",
              health.name(), known->block_bytes, options_.block_bytes);
          accounting_->RefusedHere(health, limits[n].status());
          Exclude(members[n]);
        }
      } else {
        const Status error =
            connected.ok() ? InternalError("connected without a hello") : connected;
        accounting_->Record(health, error);
        limits[n] = AtNode(health.name(), error);
      }
    }
    return limits;
  }

  Result<ServerLimits> Limits(size_t node) {
    const auto topology = Snapshot();
    if (node >= topology->members.size()) return OutOfRangeError("no node {}", node);
    std::vector<bool> wanted(topology->members.size(), false);
    wanted[node] = true;
    return std::move(LimitsOf(topology->members, wanted)[node]);
  }

  // Probes a suspect member: an echo with a deadline of its own (probe_timeout) that no
  // caller waits for; its outcome tells the member's health (an answer makes it up).
  void StartProbe(const std::shared_ptr<Member>& member) {
    accounting_->Probed();
    StartAsync(
        *member, wire::METHOD_ECHO, wire::EchoRequest(),
        [this, state = member->state](const Outcome& outcome) {
          accounting_->Record(*state, ParseReply(outcome, (wire::EchoReply*)nullptr));
        },
        options_.probe_timeout);
  }

  // Starts a call; `done` runs once on the progress thread with its outcome. Its deadline is
  // `timeout` from now (zero: the client's timeout). With `group`, the call is counted in it
  // (CallGroup::Track).
  template <typename Request>
  uint64_t StartWith(Member& member, wire::Method method, const Request& request,
                     CallOptions options, std::function<void(Outcome)> done,
                     transport::CallGroup* group = nullptr,
                     std::chrono::milliseconds timeout = {}) {
    options.deadline = transport::Clock::now() + (timeout.count() > 0 ? timeout : options_.timeout);
    const std::string bytes = request.SerializeAsString();
    accounting_->CallStarted();
    transport::ResponseCallback callback =
        [done = std::move(done)](const transport::Response& response) {
          done(Outcome{response.status,
                       std::vector<std::byte>(response.message.begin(), response.message.end()),
                       response.payload_bytes, transport::Clock::now()});
        };
    return member.channel->Call(static_cast<uint16_t>(method), std::as_bytes(std::span(bytes)),
                                options,
                                group != nullptr ? group->Track(std::move(callback)) : callback);
  }

  // Starts a call; the future holds its outcome.
  template <typename Request>
  std::future<Outcome> Start(Member& member, wire::Method method, const Request& request,
                             CallOptions options = {}) {
    auto promise = std::make_shared<std::promise<Outcome>>();
    std::future<Outcome> future = promise->get_future();
    StartWith(member, method, request, options,
              [promise](Outcome outcome) { promise->set_value(std::move(outcome)); });
    return future;
  }

  // Starts a call of `group`, whose Wait makes its same-host copies on the waiting thread (so
  // that every thread of the engine copies its own blocks); the future holds its outcome, ready
  // once the group's Wait returns.
  template <typename Request>
  std::future<Outcome> Start(transport::CallGroup& group, Member& member, wire::Method method,
                             const Request& request, CallOptions options) {
    auto promise = std::make_shared<std::promise<Outcome>>();
    std::future<Outcome> future = promise->get_future();
    options.copier = &group;
    StartWith(
        member, method, request, options,
        [promise](Outcome outcome) { promise->set_value(std::move(outcome)); }, &group);
    return future;
  }

  // Starts the PutBlock call of `block` under `key` to `member` in `group`; `done` gets its
  // outcome. Returns the call's id.
  uint64_t StartPut(transport::CallGroup& group, Member& member, const BlockKey& key, Bytes block,
                    std::function<void(Outcome)> done) {
    wire::PutBlockRequest put;
    *put.mutable_key() = wire::ToWire(key);
    put.set_length(block.size());
    // Over a network the node checks the bytes against this; a client on the node's host
    // copies them into the node's memory itself, where a checksum would guard nothing and
    // cost a hash of every block on both sides.
    if (!member.channel->payloads_mapped()) put.set_checksum(Xxh3Hash64(block));
    CallOptions options;
    options.send_payload = block;
    options.copier = &group;
    return StartWith(member, wire::METHOD_PUT_BLOCK, put, options, std::move(done), &group);
  }

  // The same, the future holding its outcome.
  std::future<Outcome> StartPut(transport::CallGroup& group, Member& member, const BlockKey& key,
                                Bytes block) {
    auto promise = std::make_shared<std::promise<Outcome>>();
    std::future<Outcome> future = promise->get_future();
    StartPut(group, member, key, block,
             [promise](Outcome outcome) { promise->set_value(std::move(outcome)); });
    return future;
  }

  // The keys of `keys` by member (each key at each of its replicas), in key order within each
  // member; which members have any.
  void ByNode(const Members& members, std::span<const BlockKey> keys,
              std::vector<std::vector<size_t>>* by_node, std::vector<bool>* wanted,
              std::vector<Placement>* places = nullptr) const {
    by_node->assign(members.size(), {});
    wanted->assign(members.size(), false);
    if (places != nullptr) places->resize(keys.size());
    for (size_t i = 0; i < keys.size(); ++i) {
      const Placement p = Place(members, keys[i]);
      if (places != nullptr) (*places)[i] = p;
      for (uint32_t r = 0; r < p.count; ++r) {
        (*by_node)[p.nodes[r]].push_back(i);
        (*wanted)[p.nodes[r]] = true;
      }
    }
  }

  // Per-key lookups, the best answer of each key's replicas; *refusal gets the first error that
  // is not an unreachable node.
  std::vector<LookupResult> Lookup(std::span<const BlockKey> keys, Status* refusal) {
    std::vector<LookupResult> states(keys.size(), LookupResult::kMiss);
    const auto topology = Snapshot();
    const Members& members = topology->members;
    std::vector<std::vector<size_t>> by_node;
    std::vector<bool> wanted;
    ByNode(members, keys, &by_node, &wanted);
    const std::vector<Result<ServerLimits>> limits = LimitsOf(members, wanted);
    // Nodes answer within the budget or their keys read as misses: never wait for the slowest.
    // A budget of the whole deadline waits for every call's outcome (each ends by then).
    const bool bounded = options_.lookup_budget < options_.timeout;
    const auto until = transport::Clock::now() + options_.lookup_budget;
    std::vector<size_t> per_call(members.size(), 0);
    for (size_t n = 0; n < members.size(); ++n) {
      if (!wanted[n]) continue;
      if (limits[n].ok()) {
        per_call[n] = KeysPerCall(*limits[n]);
      } else if (!Unreachable(limits[n].status()) && refusal->ok()) {
        *refusal = limits[n].status();
      }
    }
    const std::vector<Chunk> chunks = SplitLastFirst(by_node, per_call);
    // Per key: the replicas that answered MISS (with replicas, for repairs).
    std::vector<std::vector<std::shared_ptr<Member>>> missed_at(options_.replicas > 1 ? keys.size()
                                                                                      : 0);
    // Per key: a replica answered (or refused: counted as that); unserved keys otherwise.
    std::vector<bool> answered(keys.size(), false);
    for (size_t n = 0; n < members.size(); ++n) {
      if (wanted[n] && !limits[n].ok() && !Unreachable(limits[n].status())) {
        for (size_t i : by_node[n]) answered[i] = true;
      }
    }
    // Each call's transport outcome is recorded when it comes, also after the budget: a late
    // answer still says the node is there.
    std::vector<std::future<Outcome>> calls;
    calls.reserve(chunks.size());
    for (const Chunk& c : chunks) {
      wire::LookupRequest request;
      for (size_t j = c.begin; j < c.end; ++j) {
        wire::ToWire(keys[by_node[c.node][j]], request.add_keys());
      }
      auto promise = std::make_shared<std::promise<Outcome>>();
      calls.push_back(promise->get_future());
      StartWith(
          *members[c.node], wire::METHOD_LOOKUP, request, {},
          [accounting = accounting_, promise, state = members[c.node]->state](Outcome outcome) {
            accounting->Record(*state, outcome.status);
            promise->set_value(std::move(outcome));
          });
    }
    std::vector<bool> late(members.size(), false);
    for (size_t k = 0; k < chunks.size(); ++k) {
      const Chunk& c = chunks[k];
      Member& member = *members[c.node];
      const size_t count = c.end - c.begin;
      if (bounded && calls[k].wait_until(until) != std::future_status::ready) {
        // Misses unless another replica answers; the node is told once per lookup.
        if (!late[c.node]) member.state->Late();
        late[c.node] = true;
        accounting_->Late(count);
        continue;
      }
      const Outcome outcome = calls[k].get();
      if (!outcome.status.ok()) {
        if (Unreachable(outcome.status)) continue;  // misses unless another replica answers
        if (refusal->ok()) *refusal = AtNode(member.state->name(), outcome.status);
        for (size_t j = c.begin; j < c.end; ++j) answered[by_node[c.node][j]] = true;
        continue;  // misses, counted and logged
      }
      wire::LookupReply reply;
      Status status = ParseReply(outcome, &reply);
      if (status.ok() && reply.results_size() != static_cast<int>(count)) {
        status = InternalError("{} result(s) to a lookup of {} keys", reply.results_size(), count);
      }
      if (!status.ok()) {
        accounting_->Record(*member.state, status);
        if (refusal->ok()) *refusal = AtNode(member.state->name(), status);
        for (size_t j = c.begin; j < c.end; ++j) answered[by_node[c.node][j]] = true;
        continue;
      }
      for (size_t j = 0; j < count; ++j) {
        const size_t i = by_node[c.node][c.begin + j];
        const LookupResult result = wire::FromWire(reply.results(static_cast<int>(j)));
        answered[i] = true;
        states[i] = Better(states[i], result);
        if (result == LookupResult::kMiss && options_.replicas > 1) {
          missed_at[i].push_back(members[c.node]);
        }
      }
    }
    accounting_->Unserved(static_cast<size_t>(std::count(answered.begin(), answered.end(), false)));
    if (options_.replicas > 1) NoteRepairs(keys, states, missed_at);
    return states;
  }

  // Keys a lookup found on some of their replicas and missing on others (a node that joined,
  // or one that evicted its copy): the next read of each copies it to those others.
  void NoteRepairs(std::span<const BlockKey> keys, const std::vector<LookupResult>& states,
                   std::vector<std::vector<std::shared_ptr<Member>>>& missed_at) {
    MutexLock lock(&repairs_mu_);
    for (size_t i = 0; i < keys.size(); ++i) {
      if (states[i] != LookupResult::kHit || missed_at[i].empty()) continue;
      if (repairs_.size() >= kMaxRepairs && !repairs_.contains(keys[i])) continue;
      std::vector<std::weak_ptr<Member>>& to = repairs_[keys[i]];
      to.assign(missed_at[i].begin(), missed_at[i].end());
    }
    repairs_pending_.store(!repairs_.empty(), std::memory_order_relaxed);
  }

  // After a read: the blocks read whose key a lookup found missing on some replicas are stored
  // there, all at once, the caller waiting (only reads after a change of members pay this).
  void Repair(std::span<const BlockKey> keys, std::span<const transport::MutableBytes> outs,
              const std::vector<Result<size_t>>& results) {
    if (!repairs_pending_.load(std::memory_order_relaxed)) return;
    std::vector<std::pair<size_t, std::shared_ptr<Member>>> todo;  // key index, replica
    {
      MutexLock lock(&repairs_mu_);
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
      repairs_pending_.store(!repairs_.empty(), std::memory_order_relaxed);
    }
    if (todo.empty()) return;
    transport::CallGroup group;
    std::vector<std::future<Outcome>> calls;
    calls.reserve(todo.size());
    for (const auto& [i, member] : todo) {
      const Bytes block = outs[i].first(*results[i]);
      calls.push_back(StartPut(group, *member, keys[i], block));
    }
    group.Wait();
    size_t repaired = 0;
    for (size_t k = 0; k < todo.size(); ++k) {
      const Status status = ParseReply(calls[k].get(), (wire::PutBlockReply*)nullptr);
      accounting_->Record(*todo[k].second->state, status);
      repaired += status.ok() ? 1 : 0;
    }
    accounting_->Repaired(repaired);
  }

  // One PutBlock call per block and replica (the whole store), all in flight at once across
  // the nodes, last key first; the caller waits for the last. A block is stored once one of
  // its replicas holds it; a replica that cannot be reached is counted, not returned, while
  // another holds the block. A refusal is always returned.
  Status Put(std::span<const BlockKey> keys, std::span<const Bytes> blocks) {
    if (keys.size() != blocks.size()) {
      return InvalidArgumentError("{} keys for {} blocks", keys.size(), blocks.size());
    }
    if (keys.empty()) return Status::OK();
    const auto topology = Snapshot();
    const Members& members = topology->members;
    if (members.empty()) {
      accounting_->Unserved(keys.size());
      return UnavailableError("no live offload node in cluster {} for {} block(s)",
                              options_.cluster, keys.size());
    }
    std::vector<std::vector<size_t>> by_node;
    std::vector<bool> wanted;
    ByNode(members, keys, &by_node, &wanted);
    const std::vector<Result<ServerLimits>> limits = LimitsOf(members, wanted);
    Status refusal;                              // the first refusal, of any block
    std::vector<Status> unreached(keys.size());  // per block: a replica that did not answer
    std::vector<bool> stored(keys.size(), false);
    auto failed = [&](const Member& m, size_t i, const Status& status) {
      Status named(status.code(), fmt::format("node {}: block {}: {}", m.state->name(),
                                              keys[i].ToString(), status.message()));
      if (Unreachable(status)) {
        if (unreached[i].ok()) unreached[i] = std::move(named);
      } else if (refusal.ok()) {
        refusal = std::move(named);
      }
    };
    transport::CallGroup group;
    // Per block: its calls still out, and whether a replica holds it (written by the
    // callbacks, under settle_mu).
    struct Settle {
      Mutex mu;
      std::vector<uint32_t> out GUARDED_BY(mu);
      std::vector<bool> held GUARDED_BY(mu);
      size_t unsettled GUARDED_BY(mu) = 0;  // blocks with calls out and no replica holding them
    };
    auto settle = std::make_shared<Settle>();
    {
      MutexLock lock(&settle->mu);
      settle->out.assign(keys.size(), 0);
      settle->held.assign(keys.size(), false);
    }
    struct PutCall {
      Member* member;
      size_t key;
      uint64_t id = 0;
      std::future<Outcome> outcome;
    };
    std::vector<PutCall> puts;
    puts.reserve(keys.size() * options_.replicas);
    for (size_t i = keys.size(); i-- > 0;) {
      const Placement p = Place(members, keys[i]);
      for (uint32_t r = 0; r < p.count; ++r) {
        const size_t n = p.nodes[r];
        Member& member = *members[n];
        if (!limits[n].ok()) {
          // The node's name is in the status already.
          const Status& error = limits[n].status();
          if (Unreachable(error)) {
            if (unreached[i].ok()) {
              unreached[i] = Status(
                  error.code(), fmt::format("{}: block {}", error.message(), keys[i].ToString()));
            }
          } else if (refusal.ok()) {
            refusal = Status(error.code(),
                             fmt::format("{}: block {}", error.message(), keys[i].ToString()));
          }
          continue;
        }
        // What the node would refuse is refused here, without moving the bytes.
        Status refused;
        if (limits[n]->block_bytes != 0 && blocks[i].size() != limits[n]->block_bytes) {
          refused = InvalidArgumentError("a block of {} bytes; the node's block size is {}",
                                         blocks[i].size(), limits[n]->block_bytes);
        } else if (limits[n]->max_payload_bytes != 0 &&
                   blocks[i].size() > limits[n]->max_payload_bytes) {
          refused = InvalidArgumentError("a block of {} bytes; the largest payload is {}",
                                         blocks[i].size(), limits[n]->max_payload_bytes);
        }
        if (!refused.ok()) {
          accounting_->RefusedHere(*member.state, refused);  // its health is unchanged
          failed(member, i, refused);
          continue;
        }
        {
          MutexLock lock(&settle->mu);
          if (settle->out[i]++ == 0) ++settle->unsettled;
        }
        auto promise = std::make_shared<std::promise<Outcome>>();
        PutCall call{&member, i, 0, promise->get_future()};
        call.id = StartPut(group, member, keys[i], blocks[i], [settle, i, promise](Outcome o) {
          {
            MutexLock lock(&settle->mu);
            const bool was_unsettled = !settle->held[i];
            if (o.status.ok()) settle->held[i] = true;
            --settle->out[i];
            if (was_unsettled && (settle->held[i] || settle->out[i] == 0)) --settle->unsettled;
          }
          promise->set_value(std::move(o));
        });
        puts.push_back(std::move(call));
      }
    }
    const std::vector<bool> abandoned = WaitForReplicas(group, puts, [settle] {
      MutexLock lock(&settle->mu);
      return settle->unsettled == 0;
    });
    for (size_t k = 0; k < puts.size(); ++k) {
      auto& [member, i, id, future] = puts[k];
      const Status status = ParseReply(future.get(), (wire::PutBlockReply*)nullptr);
      // An abandoned call's node was told it was late; its cancel is no answer of its own.
      if (!abandoned[k] || status.ok()) accounting_->Record(*member->state, status);
      if (status.ok()) {
        stored[i] = true;
      } else {
        failed(*member, i, status);
      }
    }
    Status lost;  // the first key no replica took, all unreachable
    size_t unserved = 0;
    for (size_t i = keys.size(); i-- > 0;) {
      if (!stored[i] && !unreached[i].ok()) {
        ++unserved;
        if (lost.ok()) lost = unreached[i];
      }
    }
    accounting_->Unserved(unserved);
    return refusal.ok() ? lost : refusal;
  }

  // Waits for the calls of `group` (each with a `member` and an `id`): all of them, or, within
  // a budget (lookup_budget < timeout), until `settled` holds and then at most lookup_budget
  // more for the rest. Calls still out then (a replica that did not answer while another
  // did) are cancelled, their nodes told (NodeHealth::Late), and waited for: the transport
  // touches none of their buffers once their callbacks ran, which is at once unless a transfer
  // is under way (then by its deadline).
  // Which calls were abandoned so.
  template <typename Calls>
  std::vector<bool> WaitForReplicas(transport::CallGroup& group, Calls& calls,
                                    const std::function<bool()>& settled) {
    std::vector<bool> abandoned(calls.size(), false);
    if (options_.lookup_budget >= options_.timeout) {
      group.Wait();
      return abandoned;
    }
    const auto give_up = transport::Clock::now() + options_.timeout;
    if (!group.WaitUntil(settled, give_up) ||
        group.WaitUntil([] { return false; }, transport::Clock::now() + options_.lookup_budget)) {
      group.Wait();
      return abandoned;
    }
    std::set<Member*> late;
    for (size_t k = 0; k < calls.size(); ++k) {
      auto& call = calls[k];
      if (call.outcome.wait_for(std::chrono::seconds(0)) == std::future_status::ready) continue;
      call.member->channel->Cancel(call.id);
      abandoned[k] = true;
      if (late.insert(call.member).second) call.member->state->Late();
      accounting_->Abandoned();
    }
    group.Wait();
    return abandoned;
  }

  // One GetBlock per key (read from this client's pin, or pinned for the transfer by the node),
  // all in flight at once, from each key's best-ranked replica; a replica that does not hold
  // the block or cannot be reached passes the read to the next. Blocks a node is promoting from
  // SSD are asked for again until the timeout.
  std::vector<Result<size_t>> Get(std::span<const BlockKey> keys,
                                  std::span<const transport::MutableBytes> outs) {
    std::vector<Result<size_t>> results = ReadReplicas(keys, outs);
    if (keys.size() == outs.size()) Repair(keys, outs, results);
    return results;
  }

  std::vector<Result<size_t>> ReadReplicas(std::span<const BlockKey> keys,
                                           std::span<const transport::MutableBytes> outs) {
    std::vector<Result<size_t>> results(keys.size(), Result<size_t>(size_t{0}));
    if (keys.size() != outs.size()) {
      for (auto& r : results) {
        r = InvalidArgumentError("{} keys for {} buffers", keys.size(), outs.size());
      }
      return results;
    }
    const auto topology = Snapshot();
    const Members& members = topology->members;
    std::vector<Placement> places(keys.size());
    for (size_t i = 0; i < keys.size(); ++i) places[i] = Place(members, keys[i]);
    // Each member's limits, asked (connecting) only once a key's read comes to it.
    std::vector<Result<ServerLimits>> limits(members.size(), Result<ServerLimits>(ServerLimits{}));
    std::vector<bool> asked(members.size(), false);
    // Per key: the replica asked next, and the error to give if none has the block.
    std::vector<uint32_t> rank(keys.size(), 0);
    std::vector<Status> errors(keys.size());
    // The error a read gives when no replica has the block: a refusal, else a replica that
    // answered it does not hold it (a miss, whatever the others), else unreachable replicas.
    auto weight = [](const Status& s) {
      return s.ok() ? 0 : Unreachable(s) ? 1 : s.code() == StatusCode::kNotFound ? 2 : 3;
    };
    auto note_error = [&](size_t i, Status error) {
      if (weight(error) > weight(errors[i])) errors[i] = std::move(error);
    };
    // The end of key i's read without its block.
    auto give_error = [&](size_t i) {
      if (Unreachable(errors[i])) accounting_->Unserved(1);
      results[i] = errors[i];
    };
    std::vector<size_t> pending;
    for (size_t i = 0; i < keys.size(); ++i) {
      if (places[i].count == 0) {
        accounting_->Unserved(1);
        results[i] = UnavailableError("no live offload node in cluster {} for block {}",
                                      options_.cluster, keys[i].ToString());
      } else {
        pending.push_back(i);
      }
    }
    const auto give_up = transport::Clock::now() + options_.timeout;
    for (auto pause = std::chrono::microseconds(100);; pause = std::min(pause * 2, kMaxPause)) {
      // Members not yet asked are asked, all at once; keys whose replica at their rank cannot be
      // connected move on to the next rank.
      std::vector<size_t> ready;
      while (!pending.empty()) {
        std::vector<size_t> next;
        std::vector<bool> more(members.size(), false);
        bool any_more = false;
        for (size_t i : pending) {
          const size_t n = places[i].nodes[rank[i]];
          if (!asked[n]) {
            more[n] = true;
            any_more = true;
            next.push_back(i);
            continue;
          }
          if (limits[n].ok()) {
            ready.push_back(i);
            continue;
          }
          const Status& error = limits[n].status();
          note_error(i, Status(error.code(),
                               fmt::format("{}: block {}", error.message(), keys[i].ToString())));
          if (Unreachable(error) && ++rank[i] < places[i].count) {
            next.push_back(i);
          } else {
            give_error(i);
          }
        }
        if (any_more) {
          std::vector<Result<ServerLimits>> got = LimitsOf(members, more);
          for (size_t n = 0; n < members.size(); ++n) {
            if (more[n]) {
              limits[n] = std::move(got[n]);
              asked[n] = true;
            }
          }
        }
        pending = std::move(next);
      }
      if (ready.empty()) return results;
      transport::CallGroup group;
      std::vector<std::future<Outcome>> calls;
      std::vector<uint64_t> ids;
      calls.reserve(ready.size());
      const auto started = transport::Clock::now();
      for (size_t i : ready) {
        wire::GetBlockRequest get;
        *get.mutable_key() = wire::ToWire(keys[i]);
        CallOptions options;
        options.recv_payload = outs[i];
        options.copier = &group;
        auto promise = std::make_shared<std::promise<Outcome>>();
        calls.push_back(promise->get_future());
        ids.push_back(StartWith(
            *members[places[i].nodes[rank[i]]], wire::METHOD_GET_BLOCK, get, options,
            [promise](Outcome outcome) { promise->set_value(std::move(outcome)); }, &group));
      }
      const std::vector<bool> hedged =
          Hedge(group, members, places, rank, ready, calls, ids, started);
      group.Wait();
      bool wait = false;
      for (size_t j = 0; j < ready.size(); ++j) {
        const size_t i = ready[j];
        const Member& member = *members[places[i].nodes[rank[i]]];
        const Outcome outcome = calls[j].get();
        const Status& got = outcome.status;
        // A hedged read's node was told it was late (and its cancel is no answer of its own).
        if (!hedged[j] || got.ok()) accounting_->Record(*member.state, got);
        if (got.ok()) {
          member.state->ReadTook(outcome.ended - started);
          results[i] = outcome.payload_bytes;
          continue;
        }
        if (got.code() == StatusCode::kAborted && transport::Clock::now() + pause <= give_up) {
          pending.push_back(i);  // being promoted: the same replica again, after a pause
          wait = true;
          continue;
        }
        if (got.code() == StatusCode::kNotFound) {
          note_error(i, NotFoundError("node {} does not hold block {}", member.state->name(),
                                      keys[i].ToString()));
        } else {
          note_error(i,
                     Status(got.code(), fmt::format("node {}: block {}: {}", member.state->name(),
                                                    keys[i].ToString(), got.message())));
        }
        const bool passes = got.code() == StatusCode::kNotFound || Unreachable(got);
        if (passes && ++rank[i] < places[i].count) {
          pending.push_back(i);
        } else {
          give_error(i);
        }
      }
      if (pending.empty()) return results;
      if (wait) std::this_thread::sleep_for(pause);
    }
  }

  // Reads slower than their node's recent p99 (at least lookup_budget), of keys with another
  // replica to ask, are cancelled (their nodes told they were late) and go to that replica:
  // which of `ready` were. Calls that are not hedged are left to end by their deadline; the
  // caller waits for every callback (the transport no longer touches a cancelled call's buffer
  // once its callback ran).
  std::vector<bool> Hedge(transport::CallGroup& group, const Members& members,
                          const std::vector<Placement>& places, const std::vector<uint32_t>& rank,
                          const std::vector<size_t>& ready,
                          const std::vector<std::future<Outcome>>& calls,
                          const std::vector<uint64_t>& ids, transport::Clock::time_point started) {
    std::vector<bool> hedged(ready.size(), false);
    if (options_.lookup_budget >= options_.timeout) return hedged;
    // When each call with another replica to go to is hedged.
    std::vector<std::pair<transport::Clock::time_point, size_t>> at;
    for (size_t j = 0; j < ready.size(); ++j) {
      const size_t i = ready[j];
      if (rank[i] + 1 >= places[i].count) continue;
      const auto p99 = members[places[i].nodes[rank[i]]]->state->ReadP99();
      at.emplace_back(started + std::max<transport::Clock::duration>(options_.lookup_budget, p99),
                      j);
    }
    std::sort(at.begin(), at.end());
    std::set<NodeHealth*> late;
    for (const auto& [when, j] : at) {
      if (group.WaitUntil([] { return false; }, when)) break;  // every call came back
      if (calls[j].wait_for(std::chrono::seconds(0)) == std::future_status::ready) continue;
      Member& member = *members[places[ready[j]].nodes[rank[ready[j]]]];
      member.channel->Cancel(ids[j]);
      hedged[j] = true;
      accounting_->Abandoned();
      if (late.insert(member.state.get()).second) member.state->Late();
    }
    return hedged;
  }

  // The calls of a Request of `keys` (TouchRequest, LoadRequest, ReleaseRequest) to the
  // members of `by_node`: per member, split to its limits, each member's chunks last first (a
  // node applies them in arrival order, so a touch's first keys end most recent). `start`
  // starts each call; members that cannot be reached are skipped (recorded by LimitsOf).
  template <typename Request, typename StartFn>
  Status StartKeyCalls(const Members& members, const std::vector<std::vector<size_t>>& by_node,
                       const std::vector<bool>& wanted, std::span<const BlockKey> keys,
                       StartFn start) {
    const std::vector<Result<ServerLimits>> limits = LimitsOf(members, wanted);
    Status first;
    std::vector<size_t> per_call(members.size(), 0);
    for (size_t n = 0; n < members.size(); ++n) {
      if (!wanted[n]) continue;
      if (limits[n].ok()) {
        per_call[n] = KeysPerCall(*limits[n]);
      } else if (first.ok()) {
        first = limits[n].status();
      }
    }
    for (const Chunk& c : SplitLastFirst(by_node, per_call)) {
      Request request;
      for (size_t j = c.begin; j < c.end; ++j) {
        wire::ToWire(keys[by_node[c.node][j]], request.add_keys());
      }
      start(*members[c.node], request);
    }
    return first;
  }

  // As above, to each key's replicas in the live set.
  template <typename Request, typename StartFn>
  Status StartKeyCalls(std::span<const BlockKey> keys, StartFn start) {
    const auto topology = Snapshot();
    std::vector<std::vector<size_t>> by_node;
    std::vector<bool> wanted;
    ByNode(topology->members, keys, &by_node, &wanted);
    return StartKeyCalls<Request>(topology->members, by_node, wanted, keys, start);
  }

  // Starts `method` with `request` on `member` without waiting: `done` gets the outcome, and
  // the destructor (WaitForTouches) waits for it.
  template <typename Request>
  void StartAsync(Member& member, wire::Method method, const Request& request,
                  std::function<void(const Outcome&)> done,
                  std::chrono::milliseconds timeout = {}) {
    {
      MutexLock lock(&async_mu_);
      ++async_in_flight_;
    }
    StartWith(
        member, method, request, {},
        [this, done = std::move(done)](Outcome outcome) {
          done(outcome);
          // Under the lock: the destructor cannot go on until this callback is done with *this.
          MutexLock lock(&async_mu_);
          --async_in_flight_;
          async_cv_.SignalAll();
        },
        nullptr, timeout);
  }

  // Pins each key at its replicas, and remembers where: the release goes there even if the
  // members have changed since.
  void Pin(std::span<const BlockKey> keys) {
    if (keys.empty()) return;
    const auto topology = Snapshot();
    const Members& members = topology->members;
    std::vector<std::vector<size_t>> by_node;
    std::vector<bool> wanted;
    std::vector<Placement> places;
    ByNode(members, keys, &by_node, &wanted, &places);
    {
      MutexLock lock(&pins_mu_);
      for (size_t i = 0; i < keys.size(); ++i) {
        std::vector<std::weak_ptr<Member>> at;
        const Placement& p = places[i];
        for (uint32_t r = 0; r < p.count; ++r) at.push_back(members[p.nodes[r]]);
        pins_[keys[i]].push_back(std::move(at));
      }
    }
    (void)StartKeyCalls<wire::LoadRequest>(
        members, by_node, wanted, keys, [this](Member& member, const wire::LoadRequest& request) {
          StartAsync(member, wire::METHOD_LOAD, request,
                     [this, state = member.state](const Outcome& outcome) {
                       wire::LoadReply reply;
                       const Status status = ParseReply(outcome, &reply);
                       accounting_->Record(*state, status);
                       if (status.ok()) {
                         accounting_->Pinned(static_cast<size_t>(
                             std::count(reply.pinned().begin(), reply.pinned().end(), true)));
                       }
                     });
        });
  }

  // Releases each key where its oldest outstanding Pin went (members that have since closed
  // released it with their connection); a key never pinned goes to its replicas now.
  void Unpin(std::span<const BlockKey> keys) {
    if (keys.empty()) return;
    const auto topology = Snapshot();
    Members members;
    std::map<const Member*, size_t> index;
    std::vector<std::vector<size_t>> by_node;
    auto add = [&](const std::shared_ptr<Member>& member, size_t key) {
      auto [it, fresh] = index.emplace(member.get(), members.size());
      if (fresh) {
        members.push_back(member);
        by_node.emplace_back();
      }
      by_node[it->second].push_back(key);
    };
    {
      MutexLock lock(&pins_mu_);
      for (size_t i = 0; i < keys.size(); ++i) {
        auto it = pins_.find(keys[i]);
        if (it == pins_.end()) {
          const Placement p = Place(topology->members, keys[i]);
          for (uint32_t r = 0; r < p.count; ++r) add(topology->members[p.nodes[r]], i);
          continue;
        }
        for (const std::weak_ptr<Member>& weak : it->second.front()) {
          if (std::shared_ptr<Member> member = weak.lock()) add(member, i);
        }
        it->second.pop_front();
        if (it->second.empty()) pins_.erase(it);
      }
    }
    const std::vector<bool> wanted(members.size(), true);
    (void)StartKeyCalls<wire::ReleaseRequest>(
        members, by_node, wanted, keys,
        [this](Member& member, const wire::ReleaseRequest& request) {
          StartAsync(member, wire::METHOD_RELEASE, request,
                     [this, state = member.state](const Outcome& outcome) {
                       accounting_->Record(*state,
                                           ParseReply(outcome, (wire::ReleaseReply*)nullptr));
                     });
        });
  }

  void Touch(std::span<const BlockKey> keys) {
    if (keys.empty()) return;
    (void)StartKeyCalls<wire::TouchRequest>(
        keys, [this](Member& member, const wire::TouchRequest& request) {
          accounting_->Touched(static_cast<size_t>(request.keys_size()));
          StartAsync(member, wire::METHOD_TOUCH, request,
                     [this, state = member.state](const Outcome& outcome) {
                       accounting_->Record(*state, ParseReply(outcome, (wire::TouchReply*)nullptr));
                     });
        });
  }

  Status TouchSync(std::span<const BlockKey> keys) {
    std::vector<std::pair<std::shared_ptr<NodeHealth>, std::future<Outcome>>> calls;
    Status first = StartKeyCalls<wire::TouchRequest>(
        keys, [&](Member& member, const wire::TouchRequest& request) {
          accounting_->Touched(static_cast<size_t>(request.keys_size()));
          calls.emplace_back(member.state, Start(member, wire::METHOD_TOUCH, request));
        });
    for (auto& [state, future] : calls) {
      const Status status = ParseReply(future.get(), (wire::TouchReply*)nullptr);
      accounting_->Record(*state, status);
      if (!status.ok() && first.ok()) first = AtNode(state->name(), status);
    }
    return first;
  }

  // The index of `address` in `topology`; NotFound when it is not a member.
  static Result<size_t> IndexOf(const Topology& topology, const NodeAddress& address) {
    for (size_t n = 0; n < topology.members.size(); ++n) {
      if (topology.members[n]->address.host == address.host &&
          topology.members[n]->address.port == address.port) {
        return n;
      }
    }
    return NotFoundError("node {} is not a member now", address.ToString());
  }

  Result<ServerLimits> Limits(const NodeAddress& address) {
    const auto topology = Snapshot();
    KVSTASH_ASSIGN_OR_RETURN(const size_t node, IndexOf(*topology, address));
    std::vector<bool> wanted(topology->members.size(), false);
    wanted[node] = true;
    return std::move(LimitsOf(topology->members, wanted)[node]);
  }

  Result<std::map<std::string, uint64_t>> Stats(const NodeAddress& address) {
    const auto topology = Snapshot();
    KVSTASH_ASSIGN_OR_RETURN(const size_t node, IndexOf(*topology, address));
    return StatsOf(*topology->members[node]);
  }

  Result<std::map<std::string, uint64_t>> Stats(size_t node) {
    const auto topology = Snapshot();
    if (node >= topology->members.size()) return OutOfRangeError("no node {}", node);
    return StatsOf(*topology->members[node]);
  }

  Result<std::map<std::string, uint64_t>> StatsOf(Member& member) {
    wire::StatsReply reply;
    const Status status =
        ParseReply(Start(member, wire::METHOD_STATS, wire::StatsRequest()).get(), &reply);
    accounting_->Record(*member.state, status);
    if (!status.ok()) return AtNode(member.state->name(), status);
    return std::map<std::string, uint64_t>(reply.counters().begin(), reply.counters().end());
  }

  std::string node_name(size_t node) const {
    const auto topology = Snapshot();
    return node < topology->members.size() ? topology->members[node]->state->name()
                                           : fmt::format("#{}", node);
  }

 private:
  NodeClientOptions options_;
  // Shared with the callbacks of lookups that came back after their budget.
  std::shared_ptr<Accounting> accounting_ = std::make_shared<Accounting>();
  mutable Mutex topology_mu_;
  std::shared_ptr<const Topology> topology_ GUARDED_BY(topology_mu_);
  Mutex apply_mu_;  // one membership change at a time, in the watcher's order
  // Nodes left out for their block size (Exclude), by address.
  std::set<std::string> excluded_ GUARDED_BY(apply_mu_);
  // Where each pinned key's Pins went, oldest first.
  // Blocks to copy to replicas that lack them at their next read (NoteRepairs), at most
  // kMaxRepairs keys.
  static constexpr size_t kMaxRepairs = 1 << 16;
  Mutex repairs_mu_;
  std::map<BlockKey, std::vector<std::weak_ptr<Member>>> repairs_ GUARDED_BY(repairs_mu_);
  std::atomic<bool> repairs_pending_{false};
  Mutex pins_mu_;
  std::map<BlockKey, std::deque<std::vector<std::weak_ptr<Member>>>> pins_ GUARDED_BY(pins_mu_);
  // Asynchronous calls (touches, pins, releases) still out.
  Mutex async_mu_;
  CondVar async_cv_;
  size_t async_in_flight_ GUARDED_BY(async_mu_) = 0;
  std::unique_ptr<membership::MembershipWatcher> watcher_;  // last: it goes first
};

Result<std::unique_ptr<NodeClient>> NodeClient::Create(NodeClientOptions options) {
  auto impl = std::make_unique<Impl>(std::move(options));
  KVSTASH_RETURN_IF_ERROR(impl->Init());
  return std::unique_ptr<NodeClient>(new NodeClient(std::move(impl)));
}

NodeClient::NodeClient(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
NodeClient::~NodeClient() = default;

size_t NodeClient::node_count() const { return impl_->node_count(); }
NodeAddress NodeClient::node(size_t i) const { return impl_->node(i); }
std::vector<NodeAddress> NodeClient::nodes() const { return impl_->nodes(); }
size_t NodeClient::replicas() const { return impl_->replicas(); }
size_t NodeClient::NodeOf(const BlockKey& key) const {
  return impl_->NodeOf(key).value_or(impl_->node_count());
}
std::vector<NodeAddress> NodeClient::PlacesOf(const BlockKey& key) const {
  return impl_->PlacesOf(key);
}
std::vector<size_t> NodeClient::NodesOf(const BlockKey& key) const { return impl_->NodesOf(key); }
Result<transport::ServerLimits> NodeClient::Limits(size_t node) { return impl_->Limits(node); }

std::vector<LookupResult> NodeClient::Lookup(std::span<const BlockKey> keys) {
  Status refusal;
  return impl_->Lookup(keys, &refusal);  // counted and logged by the client
}

Result<std::vector<LookupResult>> NodeClient::LookupStrict(std::span<const BlockKey> keys) {
  Status refusal;
  std::vector<LookupResult> states = impl_->Lookup(keys, &refusal);
  if (!refusal.ok()) return refusal;
  return states;
}

std::optional<size_t> NodeClient::LookupPrefix(std::span<const BlockKey> keys) {
  const std::vector<LookupResult> states = Lookup(keys);
  return MaximalPrefix(states.size(), [&](size_t i) { return states[i]; });
}

Status NodeClient::Put(std::span<const BlockKey> keys, std::span<const transport::Bytes> blocks) {
  return impl_->Put(keys, blocks);
}
Result<size_t> NodeClient::Get(const BlockKey& key, transport::MutableBytes out) {
  return std::move(impl_->Get(std::span(&key, 1), std::span(&out, 1))[0]);
}
std::vector<Result<size_t>> NodeClient::Get(std::span<const BlockKey> keys,
                                            std::span<const transport::MutableBytes> outs) {
  return impl_->Get(keys, outs);
}
void NodeClient::Touch(std::span<const BlockKey> keys) { impl_->Touch(keys); }
void NodeClient::Pin(std::span<const BlockKey> keys) { impl_->Pin(keys); }
void NodeClient::Unpin(std::span<const BlockKey> keys) { impl_->Unpin(keys); }
Status NodeClient::TouchSync(std::span<const BlockKey> keys) { return impl_->TouchSync(keys); }
void NodeClient::WaitForTouches() { impl_->WaitForTouches(); }
Result<std::map<std::string, uint64_t>> NodeClient::Stats(const NodeAddress& node) {
  return impl_->Stats(node);
}
Result<transport::ServerLimits> NodeClient::Limits(const NodeAddress& node) {
  return impl_->Limits(node);
}
Result<std::map<std::string, uint64_t>> NodeClient::Stats(size_t node) {
  return impl_->Stats(node);
}
Result<uint64_t> NodeClient::BlockBytes(size_t node) {
  KVSTASH_ASSIGN_OR_RETURN(const transport::ServerLimits limits, impl_->Limits(node));
  if (limits.block_bytes == 0) {
    return FailedPreconditionError("node {} stores no blocks (a bare transport)",
                                   impl_->node_name(node));
  }
  return limits.block_bytes;
}
BlockStoreCounters NodeClient::counters() const { return impl_->counters(); }
uint64_t NodeClient::unreachable() const { return impl_->counters().unreachable; }

}  // namespace kvstash::connector
