// The cluster client's start, its members, and the calls to one node by address.

#include "cluster/client.h"

#include <utility>

namespace kvstash::connector {

NodeClient::Impl::Impl(NodeClientOptions options)
    : options_(std::move(options)),
      members_(options_,
               [accounting = accounting_](size_t joined, size_t left) {
                 accounting->MembersChanged(joined, left);
               }),
      placer_(options_.replicas),
      calls_(options_, *accounting_, members_),
      watch_(options_, calls_, *accounting_),
      repair_(calls_, *accounting_),
      lookup_(options_, accounting_, members_, placer_, calls_, repair_),
      store_(options_, *accounting_, members_, placer_, calls_, watch_),
      read_(options_, *accounting_, members_, placer_, calls_, watch_, repair_),
      keys_(*accounting_, members_, placer_, calls_) {}

NodeClient::Impl::~Impl() {
  members_.Stop();
  calls_.WaitForAsync();
}

Status NodeClient::Impl::Init() {
  if (options_.replicas == 0 || options_.replicas > kMaxReplicas) {
    return InvalidArgumentError("replicas {} is not within 1..{}", options_.replicas, kMaxReplicas);
  }
  if (!options_.worker && !options_.workers && !options_.connect) {
    options_.workers = transport::ClientWorkerPool::ForProcess(options_.transport);
  }
  return members_.Start();
}

std::vector<NodeAddress> NodeClient::Impl::nodes() const {
  std::vector<NodeAddress> out;
  for (const auto& member : members_.snapshot()->members) out.push_back(member->address);
  return out;
}

std::vector<NodeAddress> NodeClient::Impl::PlacesOf(const BlockKey& key) const {
  const auto snapshot = members_.snapshot();
  const Placement p = placer_.Place(snapshot->members, key);
  std::vector<NodeAddress> out;
  for (uint32_t r = 0; r < p.count; ++r) out.push_back(snapshot->members[p.nodes[r]]->address);
  return out;
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

Result<NodeLimits> NodeClient::Impl::Limits(const NodeAddress& address) {
  const auto snapshot = members_.snapshot();
  KVSTASH_ASSIGN_OR_RETURN(const size_t node, IndexOf(*snapshot, address));
  std::vector<bool> wanted(snapshot->members.size(), false);
  wanted[node] = true;
  return std::move(calls_.LimitsOf(snapshot->members, wanted)[node]);
}

Result<std::map<std::string, uint64_t>> NodeClient::Impl::Stats(const NodeAddress& address) {
  const auto snapshot = members_.snapshot();
  KVSTASH_ASSIGN_OR_RETURN(const size_t node, IndexOf(*snapshot, address));
  return calls_.Stats(*snapshot->members[node]);
}

}  // namespace kvstash::connector
