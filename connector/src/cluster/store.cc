// The cluster client's stores: every replica, done once one holds each block (docs/semantics.md
// §16).

#include "cluster/store.h"

#include <fmt/format.h>

#include <future>
#include <memory>
#include <utility>
#include <vector>

#include "kvstash/proto/convert.h"

namespace kvstash::connector {

Status ClusterStore::Put(std::span<const BlockKey> keys, std::span<const transport::Bytes> blocks) {
  if (keys.size() != blocks.size()) {
    return InvalidArgumentError("{} keys for {} blocks", keys.size(), blocks.size());
  }
  if (keys.empty()) return Status::OK();
  const auto topology = members_.snapshot();
  const Members& members = topology->members;
  if (members.empty()) {
    accounting_.Unserved(keys.size());
    return UnavailableError("no live offload node in cluster {} for {} block(s)", options_.cluster,
                            keys.size());
  }
  std::vector<std::vector<size_t>> by_node;
  std::vector<bool> wanted;
  placer_.ByNode(members, keys, &by_node, &wanted);
  const std::vector<Result<NodeLimits>> limits = calls_.LimitsOf(members, wanted);
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
    const Placement p = placer_.Place(members, keys[i]);
    for (uint32_t r = 0; r < p.count; ++r) {
      const size_t n = p.nodes[r];
      Member& member = *members[n];
      if (!limits[n].ok()) {
        // The node's name is in the status already.
        const Status& error = limits[n].status();
        if (Unreachable(error)) {
          if (unreached[i].ok()) {
            unreached[i] = Status(error.code(),
                                  fmt::format("{}: block {}", error.message(), keys[i].ToString()));
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
        accounting_.RefusedHere(*member.state, refused);  // its health is unchanged
        failed(member, i, refused);
        continue;
      }
      {
        MutexLock lock(&settle->mu);
        if (settle->out[i]++ == 0 && !settle->held[i]) ++settle->unsettled;
      }
      auto promise = std::make_shared<std::promise<Outcome>>();
      PutCall call{&member, i, 0, promise->get_future()};
      call.id = calls_.StartPut(group, member, keys[i], blocks[i], [settle, i, promise](Outcome o) {
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
  const std::vector<bool> abandoned = watch_.WaitForReplicas(group, puts, [settle] {
    MutexLock lock(&settle->mu);
    return settle->unsettled == 0;
  });
  for (size_t k = 0; k < puts.size(); ++k) {
    auto& [member, i, id, future] = puts[k];
    const Status status = ParseReply(future.get(), (wire::PutBlockReply*)nullptr);
    // An abandoned call's node was told it was late; its cancel is no answer of its own.
    if (!abandoned[k] || status.ok()) accounting_.Record(*member->state, status);
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
  accounting_.Unserved(unserved);
  return refusal.ok() ? lost : refusal;
}

}  // namespace kvstash::connector
