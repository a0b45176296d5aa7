// The cluster client's channel layer: its start and members, calls started on a member's
// channel (each with its deadline), a member's limits (connecting first), probes of suspect
// members, and placement over a snapshot.

#include <fmt/format.h>

#include <algorithm>

#include "cluster/client.h"
#include "kvstash/common/hash.h"

namespace kvstash::connector {

NodeClient::Impl::Impl(NodeClientOptions options)
    : options_(std::move(options)),
      members_(options_, [accounting = accounting_](size_t joined, size_t left) {
        accounting->MembersChanged(joined, left);
      }) {}

NodeClient::Impl::~Impl() {
  members_.Stop();
  WaitForTouches();
}

Status NodeClient::Impl::Init() {
  if (options_.replicas == 0 || options_.replicas > kMaxReplicas) {
    return InvalidArgumentError("replicas {} is not within 1..{}", options_.replicas, kMaxReplicas);
  }
  if (!options_.worker && !options_.connect) {
    KVSTASH_ASSIGN_OR_RETURN(options_.worker, transport::ClientWorker::Create(options_.transport));
  }
  return members_.Start();
}

std::vector<NodeAddress> NodeClient::Impl::nodes() const {
  std::vector<NodeAddress> out;
  for (const auto& member : members_.snapshot()->members) out.push_back(member->address);
  return out;
}

Placement NodeClient::Impl::Place(const Members& members, const BlockKey& key) const {
  return PlaceInZones(
      members.size(), [&](size_t i) { return members[i]->hash; },
      [&](size_t i) { return members[i]->zone; }, key, options_.replicas);
}

std::vector<NodeAddress> NodeClient::Impl::PlacesOf(const BlockKey& key) const {
  const auto snapshot = members_.snapshot();
  const Placement p = Place(snapshot->members, key);
  std::vector<NodeAddress> out;
  for (uint32_t r = 0; r < p.count; ++r) out.push_back(snapshot->members[p.nodes[r]]->address);
  return out;
}

std::vector<Result<ServerLimits>> NodeClient::Impl::LimitsOf(const Members& members,
                                                             const std::vector<bool>& wanted) {
  std::vector<Result<ServerLimits>> limits(members.size(), Result<ServerLimits>(ServerLimits{}));
  std::vector<std::pair<size_t, std::future<Status>>> connecting;
  const auto now = NodeHealth::Clock::now();
  for (size_t n = 0; n < members.size(); ++n) {
    if (!wanted[n]) continue;
    NodeHealth& health = *members[n]->state;
    const NodeHealth::Admission admission = health.Admit(now);
    if (admission == NodeHealth::Admission::kProbe) StartProbe(*members[n]);
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
        members_.Exclude(members[n]);
      }
    } else {
      const Status error = connected.ok() ? InternalError("connected without a hello") : connected;
      accounting_->Record(health, error);
      limits[n] = AtNode(health.name(), error);
    }
  }
  return limits;
}

void NodeClient::Impl::StartProbe(Member& member, std::function<void(bool answered)> done) {
  accounting_->Probed();
  StartAsync(
      member, wire::METHOD_ECHO, wire::EchoRequest(),
      [this, state = member.state, done = std::move(done)](const Outcome& outcome) {
        const Status status = ParseReply(outcome, (wire::EchoReply*)nullptr);
        accounting_->Record(*state, status);
        if (done) done(!Unreachable(status));
      },
      options_.probe_timeout);
}

void NodeClient::Impl::WaitWatching(transport::CallGroup& group, const std::vector<OutCall>& calls,
                                    const std::function<bool()>& settled,
                                    transport::Clock::time_point started,
                                    std::vector<bool>* abandoned) {
  if (options_.lookup_budget >= options_.timeout) return;
  auto out = [&](size_t k) {
    return !(*abandoned)[k] &&
           calls[k].outcome->wait_for(std::chrono::seconds(0)) != std::future_status::ready;
  };
  if (group.WaitUntil(settled, started + options_.lookup_budget)) return;
  // The nodes of the calls still out, each probed once: 0 out, 1 answered, 2 unreachable.
  struct Probe {
    Member* member;
    std::shared_ptr<std::atomic<int>> state = std::make_shared<std::atomic<int>>(0);
    bool handled = false;
  };
  std::vector<Probe> probes;
  for (size_t k = 0; k < calls.size(); ++k) {
    if (!out(k)) continue;
    if (std::any_of(probes.begin(), probes.end(),
                    [&](const Probe& p) { return p.member == calls[k].member; })) {
      continue;
    }
    Probe probe{calls[k].member};
    StartProbe(*probe.member, [state = probe.state](bool answered) {
      state->store(answered ? 1 : 2, std::memory_order_release);
    });
    probes.push_back(std::move(probe));
  }
  auto failed = [&] {
    return std::any_of(probes.begin(), probes.end(), [](const Probe& p) {
      return !p.handled && p.state->load(std::memory_order_acquire) == 2;
    });
  };
  const auto give_up = started + options_.timeout;
  constexpr auto kSlice = std::chrono::milliseconds(10);  // how often the probes are looked at
  while (!settled()) {
    const auto now = transport::Clock::now();
    if (now >= give_up) return;
    if (group.WaitUntil([&] { return settled() || failed(); }, std::min(give_up, now + kSlice)) &&
        !failed()) {
      return;  // every call came back, or settled
    }
    for (Probe& probe : probes) {
      if (probe.handled || probe.state->load(std::memory_order_acquire) != 2) continue;
      probe.handled = true;
      for (size_t k = 0; k < calls.size(); ++k) {
        if (calls[k].member != probe.member || !out(k)) continue;
        (*abandoned)[k] = true;
        accounting_->Abandoned();
      }
      // Cancelled calls whose transfer is under way would hold their buffers to the deadline:
      // the connection goes, and every call out to the node with it.
      probe.member->channel->Reset(UnavailableError(
          "node {} answered neither its calls within {} ms nor a probe within {} ms; its "
          "connection is reset",
          probe.member->state->name(), options_.lookup_budget.count(),
          options_.probe_timeout.count()));
    }
  }
}

void NodeClient::Impl::ByNode(const Members& members, std::span<const BlockKey> keys,
                              std::vector<std::vector<size_t>>* by_node, std::vector<bool>* wanted,
                              std::vector<Placement>* places) const {
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

Result<std::map<std::string, uint64_t>> NodeClient::Impl::StatsOf(Member& member) {
  wire::StatsReply reply;
  const Status status =
      ParseReply(Start(member, wire::METHOD_STATS, wire::StatsRequest()).get(), &reply);
  accounting_->Record(*member.state, status);
  if (!status.ok()) return AtNode(member.state->name(), status);
  return std::map<std::string, uint64_t>(reply.counters().begin(), reply.counters().end());
}

// Starts the PutBlock call of `block` under `key` to `member` in `group`; `done` gets its
// outcome. Returns the call's id.
uint64_t NodeClient::Impl::StartPut(transport::CallGroup& group, Member& member,
                                    const BlockKey& key, Bytes block,
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
std::future<Outcome> NodeClient::Impl::StartPut(transport::CallGroup& group, Member& member,
                                                const BlockKey& key, Bytes block) {
  auto promise = std::make_shared<std::promise<Outcome>>();
  std::future<Outcome> future = promise->get_future();
  StartPut(group, member, key, block,
           [promise](Outcome outcome) { promise->set_value(std::move(outcome)); });
  return future;
}

// The index of `address` in `snapshot`; NotFound when it is not a member now.
static Result<size_t> IndexOf(const Snapshot& snapshot, const NodeAddress& address) {
  for (size_t n = 0; n < snapshot.members.size(); ++n) {
    if (snapshot.members[n]->address.host == address.host &&
        snapshot.members[n]->address.port == address.port) {
      return n;
    }
  }
  return NotFoundError("node {} is not a member now", address.ToString());
}

Result<ServerLimits> NodeClient::Impl::Limits(const NodeAddress& address) {
  const auto snapshot = members_.snapshot();
  KVSTASH_ASSIGN_OR_RETURN(const size_t node, IndexOf(*snapshot, address));
  std::vector<bool> wanted(snapshot->members.size(), false);
  wanted[node] = true;
  return std::move(LimitsOf(snapshot->members, wanted)[node]);
}

Result<std::map<std::string, uint64_t>> NodeClient::Impl::Stats(const NodeAddress& address) {
  const auto snapshot = members_.snapshot();
  KVSTASH_ASSIGN_OR_RETURN(const size_t node, IndexOf(*snapshot, address));
  return StatsOf(*snapshot->members[node]);
}

}  // namespace kvstash::connector
