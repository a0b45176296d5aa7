// The cluster client's calls to one member at a time: a member's limits (connecting first),
// probes of suspect members, a member's counters, and the PutBlock calls of stores and repairs.

#include "cluster/node_calls.h"

#include <fmt/format.h>

#include <cstring>
#include <optional>

#include "kvstash/common/hash.h"

namespace kvstash::connector {

using transport::Bytes;
using transport::CallOptions;

std::vector<Result<NodeLimits>> NodeCalls::LimitsOf(const Members& members,
                                                    const std::vector<bool>& wanted) {
  std::vector<Result<NodeLimits>> limits(members.size(), Result<NodeLimits>(NodeLimits{}));
  std::vector<std::pair<size_t, std::future<Status>>> connecting;
  const auto now = NodeHealth::Clock::now();
  for (size_t n = 0; n < members.size(); ++n) {
    if (!wanted[n]) continue;
    NodeHealth& health = *members[n]->state;
    const NodeHealth::Admission admission = health.Admit(now);
    if (admission == NodeHealth::Admission::kProbe) StartProbe(*members[n]);
    if (admission != NodeHealth::Admission::kGo) {
      accounting_.Skipped();
      limits[n] = UnavailableError(
          "node {} is suspect (it did not answer): skipped until it "
          "answers a probe",
          health.name());
      continue;
    }
    if (auto known = members[n]->channel->server_limits()) {
      limits[n] = StatedBy(health, *known);
      continue;
    }
    auto promise = std::make_shared<std::promise<Status>>();
    connecting.emplace_back(n, promise->get_future());
    members[n]->channel->ConnectAsync([promise](const Status& s) { promise->set_value(s); });
  }
  for (auto& [n, future] : connecting) {
    NodeHealth& health = *members[n]->state;
    const Status connected = future.get();
    std::optional<transport::ServerLimits> known = members[n]->channel->server_limits();
    if (connected.ok() && known) {
      limits[n] = StatedBy(health, *known);
      if (!limits[n].ok()) continue;
      const uint64_t block_bytes = limits[n]->block_bytes;
      if (options_.block_bytes != 0 && block_bytes != 0 && block_bytes != options_.block_bytes) {
        limits[n] = FailedPreconditionError(
            "node {} stores blocks of {} bytes, this client's are {}: left out of the members",
            health.name(), block_bytes, options_.block_bytes);
        accounting_.RefusedHere(health, limits[n].status());
        members_.Exclude(members[n]);
      }
    } else {
      const Status error = connected.ok() ? InternalError("connected without a hello") : connected;
      accounting_.Record(health, error);
      limits[n] = AtNode(health.name(), error);
    }
  }
  return limits;
}

Result<NodeLimits> NodeCalls::StatedBy(NodeHealth& health, const transport::ServerLimits& stated) {
  Result<NodeLimits> limits = NodeLimitsFrom(stated);
  if (!limits.ok()) {
    // Not a kvstash node's statement: the node is refused here, as a wrong block size is.
    const Status refused = AtNode(health.name(), limits.status());
    accounting_.RefusedHere(health, refused);
    return refused;
  }
  return limits;
}

void NodeCalls::StartProbe(Member& member, std::function<void(bool answered)> done) {
  accounting_.Probed();
  StartAsync(
      member, wire::METHOD_ECHO, wire::EchoRequest(),
      [this, state = member.state, done = std::move(done)](const Outcome& outcome) {
        const Status status = ParseReply(outcome, (wire::EchoReply*)nullptr);
        accounting_.Record(*state, status);
        if (done) done(!Unreachable(status));
      },
      options_.probe_timeout);
}

Result<std::map<std::string, uint64_t>> NodeCalls::Stats(Member& member) {
  wire::StatsReply reply;
  const Status status =
      ParseReply(Start(member, wire::METHOD_STATS, wire::StatsRequest()).get(), &reply);
  accounting_.Record(*member.state, status);
  if (!status.ok()) return AtNode(member.state->name(), status);
  return std::map<std::string, uint64_t>(reply.counters().begin(), reply.counters().end());
}

uint64_t NodeCalls::StartPut(transport::CallGroup& group, Member& member, const BlockKey& key,
                             Bytes block, const BlockMeta* meta,
                             std::function<void(Outcome)> done) {
  wire::PutBlockRequest put;
  *put.mutable_key() = wire::ToWire(key);
  put.set_length(block.size());
  if (meta != nullptr) wire::ToWire(*meta, key.group, put.mutable_meta());
  // Over a network the node checks the bytes against this; a client on the node's host
  // copies them into the node's memory itself, where a checksum would guard nothing and
  // cost a hash of every block on both sides.
  if (!member.channel->payloads_mapped()) put.set_checksum(Xxh3Hash64(block));
  CallOptions options;
  options.send_payload = block;
  options.copier = &group;
  return StartWith(member, wire::METHOD_PUT_BLOCK, put, options, std::move(done), &group);
}

uint64_t NodeCalls::StartPutBatch(transport::CallGroup& group, Member& member,
                                  std::span<const BlockKey> keys, std::span<const Bytes> blocks,
                                  std::span<const BlockMeta> metas,
                                  const std::vector<size_t>& which, transport::MutableBytes staging,
                                  std::function<void(Outcome)> done) {
  wire::PutBlocksRequest put;
  size_t offset = 0;
  for (size_t i : which) {
    wire::ToWire(keys[i], put.add_keys());
    put.add_lengths(blocks[i].size());
    if (!metas.empty()) wire::ToWire(metas[i], keys[i].group, put.add_metas());
    std::memcpy(staging.data() + offset, blocks[i].data(), blocks[i].size());
    offset += blocks[i].size();
  }
  // As PutBlock: a checksum over a network, none over shared memory.
  if (!member.channel->payloads_mapped()) put.set_checksum(Xxh3Hash64(staging));
  CallOptions options;
  options.send_payload = staging;
  // Copied (over shared memory) on the progress thread: handing a batch's copy to the waiting
  // thread and back costs more thread wake-ups than the copy takes.
  return StartWith(member, wire::METHOD_PUT_BLOCKS, put, options, std::move(done), &group);
}

std::future<Outcome> NodeCalls::StartPut(transport::CallGroup& group, Member& member,
                                         const BlockKey& key, Bytes block) {
  auto promise = std::make_shared<std::promise<Outcome>>();
  std::future<Outcome> future = promise->get_future();
  StartPut(group, member, key, block, nullptr,
           [promise](Outcome outcome) { promise->set_value(std::move(outcome)); });
  return future;
}

}  // namespace kvstash::connector
