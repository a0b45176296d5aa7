#include "cluster/members.h"

#include <future>
#include <map>
#include <utility>

#include "kvstash/common/hash.h"
#include "kvstash/common/logging.h"
#include "kvstash/proto/wire.pb.h"

namespace kvstash::connector {

std::shared_ptr<Member> Snapshot::Find(const NodeAddress& address) const {
  for (const auto& member : members) {
    if (member->address.host == address.host && member->address.port == address.port) {
      return member;
    }
  }
  return nullptr;
}

void InMemoryMembers::Set(std::vector<membership::NodeRecord> records) {
  OnChange on_change;
  {
    MutexLock lock(&mu_);
    records_ = records;
    on_change = on_change_;
  }
  // Outside the lock: the client reads records() while it starts, under its own lock.
  if (on_change) on_change(records);
}

std::vector<membership::NodeRecord> InMemoryMembers::records() const {
  MutexLock lock(&mu_);
  return records_;
}

void InMemoryMembers::Follow(OnChange on_change) {
  MutexLock lock(&mu_);
  on_change_ = std::move(on_change);
}

MemberSet::MemberSet(const NodeClientOptions& options, OnChanged on_changed)
    : options_(options), on_changed_(std::move(on_changed)) {}

MemberSet::~MemberSet() { Stop(); }

void MemberSet::Stop() {
  watcher_.reset();
  if (in_memory_) in_memory_->Follow(nullptr);
}

Status MemberSet::Start() {
  const bool follow = !options_.etcd.empty() || !options_.cluster.empty();
  const int sources =
      (follow ? 1 : 0) + (options_.nodes.empty() ? 0 : 1) + (options_.members != nullptr ? 1 : 0);
  if (sources > 1) {
    return InvalidArgumentError(
        "give one source of nodes: a list, an etcd cluster to follow, "
        "or in-memory members");
  }
  if (sources == 0) return InvalidArgumentError("no nodes given");
  if (!options_.nodes.empty()) {
    // A fixed list: every node must be usable from the start.
    auto snapshot = std::make_shared<Snapshot>();
    for (const NodeAddress& address : options_.nodes) {
      KVSTASH_ASSIGN_OR_RETURN(std::shared_ptr<Member> member, MakeMember(address, ""));
      snapshot->members.push_back(std::move(member));
    }
    MutexLock lock(&mu_);
    snapshot_ = std::move(snapshot);
    return Status::OK();
  }
  // Under apply_mu_, so that a change the source sees meanwhile is not overwritten by an
  // older set.
  if (options_.members != nullptr) {
    in_memory_ = options_.members;
    in_memory_->Follow([this](const auto& records) { Follow(records); });
    MutexLock lock(&apply_mu_);
    ApplyLocked(in_memory_->records());
    return Status::OK();
  }
  if (options_.etcd.empty()) return InvalidArgumentError("a cluster to follow needs etcd");
  if (options_.cluster.empty()) return InvalidArgumentError("etcd needs a cluster name");
  membership::WatcherOptions watch;
  KVSTASH_ASSIGN_OR_RETURN(watch.etcd.endpoints, membership::ParseEtcdEndpoints(options_.etcd));
  watch.etcd.timeout = options_.etcd_timeout;
  watch.cluster = options_.cluster;
  watch.first_read_timeout = options_.etcd_first_read_timeout;
  KVSTASH_ASSIGN_OR_RETURN(
      watcher_,
      membership::MembershipWatcher::Create(
          watch, [this](const std::vector<membership::NodeRecord>& members) { Follow(members); }));
  MutexLock lock(&apply_mu_);
  ApplyLocked(watcher_->members());
  return Status::OK();
}

std::shared_ptr<const Snapshot> MemberSet::Current() const {
  MutexLock lock(&mu_);
  return snapshot_;
}

std::shared_ptr<const Snapshot> MemberSet::snapshot() const {
  std::shared_ptr<const Snapshot> current = Current();
  if (lingering_.load(std::memory_order_acquire) == 0) return current;
  // Lock-free unless a lingering member has failed: every call passes here.
  for (const auto& member : current->members) {
    if (member->state->lingering() && member->state->suspect()) {
      DropFailedLingering();
      return Current();
    }
  }
  return current;
}

void MemberSet::DropFailedLingering() const {
  MutexLock apply(&apply_mu_);
  const std::shared_ptr<const Snapshot> current = Current();
  auto next = std::make_shared<Snapshot>();
  size_t lingering = 0, dropped = 0;
  for (const auto& member : current->members) {
    if (member->state->lingering() && member->state->suspect()) {
      KVSTASH_LOG_INFO(
          "cluster {}: node {} left (its source had dropped it, and now it does not "
          "answer either); its keys go to the others",
          options_.cluster, member->state->name());
      ++dropped;
      continue;
    }
    lingering += member->state->lingering() ? 1 : 0;
    next->members.push_back(member);
  }
  lingering_.store(lingering, std::memory_order_release);
  if (dropped == 0) return;
  on_changed_(0, dropped);
  MutexLock lock(&mu_);
  snapshot_ = std::move(next);
}

Members MemberSet::StillAnswering(const Members& left) const {
  std::vector<std::pair<std::shared_ptr<Member>, std::future<bool>>> probes;
  const std::string echo = wire::EchoRequest().SerializeAsString();
  for (const auto& member : left) {
    if (member->state->suspect()) continue;
    auto answered = std::make_shared<std::promise<bool>>();
    probes.emplace_back(member, answered->get_future());
    transport::CallOptions call;
    call.deadline = transport::Clock::now() + options_.probe_timeout;
    member->channel->Call(static_cast<uint16_t>(wire::METHOD_ECHO), std::as_bytes(std::span(echo)),
                          call, [answered](const transport::Response& response) {
                            answered->set_value(!Unreachable(response.status));
                          });
  }
  Members out;
  for (auto& [member, answered] : probes) {
    if (answered.get()) out.push_back(member);
  }
  return out;
}

void MemberSet::Exclude(const std::shared_ptr<Member>& member) {
  MutexLock apply(&apply_mu_);
  excluded_.insert(member->state->name());
  const std::shared_ptr<const Snapshot> current = Current();
  auto next = std::make_shared<Snapshot>();
  for (const auto& m : current->members) {
    if (m != member) next->members.push_back(m);
  }
  if (next->members.size() == current->members.size()) return;  // already out
  MutexLock lock(&mu_);
  snapshot_ = std::move(next);
}

void MemberSet::Follow(const std::vector<membership::NodeRecord>& records) {
  MutexLock lock(&apply_mu_);
  ApplyLocked(records);
}

void MemberSet::ApplyLocked(const std::vector<membership::NodeRecord>& records) {
  const std::shared_ptr<const Snapshot> current = Current();
  std::map<std::string, std::shared_ptr<Member>> kept;
  if (current) {
    for (const auto& member : current->members) kept.emplace(member->state->name(), member);
  }
  auto next = std::make_shared<Snapshot>();
  size_t joined = 0;
  std::set<std::string> seen;
  for (const membership::NodeRecord& record : records) {
    if (!seen.insert(record.address).second) continue;
    if (excluded_.contains(record.address)) continue;  // another block size: never used
    if (auto it = kept.find(record.address); it != kept.end()) {
      it->second->state->SetLingering(false);  // listed again
      next->members.push_back(it->second);
      kept.erase(it);
      continue;
    }
    Result<NodeAddress> address = ParseNodeAddress(record.address);
    Result<std::shared_ptr<Member>> member =
        address.ok() ? MakeMember(*address, record.zone)
                     : Result<std::shared_ptr<Member>>(address.status());
    if (!member.ok()) {
      KVSTASH_LOG_ERROR("cluster {}: node {} cannot be used, its keys go to the others: {}",
                        options_.cluster, record.address, member.status().ToString());
      continue;
    }
    next->members.push_back(*std::move(member));
    ++joined;
  }
  // Members no longer listed that still answer stay (lingering) until they fail a call: a
  // source that drops a node that serves (etcd, when the node's lease lapsed while it was cut
  // off from etcd but not from this client) must not take its keys away.
  Members left_members;
  for (auto& [name, member] : kept) left_members.push_back(member);
  size_t lingering = 0;
  for (const auto& member : StillAnswering(left_members)) {
    if (!member->state->lingering()) {
      KVSTASH_LOG_WARN(
          "cluster {}: node {} is no longer listed but answers: kept until it fails a call "
          "(its lease may have lapsed while it serves)",
          options_.cluster, member->state->name());
    }
    member->state->SetLingering(true);
    next->members.push_back(member);
    kept.erase(member->state->name());
  }
  for (const auto& member : next->members) lingering += member->state->lingering() ? 1 : 0;
  lingering_.store(lingering, std::memory_order_release);
  const size_t left = current ? kept.size() : 0;
  if (current) on_changed_(joined, left);
  if (next->members.empty()) {
    KVSTASH_LOG_WARN(
        "cluster {} has no live offload nodes: lookups miss and stores fail until one joins",
        options_.cluster);
  } else if (current) {
    KVSTASH_LOG_INFO("cluster {}: {} live node(s) ({} joined, {} left); keys move by rendezvous",
                     options_.cluster, next->members.size(), joined, left);
  }
  MutexLock lock(&mu_);
  snapshot_ = std::move(next);
}

Result<std::shared_ptr<Member>> MemberSet::MakeMember(const NodeAddress& address,
                                                      const std::string& zone) {
  transport::ClientOptions client;
  client.host = address.host;
  client.port = address.port;
  client.tenant = options_.key_namespace;  // the node's namespace
  client.auth_token = options_.auth_token;
  client.transport = options_.transport;
  client.connect_timeout = options_.connect_timeout;
  client.worker = options_.worker;
  if (!client.worker && options_.workers) {
    KVSTASH_ASSIGN_OR_RETURN(client.worker, options_.workers->Next());
  }
  auto member = std::make_shared<Member>();
  member->address = address;
  member->state = std::make_shared<NodeHealth>(
      address.ToString(), HealthOptions{options_.suspect_after, options_.probe_interval,
                                        options_.probe_timeout + options_.connect_timeout});
  member->hash = Xxh3Hash64(std::as_bytes(std::span(member->state->name())));
  if (!zone.empty()) member->zone = Xxh3Hash64(std::as_bytes(std::span(zone))) | 1;
  if (options_.connect) {
    KVSTASH_ASSIGN_OR_RETURN(member->channel, options_.connect(client));
  } else {
    KVSTASH_ASSIGN_OR_RETURN(member->channel, transport::RpcClient::Create(client));
  }
  return member;
}

}  // namespace kvstash::connector
